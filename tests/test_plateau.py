"""Reducing the learning rate on a plateau, the two ways ``scanax.fit`` offers.

``fit(plateau=scanax.Plateau(...))`` (below the optax tests): the rule against a
hand-written Python loop of Keras's ``ReduceLROnPlateau`` rule and against
Keras's own callback; fit against a hand-written loop of jitted optax (or NNX)
steps whose updates are scaled the same way, for every model kind, with
accumulation, ``ema=`` and an early stop on another metric; a population's
members equal solo fits; a checkpoint resume equals the uninterrupted run; a
program without ``plateau=`` is the one it was; its errors.

optax transforms that take extra arguments (``GradientTransformationExtraArgs``)
get ``value=`` the step's loss in ``scanax.fit``: the plateau recipe of
docs/training_features.md (``optax.chain(optax.adam(...),
optax.contrib.reduce_on_plateau(...))``) against a hand-written optax loop over
the same batches, for an optax pair, NNX, a TrainState and a population; with
accumulation the value is the micro-batches' mean loss; plain transforms get no
extra argument."""

from __future__ import annotations

import collections
import functools as ft
import os
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from fit_helpers import MLP, X, Y, batch_at, joined, nnx, nnx_loss, optax, train_state
from helpers import close

import scanax
from scanax._fit import checks as _fit_checks, program as _fit_program
from scanax._fit.callbacks import plateau as _plateau
from scanax._fit.callbacks.plateau import Plateau

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


# ---------------------------------------------------------------------------- Plateau
# ``fit(plateau=scanax.Plateau(...))``: Keras's ReduceLROnPlateau in the loop.


def sequence(seed, n=30):
    """Monitored values that drift, with plateaus and ties: multiples of 1/8, so
    that float32 and Python floats agree on every comparison with min_delta."""
    rng = np.random.default_rng(seed)
    return (4 + np.cumsum(rng.integers(-2, 3, size=n) / 8)).astype(np.float32)


class KerasRule:
    """Keras 3's ``ReduceLROnPlateau.on_epoch_end`` (after ``on_train_begin``)
    as a Python loop, one evaluation per call, on an optimizer whose learning
    rate starts at ``lr`` and is kept in float32 (as a Keras optimizer keeps
    it)."""

    def __init__(self, *, factor, patience, min_delta, cooldown, min_lr, mode, lr=1.0):
        self.factor, self.patience, self.cooldown = factor, patience, cooldown
        self.min_lr, self.lr = min_lr, np.float32(lr)
        self.delta = -abs(min_delta) if mode == "min" else abs(min_delta)
        self.op = np.less if mode == "min" else np.greater
        self.best, self.wait, self.cooldown_counter = None, 0, 0

    def __call__(self, current):
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.best is None or self.op(current - self.delta, self.best):
            self.best = current
            self.wait = 0
        elif not self.cooldown_counter > 0:
            self.wait += 1
            if self.wait >= self.patience:
                old_lr = float(self.lr)
                if old_lr > np.float32(self.min_lr):
                    self.lr = np.float32(max(old_lr * self.factor, self.min_lr))
                    self.cooldown_counter = self.cooldown
                    self.wait = 0
        return self.lr


RULES = [
    dict(factor=0.5, patience=1, min_delta=0.0, cooldown=0, min_lr=0.0),
    dict(factor=0.5, patience=0, min_delta=0.25, cooldown=0, min_lr=0.0),
    dict(factor=0.1, patience=2, min_delta=0.0, cooldown=2, min_lr=0.0),
    dict(factor=0.5, patience=1, min_delta=0.125, cooldown=1, min_lr=0.2),
    dict(factor=0.25, patience=3, min_delta=0.0, cooldown=0, min_lr=0.01),
]
RULE_CASES = [
    (rule, mode, seed) for rule in RULES for mode in ("min", "max") for seed in (0, 1)
]


