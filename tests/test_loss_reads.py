"""A loss that cannot move the trained parameters is refused before anything
runs (before: fit trained nothing and said nothing): a ``loss_fn`` reading a
model other than the one it is passed (``functools.partial``, a method on an
object holding the model, a closure), one held by ``stop_gradient``, an NNX
``wrt`` choosing Variables the loss does not read. A loss that does read them
through scans, conds, checkpoints and custom derivatives trains as the plain
loss does."""

import functools as ft
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fit_helpers import (
    BS,
    KEY,
    TX,
    X,
    Y,
    eqx,
    eqx_loss,
    eqx_model,
    nnx,
    nnx_loss,
    nnx_pair,
    optax,
    ts_loss,
    ts_make,
)

import scanax

pytestmark = pytest.mark.filterwarnings("ignore:.*reads the model being trained")

RUN = dict(steps=4, batch_size=BS, key=KEY, progress=False)
NO_DEPENDENCE = "(?s)the loss does not depend on any of {}: its gradient is zero"
OTHER = ".*reads a model other than the one it is passed.*Fix: compute the loss"
CUT = ".*under `jax.lax.stop_gradient`.*Fix: stop the gradient of a target"


def _other(loss):
    """``loss`` on a model made apart from the one fit trains."""
    return lambda other, model, batch: loss(other, batch)


class Holder:
    """A user's trainer object: its method reads ``self.model``."""

    def __init__(self, model, loss):
        self.model, self.loss_of = model, loss

    def loss(self, model, batch):
        return self.loss_of(self.model, batch)


def _pair(kind):
    if kind == "nnx":
        return (*nnx_pair(), nnx_loss)
    if kind == "eqx":
        return eqx_model(), TX, eqx_loss
    return ts_make(), None, ts_loss


WHAT = {
    "nnx": r"the Variables the optimizer trains \(its `wrt`\)",
    "eqx": "the model's floating-point arrays",
    "ts": r"the TrainState's `params`",
}


def _wrong(kind, how, model, loss):
    if how == "partial":
        return ft.partial(_other(loss), _pair(kind)[0])
    if how == "method":
        return Holder(_pair(kind)[0], loss).loss
    # (inside a nested program: followed)
    return lambda m, batch: jax.tree.map(jax.jit(jax.lax.stop_gradient), loss(m, batch))


def _state(model, optimizer):
    if isinstance(model, nnx.Module):
        return nnx.state((model, optimizer))
    return model


@pytest.mark.parametrize("kind", ["nnx", "eqx", "ts"])
@pytest.mark.parametrize("how", ["partial", "method", "stop_gradient"])
def test_a_loss_not_reading_the_trained_model_is_refused_before_running(kind, how):
    model, optimizer, loss = _pair(kind)
    wrong = _wrong(kind, how, model, loss)
    before = jax.tree.map(np.asarray, _state(model, optimizer))
    fix = CUT if how == "stop_gradient" else OTHER
    with pytest.raises(ValueError, match=NO_DEPENDENCE.format(WHAT[kind]) + fix):
        scanax.fit(model, optimizer, wrong, (X, Y), **RUN)
    after = jax.tree.map(np.asarray, _state(model, optimizer))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing changed


@pytest.mark.parametrize(
    "options",
    [dict(execution="stepwise"), dict(accumulate=2)],
    ids=["stepwise", "accumulate"],
)
def test_refused_on_every_path(options):
    model, optimizer = nnx_pair()
    wrong = ft.partial(_other(nnx_loss), nnx_pair(1)[0])
    with pytest.raises(ValueError, match=NO_DEPENDENCE.format(WHAT["nnx"])):
        scanax.fit(model, optimizer, wrong, (X, Y), **RUN, **options)
    assert int(optimizer.step[...]) == 0


