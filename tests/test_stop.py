"""scanax.EarlyStop: its arguments, and its rule against a plain Python
reimplementation of Keras's and against keras.callbacks.EarlyStopping itself, in
a compiled loop and under vmap."""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scanax
from scanax._stop import StopState, keep_best

# Values on a grid of 1/8: exact in float32 and float64, so that Keras's float64
# arithmetic and ours agree on every comparison, including ties with min_delta.
CASES = [
    (mode, patience, min_delta, seed)
    for mode in ("min", "max")
    for patience in (0, 1, 3)
    for min_delta in (0.0, 0.25)
    for seed in range(3)
]


def sequence(seed, n=30):
    rng = np.random.default_rng(seed)
    steps = rng.integers(-2, 3, size=n) / 8  # drifts, with plateaus and ties
    return (4 + np.cumsum(steps)).astype(np.float32)


def keras_rule(values, *, mode, patience, min_delta):
    """Keras 3's EarlyStopping.on_epoch_end (baseline None, start_from_epoch 0)
    as a Python loop: ``(improved, stop, best, best_epoch, wait)`` per value, up to
    and including the first stop."""
    best, best_epoch, wait, out = None, 0, 0, []
    delta = -abs(min_delta) if mode == "min" else abs(min_delta)
    op = (lambda a, b: a < b) if mode == "min" else (lambda a, b: a > b)
    for epoch, v in enumerate(values):
        wait += 1
        if best is None or op(v - delta, best):
            best, best_epoch, wait = v, epoch, 0
            out.append((True, False, best, best_epoch, wait))
            continue
        stop = wait >= patience and epoch > 0
        out.append((False, stop, best, best_epoch, wait))
        if stop:
            break
    return out


def ours(stop, values):
    state, update = stop.init(), stop.update
    out = []
    for epoch, v in enumerate(values):
        state, improved, done = update(state, jnp.float32(v), epoch)
        out.append(
            (
                bool(improved),
                bool(done),
                float(state.best),
                int(state.best_step),
                int(state.wait),
            )
        )
        if done:
            break
    return out


@pytest.mark.parametrize(("mode", "patience", "min_delta", "seed"), CASES)
def test_update_is_keras_rule(mode, patience, min_delta, seed):
    values = sequence(seed)
    stop = scanax.EarlyStop(
        "val_loss", patience=patience, min_delta=min_delta, mode=mode
    )
    ref = keras_rule(values.tolist(), mode=mode, patience=patience, min_delta=min_delta)
    assert ours(stop, values) == ref


@pytest.fixture(scope="module")
def keras():
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras runs on another backend in this process")
    return keras


@pytest.mark.parametrize(("mode", "patience", "min_delta", "seed"), CASES[::2])
def test_update_is_keras_early_stopping(keras, mode, patience, min_delta, seed):
    """keras.callbacks.EarlyStopping driven with the same values, epoch by epoch."""
    values = sequence(seed)
    cb = keras.callbacks.EarlyStopping(
        monitor="val_loss", patience=patience, min_delta=min_delta, mode=mode
    )
    model = types.SimpleNamespace(stop_training=False)
    cb.set_model(model)
    cb.on_train_begin()
    theirs = []
    for epoch, v in enumerate(values.tolist()):
        cb.on_epoch_end(epoch, {"val_loss": v})
        theirs.append(
            (bool(model.stop_training), float(cb.best), cb.best_epoch, cb.wait)
        )
        if model.stop_training:
            break
    stop = scanax.EarlyStop(
        "val_loss", patience=patience, min_delta=min_delta, mode=mode
    )
    mine = [(d, b, s, w) for _, d, b, s, w in ours(stop, values)]
    assert mine == theirs


def test_in_a_compiled_loop_and_under_vmap():
    """A population of 4: vmap of update in a jitted scan over evaluations equals
    each member's own eager run; stop is sticky once reached."""
    stop = scanax.EarlyStop("val_acc", patience=2, min_delta=0.125, mode="max")
    values = np.stack([sequence(s, 25) for s in range(4)])  # [members, evals]
    steps = jnp.arange(25) * 10

    @jax.jit
    def run(values):
        def body(state, x):
            value, step = x
            state, improved, done = jax.vmap(stop.update, in_axes=(0, 0, None))(
                state, value, step
            )
            return state, (improved, done)

        state0 = jax.vmap(lambda _: stop.init())(jnp.arange(4))
        return jax.lax.scan(body, state0, (values.T, steps))

    state, (improved, done) = run(jnp.asarray(values))
    for m in range(4):
        ref = ours(stop, values[m])
        n = len(ref)
        assert improved[:n, m].tolist() == [r[0] for r in ref]
        assert done[:n, m].tolist() == [r[1] for r in ref]
        if ref[-1][1]:  # stopped: stays stopped, nothing changes any more
            assert bool(done[n - 1 :, m].all()) and not improved[n:, m].any()
        assert float(state.best[m]) == ref[-1][2]
        assert int(state.best_step[m]) == 10 * ref[-1][3]


