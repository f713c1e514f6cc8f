"""``fit(precision=...)``: the loss computed in a lower precision on cast copies,
float32 parameters, optimizer state, gradients and history, against hand-written
loops doing the same casts.

``"bfloat16"`` (first part): against a hand-written cast loop. ``"float16"``
(the rest): dynamic loss scaling, against a Python loop of one jitted step
(``Reference``) doing the casts and the scaling rule by hand, for an optax
pair, NNX and a TrainState: a forced overflow (the loss's cotangent
overflows float16 at scales of 1024 and more: six skipped steps, six halvings),
the growth after the period (shortened by patching the private constant), the
stop at scale 1 with the last good state, a population's per-member scales,
stepwise == fused, a checkpoint resume, ``ema=``, ``accumulate=``,
``plateau=``, in-loop evaluation in float16 and the errors."""

import functools as ft
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from fit_helpers import joined

import scanax
from scanax._fit.callbacks import loss_scale as _loss_scale

X = jr.normal(jr.key(0), (64, 3))
Y = X @ jnp.array([[1.0], [2.0], [-1.0]])
LABELS = (X[:, 0] > 0).astype(jnp.int32)  # an int leaf: never cast
TX = optax.adam(0.05)
P0 = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(())}
BF16 = jnp.bfloat16


def loss_fn(p, batch):
    x, y, labels = batch
    # (checked while tracing: what the step computes in)
    assert x.dtype == BF16 and p["w"].dtype == BF16 and labels.dtype == jnp.int32
    err = x @ p["w"] + p["b"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def _fit(model=P0, tx=TX, loss=loss_fn, **kw):
    kw = {"steps": 20, "batch_size": 16, "progress": False, **kw}
    return scanax.fit(model, tx, loss, (X, Y, LABELS), precision="bfloat16", **kw)


def reference(steps=20):
    def cast(t):
        return jtu.tree_map(
            lambda a: a.astype(BF16) if jnp.issubdtype(a.dtype, jnp.floating) else a, t
        )

    def objective(p, batch):
        return loss_fn(cast(p), cast(batch))[0].astype(jnp.float32)

    p, o, losses = P0, TX.init(P0), []
    for t in range(steps):
        i = t % 4
        batch = (X[i * 16 : (i + 1) * 16], Y[i * 16 : (i + 1) * 16], LABELS[:16])
        batch = batch[:2] + (LABELS[i * 16 : (i + 1) * 16],)
        loss, g = jax.value_and_grad(objective)(p, batch)
        assert all(x.dtype == jnp.float32 for x in jtu.tree_leaves(g))
        u, o = TX.update(g, o, p)
        p = optax.apply_updates(p, u)
        losses.append(loss)
    return p, o, np.array(losses)


def test_equals_the_hand_written_cast_loop():
    out = _fit()
    p, o, losses = reference()
    assert out.history["loss"].dtype == np.float32
    assert out.history["mae"].dtype == np.float32
    # (within one bfloat16 rounding: XLA may order a bfloat16 sum otherwise)
    np.testing.assert_allclose(out.history["loss"], losses, rtol=8e-3)
    for a, b in zip(
        jtu.tree_leaves((out.model, out.optimizer)), jtu.tree_leaves((p, o))
    ):
        assert a.dtype == b.dtype  # float32 parameters and moments
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-4)


