"""scanax.fit against Python loops of the same optimizer steps on the same batches."""

import inspect
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import scanax

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
train_state = pytest.importorskip("flax.training.train_state")

from fit_helpers import (  # noqa: E402
    BS,
    KEY,
    MLP,
    TX,
    X,
    Y,
    batch_at,
    eqx_loss,
    eqx_model,
    nnx_loss,
    nnx_pair,
    ts_loss,
    ts_make,
)
from helpers import count_compiles, leaves_equal, poison  # noqa: E402

STEPS = 23  # 6 batches per epoch: 23 steps cross 3 epoch boundaries
CHUNKED = dict(steps=STEPS, batch_size=BS, key=KEY, steps_per_call=7)  # array data


@nnx.jit
def nnx_step(model, optimizer, batch):
    (loss, _), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return loss


def leaves_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jr.key_data(x), jr.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


_FIT_RUNS = {}


def fit_once(kind, steps_per_call):
    """fit of one model kind on the shared task, memoized across tests."""
    if (kind, steps_per_call) not in _FIT_RUNS:
        model, opt = {
            "nnx": nnx_pair,
            "eqx": lambda: (eqx_model(), TX),
            "ts": lambda: (ts_make(), None),
        }[kind]()
        loss = {"nnx": nnx_loss, "eqx": eqx_loss, "ts": ts_loss}[kind]
        result = fit_quiet(
            model,
            opt,
            loss,
            (X, Y),
            steps=STEPS,
            batch_size=BS,
            key=KEY,
            steps_per_call=steps_per_call,
        )
        if kind == "nnx":
            state = (nnx.state(model), nnx.state(opt))
        elif kind == "eqx":
            state = (eqx.filter(result.model, eqx.is_array), result.optimizer)
        else:
            state = result.model
        _FIT_RUNS[kind, steps_per_call] = (result, state)
    return _FIT_RUNS[kind, steps_per_call]


def fit_quiet(*args, **kwargs):
    return scanax.fit(*args, progress=False, **kwargs)


# ---------------------------------------------------------------------------- NNX


@pytest.mark.parametrize("kind", ["nnx", "eqx", "ts"])
@pytest.mark.parametrize("steps_per_call", [7, 100])
def test_independent_of_steps_per_call(kind, steps_per_call):
    """Bit-identical: step t's batch and RNG depend on t only, not on the chunking."""
    one, state_one = fit_once(kind, 1)
    many, state_many = fit_once(kind, steps_per_call)
    np.testing.assert_array_equal(many.history["loss"], one.history["loss"])
    leaves_equal(state_many, state_one)


# A loop of separately jitted steps is a different XLA program than the same step
# inside scan + cond: XLA may fuse (and so round) differently, by about 1 ulp per
# step, so fit is compared with the loop to a tight tolerance, and with itself
# (other steps_per_call) exactly.


@pytest.mark.parametrize("steps_per_call", [1, 7, 100])
def test_nnx_equals_python_loop(steps_per_call):
    result, (model_state, opt_state) = fit_once("nnx", steps_per_call)
    assert result.steps == STEPS
    ref_model, ref_opt = nnx_pair()
    losses, maes = [], []
    for t in range(STEPS):
        maes.append(nnx_loss(ref_model, batch_at(t))[1]["mae"])  # before the step
        losses.append(nnx_step(ref_model, ref_opt, batch_at(t)))
    np.testing.assert_allclose(result.history["loss"], np.array(losses), rtol=1e-5)
    assert result.history["mae"].shape == (STEPS,)
    np.testing.assert_allclose(result.history["mae"], np.array(maes), rtol=1e-5)
    leaves_close(model_state, nnx.state(ref_model))
    leaves_close(opt_state, nnx.state(ref_opt))


def test_nnx_objects_updated_in_place():
    model, opt = nnx_pair()
    before = np.asarray(model.l1.kernel[...])
    result = fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    assert result.model is model and result.optimizer is opt
    assert int(opt.step[...]) == STEPS
    _, state = fit_once("nnx", 7)
    leaves_equal(nnx.state(model), state[0])
    assert not np.array_equal(before, model.l1.kernel[...])


def test_nnx_dropout_rng_and_batchnorm_state_advance():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(self.bn(self.lin(x))))

    def make():
        model = Net(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

    model, opt = make()
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=9, batch_size=BS, steps_per_call=7)
    ref_model, ref_opt = make()
    for t in range(9):
        nnx_step(ref_model, ref_opt, batch_at(t, key=None))
    leaves_close(nnx.state(model), nnx.state(ref_model))
    assert int(model.drop.rngs.count[...]) == 9  # the RNG stream advanced


def test_learning_happens_on_regression():
    model, opt = nnx_pair()
    result = fit_quiet(
        model,
        opt,
        nnx_loss,
        (X, Y),
        steps=400,
        batch_size=BS,
        key=KEY,
        steps_per_call=7,
    )
    h = result.history["loss"]
    assert h.shape == (400,)
    assert h[-50:].mean() < 0.2 * h[:10].mean()
    full = float(nnx_loss(model, (X, Y))[0])
    assert full < 0.3 * float(jnp.mean(Y**2))


def test_metrics_in_history():
    model, opt = nnx_pair()
    ref_model, _ = nnx_pair()
    result = fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    assert set(result.history) == {"step", "loss", "mae"}
    np.testing.assert_array_equal(result.history["step"], np.arange(1, STEPS + 1))
    assert result.history["mae"].dtype == np.float32
    # The first step's metrics are computed on the initial model.
    _, metrics = nnx_loss(ref_model, batch_at(0))
    np.testing.assert_allclose(result.history["mae"][0], metrics["mae"], rtol=1e-6)


def test_second_call_does_not_compile():
    model, opt = nnx_pair()
    fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    model, opt = nnx_pair(seed=3)  # new objects, same structure, new values
    x2, key2 = X + 1, jr.key(9)
    with count_compiles() as c:
        fit_quiet(
            model,
            opt,
            nnx_loss,
            (x2, Y),
            steps=STEPS,
            batch_size=BS,
            key=key2,
            steps_per_call=7,
        )
    assert c.n == 0


