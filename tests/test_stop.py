"""scanax.EarlyStop: its arguments, and its rule against a plain Python
reimplementation of Keras's and against keras.callbacks.EarlyStopping itself, in
a compiled loop and under vmap."""

import inspect
import os
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaves_equal

import scanax
from scanax._fit.callbacks.early_stop import (
    MAX_WORDS,
    MIN_WORDS,
    StopState,
    keep_best,
    warn_never_finite,
)

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
    assert a.restore_best is True and a.min_delta == 0.0
    assert a.mode == "auto" and a.direction == "min"  # `mode` stays as given
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
            {"monitor": "loss", "patience": 1, "mode": "maximum"},
            ValueError,
            r"`mode` must be 'auto', 'min' or 'max', got 'maximum'.\nFix: leave it "
            r"out \('auto': 'max' for accuracies",
        ),
        (
            {"monitor": "loss", "patience": 1, "mode": None},
            ValueError,
            r"`mode` must be 'auto', 'min' or 'max', got None",
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


@pytest.mark.parametrize("rule", ["EarlyStop", "Plateau"])
def test_a_monitored_training_metric_must_be_scalar(rule):
    """Named while fit traces its step (before any step), as a validation
    metric is; not JAX's error about the loop's carry."""
    optax = pytest.importorskip("optax")

    def loss_fn(params, batch):
        loss, metrics = classifier_loss(params, batch)
        return loss, {**metrics, "per_out": jnp.full((1,), loss)}

    params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros((1,))}
    with pytest.raises(
        ValueError,
        match=rf"(?s)^scanax\.{rule}: the monitored metric 'per_out' must be one "
        r"number per step .*float32\[1\].*from loss_fn",
    ):
        scanax.fit(
            params, optax.sgd(0.05), loss_fn, TRAIN, steps=8, batch_size=8,
            progress=False, callbacks=[scanax.Eval(VAL, every=4),
                                       getattr(scanax, rule)("per_out", patience=1)],
        )  # fmt: skip


# ------------------------------------------------------------------ mode="auto"

# Keras's usual spellings and its metric aliases, each naming the metric a model
# compiled with `metrics=[...]` has (strings as Keras resolves them).
KERAS_NAMES = [
    "val_accuracy", "val_acc", "accuracy", "val_auc", "val_f1", "val_loss", "loss",
    "val_mse", "mae", "val_mape", "msle", "val_bce",
]  # fmt: skip


def keras_direction(keras, model, monitor):
    """What keras.callbacks.EarlyStopping(monitor, mode="auto") resolves to for
    ``model``'s metrics, at its first epoch."""
    cb = keras.callbacks.EarlyStopping(monitor=monitor, mode="auto")
    cb.set_model(model)
    cb.on_train_begin()
    cb.on_epoch_end(0, {monitor: 1.0})
    return {keras.ops.greater: "max", keras.ops.less: "min"}[cb.monitor_op]


def test_auto_mode_is_keras_for_a_compiled_model(keras):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    f1 = keras.metrics.F1Score(name="f1")
    metrics = ["accuracy", "acc", "auc", f1, "mse", "mae", "mape", "msle", "bce"]
    model.compile(loss="binary_crossentropy", metrics=metrics)
    y = np.zeros((4, 1), np.float32)
    model._compile_metrics.build(y, y)  # what Keras's fit does at its first batch
    for name in KERAS_NAMES:
        expected = keras_direction(keras, model, name)
        assert scanax.EarlyStop(name, patience=1).direction == expected, name


def keras_builtin_metrics(keras):
    """Every built-in Keras metric that knows its direction, default-named."""
    required = {
        "num_classes": 2, "recall": 0.5, "precision": 0.5, "specificity": 0.5,
        "sensitivity": 0.5, "target_class_ids": [0],
    }  # fmt: skip
    out = []
    for cls in vars(keras.metrics).values():
        if not (isinstance(cls, type) and issubclass(cls, keras.metrics.Metric)):
            continue
        params = inspect.signature(cls.__init__).parameters
        args = {k: v for k, v in required.items() if k in params}
        if any(
            p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
            for k, p in params.items()
            if k != "self" and k not in args
        ):
            continue  # e.g. MeanMetricWrapper(fn): not a metric by itself
        metric = cls(**args)
        if getattr(metric, "_direction", None) in ("up", "down"):
            out.append(metric)
    return out