def test_nnx_with_batchnorm_and_dropout():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 8, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
            self.out = nnx.Linear(8, 1, rngs=nnx.Rngs(2))

        def __call__(self, x):
            h = self.lin(x)
            assert h.dtype == BF16  # (the Linear computes in bfloat16)
            return self.out(self.drop(self.bn(h)))

    def loss(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    model = Net()
    mean0 = np.asarray(model.bn.mean[...])
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    out = _fit(model, optimizer, loss, eval_data=(X, Y, LABELS), eval_every=10)
    assert np.isfinite(out.history["loss"]).all()
    assert np.isfinite(out.history["val_loss"]).all()
    assert model.lin.kernel.dtype == jnp.float32 and model.bn.mean.dtype == jnp.float32
    assert not np.allclose(model.bn.mean[...], mean0)  # statistics written back
    # Dropout's RNG advanced: two more steps give other masks than a re-run
    counts = [int(x) for x in jtu.tree_leaves(nnx.state(model, nnx.RngCount))]
    assert counts and max(counts) >= 20


def test_trainstate_and_a_population_member():
    ts = pytest.importorskip("flax.training.train_state")

    def apply(params, x):
        return x @ params["w"] + params["b"]

    def loss(state, batch):
        return loss_fn(state.params, batch)

    state = ts.TrainState.create(apply_fn=apply, params=P0, tx=TX)
    out = _fit(state, None, loss)
    p, _, losses = reference()
    np.testing.assert_allclose(out.history["loss"], losses, rtol=8e-3)
    np.testing.assert_allclose(out.model.params["w"], p["w"], rtol=2e-2, atol=1e-4)

    def make(key):
        return P0, TX

    pop = scanax.population(make, 2, key=jr.key(0))
    both = _fit(pop, None)
    np.testing.assert_allclose(both.history["loss"][1], losses, rtol=8e-3)


def test_error_precision_object_names_itself():
    """scanax.Precision's own dtype error names Precision and its argument, not
    fit's precision= keyword."""
    for bad in ["half", "float32", jnp.bfloat16, 16]:
        with pytest.raises(ValueError) as err:
            scanax.Precision(bad)
        msg = str(err.value)
        assert msg.startswith(f"scanax.Precision: dtype={bad!r} is not one it knows: "
                              "expected 'bfloat16' or 'float16'.\nFix: pass "
                              "scanax.Precision('bfloat16')"), msg  # fmt: skip
        assert "scanax.fit" not in msg and "precision=None" not in msg


def test_errors():
    with pytest.raises(ValueError, match="precision='half' is not one fit knows"):
        scanax.fit(P0, TX, loss_fn, (X, Y, LABELS), steps=1, batch_size=16,
                   precision="half")  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"expected 'bfloat16', 'float16' \(scanax.Precision's dtype\) or None",
    ):
        scanax.fit(P0, TX, loss_fn, (X, Y, LABELS), steps=1, batch_size=16,
                   precision=16)  # fmt: skip


# ============================================================ float16: loss scaling

F16, F32 = jnp.float16, jnp.float32
N, BS, STEPS, LR = 48, 8, 24, 1e-2
X16 = jr.normal(jr.key(0), (N, 3))
Y16 = jnp.sin(X16 @ jnp.array([[1.0], [-2.0], [0.5]]))
# Markers (an int leaf, never cast) of the rows whose gradient a test poisons
MARK = (jnp.arange(N) >= 2 * BS).astype(jnp.int32)
OVERFLOW = 64.0  # 64 * scale overflows float16 (max 65504) from scale 1024 up
# The scales of the forced overflow: six skipped steps, each halving the scale
HALVINGS = [2.0**15 / 2**i for i in range(7)]