def test_progress_bar(capsys):
    model, opt = nnx_pair()
    scanax.fit(model, opt, nnx_loss, (X, Y), **CHUNKED)
    err = capsys.readouterr().err
    assert "23/23" in err and "step/s" in err and "loss=" in err


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_progress_reports_from_inside_the_loop(monkeypatch, platform):
    """With a bar, each compiled call reports every few steps from inside the loop
    (a call of 60 steps with unknown speed: every 6th step, rounded up to a
    multiple of the chunk off CPU: each report cuts a chunk), and the result is
    the same as without a bar. ``platform``: fit decides as on that backend."""
    import scanax._progress as progress_module
    from scanax import _backend
    from scanax._fit import program as _fit_program

    monkeypatch.setattr(_backend, "platform", lambda: platform)
    _fit_program.PROGRAMS.clear()  # (built anew for this platform's plan)
    seen = []
    monkeypatch.setattr(
        progress_module, "report_newest", lambda d, loss: seen.append(int(d))
    )
    model, opt = nnx_pair()
    kwargs = dict(steps=60, batch_size=BS, key=KEY, steps_per_call=60)
    with_bar = scanax.fit(model, opt, nnx_loss, (X, Y), progress=True, **kwargs)
    jax.effects_barrier()
    (program,) = _fit_program.PROGRAMS.values()
    k = program.chunks.plan.k
    assert (k == 1) == (platform == "cpu")
    every = -(-6 // k) * k
    assert sorted(seen) == list(range(every, 61, every))
    model2, opt2 = nnx_pair()
    without = fit_quiet(model2, opt2, nnx_loss, (X, Y), **kwargs)
    np.testing.assert_array_equal(with_bar.history["loss"], without.history["loss"])
    leaves_equal(nnx.state(model), nnx.state(model2))


def test_progress_spec_as_in_scan(monkeypatch, capsys):
    """fit takes scan's progress values: an int or a scanax.Progress sets the
    in-loop cadence exactly (here every 5 steps, over calls of 7), its label and
    unit; bad values get scan's error."""
    import scanax._progress as progress_module

    seen = []
    report = progress_module.report_newest
    monkeypatch.setattr(
        progress_module,
        "report_newest",
        lambda d, loss: (seen.append(int(d)), report(d, loss)),
    )
    kwargs = CHUNKED
    spec = scanax.Progress(every=5, desc="train", unit="batch")
    model, opt = nnx_pair()
    scanax.fit(model, opt, nnx_loss, (X, Y), progress=spec, **kwargs)
    jax.effects_barrier()
    assert sorted(seen) == list(range(5, STEPS + 1, 5))
    err = capsys.readouterr().err
    assert "train: 100%" in err and f"{STEPS}/{STEPS}" in err and "batch/s" in err
    seen.clear()
    scanax.fit(*nnx_pair(), nnx_loss, (X, Y), progress=4, **kwargs)
    jax.effects_barrier()
    assert sorted(seen) == list(range(4, STEPS + 1, 4))
    with pytest.raises(
        TypeError, match=r"^scanax\.fit: `progress` must be False, True, a positive"
    ):
        scanax.fit(*nnx_pair(), nnx_loss, (X, Y), progress="yes", **kwargs)
    with pytest.raises(ValueError, match=r"^scanax\.fit: the progress bar's `every`"):
        scanax.fit(*nnx_pair(), nnx_loss, (X, Y), progress=0, **kwargs)


def test_progress_false_is_silent(capsys):
    model, opt = nnx_pair()
    fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_progress_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    model, opt = nnx_pair()
    with pytest.raises(
        ImportError,
        match=r"(?s)scanax.fit: `progress=` needs tqdm.*or pass progress=False",
    ):
        scanax.fit(model, opt, nnx_loss, (X, Y), steps=3, batch_size=BS)


# ---------------------------------------------------------------------------- data


def test_iterable_data_equals_array_data_order():
    batches = [batch_at(t) for t in range(STEPS)]
    model, opt = nnx_pair()
    result = fit_quiet(
        model, opt, nnx_loss, iter(batches), steps=STEPS, steps_per_call=7
    )
    ref_model, ref_opt = nnx_pair()
    losses = [nnx_step(ref_model, ref_opt, b) for b in batches]
    assert result.steps == STEPS
    np.testing.assert_allclose(result.history["loss"], np.array(losses), rtol=1e-5)
    leaves_close(nnx.state(model), nnx.state(ref_model))


@pytest.mark.parametrize("available", [3, 10])
def test_iterator_ends_early(available):
    def gen():
        for t in range(available):
            yield tuple(np.asarray(a) for a in batch_at(t))

    model, opt = nnx_pair()
    result = fit_quiet(model, opt, nnx_loss, gen(), steps=STEPS, steps_per_call=7)
    assert result.steps == available
    assert result.history["loss"].shape == (available,)
    ref_model, ref_opt = nnx_pair()
    for t in range(available):
        nnx_step(ref_model, ref_opt, batch_at(t))
    leaves_close(nnx.state(model), nnx.state(ref_model))


def test_unshuffled_array_data_in_order():
    model, opt = nnx_pair()
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=8, batch_size=BS, steps_per_call=7)
    ref_model, ref_opt = nnx_pair()
    for t in range(8):
        nnx_step(ref_model, ref_opt, batch_at(t, key=None))
    leaves_close(nnx.state(model), nnx.state(ref_model))


# ---------------------------------------------------------------------------- NaN


@pytest.mark.parametrize("bad_step", [0, 9])
def test_nan_loss_stops_and_keeps_last_good_state(bad_step):
    batches = [batch_at(t) for t in range(STEPS)]
    x, y = batches[bad_step]
    batches[bad_step] = (x, y.at[0].set(jnp.nan))
    model, opt = nnx_pair()
    with pytest.warns(
        RuntimeWarning,
        match=rf"scanax.fit: step {bad_step + 1} gave a non-finite loss \(nan\).*"
        rf"state after step {bad_step} \({bad_step} good steps in this call\)",
    ):
        result = fit_quiet(model, opt, nnx_loss, batches, steps=STEPS, steps_per_call=7)
    assert result.steps == bad_step
    assert result.history["loss"].shape == (bad_step,)
    # Exactly the state of a run that stopped before the bad batch.
    ref_model, ref_opt = nnx_pair()
    if bad_step:
        fit_quiet(
            ref_model,
            ref_opt,
            nnx_loss,
            batches[:bad_step],
            steps=STEPS,
            steps_per_call=7,
        )
    leaves_equal(nnx.state(model), nnx.state(ref_model))
    leaves_equal(nnx.state(opt), nnx.state(ref_opt))


class WithData(nnx.Module):
    """An NNX model with an array outside any Variable (``nnx.data``)."""

    def __init__(self):
        self.lin = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        self.scale = nnx.data(jnp.full((1,), 0.5))

    def __call__(self, x):
        return self.lin(x) * self.scale


def test_nnx_array_outside_a_variable():
    """Such a leaf is carried unchanged and written back with the rest, and the
    Variables are trained as in a Python loop."""
    model, ref = WithData(), WithData()
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    result = fit_quiet(model, opt, nnx_loss, (X, Y), steps=9, batch_size=BS)
    losses = [nnx_step(ref, ref_opt, batch_at(t, key=None)) for t in range(9)]
    np.testing.assert_allclose(result.history["loss"], losses, rtol=1e-5)
    leaves_close(nnx.state(model), nnx.state(ref))
    assert model.scale is not None and float(model.scale[0]) == 0.5


def test_interrupt_keeps_the_last_checked_state(monkeypatch):
    """Ctrl-C while fit waits for a call: the NNX objects hold the state after the
    calls already checked (here the first 7 steps), exactly, not a half-run one."""
    import scanax._fit.engine as fit_module

    batches = [batch_at(t) for t in range(STEPS)]
    real_get, calls = jax.device_get, []

    def interrupted(x):
        calls.append(1)
        if len(calls) == 2:  # waiting for the second call of 7 steps
            raise KeyboardInterrupt
        return real_get(x)

    monkeypatch.setattr(fit_module.jax, "device_get", interrupted)
    model, opt = nnx_pair()
    with pytest.raises(KeyboardInterrupt):
        fit_quiet(model, opt, nnx_loss, batches, steps=STEPS, steps_per_call=7)
    monkeypatch.setattr(fit_module.jax, "device_get", real_get)
    ref_model, ref_opt = nnx_pair()
    fit_quiet(ref_model, ref_opt, nnx_loss, batches[:7], steps=7, steps_per_call=7)
    leaves_equal(nnx.state(model), nnx.state(ref_model))
    leaves_equal(nnx.state(opt), nnx.state(ref_opt))


def test_nonfinite_gradients_stop():
    def loss_fn(model, batch):
        x, y = batch
        penalty = poison(model.l2.bias[...], y[0, 0] == 0)
        return jnp.mean((model(x) - y) ** 2) + penalty

    batches = [batch_at(t) for t in range(6)]
    batches[4] = (batches[4][0], batches[4][1].at[0, 0].set(0.0))
    model, opt = nnx_pair()
    with pytest.warns(RuntimeWarning, match=r"step 5 gave non-finite gradients"):
        result = fit_quiet(model, opt, loss_fn, batches, steps=6, steps_per_call=3)
    assert result.steps == 4


# ---------------------------------------------------------------------------- Equinox