def test_keep_best_follows_improvements():
    stop = scanax.EarlyStop("loss", patience=5)
    params = {"w": jnp.zeros(3)}
    best, state = params, stop.init()
    for step, v in enumerate([3.0, 2.0, 2.5, 1.0, 1.5]):
        current = {"w": jnp.full(3, float(step))}
        state, improved, _ = stop.update(state, jnp.float32(v), step)
        best = keep_best(best, current, improved)
    np.testing.assert_array_equal(best["w"], [3.0, 3.0, 3.0])  # step 3: value 1.0
    members = {"w": jnp.zeros((2, 3))}
    kept = jax.vmap(keep_best)(
        members, {"w": jnp.ones((2, 3))}, jnp.array([True, False])
    )
    np.testing.assert_array_equal(kept["w"], [[1, 1, 1], [0, 0, 0]])


def test_nan_is_never_an_improvement():
    """The documented difference from Keras: a first NaN is not the best."""
    stop = scanax.EarlyStop("loss", patience=1)
    state = stop.init()
    state, improved, done = stop.update(state, jnp.float32(jnp.nan), 1)
    assert not improved and not done and int(state.best_step) == -1
    state, improved, done = stop.update(state, jnp.float32(2.0), 2)
    assert improved and float(state.best) == 2.0
    state, improved, done = stop.update(state, jnp.float32(jnp.nan), 3)
    assert not improved and done


def test_state_is_a_small_pytree():
    state = scanax.EarlyStop("loss", patience=1, mode="max").init()
    assert isinstance(state, StopState)
    assert float(state.best) == -np.inf and int(state.best_step) == -1
    assert [x.shape for x in jax.tree.leaves(state)] == [()] * 4


def test_is_hashable_and_frozen():
    a = scanax.EarlyStop("val_loss", patience=3)
    assert a == scanax.EarlyStop("val_loss", patience=3) and hash(a) == hash(
        scanax.EarlyStop("val_loss", patience=3)
    )
    assert a.restore_best is True and a.mode == "min" and a.min_delta == 0.0
    with pytest.raises(AttributeError):
        a.patience = 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"monitor": 3, "patience": 1},
            TypeError,
            r"`monitor` must be the name of a metric.*got int 3",
        ),
        ({"monitor": "", "patience": 1}, TypeError, r"`monitor` must be"),
        (
            {"monitor": "loss", "patience": 1.5},
            TypeError,
            r"`patience` must be an int.*got float 1.5",
        ),
        (
            {"monitor": "loss", "patience": True},
            TypeError,
            r"`patience` must be an int",
        ),
        (
            {"monitor": "loss", "patience": -1},
            ValueError,
            r"`patience` must be 0 or more, got -1",
        ),
        (
            {"monitor": "loss", "patience": 1, "min_delta": "0.1"},
            TypeError,
            r"`min_delta` must be a real number, got str",
        ),
        (
            {"monitor": "loss", "patience": 1, "min_delta": -0.1},
            ValueError,
            r"`min_delta` must be finite and 0 or more, got -0.1.*mode='max'",
        ),
        (
            {"monitor": "loss", "patience": 1, "min_delta": float("nan")},
            ValueError,
            r"`min_delta` must be finite",
        ),
        (
            {"monitor": "loss", "patience": 1, "mode": "auto"},
            ValueError,
            r"`mode` must be 'min' or 'max', got 'auto'.*does not guess",
        ),
        (
            {"monitor": "loss", "patience": 1, "restore_best": 1},
            TypeError,
            r"`restore_best` must be True or False, got int 1",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    monitor = kwargs.pop("monitor")
    with pytest.raises(error, match=r"(?s)^scanax\.EarlyStop: " + match):
        scanax.EarlyStop(monitor, **kwargs)


def test_patience_is_keyword_only():
    with pytest.raises(TypeError):
        scanax.EarlyStop("loss", 3)


@pytest.mark.parametrize(
    ("monitor", "available", "match"),
    [
        (
            "val_los",
            ["loss", "val_loss", "val_acc"],
            r"monitor='val_los' is not a metric of this run; the metrics are: loss, val_acc, val_loss.\nFix: Did you mean 'val_loss'\?",
        ),
        (
            "val_loss",
            ["loss", "acc"],
            r"the metrics are: acc, loss.\nFix: Did you mean 'loss'\? Validation metrics \(val_\*\) exist only with eval_data=.*Otherwise monitor one of the metrics above",
        ),
        ("zzz", [], r"the metrics are: none.\nFix: Monitor one of the metrics above"),
    ],
)
def test_unknown_monitor(monitor, available, match):
    stop = scanax.EarlyStop(monitor, patience=1)
    with pytest.raises(ValueError, match=r"(?s)^scanax\.EarlyStop: .*" + match):
        stop.check_monitor(available)
    stop.check_monitor([*available, monitor])  # known: no error


def test_monitored_value_must_be_scalar():
    stop = scanax.EarlyStop("val_loss", patience=1)
    with pytest.raises(
        ValueError, match=r"'val_loss' must be one number per evaluation.*float32\[3\]"
    ):
        stop.update(stop.init(), jnp.ones(3), 1)