def batch_at(t):
    """The batch of step ``t`` (``key=None``: the rows in order)."""
    i = (t % (N // BS)) * BS
    return X16[i : i + BS], Y16[i : i + BS], MARK[i : i + BS]


def cast16(tree):
    return jtu.tree_map(
        lambda a: a.astype(F16) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def checked(x):
    assert x.dtype == F16, x.dtype  # (while tracing: the step computes in float16)
    return x


def mse16(out, y, k):
    """``k * mean((err / 8)**2)``: ``mean(err**2)`` for ``k = 64``, whose
    backward multiplies the loss's cotangent by 64 first."""
    err = (checked(out) - y) * 0.125
    return k * jnp.mean(err**2)


def linear_loss(p, batch, k=OVERFLOW):
    x, y, _ = batch
    return mse16(x @ checked(p["w"]) + p["b"], y, k)


def params0():
    return {"w": jr.normal(jr.key(1), (3, 1)) * 0.1, "b": jnp.zeros((1,))}


@jax.custom_vjp
def poison(x, marks):
    """``x``, whose gradient is infinite where a row of the batch is marked."""
    return x


poison.defvjp(
    lambda x, marks: (x, marks),
    lambda marks, g: (g * jnp.where(marks.any(), jnp.inf, 1.0).astype(g.dtype), None),
)


def poisoned_loss(p, batch):
    x, y, marks = batch
    return mse16(poison(x @ p["w"] + p["b"], marks), y, 1.0)


def fit16(model, optimizer, loss, steps=STEPS, data=None, **kw):
    kw = {"execution": "fused", "precision": "float16", **kw}
    return scanax.fit(
        model, optimizer, loss, (X16, Y16, MARK) if data is None else data,
        steps=steps, batch_size=BS, key=None, progress=False, **kw,
    )  # fmt: skip


def is_count(x):
    """The step counts (here: the integer scalars: Adam's count, an NNX
    optimizer's step, a TrainState's step), which a skipped step advances."""
    return jnp.issubdtype(x.dtype, jnp.integer) and x.ndim == 0


def all_finite(tree):
    return bool(all(jnp.isfinite(x).all() for x in jtu.tree_leaves(tree)))


class Reference:
    """The hand-written loop: per step, ``grad(scale * loss)`` through the
    float16 casts (``step(state, micro-batches, scale)`` jitted, given the
    step's update as ``(state after, loss, gradients)``), the gradients divided
    by the scale in float32, then the rule in Python. ``ema``: the average,
    updated after each step applied; ``lr_scales``: the steps' plateau scales
    (the update moved that much of the way)."""

    def __init__(self, step, state, period=2000, ema=None, lr_scales=None):
        self.step, self.state, self.period = step, state, period
        self.ema, self.lr_scales = ema, lr_scales

    def run(self, steps, accumulate=1, params=None, scale=2.0**15):
        good = 0
        state = self.state
        average = None if self.ema is None else params(state)
        out = {"loss": [], "loss_scale": [], "skipped": [], "stop": None}
        for t in range(steps):
            micro = [batch_at(t * accumulate + j) for j in range(accumulate)]
            new, loss, grads = self.step(state, micro, jnp.float32(scale))
            out["loss"].append(float(loss))
            out["loss_scale"].append(scale)
            loss_ok, grads_ok = bool(jnp.isfinite(loss)), all_finite(grads)
            if not loss_ok or (not grads_ok and scale <= 1):
                out["stop"] = t
                break
            if grads_ok:  # applied
                if self.lr_scales is not None:  # (an optax pair's parameters)
                    s = jnp.float32(self.lr_scales[t])
                    moved = jtu.tree_map(lambda p, q: p + s * (q - p), state[0], new[0])
                    new = (moved, new[1])
                state = new
                if average is not None:
                    average = jtu.tree_map(
                        lambda e, p: self.ema * e + (1 - self.ema) * p,
                        average,
                        params(state),
                    )
                good += 1
                if good == self.period:  # (never past 2**15)
                    scale, good = min(scale * 2, 2.0**15), 0
            else:  # skipped: all but the step counts as they were
                state = jtu.tree_map(lambda o, n: n if is_count(n) else o, state, new)
                scale, good = max(scale / 2, 1.0), 0
                out["skipped"].append(t)
        out["state"], out["ema"] = state, average
        return out


def unscaled(grads, scale):
    return jtu.tree_map(lambda g: g / scale, grads)


def optax_step(tx, loss):
    """The optax pair's reference step (micro-batches' gradients averaged)."""

    @jax.jit
    def step(state, micro, scale):
        p, o = state

        def objective(q, b):
            value = loss(cast16(q), cast16(b)).astype(F32)
            return scale * value, value

        grads, losses = [], []
        for b in micro:
            g, value = jax.grad(objective, has_aux=True)(p, b)
            grads.append(unscaled(g, scale))
            losses.append(value)
        g = jtu.tree_map(lambda *g: sum(g) / len(g), *grads)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), sum(losses) / len(losses), g

    return step


@ft.cache
def optax_reference(k=OVERFLOW, lr=LR):
    tx = optax.adam(lr)
    loss = ft.partial(linear_loss, k=k)
    return Reference(optax_step(tx, loss), (params0(), tx.init(params0()))).run(STEPS)


allclose = ft.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
# A population member against its solo reference: the same float16 program,
# vmapped. XLA:CPU computes both alike; a GPU's vmapped float16 reductions may
# round once differently (5e-4 relative measured on an H200, at highest matmul
# precision): within float16's epsilon there.
member_close = (
    allclose
    if jax.default_backend() == "cpu"
    else ft.partial(allclose, rtol=float(jnp.finfo(jnp.float16).eps))
)
# Its state: each of Adam's STEPS updates (at most LR in size, normalised) may
# move by float16's epsilon of LR where a gradient rounded otherwise (measured
# on a TPU v5e: 2.4e-5 on a weight of 0.015, the bound here 2.3e-4).
member_state_close = (
    allclose
    if jax.default_backend() == "cpu"
    else ft.partial(
        allclose,
        rtol=float(jnp.finfo(jnp.float16).eps),
        atol=STEPS * LR * float(jnp.finfo(jnp.float16).eps),
    )
)


def same(result_state, reference_state, close=allclose):
    for a, b in zip(
        jtu.tree_leaves(result_state), jtu.tree_leaves(reference_state), strict=True
    ):
        assert a.dtype == b.dtype
        close(np.asarray(a, np.float64), np.asarray(b, np.float64))


def equal(a, b):
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@ft.cache
def optax_fused():
    return fit16(params0(), optax.adam(LR), linear_loss)


def test_optax_pair_skips_and_halves_as_the_reference():
    ref, out = optax_reference(), optax_fused()
    assert ref["skipped"] == [0, 1, 2, 3, 4, 5] and ref["stop"] is None
    expected = HALVINGS + [HALVINGS[-1]] * (STEPS - len(HALVINGS))
    assert ref["loss_scale"] == expected
    np.testing.assert_array_equal(out.history["loss_scale"], expected)
    assert out.history["loss_scale"].dtype == np.float32
    assert out.history["loss"].dtype == np.float32 and out.steps == STEPS
    allclose(out.history["loss"], ref["loss"])
    same((out.model, out.optimizer), ref["state"])
    # the six skipped steps left the parameters and moments, not the count
    assert int(out.optimizer[0].count) == STEPS


def test_stepwise_is_fused():
    stepwise = fit16(params0(), optax.adam(LR), linear_loss, execution="stepwise")
    fused = optax_fused()
    assert stepwise.execution == "stepwise"
    equal(stepwise.history, fused.history)
    equal((stepwise.model, stepwise.optimizer), (fused.model, fused.optimizer))


def test_nnx_skips_and_halves_as_the_reference_and_evaluates_in_float16():
    nnx = pytest.importorskip("flax.nnx")
    from fit_helpers import MLP

    def loss(model, batch):
        x, y, _ = batch
        return mse16(model(checked(x)), y, OVERFLOW)

    def make():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    model, optimizer = make()
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state, micro, scale):
        model, optimizer = nnx.merge(graphdef, state)
        gd, params, rest = nnx.split(model, nnx.Param, ...)

        def objective(params):
            value = loss(nnx.merge(gd, cast16(params), rest), cast16(micro[0]))
            return scale * value.astype(F32), value.astype(F32)

        g, value = jax.grad(objective, has_aux=True)(params)
        g = unscaled(g, scale)
        optimizer.update(model, g)
        return nnx.state((model, optimizer)), value, g

    ref = Reference(step, state).run(STEPS)
    evaluated = []

    def eval_fn(model, batch):
        evaluated.append(batch[0].dtype)
        return loss(model, batch)

    out = fit16(
        model, optimizer, loss, eval_data=(X16, Y16, MARK), eval_every=STEPS,
        eval_fn=eval_fn,
    )  # fmt: skip
    assert ref["skipped"] == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(out.history["loss_scale"], ref["loss_scale"])
    allclose(out.history["loss"], ref["loss"])
    same(nnx.state((model, optimizer)), ref["state"])
    assert int(optimizer.step[...]) == STEPS
    # the evaluation ran in float16 (no scaling: no gradient), on the result
    assert evaluated and set(evaluated) == {jnp.dtype(F16)}
    copy = cast16_model(nnx, model)
    expected = np.mean([float(loss(copy, cast16(batch_at(t)))) for t in range(6)])
    allclose(out.history["val_loss"], [expected], rtol=1e-2)


def cast16_model(nnx, model):
    gd, params, rest = nnx.split(model, nnx.Param, ...)
    out = nnx.merge(gd, cast16(params), rest)
    out.eval()
    return out


def test_trainstate_skips_and_halves_as_the_reference():
    ts = pytest.importorskip("flax.training.train_state")

    def apply(params, x):
        return x @ params["w"] + params["b"]

    def loss(state, batch):
        x, y, _ = batch
        checked(state.params["w"])
        return mse16(state.apply_fn(state.params, x), y, OVERFLOW)

    state = ts.TrainState.create(apply_fn=apply, params=params0(), tx=optax.adam(LR))

    @jax.jit
    def step(state, micro, scale):
        def objective(params):
            value = loss(state.replace(params=cast16(params)), cast16(micro[0]))
            return scale * value.astype(F32), value.astype(F32)

        g, value = jax.grad(objective, has_aux=True)(state.params)
        g = unscaled(g, scale)
        return state.apply_gradients(grads=g), value, g

    ref = Reference(step, state).run(STEPS)
    out = fit16(state, None, loss)
    np.testing.assert_array_equal(out.history["loss_scale"], ref["loss_scale"])
    allclose(out.history["loss"], ref["loss"])
    same(out.model, ref["state"])
    assert int(out.model.step) == STEPS
    # the same values as the optax pair's (the same model, loss and steps)
    same(out.model.params, optax_reference()["state"][0])


def test_the_scale_doubles_after_the_period_up_to_2_15(monkeypatch):
    """With a period of 3 (patched), from a scale of 2**12 (given as
    ``loss_scale_state``): three good steps in a row double the scale, up to
    2**15 and no further (2**16 is not a float16 number: the float16 loss's own
    cotangent would overflow)."""
    monkeypatch.setattr(_loss_scale, "PERIOD", 3)
    loss = ft.partial(linear_loss, k=1.0)  # no overflow at 2**15
    tx = optax.adam(LR)
    ref = Reference(
        optax_step(tx, loss), (params0(), tx.init(params0())), period=3
    ).run(14, scale=2.0**12)
    start = scanax.LossScale(2.0**12, 0)
    out = fit16(params0(), tx, loss, steps=14, loss_scale_state=start)
    expected = [2.0**12] * 3 + [2.0**13] * 3 + [2.0**14] * 3 + [2.0**15] * 5
    assert ref["loss_scale"] == expected and ref["skipped"] == []
    np.testing.assert_array_equal(out.history["loss_scale"], expected)
    allclose(out.history["loss"], ref["loss"])
    same((out.model, out.optimizer), ref["state"])
    assert float(out.loss_scale.scale) == 2.0**15


def test_non_finite_gradients_at_scale_1_stop_with_the_last_good_state():
    """Batches 2 to 5 of each epoch give infinite gradients: those steps are
    skipped, each halving the scale, until it is 1 (after 15 skips); the next
    such step stops fit, which keeps the state after the last step run."""
    tx = optax.adam(LR)
    ref = Reference(optax_step(tx, poisoned_loss), (params0(), tx.init(params0())))
    ref = ref.run(40)
    assert ref["stop"] == 23 and len(ref["skipped"]) == 15
    assert ref["loss_scale"][-1] == 1.0
    with pytest.warns(RuntimeWarning, match="step 24 gave non-finite gradients"):
        out = fit16(params0(), tx, poisoned_loss, steps=40)
    assert out.steps == 23 and len(out.history["loss"]) == 23
    np.testing.assert_array_equal(out.history["loss_scale"], ref["loss_scale"][:23])
    same((out.model, out.optimizer), ref["state"])
    assert int(out.optimizer[0].count) == 23


def test_a_non_finite_loss_stops_at_any_scale():
    def loss(p, batch):
        x, y, marks = batch
        value = linear_loss(p, batch)
        return jnp.where(marks.any(), jnp.inf, 1.0).astype(value.dtype) * value

    with pytest.warns(RuntimeWarning, match=r"step 3 gave a non-finite loss \(inf\)"):
        out = fit16(params0(), optax.adam(LR), loss, steps=8)
    assert out.steps == 2
    np.testing.assert_array_equal(out.history["loss_scale"], HALVINGS[:2])
    equal(out.model, params0())  # (both steps skipped)


def test_population_members_have_their_own_scales():
    """Member 0's loss overflows (k = 64), member 1's does not (k = 1): each
    member is its solo reference run."""

    def make(key, k):
        return params0(), optax.adam(LR)

    def loss(p, batch, hp):
        return linear_loss(p, batch, hp["k"].astype(F16))

    pop = scanax.population(make, 2, key=jr.key(0), k=np.float32([OVERFLOW, 1.0]))
    out = fit16(pop, None, loss)
    for i, k in enumerate((OVERFLOW, 1.0)):
        ref = optax_reference(k)
        np.testing.assert_array_equal(out.history["loss_scale"][i], ref["loss_scale"])
        member_close(out.history["loss"][i], ref["loss"])
        same((out.model[i], out.optimizer[i]), ref["state"], member_state_close)
    assert out.history["loss_scale"][1].min() == 2.0**15


def test_every_trained_leaf_is_unscaled():
    """The gradient of every leaf the optimizer trains is divided by the scale,
    not only of the floating parameters that are cast: an NNX Variable of the
    user's own kind in ``wrt`` and a complex leaf of a pytree model get float32's
    update (the loss is linear in them: float16 changes only rounding)."""
    nnx = pytest.importorskip("flax.nnx")

    class Gain(nnx.Variable):
        pass

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 1, rngs=rngs)
            self.gain = Gain(jnp.ones((1,)))

        def __call__(self, x):
            return self.lin(x) * self.gain[...]

    def loss(model, batch):
        x, y, _ = batch
        return jnp.mean((model(x).astype(F32) - y) ** 2)

    moved = {}
    for precision in (None, "float16"):
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Any(nnx.Param, Gain))
        fit16(model, opt, loss, steps=1, precision=precision)
        moved[precision] = float(model.gain[...][0]) - 1.0
    assert moved[None] != 0
    np.testing.assert_allclose(moved["float16"], moved[None], rtol=1e-2)

    def complex_loss(p, batch):
        x, y, _ = batch
        out = x @ p["w"] + jnp.real(p["c"] * jnp.conj(p["c"])).astype(x.dtype)
        return jnp.mean((out.astype(F32) - y) ** 2)

    p0 = {"w": params0()["w"], "c": jnp.array([0.3 + 0.1j], jnp.complex64)}
    outs = [
        fit16(p0, optax.sgd(1e-3), complex_loss, steps=1, precision=precision)
        for precision in (None, "float16")
    ]
    step32, step16 = (o.model["c"] - p0["c"] for o in outs)
    assert abs(complex(step32[0])) > 0
    np.testing.assert_allclose(step16, step32, rtol=1e-2)