@eqx.filter_jit
def eqx_step(model, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(eqx_loss)(model, batch)
    updates, opt_state = TX.update(
        grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
    )
    return eqx.apply_updates(model, updates), opt_state, loss


@pytest.mark.parametrize("steps_per_call", [1, 7, 100])
def test_equinox_equals_python_loop(steps_per_call):
    result, (params, opt_state_fit) = fit_once("eqx", steps_per_call)
    model = eqx_model()
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for t in range(STEPS):
        model, opt_state, loss = eqx_step(model, opt_state, batch_at(t))
        losses.append(loss)
    assert type(result.model) is type(model)
    np.testing.assert_allclose(result.history["loss"], np.array(losses), rtol=1e-5)
    leaves_close(params, eqx.filter(model, eqx.is_array))
    leaves_close(opt_state_fit, opt_state)
    assert result.model.activation is model.activation  # static leaves kept


def test_equinox_continues_from_opt_state():
    """Two fits, the second given the first's optax state, equal one fit over all
    the batches, exactly; the wrong state, or one for an NNX pair, is refused."""
    batches = [batch_at(t) for t in range(STEPS)]
    whole = fit_quiet(eqx_model(), TX, eqx_loss, batches, steps=STEPS, steps_per_call=7)
    first = fit_quiet(eqx_model(), TX, eqx_loss, batches[:10], steps=10)
    second = fit_quiet(
        first.model,
        TX,
        eqx_loss,
        batches[10:],
        steps=STEPS - 10,
        steps_per_call=7,
        opt_state=first.optimizer,
    )
    both = np.concatenate([first.history["loss"], second.history["loss"]])
    np.testing.assert_array_equal(both, whole.history["loss"])
    leaves_equal(
        eqx.filter(second.model, eqx.is_array), eqx.filter(whole.model, eqx.is_array)
    )
    leaves_equal(second.optimizer, whole.optimizer)
    wrong_shapes = jax.tree.map(lambda a: jnp.zeros((2, *a.shape)), first.optimizer)
    small = eqx.nn.MLP(3, 1, 3, 1, key=jr.key(0))
    other_sizes = TX.init(eqx.filter(small, eqx.is_inexact_array))
    for bad, detail in [
        (wrong_shapes, r"opt_state\[0\]\.count is float32\[2\], expected int32\[\]"),
        (other_sizes, r"the same leaves, but other static fields"),
        (optax.sgd(0.1).init(first.model), r"opt_state\[0\]\.count is missing"),
    ]:
        with pytest.raises(
            TypeError,
            match=r"^scanax\.fit: `opt_state` does not match tx\.init\(params\) of "
            rf"this model and optimizer \({detail}",
        ):
            fit_quiet(eqx_model(), TX, eqx_loss, batches, steps=2, opt_state=bad)
    with pytest.raises(TypeError, match=r"^scanax\.fit: `opt_state` is for an Equinox"):
        fit_quiet(*nnx_pair(), nnx_loss, batches, steps=2, opt_state=first.optimizer)


def test_plain_pytree_params():
    params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros((1,)), "n": jnp.array(3)}

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    result = fit_quiet(params, optax.sgd(0.1), loss_fn, (X, Y), steps=5, batch_size=BS)
    p = dict(params)
    for t in range(5):
        g = jax.grad(
            lambda w, b: loss_fn({"w": w, "b": b}, batch_at(t, key=None)),
            argnums=(0, 1),
        )(p["w"], p["b"])
        g = {"w": g[0], "b": g[1]}
        p = {**p, "w": p["w"] - 0.1 * g["w"], "b": p["b"] - 0.1 * g["b"]}
    np.testing.assert_allclose(result.model["w"], p["w"], rtol=1e-6)
    assert result.model["n"] is not None and int(result.model["n"]) == 3


@pytest.mark.standard_promotion("optax.MultiSteps divides gradients by an int32 count")
def test_optax_multisteps_accepted_as_is():
    """``optax.MultiSteps`` is not a GradientTransformation; fit takes its
    ``gradient_transformation()`` (gradient accumulation over 2 steps)."""
    params = {"w": jnp.zeros((3, 1))}

    def loss_fn(p, batch):
        return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)

    multi = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    result = fit_quiet(params, multi, loss_fn, (X, Y), steps=6, batch_size=BS)
    tx = multi.gradient_transformation()
    p, state = params, tx.init(params)
    for t in range(6):
        g = jax.grad(loss_fn)(p, batch_at(t, key=None))
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
    np.testing.assert_allclose(result.model["w"], p["w"], rtol=1e-6)
    assert not np.allclose(p["w"], 0.0)


# ---------------------------------------------------------------------------- TrainState


@jax.jit
def ts_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: ts_loss(state.replace(params=p), batch))(
        state.params
    )
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("steps_per_call", [1, 7, 100])
def test_trainstate_equals_python_loop(steps_per_call):
    result, _ = fit_once("ts", steps_per_call)
    state, losses = ts_make(), []
    for t in range(STEPS):
        state, loss = ts_step(state, batch_at(t))
        losses.append(loss)
    assert result.optimizer is None
    assert int(result.model.step) == STEPS
    np.testing.assert_allclose(result.history["loss"], np.array(losses), rtol=1e-5)
    leaves_close(result.model, state)


class BNState(train_state.TrainState):
    batch_stats: dict


def bn_setup():
    linen = pytest.importorskip("flax.linen")

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x, train):
            return linen.Dense(1)(linen.BatchNorm(use_running_average=not train)(x))

    variables = Net().init(jr.key(1), X, train=False)
    state = BNState.create(
        apply_fn=Net().apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=TX,
    )

    def forward(state, batch):
        out, new = state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats},
            batch[0],
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch[1]) ** 2), new

    return state, forward


def bn_loss_and_step(forward):
    """fit's ``loss_fn`` returning the new ``batch_stats``, and the hand-written
    step it equals (flax's: ``apply_gradients``, then the new statistics)."""

    def loss(state, batch):
        value, new = forward(state, batch)
        return value, {}, {"batch_stats": new["batch_stats"]}

    @jax.jit
    def step(state, batch):
        (value, new), grads = jax.value_and_grad(
            lambda p: forward(state.replace(params=p), batch), has_aux=True
        )(state.params)
        state = state.apply_gradients(grads=grads)
        return state.replace(batch_stats=new["batch_stats"]), value

    return loss, step


def test_trainstate_batch_stats_updated_from_loss_fn():
    state, forward = bn_setup()
    loss, step = bn_loss_and_step(forward)
    result = fit_quiet(state, None, loss, (X, Y), **CHUNKED)

    ref, losses = state, []
    for t in range(STEPS):
        ref, value = step(ref, batch_at(t))
        losses.append(value)
    np.testing.assert_allclose(result.history["loss"], np.array(losses), rtol=1e-5)
    leaves_close(result.model, ref)
    assert not np.allclose(result.model.batch_stats["BatchNorm_0"]["mean"], 0.0)


class SeenState(BNState):
    """Its apply_gradients reads batch_stats: the updates' order shows."""

    seen: dict

    def apply_gradients(self, *, grads, **kwargs):
        new = super().apply_gradients(grads=grads, **kwargs)
        return new.replace(
            seen=jax.tree.map(
                lambda e, b: 0.5 * e + 0.5 * b, self.seen, self.batch_stats
            )
        )


def test_trainstate_updates_are_applied_after_apply_gradients():
    """As fit.md says and flax's examples do (``apply_gradients`` on the state
    the step started from, then the new ``batch_stats``): a subclass whose
    ``apply_gradients`` reads them sees the step's old ones (before: the new)."""
    base, forward = bn_setup()
    state = SeenState.create(
        apply_fn=base.apply_fn, params=base.params, tx=TX,
        batch_stats=base.batch_stats, seen=base.batch_stats,
    )  # fmt: skip
    loss, step = bn_loss_and_step(forward)
    result = fit_quiet(state, None, loss, (X, Y), **CHUNKED)
    ref = state
    for t in range(STEPS):
        ref, _ = step(ref, batch_at(t))
    leaves_close(result.model, ref)
    assert not np.allclose(result.model.seen["BatchNorm_0"]["mean"], 0.0)


def test_trainstate_batch_stats_without_updates_warns_and_bad_updates_fail():
    state, forward = bn_setup()
    with pytest.warns(UserWarning, match=r"TrainState has `batch_stats`, but"):
        fit_quiet(
            state, None, lambda s, b: forward(s, b)[0], (X, Y), steps=2, batch_size=BS
        )
    for updates, err, msg in [
        (
            [1],
            TypeError,
            r"must be a dict of new values for fields of the TrainState "
            r"\(batch_stats\), got list",
        ),
        ({"params": 1}, ValueError, r"an update for 'params', which is not a field"),
        (
            {"batch_stats": 1.0},
            TypeError,
            r"(?s)for state.batch_stats changes its "
            r"structure.*BatchNorm_0",
        ),
    ]:
        with pytest.raises(err, match=msg):
            fit_quiet(
                state,
                None,
                lambda s, b, u=updates: (forward(s, b)[0], {}, u),
                (X, Y),
                steps=2,
                batch_size=BS,
            )


# ---------------------------------------------------------------------------- low level


