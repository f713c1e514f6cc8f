"""optax transforms that take extra arguments (``GradientTransformationExtraArgs``)
get ``value=`` the step's loss in ``scanax.fit``: the plateau recipe of
docs/training_features.md (``optax.chain(optax.adam(...),
optax.contrib.reduce_on_plateau(...))``) against a hand-written optax loop over
the same batches, for an optax pair, NNX, a TrainState and a population; with
accumulation the value is the micro-batches' mean loss; plain transforms get no
extra argument."""

from __future__ import annotations

import functools as ft
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from fit_helpers import MLP, X, Y, batch_at, nnx, nnx_loss, optax, train_state
from helpers import close

import scanax

allclose = ft.partial(close, rtol=1e-5, atol=1e-6)
STEPS, BS = 48, 8


def plateau(lr=1e-1):
    """The docs' recipe, with a patience short enough to act within STEPS: the
    step's loss averaged over 3 steps, the scale halved after 2 such windows
    without improvement."""
    return optax.chain(
        optax.adam(lr),
        optax.contrib.reduce_on_plateau(factor=0.5, patience=2, accumulation_size=3),
    )


def batches(t, accumulate=1):
    """The micro-batches of optimizer step t with ``key=None``: data steps
    ``t*k ... t*k+k-1`` in order."""
    return [batch_at(t * accumulate + j, key=None) for j in range(accumulate)]


def params0():
    return {"w": jr.normal(jr.key(1), (3, 1)) * 0.1, "b": jnp.zeros((1,))}


def linear_loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def fit(model, optimizer, loss_fn, steps=STEPS, **kwargs):
    """``scanax.fit`` over the batches in order (``key=None``)."""
    return scanax.fit(
        model, optimizer, loss_fn, (X, Y), steps=steps, batch_size=BS, key=None,
        progress=False, **kwargs,
    )  # fmt: skip


def optax_reference(tx, params, loss_fn, steps=STEPS, accumulate=1):
    """The hand-written loop: per step, the micro-batches' mean gradient and loss,
    then ``tx.update(..., value=loss)`` and ``optax.apply_updates``."""

    @jax.jit
    def step(params, state, micro):
        losses, grads = zip(*(jax.value_and_grad(loss_fn)(params, b) for b in micro))
        grads = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        loss = sum(losses) / len(losses)
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state, loss

    state, losses = tx.init(params), []
    for t in range(steps):
        params, state, loss = step(params, state, batches(t, accumulate))
        losses.append(loss)
    return params, state, np.array(losses)


def dropped(scale):
    """The plateau rule acted: the scale fell below 1 (to a power of 0.5)."""
    scale = float(scale)
    assert scale < 1.0
    return scale


@pytest.mark.parametrize("accumulate", [1, 2])
def test_optax_pair_is_the_reference_loop(accumulate):
    tx = plateau()
    result = fit(params0(), tx, linear_loss, accumulate=accumulate)
    params, state, losses = optax_reference(
        tx, params0(), linear_loss, accumulate=accumulate
    )
    dropped(state[1].scale)
    allclose(result.model, params)
    allclose(result.optimizer, state)
    allclose(result.history["loss"], losses)


def test_nnx_is_the_reference_loop():
    tx = plateau()
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    fit(model, optimizer, nnx_loss)

    ref = MLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        grad_fn = nnx.value_and_grad(nnx_loss, has_aux=True)
        (loss, _), grads = grad_fn(model, batch)
        optimizer.update(model, grads, value=loss)

    for t in range(STEPS):
        step(ref, ref_opt, batch_at(t, key=None))
    dropped(ref_opt.opt_state[1].scale[...])
    allclose(nnx.state((model, optimizer)), nnx.state((ref, ref_opt)))


def ts_apply(params, x):
    return x @ params["w"] + params["b"]


def ts_loss(state, batch):
    return linear_loss(state.params, batch)


def test_trainstate_is_the_reference_loop():
    tx = plateau()
    state = train_state.TrainState.create(apply_fn=ts_apply, params=params0(), tx=tx)
    result = fit(state, None, ts_loss)
    params, opt_state, losses = optax_reference(tx, params0(), linear_loss)
    dropped(opt_state[1].scale)
    assert result.model.tx is tx  # the state's own transform, not a bound copy
    assert int(result.model.step) == STEPS
    allclose(result.model.params, params)
    allclose(result.model.opt_state, opt_state)
    allclose(result.history["loss"], losses)


def make_member(key, lr):
    del key
    return params0(), plateau(lr)


def test_each_population_member_is_the_reference_loop():
    lrs = np.array([3e-2, 1e-1], np.float32)
    pop = scanax.population(make_member, 2, key=jr.key(0), lr=lrs)
    result = fit(pop, None, linear_loss)
    for i, lr in enumerate(lrs):
        params, state, losses = optax_reference(plateau(lr), params0(), linear_loss)
        dropped(state[1].scale)
        allclose(result.model[i], params)
        allclose(result.optimizer[i], state)
        allclose(result.history["loss"][i], losses)


class Recorded(NamedTuple):
    count: jax.Array  # steps taken (a step count, as optax states keep)
    value: jax.Array  # the last ``value`` received


def record_value():
    """An extra-args transform that keeps the last ``value`` it got."""

    def init(params):
        del params
        return Recorded(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def update(updates, state, params=None, *, value, **extra):
        del params, extra
        return updates, Recorded(state.count + 1, jnp.asarray(value, jnp.float32))

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_value_is_the_steps_loss(accumulate):
    """Alone and inside a chain; with accumulation, the micro-batches' mean loss."""
    mean = sum(linear_loss(params0(), b) for b in batches(0, accumulate)) / accumulate
    alone = fit(params0(), record_value(), linear_loss, steps=1, accumulate=accumulate)
    np.testing.assert_allclose(alone.optimizer.value, mean, rtol=1e-6)
    assert float(alone.optimizer.value) == alone.history["loss"][0]
    tx = optax.chain(optax.adam(1e-2), record_value())
    chained = fit(params0(), tx, linear_loss, steps=3, accumulate=accumulate)
    assert float(chained.optimizer[1].value) == chained.history["loss"][-1]


def test_plain_transforms_get_no_extra_arguments():
    """A plain GradientTransformation whose update takes no ``value`` trains as
    before (passing it would be a TypeError)."""
    sgd = optax.sgd(1e-2)
    plain = optax.GradientTransformation(
        sgd.init, lambda updates, state, params=None: sgd.update(updates, state)
    )
    assert not isinstance(plain, optax.GradientTransformationExtraArgs)
    result = fit(params0(), plain, linear_loss, steps=3)
    params, _, losses = optax_reference(sgd, params0(), linear_loss, steps=3)
    allclose(result.model, params)
    allclose(result.history["loss"], losses)