def test_loss_scale_state_continues_the_scale_across_calls():
    """Two calls, the second given the first's ``result.loss_scale`` (and its
    optimizer state): the one call's scales, losses and state, exactly, and no
    step skipped twice; without it the second call starts at 2**15 again."""
    whole, half = optax_fused(), STEPS // 2
    first = fit16(params0(), optax.adam(LR), linear_loss, steps=half)
    state = first.loss_scale
    assert isinstance(state, scanax.LossScale)
    assert float(state.scale) == HALVINGS[-1] and int(state.good_steps) == half - 6
    second = fit16(
        first.model, optax.adam(LR), linear_loss, steps=half,
        opt_state=first.optimizer, loss_scale_state=state,
    )  # fmt: skip
    scales = joined([first, second], "loss_scale")
    np.testing.assert_array_equal(scales, whole.history["loss_scale"])
    losses = joined([first, second], "loss")
    np.testing.assert_array_equal(losses, whole.history["loss"])
    equal((second.model, second.optimizer), (whole.model, whole.optimizer))
    assert int(second.loss_scale.good_steps) == int(whole.loss_scale.good_steps)
    again = fit16(
        first.model, optax.adam(LR), linear_loss, steps=2, opt_state=first.optimizer
    )
    assert again.history["loss_scale"][0] == 2.0**15