def eager(rule, values):
    """``Plateau.update`` value by value: ``(best, wait, cooldown, scale)``."""
    state, out = rule.init(), []
    for v in values:
        state, reduced = rule.update(state, jnp.float32(v))
        assert bool(reduced) == (float(state.scale) != (out[-1][3] if out else 1.0))
        out.append(
            (
                float(state.best),
                int(state.wait),
                int(state.cooldown),
                float(state.scale),
            )
        )
    return out


@pytest.mark.parametrize(("rule", "mode", "seed"), RULE_CASES)
def test_update_is_keras_rule(rule, mode, seed):
    values = sequence(seed)
    keras = KerasRule(**rule, mode=mode)
    theirs = []
    for v in values:
        lr = keras(v)
        theirs.append(
            (float(keras.best), keras.wait, keras.cooldown_counter, float(lr))
        )
    ours = eager(Plateau("val_loss", mode=mode, **rule), values)
    assert [o[:3] for o in ours] == [t[:3] for t in theirs]
    np.testing.assert_allclose([o[3] for o in ours], [t[3] for t in theirs], rtol=1e-6)
    assert ours[-1][3] < 1.0  # the rule acted


def test_lr_makes_min_lr_a_rate():
    """``lr=``: ``min_lr`` bounds ``lr * scale``, as Keras's does the rate."""
    values = sequence(2, 40)
    kw = dict(factor=0.5, patience=1, min_delta=0.0, cooldown=0, min_lr=0.002)
    keras = KerasRule(**kw, mode="min", lr=0.01)
    rates = [float(keras(v)) for v in values]
    ours = eager(Plateau("val_loss", mode="min", lr=0.01, **kw), values)
    np.testing.assert_allclose([0.01 * o[3] for o in ours], rates, rtol=1e-6)
    assert min(rates) == pytest.approx(0.002)
    assert Plateau(min_lr=0.002, lr=0.01).min_scale == pytest.approx(0.2)
    assert Plateau(min_lr=0.002).min_scale == 0.002


@pytest.fixture(scope="module")
def keras():
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs on another backend in this process")
    return keras


class Float32Rate:
    """What the callback reads and sets of an optimizer: a learning rate kept
    in float32, as a Keras optimizer's variable keeps it (a Keras 3 variable
    itself trips NumPy 2's ``__array__`` deprecation under warnings-as-errors)."""

    def __init__(self):
        self.rate = np.float32(1.0)

    @property
    def learning_rate(self):
        return self.rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.rate = np.float32(value)


@pytest.mark.parametrize(("rule", "mode", "seed"), RULE_CASES[::3])
def test_update_is_keras_reduce_lr_on_plateau(keras, rule, mode, seed):
    """keras.callbacks.ReduceLROnPlateau driven with the same values, epoch by
    epoch, on an optimizer whose learning rate starts at 1."""
    values = sequence(seed)
    cb = keras.callbacks.ReduceLROnPlateau(monitor="val_loss", mode=mode, **rule)
    model = types.SimpleNamespace(optimizer=Float32Rate())
    cb.set_model(model)
    cb.on_train_begin()
    theirs = []
    for epoch, v in enumerate(values.tolist()):
        cb.on_epoch_end(epoch, {"val_loss": v})
        lr = float(model.optimizer.learning_rate)
        theirs.append((float(cb.best), cb.wait, cb.cooldown_counter, lr))
    ours = eager(Plateau("val_loss", mode=mode, **rule), values)
    assert [o[:3] for o in ours] == [t[:3] for t in theirs]
    np.testing.assert_allclose([o[3] for o in ours], [t[3] for t in theirs], rtol=1e-6)