def test_a_population_member_not_reading_its_model_is_refused():
    other = eqx_model()

    def make(key):
        return eqx.nn.MLP(3, 1, 8, 1, key=key), TX

    pop = scanax.population(make, 2, key=KEY)
    with pytest.raises(ValueError, match=NO_DEPENDENCE.format(WHAT["eqx"])):
        scanax.fit(pop, None, lambda m, b: eqx_loss(other, b), (X, Y), **RUN)


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 1, rngs=rngs)
        self.bn = nnx.BatchNorm(1, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_wrt_choosing_variables_training_does_not_read_is_refused():
    """In training, BatchNorm normalises with the batch's statistics: its
    running averages (``nnx.BatchStat``) are written, never read."""
    model = Normed(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.BatchStat)
    with pytest.raises(ValueError, match=NO_DEPENDENCE.format(WHAT["nnx"])):
        scanax.fit(model, optimizer, nnx_loss, (X, Y), **RUN)


def _through_transforms(model, batch):
    """``nnx_loss`` with its value routed through a scan, a cond, a checkpoint
    and a custom derivative: the same number, the same gradient."""
    loss, metrics = nnx_loss(model, batch)

    @jax.custom_jvp
    def same(v):
        return v

    same.defjvp(lambda p, t: (p[0], t[0]))
    loss = jax.checkpoint(same)(loss)
    loss = jax.lax.cond(loss > -1.0, lambda v: v, lambda v: -v, loss)
    loss = jax.lax.scan(lambda c, _: (c, None), loss, None, length=2)[0]
    return loss, metrics


def _unused_param(model, batch):
    """``l2``'s bias is read; a loss need not read every parameter."""
    x, y = batch
    h = jax.nn.relu(model.l1(x))
    err = h @ model.l2.kernel[...] - y
    return jnp.mean(err**2)


def test_a_loss_reading_the_model_through_transforms_trains_as_the_plain_one():
    model, optimizer = nnx_pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = scanax.fit(model, optimizer, _through_transforms, (X, Y), **RUN)
    ref_model, ref_opt = nnx_pair()
    want = scanax.fit(ref_model, ref_opt, nnx_loss, (X, Y), **RUN)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-6)
    assert got.history["loss"][-1] < got.history["loss"][0]

    model, optimizer = nnx_pair()
    bias = np.asarray(model.l2.bias[...])
    kernel = np.asarray(model.l2.kernel[...])
    scanax.fit(model, optimizer, _unused_param, (X, Y), **RUN)
    np.testing.assert_array_equal(model.l2.bias[...], bias)  # (its gradient: 0)
    assert not np.array_equal(model.l2.kernel[...], kernel)


def test_a_loss_with_callbacks_is_checked():
    """A callback (``jax.debug.print``) is an effect the check walks through:
    a loss printing as it reads another model is refused too."""
    model, optimizer = nnx_pair()
    other = nnx_pair(1)[0]

    def printed(m, batch):
        loss = nnx_loss(other, batch)[0]
        jax.debug.callback(lambda v: None, loss)
        return loss

    with pytest.raises(ValueError, match=NO_DEPENDENCE.format(WHAT["nnx"]) + OTHER):
        scanax.fit(model, optimizer, printed, (X, Y), **RUN)


class Plain(nnx.Module):
    """Weights held as plain ``nnx.Variable``s, not ``nnx.Param``."""

    def __init__(self):
        self.w = nnx.Variable(jnp.ones((3, 1)))
        self.b = nnx.Variable(jnp.zeros((1,)))

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]


def _plain_loss(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def test_wrt_choosing_no_variable_is_refused():
    """(before: trained nothing, silently)"""
    model = Plain()
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"(?s)`wrt` \(<class '.*Param'>\) chooses none of the model's "
        r"floating-point Variables.*holds: Variable \(2\).*Fix: hold the weights",
    ):
        scanax.fit(model, optimizer, _plain_loss, (X, Y), **RUN)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Variable)
    scanax.fit(model, optimizer, _plain_loss, (X, Y), **RUN)
    assert not np.array_equal(model.w[...], np.ones((3, 1)))  # (trains with its wrt)


@jax.custom_vjp
def _ste_round(x):
    """Rounding with a straight-through gradient: its primal program is under
    ``stop_gradient``, its gradient the identity (its rule)."""
    return jax.lax.stop_gradient(jnp.round(x))


_ste_round.defvjp(lambda x: (_ste_round(x), None), lambda _, g: (g,))


def test_a_custom_derivative_rule_decides_not_its_primal():
    """A straight-through estimator (quantisation-aware training) trains: its
    gradient is its rule's, though its primal is under ``stop_gradient``
    (a review found it refused). One SGD step equals ``jax.grad``'s."""
    w = {"w": jnp.full((3, 1), 0.3)}

    def loss(p, batch):
        x, y = batch
        return jnp.mean((_ste_round(4 * x @ p["w"]) / 4 - y) ** 2)

    batch = (X[:BS], Y[:BS])
    want = jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w, batch))
    got = scanax.fit(w, optax.sgd(0.1), loss, (X, Y), steps=1, batch_size=BS,
                     key=None, progress=False)  # fmt: skip
    np.testing.assert_allclose(got.model["w"], want["w"], rtol=1e-6)
    assert not np.allclose(want["w"], w["w"])