def test_model_and_optimizer_as_the_carry_of_scanax_scan():
    """(model, optimizer) as the carry of scanax.scan: the low-level form of fit."""

    def train_step(carry, batch):
        model, optimizer = carry
        loss, grads = nnx.value_and_grad(lambda m: nnx_loss(m, batch)[0])(model)
        optimizer.update(model, grads)
        return (model, optimizer), loss

    batches = jtu.tree_map(lambda *b: jnp.stack(b), *[batch_at(t) for t in range(6)])
    model, opt = nnx_pair()
    (m2, o2), losses = scanax.scan(train_step, (model, opt), batches)
    assert m2 is model and o2 is opt
    ref_model, ref_opt = nnx_pair()
    ref = [nnx_step(ref_model, ref_opt, batch_at(t)) for t in range(6)]
    np.testing.assert_allclose(losses, np.array(ref), rtol=1e-6)
    for a, b in zip(
        jtu.tree_leaves(nnx.state(model)), jtu.tree_leaves(nnx.state(ref_model))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- errors


def test_error_unsupported_pair():
    model, _ = nnx_pair()
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.fit: unsupported \(model, optimizer\) pair \(MLP, "
        r"GradientTransformationExtraArgs\).*\(nnx.Module, nnx.Optimizer\).*"
        r"Fix: pass nnx.Optimizer\(model, tx, wrt=nnx.Param\)",
    ):
        fit_quiet(model, TX, nnx_loss, (X, Y), steps=1, batch_size=BS)
    with pytest.raises(TypeError, match=r"unsupported .* pair \(dict, str\)"):
        fit_quiet({"w": X}, "adam", nnx_loss, (X, Y), steps=1, batch_size=BS)
    with pytest.raises(
        TypeError, match=r"(?s)carries its own optimizer.*optimizer=None"
    ):
        fit_quiet(ts_make(), TX, ts_loss, (X, Y), steps=1, batch_size=BS)


def test_error_swapped_or_uncalled_optimizer_is_named():
    """The two pair mistakes a new user makes: the model and the optimizer
    swapped (each kind), an optax function passed uncalled (``optax.adam``)."""
    model, opt = nnx_pair()
    params = {"w": jnp.zeros((3, 1))}
    swapped = r"(?s)The model and the optimizer are swapped.*Fix: fit\(model, optimizer"
    with pytest.raises(TypeError, match=swapped):
        fit_quiet(opt, model, nnx_loss, (X, Y), steps=1, batch_size=BS)
    with pytest.raises(TypeError, match=swapped):
        fit_quiet(TX, params, nnx_loss, (X, Y), steps=1, batch_size=BS)
    with pytest.raises(
        TypeError,
        match=r"(?s)\(dict, function\).*optax's function, not called.*optax.adam\(1e-3\)",
    ):
        fit_quiet(params, optax.adam, nnx_loss, (X, Y), steps=1, batch_size=BS)


def test_error_a_line_search_without_its_arguments():
    """optax.lbfgs()'s line search needs ``grad=`` and ``value_fn=``, which fit
    does not pass: a TypeError of fit's naming the fix (not optax's from inside
    its update), before any step, with every model kind left as it was; without
    the line search it trains."""
    match = (
        r"(?s)update asks for arguments fit does not pass.*value_fn.*linesearch=None"
    )
    tx = optax.lbfgs()
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = jtu.tree_map(np.asarray, nnx.state((model, opt)))
    with pytest.raises(TypeError, match=match):
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=2, batch_size=BS)
    leaves_equal(nnx.state((model, opt)), before)
    state = ts_make().replace(tx=tx)
    state = state.replace(opt_state=tx.init(state.params))
    with pytest.raises(TypeError, match=match):
        fit_quiet(state, None, ts_loss, (X, Y), steps=2, batch_size=BS)
    with pytest.raises(TypeError, match=match):
        fit_quiet(eqx_model(), tx, eqx_loss, (X, Y), steps=2, batch_size=BS)
    out = fit_quiet(
        eqx_model(), optax.lbfgs(0.1, linesearch=None), eqx_loss, (X, Y),
        steps=2, batch_size=BS,
    )  # fmt: skip
    assert out.steps == 2 and np.isfinite(out.history["loss"]).all()


class Sowing(MLP):
    """MLP that stores its hidden layer with ``sow``: a new Variable per call."""

    def __call__(self, x):
        h = jax.nn.relu(self.l1(x))
        self.sow(nnx.Intermediate, "hidden", h)
        return self.l2(h)


@pytest.mark.filterwarnings(
    "ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning"
)
def test_error_loss_fn_adds_a_variable():
    model = Sowing(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    before = jtu.tree_map(np.asarray, nnx.state((model, opt)))
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.fit: `loss_fn` changed the model's or optimizer's "
        r"Variables \(added model\['hidden'\]\).*Fix: .*"
        r"nnx.capture\(model, nnx.Intermediate\).*nnx.pop\(model, nnx.Intermediate\)",
    ):
        fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    # Nothing was written: no Intermediate, the same values as before.
    leaves_equal(nnx.state((model, opt)), before)


def test_sowing_model_trains_through_nnx_capture():
    """The fix the message gives: the same run as the model without ``sow``."""

    def loss(m, b):
        pred, captured = nnx.capture(m, nnx.Intermediate)(b[0])
        hidden = captured["hidden"][0]
        return jnp.mean((pred - b[1]) ** 2), {"active": jnp.mean(hidden > 0)}

    model = Sowing(nnx.Rngs(0))
    result = fit_quiet(
        model, nnx.Optimizer(model, TX, wrt=nnx.Param), loss, (X, Y), **CHUNKED
    )
    ref, _ = fit_once("nnx", 7)
    np.testing.assert_allclose(result.history["loss"], ref.history["loss"], rtol=1e-6)
    assert result.history["active"].shape == (STEPS,)
    assert 0 < result.history["active"].min() <= result.history["active"].max() < 1


def _bad_metrics(m, b):
    return nnx_loss(m, b)[0], 1, 2


def _str_metric(m, b):
    return nnx_loss(m, b)[0], {"tag": "not an array"}


def _nested_metrics(m, b):
    loss, metrics = nnx_loss(m, b)
    return loss, {"err": {"mae": metrics["mae"]}}


def _list_result(m, b):  # (was: "must return a scalar loss, got list")
    return list(nnx_loss(m, b))


def _int_named_metric(m, b):  # (failed after training: review 2026-12-06)
    loss, metrics = nnx_loss(m, b)
    return loss, {0: metrics["mae"]}


ARRAYS = dict(steps=2, batch_size=BS)  # the valid options for (X, Y)