def test_in_a_compiled_loop_and_under_vmap():
    """Members side by side (vmap in a jitted scan) each as its own eager run."""
    rule = Plateau("val_acc", factor=0.5, patience=1, cooldown=1, min_delta=0.125)
    assert rule.direction == "max"
    values = np.stack([sequence(s, 20) for s in range(3)])  # [members, evals]

    @jax.jit
    def run(values):
        def body(state, v):
            state, _ = jax.vmap(rule.update)(state, v)
            return state, state.scale

        state = jax.vmap(lambda _: rule.init())(jnp.arange(3))
        return jax.lax.scan(body, state, values.T)[1].T

    scales = np.asarray(run(values))
    for m in range(3):
        np.testing.assert_array_equal(scales[m], [o[3] for o in eager(rule, values[m])])
    assert (scales[:, -1] < 1).all()


# A rule that acts within the steps, on a training metric's mean since the
# last check (windows of EVERY steps across the 6 batches of an epoch).
EVERY, LR = 4, 0.3
RULE = Plateau("loss", factor=0.5, patience=1, cooldown=1, min_delta=1e-3)


def keras_of(rule):
    kw = {k: getattr(rule, k) for k in ("factor", "patience", "min_delta")}
    kw.update(cooldown=rule.cooldown, min_lr=rule.min_lr, mode=rule.direction)
    return KerasRule(**kw)


def by_hand(step, steps, rule, evaluate=None, stop=None):
    """The loop ``fit(plateau=rule)`` compiles, written out: ``step(t, scale)``
    (jitted) takes step ``t`` with its update scaled and returns its loss; every
    EVERY steps the Keras rule gets the monitored value (``evaluate()``, else
    the loss's float32 mean since the last check) and sets the next steps'
    scale. ``stop``: an EarlyStop on ``evaluate()`` too, which returns
    ``(losses, scales, (best_step, stopped_at))``."""
    keras, losses, scales = keras_of(rule), [], []
    total, seen = np.float32(0), 0
    state, best_step = None if stop is None else stop.init(), -1
    for t in range(steps):
        scale = keras.lr
        losses.append(float(step(t, jnp.float32(scale))))
        scales.append(scale)
        total, seen = np.float32(total + np.float32(losses[-1])), seen + 1
        if (t + 1) % EVERY:
            continue
        if rule.monitor == "loss":
            value = np.float32(total / np.float32(seen))
        else:
            value = np.float32(evaluate())
        keras(value)
        total, seen = np.float32(0), 0
        if stop is not None:
            state, improved, done = stop.update(state, jnp.float32(evaluate()), t + 1)
            if improved:
                best_step = t + 1
            if done:
                break
    return np.array(losses, np.float32), np.array(scales, np.float32), best_step


def optax_by_hand(tx, steps=STEPS, rule=RULE, accumulate=1, ema=None):
    """``by_hand`` for an optax pair on ``linear_loss`` (batches in order):
    ``(params, opt_state, average, losses, scales)``."""
    box = {"p": params0(), "s": tx.init(params0())}
    box["e"] = box["p"]

    @jax.jit
    def step(p, s, e, micro, scale):
        losses, grads = zip(*(jax.value_and_grad(linear_loss)(p, b) for b in micro))
        grads = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        updates, s = tx.update(grads, s, p)
        stepped = optax.apply_updates(p, updates)
        p = jax.tree.map(lambda a, b: a + scale * (b - a), p, stepped)
        if ema is not None:
            e = jax.tree.map(lambda e, p: ema * e + (1.0 - ema) * p, e, p)
        return p, s, e, sum(losses) / len(losses)

    def one(t, scale):
        box["p"], box["s"], box["e"], loss = step(
            box["p"], box["s"], box["e"], batches(t, accumulate), scale
        )
        return loss

    def evaluate():
        return linear_loss(box["p"], (X, Y))

    losses, scales, _ = by_hand(one, steps, rule, evaluate)
    return box["p"], box["s"], box["e"], losses, scales


def plateau_fit(model, optimizer, loss_fn, steps=STEPS, rule=RULE, **kwargs):
    return fit(
        model, optimizer, loss_fn, steps, eval_every=EVERY, plateau=rule, **kwargs
    )


def acted(scales):
    """The rule reduced the scale (at least twice), so that comparisons test it."""
    scales = np.asarray(scales)
    assert scales[-1] <= 0.25 and scales[0] == 1.0
    return scales