def test_loss_scale_state_continues_each_population_member():
    def make(key, k):
        return params0(), optax.adam(LR)

    def loss(p, batch, hp):
        return linear_loss(p, batch, hp["k"].astype(F16))

    def pop():
        return scanax.population(make, 2, key=jr.key(0), k=np.float32([OVERFLOW, 1.0]))

    whole, members, half = fit16(pop(), None, loss), pop(), STEPS // 2
    first = fit16(members, None, loss, steps=half)
    assert np.shape(first.loss_scale.scale) == (2,)
    second = fit16(members, None, loss, steps=half, loss_scale_state=first.loss_scale)
    scales = joined([first, second], "loss_scale")
    np.testing.assert_array_equal(scales, whole.history["loss_scale"])
    for i in range(2):
        equal(second.model[i], whole.model[i])


def test_loss_scale_state_errors():
    state = scanax.LossScale(jnp.float32(4.0), jnp.int32(0))
    with pytest.raises(
        TypeError,
        match=r"`loss_scale_state` \(scanax.Precision's `state`\) continues float16's",
    ):
        scanax.fit(P0, TX, loss_fn, (X, Y, LABELS), steps=1, batch_size=16,
                   precision="bfloat16", loss_scale_state=state)  # fmt: skip
    for bad, message in (
        (4.0, r"`loss_scale_state` \(scanax.Precision's `state`\) must be the"),
        (
            (jnp.float32(4.0), jnp.int32(0)),
            r"`loss_scale_state` \(scanax.Precision's `state`\) must be the",
        ),
        (
            state._replace(scale=jnp.ones(2)),
            r"`loss_scale_state.scale` \(scanax.Precision\'s `state`\) must be a",
        ),
        (
            state._replace(good_steps="3"),
            r"`loss_scale_state.good_steps` \(scanax.Precision\'s `state`\) must be",
        ),
    ):
        with pytest.raises(TypeError, match=message):
            fit16(params0(), optax.adam(LR), linear_loss, steps=1,
                  loss_scale_state=bad)  # fmt: skip
    for field, value in (("scale", np.inf), ("scale", 0.5), ("scale", 2.0**16),
                         ("good_steps", -1), ("good_steps", 2.5)):  # fmt: skip
        with pytest.raises(
            ValueError,
            match=rf"`loss_scale_state.{field}` \(scanax.Precision\'s `state`\) must be",
        ):
            fit16(params0(), optax.adam(LR), linear_loss, steps=1,
                  loss_scale_state=state._replace(**{field: value}))  # fmt: skip
    # Python numbers are numbers: the documented `_replace` recipe works
    out = fit16(params0(), optax.adam(LR), linear_loss, steps=1,
                loss_scale_state=scanax.LossScale(512.0, 0))  # fmt: skip
    assert out.history["loss_scale"][0] == 512.0