@pytest.mark.parametrize(
    "loss_fn, data, kwargs, err, msg",
    [
        (
            lambda m, b: (m(b[0]) - b[1]) ** 2,
            (X, Y),
            ARRAYS,
            TypeError,
            r"scanax.fit: `loss_fn` must return a scalar floating-point loss, got "
            r"float32\[8, 1\].\nFix: reduce it",
        ),
        (
            nnx_loss,
            (X, Y[:40]),
            ARRAYS,
            ValueError,
            r"(?s)scanax.fit: the arrays in `data` must share their leading.*"
            r"data\[0\]\s+float32\[48, 3\]: 48.*data\[1\]\s+float32\[40, 1\]: 40",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(steps=2, batch_size=64),
            ValueError,
            r"batch_size=64 is larger than the data \(48 examples",
        ),
        (  # (review 2026-12-07: "batch_size=8 is larger ... pass batch_size <= 0")
            nnx_loss,
            (X[:0], Y[:0]),
            ARRAYS,
            ValueError,
            r"`data` \(the training data\) has no examples \(float32\[0, 3\], "
            r"float32\[0, 1\]\).\nFix: pass at least one example",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(ARRAYS, callbacks=[scanax.Eval((X[:0], Y[:0]), every=1)]),
            ValueError,
            r"`eval_data` \(scanax.Eval's data\) has no examples",
        ),
        *[
            (nnx_loss, (X, Y), dict(steps=steps, batch_size=BS), err, msg)
            for steps, err, msg in [
                (0, ValueError, r"scanax.fit: `steps` must be a positive int, got 0"),
                (-3, ValueError, r"scanax.fit: `steps` must be a positive int, got -3"),
                (
                    2.5,
                    TypeError,
                    r"scanax.fit: `steps` must be a positive int, got float 2.5",
                ),
                (
                    True,
                    TypeError,
                    r"scanax.fit: `steps` must be a positive int, got bool True",
                ),
                (
                    None,
                    TypeError,
                    r"scanax.fit: how long to train is missing.\nFix: pass steps=N",
                ),
            ]
        ],
        (
            nnx_loss,
            (X, Y),
            dict(steps=2),
            TypeError,
            r"scanax.fit: `data` is a pytree of arrays \(48 examples\) but "
            r"`batch_size` is None",
        ),
        (
            nnx_loss,
            [batch_at(0), (X[:8, :2], Y[:8])],
            dict(steps=2, steps_per_call=2),
            TypeError,
            r"(?s)batch 1 of `data` differs.*batch\[0\]\s+float32\[8, 2\]",
        ),
        (
            _bad_metrics,
            (X, Y),
            ARRAYS,
            TypeError,
            r"`loss_fn` returned a tuple of 3",
        ),
        (
            _str_metric,
            (X, Y),
            ARRAYS,
            TypeError,
            r"scanax.fit: metric metrics\['tag'\] is str, expected an array",
        ),
        (
            lambda m, b: nnx_loss(m, (b["x"], b["y"])),
            {"x": X, "y": Y, "name": "train"},
            ARRAYS,
            TypeError,
            r"(?s)scanax.fit: data\['name'\] is str, not an array, next to arrays",
        ),
        (  # labels left as a Python list: the list is named, and the fix
            lambda m, b: nnx_loss(m, (b["x"], b["y"])),
            {"x": X, "y": Y.tolist()},
            ARRAYS,
            TypeError,
            rf"(?s)scanax.fit: data\['y'\] is a list of {len(Y)}, not an array, "
            r"next to arrays.*Fix: make it one array: jnp.asarray\(data\['y'\]\)",
        ),
        (
            lambda m, b: nnx_loss(m, (b["x"], b["y"])),
            [{"x": X[:8], "y": Y[:8], "tag": "train"}] * 2,
            dict(steps=2),
            TypeError,
            r"(?s)scanax.fit: batch 0 of `data` has batch\['tag'\] = str 'train', which "
            r"is not numbers.*Fix: drop it",
        ),
        (
            _nested_metrics,
            (X, Y),
            ARRAYS,
            TypeError,
            r"(?s)scanax.fit: metric metrics\['err'\] is dict, expected an array "
            r"\(metrics is one flat dict.*'err/mae'",
        ),
        (
            _list_result,
            (X, Y),
            ARRAYS,
            TypeError,
            r"(?s)`loss_fn` returned a list of 2 \(float32\[\], dict\).*Fix: return "
            r"a tuple",
        ),
        (
            _int_named_metric,
            (X, Y),
            ARRAYS,
            TypeError,
            r"(?s)scanax.fit: `loss_fn` returned a metric named 0 \(int\); metric "
            r"names are strings.*Fix: .*'metric_0'",
        ),
        (
            nnx_loss,
            [batch_at(0), {"x": X[:8], "y": Y[:8]}],
            dict(steps=2, steps_per_call=2),
            TypeError,
            r"scanax.fit: batch 1 of `data` has structure .*, but the first batch "
            r"had",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(ARRAYS, steps_per_call=0),
            ValueError,
            r"scanax.fit: `steps_per_call` must be a positive int, got 0",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(ARRAYS, checkpoint_every=5),
            TypeError,
            r"scanax.fit: checkpoint_every=5 is given but checkpoint_dir is None",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(ARRAYS, checkpoint_dir=__file__),
            ValueError,
            r"scanax.fit: checkpoint_dir '.*test_fit.py' exists and is not a directory",
        ),
        (
            nnx_loss,
            (X, Y),
            dict(ARRAYS, checkpoint_dir=3),
            TypeError,
            r"scanax.Checkpoint: its directory \(checkpoint_dir=\) must be a path \(str or os.PathLike\), got int",
        ),
        (
            "mse",
            (X, Y),
            ARRAYS,
            TypeError,
            r"scanax.fit: `loss_fn` must be callable",
        ),
        (
            nnx_loss,
            [batch_at(0)],
            ARRAYS,
            TypeError,
            r"`batch_size` is for array data, but `data` is list",
        ),
    ],
)
def test_error_bad_call(loss_fn, data, kwargs, err, msg):
    model, opt = nnx_pair()
    with pytest.raises(err, match=msg):
        fit_quiet(model, opt, loss_fn, data, **kwargs)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (
            (Y,),
            r"(?s)^scanax.fit takes 4 positional arguments \(model, optimizer, loss_fn, "
            r"data\), got 5: after `data` came float32\[\d+, 1\].*Fix: `data` is one "
            r"argument .*fit\(model, optimizer, loss_fn, \{'x': x, 'y': y\}, \.\.\.\)",
        ),
        (
            (STEPS, BS),
            r"(?s)got 6: after `data` came int \d+, int \d+\..*Fix: the options after "
            rf"`data` are keywords: fit\(model, optimizer, loss_fn, data, steps={STEPS}, ",
        ),
    ],
)
def test_error_data_or_options_by_position(extra, msg):
    """Keras's ``fit(x, y)`` and ``steps`` given by position: scanax's message
    with the call to write (it was Python's "takes 4 positional arguments but 5
    were given"); nothing traced, the model unchanged; the signature shown is
    fit's own."""
    model, opt = nnx_pair()
    before = jax.tree.map(np.asarray, nnx.state(model))
    with count_compiles() as c, pytest.raises(TypeError, match=msg):
        scanax.fit(model, opt, nnx_loss, X, *extra)
    assert c.n == 0
    leaves_equal(nnx.state(model), before)
    assert list(inspect.signature(scanax.fit).parameters)[:5] == [
        "model",
        "optimizer",
        "loss_fn",
        "data",
        "steps",
    ]


def test_error_fit_under_disable_jit():
    """fit compiles its loop ahead of time, which JAX refuses under
    ``jax.disable_jit()``: named before anything runs, the model untouched, and
    the fit that follows outside the block equal to one that never saw it."""
    model, opt = nnx_pair()
    before = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt)))
    calls = []

    def loss(m, b):
        calls.append(1)
        return nnx_loss(m, b)

    with (
        jax.disable_jit(),
        pytest.raises(
            ValueError,
            match=r"(?s)cannot run under jax.disable_jit\(\).*Fix: call fit outside",
        ),
    ):
        fit_quiet(model, opt, loss, (X, Y), steps=STEPS, batch_size=BS, key=KEY)
    assert not calls
    leaves_equal((nnx.state(model), nnx.state(opt)), before)
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=STEPS, batch_size=BS, key=KEY)
    again, opt2 = nnx_pair()
    fit_quiet(again, opt2, nnx_loss, (X, Y), steps=STEPS, batch_size=BS, key=KEY)
    leaves_equal(
        (nnx.state(model), nnx.state(opt)), (nnx.state(again), nnx.state(opt2))
    )


@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_error_fit_and_evaluate_inside_a_transformation(transform):
    """fit inside jax.jit/vmap/grad had failed on a traced array's sharding,
    and then left a tracer in a cached placeholder key, so every later fit
    without key= in the process failed (review 2026-12-07). Named before
    anything runs; the fit after it equals one in a fresh process's state."""
    p = {"w": jnp.zeros((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    def inside(x):
        out = scanax.fit(p, optax.sgd(0.1), loss, (x, Y), steps=2, batch_size=BS,
                         progress=False)  # fmt: skip
        return out.history["loss"].sum()

    with pytest.raises(
        TypeError, match=r"(?s)^scanax\.fit: cannot run inside jax\.jit.*top level"
    ):
        getattr(jax, transform)(inside)(X)
    with pytest.raises(TypeError, match=r"^scanax\.evaluate: cannot run inside"):
        getattr(jax, transform)(lambda x: scanax.evaluate(p, loss, (x, Y))["loss"])(X)
    out = scanax.fit(p, optax.sgd(0.1), loss, (X, Y), steps=2, batch_size=BS,
                     progress=False)  # fmt: skip
    w = p["w"]
    for t in range(2):
        g = jax.grad(loss)(
            {"w": w}, (X[t * BS : (t + 1) * BS], Y[t * BS : (t + 1) * BS])
        )
        w = w - 0.1 * g["w"]
    np.testing.assert_allclose(out.model["w"], w, rtol=1e-6)


def test_dropout_left_in_eval_mode_is_warned_and_trained_as_found():
    """A model left in eval mode (model.eval() for a validation by hand, as
    PyTorch users do) trained silently without dropout (review 2026-12-07):
    now a warning naming the layer; the training is still the mode's, equal
    to a Python loop in that mode."""

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 1, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.lin(self.drop(x))

    def pair():
        m = Dropped(nnx.Rngs(0))
        return m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)

    model, opt = pair()
    model.eval()
    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)Dropout \(model\.drop\) is in eval mode.*model\.train\(\)",
    ):
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=2, batch_size=BS)
    ref, ref_opt = pair()
    ref.eval()
    for t in range(2):
        batch = (X[t * BS : (t + 1) * BS], Y[t * BS : (t + 1) * BS])
        ref_opt.update(ref, nnx.grad(nnx_loss, has_aux=True)(ref, batch)[0])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        nnx.state(model, nnx.Param),
        nnx.state(ref, nnx.Param),
    )
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=1, batch_size=BS, key=KEY)