@pytest.fixture(scope="module")
def optax_run():
    return plateau_fit(params0(), optax.adam(LR), linear_loss)


def test_fit_of_an_optax_pair_is_the_reference_loop(optax_run):
    params, opt_state, _, losses, scales = optax_by_hand(optax.adam(LR))
    np.testing.assert_array_equal(optax_run.history["lr_scale"], acted(scales))
    allclose(optax_run.history["loss"], losses)
    allclose(optax_run.model, params)
    allclose(optax_run.optimizer, opt_state)


def test_fit_of_a_trainstate_is_the_reference_loop(optax_run):
    state = train_state.TrainState.create(
        apply_fn=ts_apply, params=params0(), tx=optax.adam(LR)
    )
    result = plateau_fit(state, None, ts_loss)
    np.testing.assert_array_equal(
        result.history["lr_scale"], optax_run.history["lr_scale"]
    )
    allclose(result.model.params, optax_run.model)
    assert int(result.model.step) == STEPS


def test_nnx_on_a_validation_metric_is_the_reference_loop():
    """NNX, monitoring val_loss: only the Params move less (the optimizer's
    moments and step count are the plain step's)."""
    rule = Plateau("val_loss", factor=0.5, patience=1, min_delta=0.0)
    tx = optax.adam(LR)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    result = plateau_fit(model, optimizer, nnx_loss, rule=rule, eval_data=(X, Y))

    ref = MLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, scale):
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # (a copy)
        grad_fn = nnx.value_and_grad(nnx_loss, has_aux=True)
        (loss, _), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        after = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda a, b: a + scale * (b - a), before, after))
        return loss

    losses, scales, _ = by_hand(
        lambda t, scale: step(ref, ref_opt, batch_at(t, key=None), scale),
        STEPS,
        rule,
        lambda: nnx_loss(ref, (X, Y))[0],
    )
    np.testing.assert_array_equal(result.history["lr_scale"], acted(scales))
    allclose(result.history["loss"], losses)
    allclose(nnx.state((model, optimizer)), nnx.state((ref, ref_opt)))


def test_accumulation_and_the_average_follow_the_scaled_parameters():
    """accumulate=2 (one scaled update per 2 micro-batches) and ema= (the
    average of the parameters as scaled)."""
    result = plateau_fit(params0(), optax.adam(LR), linear_loss, accumulate=2, ema=0.9)
    params, _, average, losses, scales = optax_by_hand(
        optax.adam(LR), accumulate=2, ema=0.9
    )
    np.testing.assert_array_equal(result.history["lr_scale"], acted(scales))
    allclose(result.history["loss"], losses)
    allclose(result.model, params)
    allclose(result.ema, average)