def test_ema_accumulation_and_plateau_compose():
    """Two micro-batches per step, an average of the weights and a plateau
    rule lowering the rate at each evaluation: the average is left by skipped
    steps, the plateau's scale moves the applied updates."""
    tx = optax.adam(LR)
    rule = scanax.Plateau("loss", factor=0.5, patience=0, min_delta=10.0)
    out = fit16(
        params0(), tx, linear_loss, accumulate=2, ema=0.5, plateau=rule,
        eval_every=4,
    )  # fmt: skip
    lr_scales = out.history["lr_scale"]
    assert lr_scales[-1] < 1.0
    ref = Reference(
        optax_step(tx, linear_loss), (params0(), tx.init(params0())), ema=0.5,
        lr_scales=lr_scales,
    ).run(STEPS, accumulate=2, params=lambda s: s[0])  # fmt: skip
    assert ref["skipped"] == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(out.history["loss_scale"], ref["loss_scale"])
    allclose(out.history["loss"], ref["loss"])
    same((out.model, out.optimizer), ref["state"])
    same(out.ema, ref["ema"])


def test_a_checkpoint_resumes_the_scale_exactly(tmp_path):
    """Stopped after step 10 (the scale at 512, its good steps counted), then
    restarted from the top with the same directory: the uninterrupted run,
    exactly. A later call starts at 2**15 again."""
    kw = dict(checkpoint_dir=tmp_path, checkpoint_every=4)
    first = fit16(params0(), optax.adam(LR), linear_loss, steps=10, **kw)
    assert first.history["loss_scale"][-1] == 512.0
    resumed = fit16(params0(), optax.adam(LR), linear_loss, **kw)
    full = optax_fused()
    assert resumed.steps == STEPS
    equal(resumed.history["loss_scale"], full.history["loss_scale"])
    equal((resumed.model, resumed.optimizer), (full.model, full.optimizer))
    again = fit16(
        first.model, optax.adam(LR), linear_loss, steps=2, opt_state=first.optimizer
    )
    assert again.history["loss_scale"][0] == 2.0**15
    # (the skipped steps were steps: the next call continues after step 10)
    assert again.history["step"].tolist() == [11, 12]


def test_float16_errors_leave_the_model_as_it_was():
    def taken(p, batch):
        value = linear_loss(p, batch)
        return value, {"loss_scale": value}

    p = params0()
    with pytest.raises(ValueError, match="returns a metric named 'loss_scale'"):
        fit16(p, optax.adam(LR), taken, steps=2)
    equal(p, params0())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit16(p, optax.adam(LR), linear_loss, steps=1)  # float16 is accepted