def test_an_iterator_used_up_by_a_call_before_is_said_so():
    """An epoch loop over one generator: the second call gets no batch and had
    returned 0 steps silently (Keras warns, review 2026-12-07). Warned, with
    the fix; a new generator per call trains each call."""
    p = {"w": jnp.zeros((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    def loader():
        return ((X[i : i + BS], Y[i : i + BS]) for i in range(0, 4 * BS, BS))

    once = loader()
    first = scanax.fit(p, optax.sgd(0.1), loss, once, steps=4, progress=False)
    assert first.steps == 4
    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)`data` gave no batch, so none of the 4 steps ran.*Fix: pass a new",
    ):
        again = scanax.fit(first.model, optax.sgd(0.1), loss, once, steps=4,
                           progress=False)  # fmt: skip
    assert again.steps == 0
    fresh = scanax.fit(first.model, optax.sgd(0.1), loss, loader(), steps=4,
                       progress=False)  # fmt: skip
    assert fresh.steps == 4


def test_an_incomplete_last_batch_ends_training_before_it():
    """A loader's incomplete last batch (drop_last=False) had raised after
    training, losing an Equinox or optax result (review 2026-12-07): it ends
    the run as running out does, with a warning, the steps before it those
    of the whole batches alone."""
    p = {"w": jnp.zeros((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    def loader(n):
        return ((X[i : min(i + BS, n)], Y[i : min(i + BS, n)]) for i in range(0, n, BS))

    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)batch 5 of `data` has 4 examples where the first had 8.*"
        r"training ended before it.*drop_last=True",
    ):
        got = scanax.fit(p, optax.sgd(0.1), loss, loader(5 * BS + 4), steps=20,
                         steps_per_call=3, progress=False)  # fmt: skip
    want = scanax.fit(p, optax.sgd(0.1), loss, loader(5 * BS), steps=20,
                      steps_per_call=3, progress=False)  # fmt: skip
    assert got.steps == want.steps == 5
    leaves_equal(got.model, want.model)
    np.testing.assert_array_equal(got.history["loss"], want.history["loss"])


def test_error_an_optimizer_made_for_another_model():
    """An nnx.Optimizer kept after a layer of its model was replaced had given
    lax.scan's carry-type error from inside fit (review 2026-12-07): named,
    with the leaf and the fix, before any step; the fix trains."""
    model, opt = nnx_pair()
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=2, batch_size=BS, key=KEY)
    model.l2 = nnx.Linear(model.l2.in_features, 1, use_bias=False, rngs=nnx.Rngs(3))
    before = jax.tree.map(np.asarray, nnx.state(model))
    with pytest.raises(
        TypeError,
        match=r"(?s)the optimizer's state does not fit the model it trains: "
        r"optimizer\.opt_state.*\['l2'\].*Fix: make the optimizer for this model",
    ):
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=2, batch_size=BS, key=KEY)
    leaves_equal(nnx.state(model), before)
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    assert fit_quiet(model, opt, nnx_loss, (X, Y), steps=2, batch_size=BS).steps == 2


def test_error_loss_fn_failing_on_the_training_batches():
    """A loss that fails while it is traced on the training batches (data of
    another width than the model's: JAX's own shape error from inside it) is
    named as evaluate names it: the function, the batch's structure, the
    original chained; the model untouched."""
    model, opt = nnx_pair()
    before = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt)))
    wide = jnp.concatenate([X, X], axis=1)
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.fit: `loss_fn` raised TypeError while it was traced on a "
        r"batch of `data`.*dot_general.*A batch of `data` is tuple: \[0\] "
        r"float32\[8, 6\], \[1\] float32\[8, 1\]\.\nFix:",
    ) as caught:
        fit_quiet(model, opt, nnx_loss, (wide, Y), steps=STEPS, batch_size=BS, key=KEY)
    assert isinstance(caught.value.__cause__, TypeError)
    assert "default eval_fn" not in str(caught.value)
    leaves_equal((nnx.state(model), nnx.state(opt)), before)


def test_error_disable_jit_turned_on_by_the_data_while_fit_runs():
    """A generator that yields inside ``jax.disable_jit()`` turns it on in
    fit's thread while fit runs: the same error, at the call it would break."""
    p = {"w": jnp.ones(3)}

    def batches():
        for i in range(4):
            with jax.disable_jit():
                yield jnp.full(3, float(i))

    def loss(p, b):
        return jnp.sum((p["w"] - b) ** 2)

    with pytest.raises(ValueError, match=r"cannot run under jax.disable_jit\(\)"):
        fit_quiet(p, optax.adam(0.1), loss, batches(), steps=4)
    # the generator (and its disable_jit block) is freed with the error: fit
    # keeps no reference cycle to it (one left jit off for later tests)
    assert not jax.config.jax_disable_jit


def test_error_parameters_on_an_explicit_mesh_without_mesh():
    """Parameters on a mesh of Explicit axes (``jax.make_mesh``'s default) and
    no ``mesh=``: named before anything runs (it was JAX's ShardingTypeError
    from inside fit's loop); with ``mesh=`` the fit equals one on one device."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    here = {"w": jnp.ones(3), "b": jnp.zeros(())}
    placed = jax.device_put(
        here, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )

    def loss(p, b):
        return jnp.mean((b @ p["w"] + p["b"] - 1.0) ** 2)

    data = jr.normal(KEY, (8, 3))
    with pytest.raises(
        ValueError,
        match=r"(?s)model\['b'\] is placed on a mesh with Explicit axes "
        r"\('data',\).*but fit got no mesh=.*Fix: pass mesh=",
    ):
        fit_quiet(placed, optax.adam(0.1), loss, data, steps=3, batch_size=4)
    run = fit_quiet(
        placed, optax.adam(0.1), loss, data, steps=3, batch_size=4, mesh=mesh
    )
    ref = fit_quiet(here, optax.adam(0.1), loss, data, steps=3, batch_size=4)
    np.testing.assert_allclose(run.history["loss"], ref.history["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(run.model), jax.tree.leaves(ref.model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_cache_does_not_keep_data_alive():
    import gc
    import weakref

    x, y = X + 0.0, Y + 0.0
    ref = weakref.ref(x)
    model, opt = nnx_pair()
    fit_quiet(
        model,
        opt,
        nnx_loss,
        (x, y),
        steps=STEPS,
        batch_size=BS,
        key=KEY,
        steps_per_call=7,
    )
    del x, y
    gc.collect()
    assert ref() is None


def test_one_while_loop_per_call(monkeypatch):
    """docs/index.md and docs/fit.md say each call is one compiled lax.while_loop:
    the traced chunk holds exactly one while loop at its top level, and no host
    callback for array data with automatic calls (so a bar changes nothing)."""
    import scanax._fit.program as fit_module

    seen = []
    real = fit_module.Program.executable

    def spy(self, args):
        seen.append((self, args))
        return real(self, args)

    monkeypatch.setattr(fit_module.Program, "executable", spy)
    fit_module.PROGRAMS.clear()

    def traced(**kwargs):
        seen.clear()
        model, opt = nnx_pair()
        scanax.fit(model, opt, nnx_loss, (X, Y), batch_size=BS, key=KEY, **kwargs)
        program, args = seen[0]
        jaxpr = jax.make_jaxpr(program.jitted)(*args).jaxpr
        return jaxpr.eqns[0].params["jaxpr"].jaxpr  # the jitted chunk

    inner = traced(steps=STEPS)
    assert [e.primitive.name for e in inner.eqns].count("while") == 1
    assert "callback" not in str(inner)
    # With a steps_per_call of the user's, the bar reports from inside the loop:
    # the check above can see a callback where there is one.
    assert "callback" in str(traced(steps=STEPS, steps_per_call=7))


# ------------------------------------------- issue 38: keys, metrics, evaluation


class DropNet(nnx.Module):
    """As the Flax NNX tutorial writes it: a Dropout made without ``rngs``,
    given a key at the call (``model(x, rngs=rngs)``)."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.l2(self.drop(jax.nn.relu(self.l1(x)), rngs=rngs))


def tutorial_loss(model, batch, rngs=None):
    x, y = batch
    return jnp.mean((model(x, rngs=rngs) - y) ** 2)