def test_with_an_early_stop_on_another_metric():
    """Two rules at each evaluation: the plateau on the training loss, an early
    stop (restoring the best) on val_loss."""
    stop = scanax.EarlyStop("val_loss", patience=2)
    result = plateau_fit(
        params0(), optax.adam(LR), linear_loss, steps=96, stop=stop, eval_data=(X, Y)
    )
    box = {"p": params0(), "s": optax.adam(LR).init(params0())}
    kept = {}
    tx = optax.adam(LR)

    @jax.jit
    def step(p, s, batch, scale):
        loss, grads = jax.value_and_grad(linear_loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        stepped = optax.apply_updates(p, updates)
        return jax.tree.map(lambda a, b: a + scale * (b - a), p, stepped), s, loss

    def one(t, scale):
        box["p"], box["s"], loss = step(box["p"], box["s"], batch_at(t, None), scale)
        return loss

    def evaluate():  # (only the early stop's: the plateau's is the loss)
        kept[len(kept)] = box["p"]  # the state of each check, in order
        return linear_loss(box["p"], (X, Y))

    losses, scales, best_step = by_hand(one, 96, RULE, evaluate, stop)
    assert result.steps == len(losses) < 96  # it stopped
    assert result.best_step == best_step > 0
    np.testing.assert_array_equal(result.history["lr_scale"], scales)
    allclose(result.model, kept[best_step // EVERY - 1])


def adam_member(key, lr):
    del key
    return params0(), optax.adam(lr)


def test_population_members_equal_solo_fits(optax_run):
    lrs = np.array([LR, 0.05], np.float32)
    pop = scanax.population(adam_member, 2, key=jr.key(0), lr=lrs)
    result = plateau_fit(pop, None, linear_loss)
    assert result.history["lr_scale"].shape == (2, STEPS)
    np.testing.assert_array_equal(
        result.history["lr_scale"][0], optax_run.history["lr_scale"]
    )
    allclose(result.model[0], optax_run.model)
    slow = plateau_fit(params0(), optax.adam(0.05), linear_loss)
    np.testing.assert_array_equal(
        result.history["lr_scale"][1], slow.history["lr_scale"]
    )
    allclose(result.model[1], slow.model)
    allclose(result.optimizer[1], slow.optimizer)


def test_a_checkpoint_resumes_the_rule_exactly(optax_run, tmp_path):
    """Killed after step 21 (mid-window: the training loss's running sum is
    part of what is saved), restarted from the top: the uninterrupted run's
    scales and parameters, exactly. A later call starts the rule again."""
    kw = dict(checkpoint_dir=tmp_path, checkpoint_every=7)
    first = plateau_fit(params0(), optax.adam(LR), linear_loss, steps=21, **kw)
    assert first.history["lr_scale"][-1] < 1  # the scale to restore is not 1
    resumed = plateau_fit(params0(), optax.adam(LR), linear_loss, **kw)
    assert resumed.steps == STEPS and len(resumed.history["lr_scale"]) == STEPS
    np.testing.assert_array_equal(
        resumed.history["lr_scale"], optax_run.history["lr_scale"]
    )
    close(resumed.model, optax_run.model, rtol=0, atol=0)
    again = plateau_fit(
        first.model, optax.adam(LR), linear_loss, steps=4, opt_state=first.optimizer
    )
    assert again.history["lr_scale"][0] == 1.0


def test_plateau_state_continues_the_rule_across_calls(optax_run):
    """Two calls of half the steps, the second given the first's
    ``result.plateau`` (and its optimizer state): the one call's scales,
    losses and parameters, exactly; ``result.plateau`` is the rule's state."""
    half = STEPS // 2
    assert half % EVERY == 0  # (a call boundary at a check: windows align)
    first = plateau_fit(params0(), optax.adam(LR), linear_loss, steps=half)
    state = first.plateau
    assert isinstance(state, _plateau.PlateauState)
    assert float(state.scale) == first.history["lr_scale"][-1] < 1
    second = plateau_fit(
        first.model, optax.adam(LR), linear_loss, steps=half,
        opt_state=first.optimizer, plateau_state=state,
    )  # fmt: skip
    scales = joined([first, second], "lr_scale")
    np.testing.assert_array_equal(scales, optax_run.history["lr_scale"])
    losses = joined([first, second], "loss")
    np.testing.assert_array_equal(losses, optax_run.history["loss"])
    close(second.model, optax_run.model, rtol=0, atol=0)
    np.testing.assert_array_equal(
        np.asarray(second.plateau.scale), np.asarray(optax_run.plateau.scale)
    )
    assert optax_run.plateau.wait == second.plateau.wait


def test_plateau_state_continues_each_population_member():
    """A population continues in its own object; with ``plateau_state`` each
    member's rule continues too: two calls equal one."""
    lrs = np.array([LR, 0.05], np.float32)

    def pop():
        return scanax.population(adam_member, 2, key=jr.key(0), lr=lrs)

    whole = plateau_fit(pop(), None, linear_loss)
    half, members = STEPS // 2, pop()
    first = plateau_fit(members, None, linear_loss, steps=half)
    assert np.shape(first.plateau.scale) == (2,)
    second = plateau_fit(
        members, None, linear_loss, steps=half, plateau_state=first.plateau
    )
    scales = joined([first, second], "lr_scale")
    np.testing.assert_array_equal(scales, whole.history["lr_scale"])
    assert scales[1, -1] < 1 and scales[0, -1] < 1
    for i in range(2):
        close(second.model[i], whole.model[i], rtol=0, atol=0)


def test_a_scale_reduced_to_zero_continues():
    """With ``min_lr=0`` repeated reductions reach a scale of 0 (float32
    underflow, as Keras's rate does); the state given back is taken by the next
    call (it was refused as "must be in (0, 1]", the fix it named being what
    was passed), which leaves the parameters where they are."""
    rule = Plateau("loss", factor=1e-30, patience=0, min_delta=1e3)
    first = plateau_fit(params0(), optax.adam(LR), linear_loss, steps=12, rule=rule)
    assert float(first.plateau.scale) == 0.0
    again = plateau_fit(
        first.model, optax.adam(LR), linear_loss, steps=4, rule=rule,
        opt_state=first.optimizer, plateau_state=first.plateau,
    )  # fmt: skip
    np.testing.assert_array_equal(again.history["lr_scale"], 0.0)
    close(again.model, first.model, rtol=0, atol=0)


def test_plateau_state_errors_and_the_keras_recipe():
    with pytest.raises(TypeError, match=r"`plateau_state` was given without"):
        fit(params0(), optax.adam(LR), linear_loss, plateau_state=1)
    state = _plateau.PlateauState(1.0, 0, 0, 1.0)
    for bad, message in (
        (1.0, r"`plateau_state` \(scanax.Plateau.s `state`\) must be the"),
        ({"scale": 1.0}, r"`plateau_state` \(scanax.Plateau.s `state`\) must be the"),
        (
            state._replace(scale=jnp.ones(2)),
            r"`plateau_state.scale` \(scanax.Plateau\'s `state`\) must be a",
        ),
    ):
        with pytest.raises(TypeError, match=message):
            plateau_fit(params0(), optax.adam(LR), linear_loss, steps=2,
                        plateau_state=bad)  # fmt: skip
    for field, value in (("scale", -0.5), ("scale", 5.0), ("scale", np.nan),
                         ("best", np.nan), ("wait", -1), ("cooldown", 0.5)):  # fmt: skip
        with pytest.raises(
            ValueError,
            match=rf"`plateau_state.{field}` \(scanax.Plateau\'s `state`\) must be",
        ):
            plateau_fit(params0(), optax.adam(LR), linear_loss, steps=2,
                        plateau_state=state._replace(**{field: value}))  # fmt: skip
    # the docs' recipe for Keras's behaviour: the rate kept, the rest reset
    first = plateau_fit(params0(), optax.adam(LR), linear_loss, steps=24)
    keras_like = first.plateau._replace(best=float("inf"), wait=0, cooldown=0)
    again = plateau_fit(first.model, optax.adam(LR), linear_loss, steps=4,
                        opt_state=first.optimizer, plateau_state=keras_like)  # fmt: skip
    assert again.history["lr_scale"][0] == first.history["lr_scale"][-1] < 1


class Traced(Exception):
    """Raised instead of compiling: the program was traced."""


def test_without_plateau_the_program_has_no_plateau_code(monkeypatch):
    """``plateau=`` is a static option: a program without it (evaluation and an
    early stop, one model and a population) traces no code of the rule. (Its
    jaxpr was also checked equal, text for text, to the one before the rule
    existed.)"""

    def never(*args, **kwargs):
        raise AssertionError("plateau code traced without plateau=")

    def trace(program, args):
        program.jitted.trace(*args)
        raise Traced

    monkeypatch.setattr(_fit_program, "PROGRAMS", collections.OrderedDict())
    monkeypatch.setattr(_fit_program.Program, "executable", trace)
    monkeypatch.setattr(_plateau, "scaled", never)
    monkeypatch.setattr(_plateau, "read", never)
    monkeypatch.setattr(Plateau, "update", never)
    monkeypatch.setattr(_fit_checks.Checks, "_reduce", never)
    stop = scanax.EarlyStop("val_loss", patience=2)
    kw = dict(eval_every=EVERY, stop=stop, eval_data=(X, Y), execution="fused")
    with pytest.raises(Traced):
        fit(params0(), optax.adam(LR), linear_loss, steps=8, **kw)
    pop = scanax.population(adam_member, 2, key=jr.key(0), lr=np.float32([0.1, 0.2]))
    with pytest.raises(Traced):
        fit(pop, None, linear_loss, steps=8, **kw)
    with pytest.raises(AssertionError, match="plateau code traced"):  # (the stubs)
        plateau_fit(params0(), optax.adam(LR), linear_loss, steps=8)


def test_errors():
    with pytest.raises(ValueError, match="`factor` must be between 0 and 1"):
        Plateau(factor=1.0)
    with pytest.raises(ValueError, match="`factor` must be between 0 and 1"):
        Plateau(factor=0.0)
    with pytest.raises(TypeError, match="scanax.Plateau: `factor` must be a real"):
        Plateau(factor="0.5")
    with pytest.raises(ValueError, match="`patience` must be 0 or more, got -1"):
        Plateau(patience=-1)
    with pytest.raises(ValueError, match="`cooldown` must be 0 or more, got -2"):
        Plateau(cooldown=-2)
    with pytest.raises(TypeError, match="`patience` must be an int"):
        Plateau(patience=2.5)
    with pytest.raises(ValueError, match="scanax.Plateau: `min_delta` must be fin"):
        Plateau(min_delta=-1e-3)
    with pytest.raises(ValueError, match="`min_lr` must be finite and 0 or more"):
        Plateau(min_lr=-1.0)
    with pytest.raises(ValueError, match="`lr` must be a finite learning rate"):
        Plateau(lr=0.0)
    # (a floor not below the rate, or the starting scale: it could never reduce)
    with pytest.raises(
        ValueError, match=r"`min_lr` \(0.1\) is not below `lr` \(0.01\)"
    ):
        Plateau(min_lr=0.1, lr=0.01)
    with pytest.raises(
        ValueError, match=r"`min_lr` \(1.0\) is not below 1, the starting"
    ):
        Plateau(min_lr=1.0)
    with pytest.raises(ValueError, match="scanax.Plateau: `mode` must be 'auto'"):
        Plateau(mode="maximum")
    with pytest.raises(TypeError, match="scanax.Plateau: `monitor` must be the name"):
        Plateau("")
    with pytest.raises(TypeError, match="`plateau` must be a scanax.Plateau"):
        fit(params0(), optax.adam(LR), linear_loss, eval_every=4, plateau="val_loss")
    with pytest.raises(
        TypeError,
        match=r"scanax.Plateau \(plateau=\) is given without a scanax.Eval\'s `every`",
    ):
        fit(params0(), optax.adam(LR), linear_loss, plateau=RULE)
    with pytest.raises(
        ValueError, match="scanax.Plateau monitors 'val_loss', a validat"
    ):
        fit(params0(), optax.adam(LR), linear_loss, eval_every=4, plateau=Plateau())


def test_an_unknown_monitor_or_a_taken_name_leaves_the_model_as_it_was():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    with pytest.raises(ValueError, match=r"scanax.Plateau: monitor='val_los' is no"):
        plateau_fit(
            model, optimizer, nnx_loss, rule=Plateau("val_los"), eval_data=(X, Y)
        )

    def taken(model, batch):
        loss, _ = nnx_loss(model, batch)
        return loss, {"lr_scale": loss}

    with pytest.raises(ValueError, match="returns a metric named 'lr_scale'"):
        plateau_fit(model, optimizer, taken)
    allclose(nnx.state((model, optimizer)), before)