def test_auto_mode_is_keras_for_every_builtin_metric(keras):
    """Each built-in metric's default name, with and without ``val_``, gets the
    direction Keras's own metric object gives it."""
    from keras.src.trainers.compile_utils import MetricsList

    metrics = keras_builtin_metrics(keras)
    assert len(metrics) > 30  # (the enumeration found them)
    model = types.SimpleNamespace(metrics=[MetricsList(metrics)])
    for metric in metrics:
        for name in (metric.name, "val_" + metric.name):
            expected = keras_direction(keras, model, name)
            assert scanax.EarlyStop(name, patience=1).direction == expected, name


@pytest.mark.parametrize(
    ("monitor", "direction"),
    [
        *[(n, "max") for n in ("val_top5_acc", "acc@1", "acc1", "Val_Accuracy")],
        *[(n, "max") for n in ("f1_score", "val_mean_io_u", "miou", "PSNR", "ndcg")],
        *[(n, "max") for n in ("recall_at_precision", "val_r2", "dice", "BLEU")],
        *[(n, "max") for n in ("rollout_return", "rollout_episode_reward")],
        *[(n, "min") for n in ("returned", "reward_loss")],
        *[(n, "min") for n in ("val_auc_loss", "dice_loss", "top1_err", "mae")],
        *[(n, "min") for n in ("accumulated", "val_mape", "ppl", "f1score")],
        *[(n, "min") for n in ("error", "val_acc_error", "kl_divergence")],
    ],
)
def test_auto_mode_by_words(monitor, direction):
    """The documented rule: one of the words, not run together with letters, and
    none of loss/error/err."""
    assert scanax.EarlyStop(monitor, patience=1).direction == direction
    for mode in ("min", "max"):  # an explicit mode is the mode
        assert scanax.EarlyStop(monitor, patience=1, mode=mode).direction == mode


def test_auto_mode_words_are_documented():
    """The list in EarlyStop.direction's docstring is the one the rule uses."""
    doc = " ".join(scanax.EarlyStop.direction.__doc__.split())
    listed = re.findall(r"``([a-z0-9_]+)``", doc.split("when it holds")[1])
    words = listed[listed.index("err") + 1 : listed.index("val_top5_acc")]
    assert set(words) == set(MAX_WORDS) and listed[:3] == list(MIN_WORDS)


@pytest.mark.parametrize(("monitor", "mode"), [("val_acc", "max"), ("loss", "min")])
def test_auto_is_the_explicit_mode(monitor, mode):
    """Same states, step by step, as the mode it resolves to."""
    values = sequence(0)
    auto = scanax.EarlyStop(monitor, patience=2, min_delta=0.125)
    explicit = scanax.EarlyStop(monitor, patience=2, min_delta=0.125, mode=mode)
    assert auto.direction == mode and ours(auto, values) == ours(explicit, values)
    leaves_equal(auto.init(), explicit.init())


# An accuracy that rises: a linear classifier from a bad start, plain SGD, batches
# in order (key=None). Evaluated every 4 steps.
W = jnp.array([[1.0], [-2.0], [0.5]])
XT = jax.random.normal(jax.random.key(0), (48, 3))
XV = jax.random.normal(jax.random.key(3), (64, 3))
TRAIN = (XT, (XT @ W > 0).astype(jnp.float32))
VAL = (XV, (XV @ W > 0.3).astype(jnp.float32))