def test_a_loss_fn_with_rngs_none_gets_the_per_step_key():
    """``loss_fn(model, batch, rngs=None)`` gets fit's per-step key (before:
    only a third parameter without a default did, and Dropout complained),
    equal to a Python loop of ``nnx.value_and_grad`` steps with those keys."""
    model = DropNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    result = scanax.fit(
        model, optimizer, tutorial_loss, (X, Y), steps=5, batch_size=BS, key=KEY,
        progress=False,
    )  # fmt: skip
    ref = DropNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, TX, wrt=nnx.Param)
    losses = []
    for t in range(5):
        key_t = jr.fold_in(jr.split(KEY)[1], t)
        loss, grads = nnx.value_and_grad(tutorial_loss)(ref, batch_at(t), key_t)
        ref_opt.update(ref, grads)
        losses.append(loss)
    np.testing.assert_allclose(result.history["loss"], losses, rtol=1e-5)
    leaves_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))


@pytest.mark.parametrize("name", ["key", "rng", "rngs"])
def test_a_key_parameter_with_a_default_is_found_by_name(name):
    ns: dict = {}
    exec(  # (the parameter's name is the test's)
        f"def loss(model, batch, {name}=None):\n"
        f"    return eqx_loss(model, batch) + 0.1 * jr.normal({name})\n",
        {"eqx_loss": eqx_loss, "jr": jr},
        ns,
    )
    kw = dict(steps=3, batch_size=BS, key=KEY, progress=False)
    got = scanax.fit(eqx_model(), TX, ns["loss"], (X, Y), **kw)
    ref = scanax.fit(eqx_model(), TX, lambda m, b, k: ns["loss"](m, b, k), (X, Y), **kw)
    np.testing.assert_array_equal(got.history["loss"], ref.history["loss"])
    with pytest.raises(
        TypeError,
        match=rf"(?s)`loss_fn` takes a third argument, `{name}`.*key=None.*Fix",
    ):
        scanax.fit(eqx_model(), TX, ns["loss"], (X, Y), steps=3, batch_size=BS)


def test_key_parameters_that_would_never_get_a_key_are_refused_by_name():
    def key_like(model, batch, dropout_rng=None):
        return eqx_loss(model, batch)

    def keyword(model, batch, *, rngs=None):
        return eqx_loss(model, batch)

    kw = dict(steps=2, batch_size=BS, key=KEY, progress=False)
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax.fit: `loss_fn`'s third parameter `dropout_rng` looks "
        r"like a key.*Fix: rename it `key`",
    ):
        scanax.fit(eqx_model(), TX, key_like, (X, Y), **kw)
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax.fit: `loss_fn`'s keyword-only parameter `rngs`.*"
        r"Fix: drop the `\*`",
    ):
        scanax.fit(eqx_model(), TX, keyword, (X, Y), **kw)
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax.fit: `eval_fn` takes 1 positional argument \(m\); fit "
        r"calls eval_fn\(model, batch\).*Fix: define it as def eval_fn\(model, batch\)",
    ):
        scanax.fit(
            eqx_model(), TX, eqx_loss, (X, Y), **kw, eval_data=(X, Y), eval_every=1,
            eval_fn=lambda m: 0.0,
        )  # fmt: skip


def _unchanged_after(call, model):
    """``call()`` raises; the model's arrays are as they were."""
    before = [np.asarray(x) for x in jtu.tree_leaves(model)]
    with pytest.raises(Exception) as info:
        call()
    for a, b in zip(before, jtu.tree_leaves(model)):
        np.testing.assert_array_equal(a, b)
    return info.value


# (trained with Dropout deterministic on purpose: its warning silenced, as a user
# who means it would)
@pytest.mark.filterwarnings("ignore:scanax.fit. the model's Dropout:RuntimeWarning")
def test_fits_evaluation_uses_no_key_unless_the_model_draws_one_in_eval_mode():
    """fit's evaluation of a key-taking function without ``key=`` gets a
    placeholder: fine when the result does not depend on it (Dropout in eval
    mode), refused before any step, naming ``key=``, when it does."""
    model = DropNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    def plain(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    def noisy_eval(model, batch, key):
        return tutorial_loss(model, batch) + 0.1 * jr.normal(key)

    model.drop.deterministic = True  # (trained without dropout: no key needed)
    kw = dict(steps=4, batch_size=BS, progress=False, eval_data=(X, Y), eval_every=2)
    got = scanax.fit(model, optimizer, plain, (X, Y), eval_fn=tutorial_loss, **kw)
    ref = scanax.fit(
        *nnx_pair_of(DropNet, deterministic=True), plain, (X, Y), eval_fn=plain, **kw
    )
    np.testing.assert_array_equal(got.history["val_loss"], ref.history["val_loss"])
    model, optimizer = nnx_pair_of(DropNet, deterministic=True)
    err = _unchanged_after(
        lambda: scanax.fit(model, optimizer, plain, (X, Y), eval_fn=noisy_eval, **kw),
        nnx.state(model),
    )
    assert isinstance(err, TypeError)
    assert re.match(
        r"(?s)scanax.fit: `eval_fn` uses its key `key` in eval mode.*fit was "
        r"called with key=None.*Fix: pass key=jax.random.key\(seed\) to fit",
        str(err),
    )
    assert int(optimizer.step[...]) == 0


def nnx_pair_of(cls, deterministic=False):
    model = cls(nnx.Rngs(0))
    if deterministic:
        model.drop.deterministic = True
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def test_an_array_metric_of_loss_fn_is_kept_per_step():
    """A metric of any fixed shape is recorded with it, ``[steps, ...]`` (before:
    every step ran, then the history failed to concatenate and was lost)."""

    def loss(params, batch):
        x, y = batch
        pred = x @ params["w"]
        return jnp.mean((pred - y) ** 2), {"pred": pred[:, 0], "n": jnp.int32(3)}

    p0 = {"w": jnp.zeros((3, 1))}
    tx = optax.sgd(0.1)
    seen = []
    result = scanax.fit(
        p0, tx, loss, (X, Y), steps=5, batch_size=BS, key=KEY, progress=False,
        log=lambda step, metrics: seen.append((step, metrics)), log_every=5,
    )  # fmt: skip
    params, opt, preds = p0, tx.init(p0), []
    for t in range(5):
        (_, extra), grads = jax.value_and_grad(loss, has_aux=True)(params, batch_at(t))
        preds.append(extra["pred"])
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    assert result.history["pred"].shape == (5, BS)
    np.testing.assert_allclose(
        result.history["pred"], np.stack(preds), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_array_equal(result.history["n"], [3] * 5)
    ((step, logged),) = seen
    assert step == 5
    np.testing.assert_allclose(logged["pred"], np.mean(preds, 0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("where", ["loss_fn", "eval_fn"])
def test_a_complex_metric_is_refused_by_name_before_any_step(where):
    """One rule: a complex metric is refused by name for training and
    evaluation alike (before: training kept it complex, evaluation silently
    kept its real part)."""

    def loss(params, batch):
        x, y = batch
        err = x @ params["w"] - y
        return jnp.mean(err**2), {"z": jax.lax.complex(jnp.mean(err), 1.0)}

    p0 = {"w": jnp.zeros((3, 1))}
    kw = dict(steps=2, batch_size=BS, key=KEY, progress=False)
    if where == "eval_fn":
        kw.update(eval_data=(X, Y), eval_every=1, eval_fn=loss)

        def loss_fn(params, batch):
            return loss(params, batch)[0]

    else:
        loss_fn = loss
    with pytest.raises(
        TypeError,
        match=rf"(?s)^scanax.fit: metric metrics\['z'\] returned by `{where}` is "
        r"complex64\[\];.*Fix: return a real value, e.g. jnp.abs\(z\), or two metrics",
    ):
        scanax.fit(p0, optax.sgd(0.1), loss_fn, (X, Y), **kw)


@pytest.mark.parametrize(
    "eval_data, found",
    [
        ({"x": X, "y": Y}, r"raised TypeError .* dict: \['x'\] float32\[8, 3\]"),
        (
            (jnp.ones((X.shape[0], 5)), Y),
            r"raised TypeError .* tuple: \[0\] float32\[8, 5\]",
        ),
    ],
    ids=["structure", "feature-shape"],
)
def test_eval_data_unlike_what_the_loss_reads_is_refused_before_any_step(
    eval_data, found
):
    model, optimizer = nnx_pair()
    err = _unchanged_after(
        lambda: scanax.fit(
            model,
            optimizer,
            nnx_loss,
            (X, Y),
            steps=4,
            batch_size=BS,
            key=KEY,
            progress=False,
            eval_data=eval_data,
            eval_every=2,
            eval_batch_size=8,
        ),  # fmt: skip
        nnx.state(model),
    )
    assert isinstance(err, TypeError)
    assert re.match(
        rf"(?s)^scanax.fit: `loss_fn` {found}.*Fix: if `loss_fn` reads", str(err)
    )
    assert int(optimizer.step[...]) == 0


def test_array_metrics_of_a_population_equal_each_members_solo_run():
    """Training and evaluation metrics of a fixed shape keep it in a
    population's history, ``[members, steps, ...]`` and ``[members,
    evaluations, ...]`` (before: the evaluation's failed to broadcast)."""

    def loss(params, batch):
        x, y = batch
        err = x @ params["w"] - y
        return jnp.mean(err**2), {"abs": jnp.mean(jnp.abs(err), 0) * jnp.ones(3)}

    def make(key, lr):
        return {"w": 0.1 * jr.normal(key, (3, 1))}, optax.sgd(lr)

    lrs = [0.05, 0.2]
    pop = scanax.population(make, 2, key=jr.key(1), lr=lrs)
    kw = dict(steps=4, batch_size=BS, key=KEY, progress=False)
    kw.update(eval_data=(X, Y), eval_every=2, eval_fn=loss)
    result = scanax.fit(pop, None, loss, (X, Y), **kw, shared_batches=True)
    assert result.history["abs"].shape == (2, 4, 3)
    assert result.history["val_abs"].shape == (2, 2, 3)
    for i, lr in enumerate(lrs):
        params, tx = make(jr.split(jr.key(1), 2)[i], lr)
        solo = scanax.fit(params, tx, loss, (X, Y), **kw)
        for name in ("abs", "val_abs"):
            np.testing.assert_allclose(
                result.history[name][i], solo.history[name], rtol=1e-5
            )


class LoggingOptimizer(nnx.Optimizer):
    """A subclass whose ``update`` takes no extra arguments."""

    def update(self, model, grads):
        return super().update(model, grads)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["subclass", "model_and_optimizer"])
def test_optimizers_whose_update_takes_other_arguments(kind):
    """``update(self, model, grads)`` is called without ``value=`` (before: a
    TypeError about an argument the user never passed), and
    ``nnx.ModelAndOptimizer``'s ``update(grads)`` without the model (before:
    an arity error from inside scanax); both train as ``nnx.Optimizer`` does,
    whose run equals a hand loop (``test_nnx_equals_python_loop``)."""
    model, _ = nnx_pair()
    if kind == "subclass":
        opt = LoggingOptimizer(model, TX, wrt=nnx.Param)
    else:
        opt = nnx.ModelAndOptimizer(model, TX)
    got = fit_quiet(model, opt, nnx_loss, (X, Y), **CHUNKED)
    ref_model, ref_opt = nnx_pair()
    want = fit_quiet(ref_model, ref_opt, nnx_loss, (X, Y), **CHUNKED)
    np.testing.assert_array_equal(got.history["loss"], want.history["loss"])
    leaves_equal(nnx.state(model), nnx.state(ref_model))
    assert int(opt.step[...]) == STEPS


GLOBAL_MODEL = None


def global_model_loss(m, batch):
    """Reads the global, not its argument: a typo a user makes."""
    return nnx_loss(GLOBAL_MODEL, batch)


def attribute_named_like_the_global(m, batch):
    """``m.GLOBAL_MODEL`` is an attribute read, not the global."""
    return nnx_loss(getattr(m, "GLOBAL_MODEL", m), batch)


def test_a_loss_fn_reading_the_trained_model_from_outside_warns(monkeypatch):
    """A loss_fn reading the model being trained from its closure or globals,
    not its argument, has gradients of zero (before: a flat loss and no
    warning; with BatchNorm, flax's bare TraceContextError). A warning names
    it (not an error: reading a static attribute of it is harmless); a loss
    that then reads no trained parameter at all is refused
    (``test_loss_reads.py``); an attribute of the same name is no read."""
    model, opt = nnx_pair()
    before = nnx.state(nnx.clone(model))

    def closed(m, batch):
        return nnx_loss(model, batch)

    refused = pytest.raises(ValueError, match="does not depend on any of")
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL_MODEL", model)
    for fn, name in [(closed, "model"), (global_model_loss, "GLOBAL_MODEL")]:
        with (
            pytest.warns(
                RuntimeWarning,
                match=rf"(?s)`loss_fn` reads the model being trained as `{name}` "
                r"from outside.*Fix: use the argument",
            ),
            refused,
        ):
            fit_quiet(model, opt, fn, (X, Y), steps=3, batch_size=BS)
    leaves_equal(nnx.state(model)["l1"], before["l1"])
    with warnings.catch_warnings(), refused:  # (warned once per loss function)
        warnings.simplefilter("error")
        fit_quiet(model, opt, closed, (X, Y), steps=3, batch_size=BS)

    class Normed(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.bn = nnx.Linear(3, 1, rngs=rngs), nnx.BatchNorm(1, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    normed = Normed(nnx.Rngs(0))
    normed_opt = nnx.Optimizer(normed, TX, wrt=nnx.Param)

    def writes(m, batch):  # (calling it writes its BatchNorm statistics)
        return jnp.mean((normed(batch[0]) - batch[1]) ** 2)

    wrote = r"(?s)reads the model being trained as `normed` from outside.*"
    wrote += r"changed its state \(BatchNorm statistics\).*Fix: use the argument"
    with (
        pytest.warns(RuntimeWarning, match="reads the model being trained"),
        pytest.raises(TypeError, match=wrote),
    ):
        fit_quiet(normed, normed_opt, writes, (X, Y), steps=3, batch_size=BS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, opt = nnx_pair()
        got = fit_quiet(model, opt, attribute_named_like_the_global, (X, Y), **CHUNKED)
    ref_model, ref_opt = nnx_pair()
    want = fit_quiet(ref_model, ref_opt, nnx_loss, (X, Y), **CHUNKED)
    np.testing.assert_array_equal(got.history["loss"], want.history["loss"])


@pytest.mark.parametrize(
    "loss, found, fix",
    [
        (lambda p, b: 1.0, "float 1.0", r"compute the loss .*a Python number is"),
        (lambda p, b: jnp.sum(b[0] > 0), r"int32\[\]", "compute it in floating point"),
        (
            lambda p, b: b[0] @ p["w"],
            r"float32\[\d+, 1\]",
            r"reduce it, e.g. `jnp.mean",
        ),
    ],
)
def test_a_loss_that_is_no_floating_scalar_gets_the_fix_for_what_it_is(
    loss, found, fix
):
    """A constant or an integer count is already a scalar: "reduce it" was the
    wrong fix for them."""
    p = {"w": jnp.zeros((X.shape[1], 1))}
    with pytest.raises(
        TypeError, match=rf"(?s)scalar floating-point loss, got {found}\..*Fix: {fix}"
    ):
        scanax.fit(
            p, optax.sgd(0.1), loss, (X, Y), steps=1, batch_size=4, progress=False
        )


def test_a_result_prints_on_one_screen():
    """``repr(result)`` (a notebook's last line) was the dataclass's: every
    array of the history and the whole model. Now the counts, each entry's
    shape, the last finite losses and the kinds."""
    model, opt = nnx_pair()
    result = fit_quiet(model, opt, nnx_loss, (X, Y), steps=6, batch_size=BS)
    text = repr(result)
    loss = result.history["loss"][-1]
    assert text == (
        "FitResult(steps=6,\n          execution='fused',\n"
        "          history: step[6] loss[6] mae[6],\n"
        f"          last loss={loss:.4g},\n"
        "          model: MLP, optimizer: Optimizer)"
    )
    members = scanax.FitResult(  # a population's: per member, NaN where none ran
        model=None,
        optimizer=None,
        history={
            "step": np.arange(1, 3),
            "loss": np.array([[0.5, 0.25], [1.5, np.nan]]),
        },
        steps=np.array([2, 1]),
        best_step=np.array([2, -1]),
    )
    assert "steps=[2, 1]" in repr(members) and "best_step=[2, -1]" in repr(members)
    assert "last loss=[0.25, 1.5]" in repr(members)
    bare = scanax.FitResult(None, None, {}, 0, ema=np.ones(3))  # (an array's EMA)
    assert repr(bare).endswith("history: (empty),\n          model: None, "
                               "optimizer: None,\n          with ema)")  # fmt: skip