def classifier_loss(params, batch):
    optax = pytest.importorskip("optax")
    x, y = batch
    logits = x @ params["w"] + params["b"]
    accuracy = jnp.mean(((logits > 0) == (y > 0.5)).astype(jnp.float32))
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, y))
    return loss, {"accuracy": accuracy}


def fit_classifier(steps=200, **kwargs):
    optax = pytest.importorskip("optax")
    params = {"w": jnp.array([[-0.5], [0.5], [0.0]]), "b": jnp.zeros((1,))}
    return scanax.fit(
        params, optax.sgd(0.05), classifier_loss, TRAIN, steps=steps, batch_size=8,
        key=None, progress=False, eval_data=VAL, eval_every=4, **kwargs,
    )  # fmt: skip


def test_fit_keeps_the_best_accuracy():
    """EarlyStop("val_accuracy") maximises: the model returned is the one at the
    first highest validation accuracy (the same model as a run that stops there),
    as mode="max" gives (the old default, "min", kept the first, worst one)."""
    result = fit_classifier(stop=scanax.EarlyStop("val_accuracy", patience=2))
    steps, acc = result.history["val_step"], result.history["val_accuracy"]
    assert acc[-1] > acc[0] and result.steps < 200  # rose, then stopped on a plateau
    best = int(steps[np.argmax(acc)])  # (argmax: the first of equal maxima)
    assert result.best_step == best and best not in (steps[0], steps[-1])
    plain = fit_classifier(steps=best)  # no rule: trained up to the best step
    leaves_equal(result.model, plain.model)
    assert float(classifier_loss(result.model, VAL)[1]["accuracy"]) == acc.max()

    explicit = fit_classifier(
        stop=scanax.EarlyStop("val_accuracy", patience=2, mode="max")
    )
    assert explicit.best_step == best and explicit.steps == result.steps
    leaves_equal(result.model, explicit.model)
    np.testing.assert_array_equal(explicit.history["loss"], result.history["loss"])


def test_a_monitor_never_finite_warns():
    """An eval metric that is NaN at every check (before: a stop after patience
    checks, no best kept, and nothing said) warns, naming it; one finite value
    is enough to say nothing; a population names the members."""

    def nan_at_eval(params, batch):
        loss, metrics = classifier_loss(params, batch)
        empty = jnp.mean(jnp.zeros((0,)))  # (a mean over nothing)
        return loss, {**metrics, "odd": metrics["accuracy"] * 0 + empty}

    rule = scanax.EarlyStop("val_odd", patience=2, restore_best=True)
    with pytest.warns(
        RuntimeWarning, match=r"(?s)monitor 'val_odd' was never finite in this call "
        r"\(2 value\(s\).*no best state was kept.*Fix: look at"
    ):  # fmt: skip
        result = fit_classifier(stop=rule, eval_fn=nan_at_eval)
    assert result.steps == 8 and result.best_step is None  # (patience=2)
    assert np.isnan(result.history["val_odd"]).all()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_classifier(steps=12, stop=scanax.EarlyStop("val_accuracy", patience=2))
    nan = np.nan
    history = {  # a population's: member 1 trained to step 2, member 2 to none
        "step": np.array([1, 2, 3, 4]),
        "loss": np.array([[0.1] * 4, [0.1, 0.1, nan, nan], [nan] * 4]),
        "val_step": np.array([2, 4]),
        "val_odd": np.array([[nan, 0.5], [nan, nan], [nan, nan]]),
    }
    with pytest.warns(RuntimeWarning, match=r"for member\(s\) \[1\] \(1 value"):
        warn_never_finite(rule, history)
    with warnings.catch_warnings():  # (NaN where a member did not train: padding)
        warnings.simplefilter("error")
        history["loss"][1, 1] = nan  # (member 1 trained to step 1: no check)
        warn_never_finite(rule, history)
        # a training metric is compared as its mean since the last check, which
        # history does not hold: not warned
        trained = scanax.EarlyStop("odd", patience=2)
        warn_never_finite(trained, {"odd": np.full(4, nan), "step": np.arange(4)})
