"""fit's training-loop features (issue 16) against references: in-loop evaluation
vs a separate evaluation at those steps (eval mode), early stopping vs a Python
loop tracking the best, accumulate=k vs optax.MultiSteps and vs one big batch,
log= sinks vs the history's window means, a kill -9 + resume logging each step
once, the plot, and the errors."""

from __future__ import annotations

import csv
import functools as ft
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import JOBS_RUN_ELSEWHERE, close, count_compiles

import scanax
from scanax._fit.logs import window_reduce

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

HERE = Path(__file__).parent
allclose = ft.partial(close, rtol=1e-5, atol=1e-6)
X = jr.normal(jr.key(0), (48, 4))
Y = jnp.sum(X, 1, keepdims=True)
XV = jr.normal(jr.key(1), (30, 4))  # 30: two batches of 12 and a remainder of 6
YV = jnp.sum(XV, 1, keepdims=True) + jnp.sin(3 * XV[:, :1])
BS, KEY = 8, jr.key(2)


class Net(nnx.Module):
    """Dropout and BatchNorm: evaluation must switch both to eval mode."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def nnx_loss(model, batch):
    x, y = batch
    err = model(x) - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def eqx_loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def nnx_pair(tx=None):
    model = Net(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param)


def fit(model, opt, loss, steps, **kwargs):
    kwargs.setdefault("key", KEY)
    return scanax.fit(
        model, opt, loss, (X, Y), steps=steps, batch_size=BS, progress=False, **kwargs
    )


def evaluate_nnx(model):
    """The separate evaluation: the whole validation set at once, eval mode."""
    model.eval()
    loss, metrics = nnx_loss(model, (XV, YV))
    model.train()
    return {"val_loss": loss, "val_mae": metrics["mae"]}


# ------------------------------------------------------------------ evaluation


def test_nnx_evaluation_equals_a_separate_evaluation_in_eval_mode():
    model, opt = nnx_pair()
    result = fit(
        model, opt, nnx_loss, 30, eval_data=(XV, YV), eval_every=10, eval_batch_size=12
    )
    np.testing.assert_array_equal(result.history["val_step"], [10, 20, 30])
    ref_model, ref_opt = nnx_pair()
    for k in range(3):
        fit(ref_model, ref_opt, nnx_loss, 10)
        expected = evaluate_nnx(ref_model)
        for name, value in expected.items():
            allclose(result.history[name][k], value)
    assert not model.drop.deterministic  # the user's model stays in train mode
    allclose(nnx.state(model), nnx.state(ref_model))


def test_equinox_evaluation_in_inference_mode():
    class Drop(eqx.Module):
        mlp: eqx.nn.MLP
        drop: eqx.nn.Dropout

        def __call__(self, x, key=None):
            return self.mlp(self.drop(x, key=key))

    def loss(model, batch, key):
        x, y = batch
        keys = jr.split(key, x.shape[0])
        return jnp.mean((jax.vmap(model)(x, keys) - y) ** 2)

    model = Drop(eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0)), eqx.nn.Dropout(0.5))
    tx = optax.adam(1e-2)
    result = fit(model, tx, loss, 12, eval_data=(XV, YV), eval_every=6)
    ref = fit(model, tx, loss, 6)
    inference = eqx.nn.inference_mode(ref.model)
    expected = loss(inference, (XV, YV), jr.key(9))  # no dropout: any key
    allclose(result.history["val_loss"][0], expected)


def test_trainstate_evaluation_and_eval_fn():
    from flax.training import train_state

    params = {"w": jr.normal(jr.key(0), (4, 1))}
    state = train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params=params, tx=optax.sgd(0.05)
    )

    def loss(s, batch):
        x, y = batch
        return jnp.mean((s.apply_fn(s.params, x) - y) ** 2)

    def accuracy(s, batch):
        x, y = batch
        err = jnp.abs(s.apply_fn(s.params, x) - y)
        return loss(s, batch), {"close": jnp.mean(err < 0.5)}

    result = fit(
        state, None, loss, 10, eval_data=(XV, YV), eval_every=5, eval_fn=accuracy
    )
    ref = fit(state, None, loss, 10)
    loss_v, m = accuracy(ref.model, (XV, YV))
    allclose(result.history["val_loss"][-1], loss_v)
    allclose(result.history["val_close"][-1], m["close"])


def test_evaluation_does_not_recompile_and_is_cheap_to_repeat():
    model, opt = nnx_pair()
    fit(model, opt, nnx_loss, 5, eval_data=(XV, YV), eval_every=5)

    other = (XV * 2, YV)  # (an eager multiply compiles: outside the count)
    with count_compiles() as c:
        model, opt = nnx_pair()
        fit(model, opt, nnx_loss, 15, eval_data=other, eval_every=5)
    assert c.n == 0


# ------------------------------------------------------------- early stopping


def test_early_stopping_equals_a_python_loop_keeping_the_best():
    stop = scanax.EarlyStop("val_loss", patience=2, min_delta=1e-3)
    model, opt = nnx_pair(optax.adam(5e-2))
    result = fit(
        model, opt, nnx_loss, 300, eval_data=(XV, YV), eval_every=10, stop=stop
    )
    # the reference: 10 steps at a time, evaluate, track the best, stop
    ref_model, ref_opt = nnx_pair(optax.adam(5e-2))
    rule, best, step = stop.init(), None, 0
    while step < 300:
        fit(ref_model, ref_opt, nnx_loss, 10)
        step += 10
        value = evaluate_nnx(ref_model)["val_loss"]
        rule, improved, done = stop.update(rule, value, step)
        if improved:
            best = nnx.clone((ref_model, ref_opt))
        if done:
            break
    assert step < 300, "the reference run should stop early"
    assert result.steps == step and result.best_step == int(rule.best_step)
    np.testing.assert_array_equal(
        result.history["val_step"], np.arange(10, step + 1, 10)
    )
    # restored: the best state, except its counts (optimizer.step, Adam's count,
    # the Dropout stream's count), kept at the last step run: the next call
    # continues after it
    got, kept = nnx.state((model, opt)), nnx.state(best)
    last = nnx.state((ref_model, ref_opt))
    counts = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.integer), got)
    assert sum(jax.tree.leaves(counts)) == 3
    allclose(got, jax.tree.map(lambda c, b, x: x if c else b, counts, kept, last))


def test_early_stopping_on_a_training_metric_without_eval_data():
    stop = scanax.EarlyStop("loss", patience=0, restore_best=False, min_delta=10.0)
    model, opt = nnx_pair()
    result = fit(model, opt, nnx_loss, 100, eval_every=5, stop=stop)
    # a min_delta no window mean can beat: the first check improves (from inf),
    # the second stops
    assert result.steps == 10 and result.best_step is None


# ----------------------------------------------------------------- accumulate


@pytest.mark.standard_promotion("optax.MultiSteps divides gradients by an int32 count")
@pytest.mark.parametrize("kind", ["nnx", "eqx"])
def test_accumulate_equals_optax_multisteps(kind):
    if kind == "nnx":  # (SGD: the bias before BatchNorm has a ~0 gradient, which
        # Adam would blow up to a full step from float noise)
        a = nnx_pair(optax.sgd(0.05))
        b = nnx_pair(optax.MultiSteps(optax.sgd(0.05), 4))
        loss = nnx_loss
    else:
        m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0))
        a, b = (m, optax.adam(1e-2)), (m, optax.MultiSteps(optax.adam(1e-2), 4))
        loss = eqx_loss
    ra = fit(*a, loss, 6, accumulate=4)
    rb = fit(*b, loss, 24)
    mean4 = rb.history["loss"].reshape(6, 4).mean(1)
    allclose(ra.history["loss"], mean4)
    if kind == "nnx":
        allclose(nnx.state(a[0], nnx.Param), nnx.state(b[0], nnx.Param))
    else:
        allclose(eqx.filter(ra.model, eqx.is_array), eqx.filter(rb.model, eqx.is_array))


@pytest.mark.parametrize("data", ["arrays", "iterable"])
def test_accumulate_with_x64_and_strict_promotion(data):
    """The micro-batch indices and keys stay int32 with x64 on (int32 step +
    int64 arange failed under strict promotion): as one big batch."""
    with jax.enable_x64(True):
        m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0), dtype=jnp.float32)
        tx = optax.sgd(0.1)

        def loss(model, batch, key):  # (a key: the micro-batch keys)
            noise = jr.normal(key, (), jnp.float32)
            return eqx_loss(model, batch) + 0 * noise

        if data == "arrays":
            kw = dict(batch_size=4)
            a, b = (X, Y), (X, Y)
        else:
            a = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 48, 4)]
            b = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 48, 8)]
            kw = {}
        ra = scanax.fit(
            m, tx, loss, a, steps=3, accumulate=2, key=jr.key(1), progress=False, **kw
        )
        kw = {k: 2 * v for k, v in kw.items()}
        rb = scanax.fit(m, tx, loss, b, steps=3, key=jr.key(1), progress=False, **kw)
    allclose(eqx.filter(ra.model, eqx.is_array), eqx.filter(rb.model, eqx.is_array))


def test_accumulate_equals_one_step_on_the_concatenated_batch():
    m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0))
    tx = optax.sgd(0.1)
    ra = scanax.fit(
        m, tx, eqx_loss, (X, Y), steps=3, batch_size=4, accumulate=2, progress=False
    )
    rb = scanax.fit(m, tx, eqx_loss, (X, Y), steps=3, batch_size=8, progress=False)
    allclose(eqx.filter(ra.model, eqx.is_array), eqx.filter(rb.model, eqx.is_array))


def test_accumulate_with_iterable_data():
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 48, 4)]
    m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0))
    tx = optax.sgd(0.1)
    ra = scanax.fit(m, tx, eqx_loss, batches, steps=6, accumulate=2, progress=False)
    big = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 48, 8)]
    rb = scanax.fit(m, tx, eqx_loss, big, steps=6, progress=False)
    assert ra.steps == 6
    allclose(eqx.filter(ra.model, eqx.is_array), eqx.filter(rb.model, eqx.is_array))


def test_batches_left_after_the_last_group_of_accumulate_are_warned_of():
    """11 batches with accumulate=2: 5 steps, the last batch not trained on,
    as an incomplete last batch is (before: dropped without a word); the 5
    steps equal those of 5 batches of twice the size."""
    batches = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 44, 4)]
    m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0))
    tx = optax.sgd(0.1)
    with pytest.warns(
        RuntimeWarning,
        match=r"`data` ended with 1 batch after the last full group of accumulate=2",
    ):
        ra = scanax.fit(
            m, tx, eqx_loss, batches, steps=10, accumulate=2, progress=False
        )
    big = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 40, 8)]
    rb = scanax.fit(m, tx, eqx_loss, big, steps=10, progress=False)
    assert ra.steps == rb.steps == 5
    allclose(eqx.filter(ra.model, eqx.is_array), eqx.filter(rb.model, eqx.is_array))


# -------------------------------------------------------------------- logging


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_log_sinks_hold_the_history_window_means(tmp_path):
    seen = []
    model, opt = nnx_pair()
    result = fit(
        model,
        opt,
        nnx_loss,
        23,
        eval_data=(XV, YV),
        eval_every=10,
        log=[scanax.CSV(tmp_path / "log.csv"), lambda s, m: seen.append((s, m))],
        log_every=5,
        steps_per_call=7,  # windows cross calls
    )
    h = result.history
    steps, windows = window_reduce(h["step"], {"loss": h["loss"], "mae": h["mae"]}, 5)
    np.testing.assert_array_equal(steps, [5, 10, 15, 20, 23])
    rows = read_csv(tmp_path / "log.csv")
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20, 23]
    train = [(s, m) for s, m in seen if "loss" in m]
    assert [s for s, _ in train] == [5, 10, 15, 20, 23]
    for k, (_, m) in enumerate(train):
        np.testing.assert_allclose(m["loss"], windows["loss"][k], rtol=1e-6)
        np.testing.assert_allclose(
            float(rows[k]["loss"]), windows["loss"][k], rtol=1e-6
        )
    val = {s: m["val_loss"] for s, m in seen if "val_loss" in m}
    assert sorted(val) == [10, 20]
    np.testing.assert_allclose(list(val.values()), h["val_loss"], rtol=1e-6)


def test_tensorboard_read_back(tmp_path):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    model, opt = nnx_pair()
    result = fit(
        model, opt, nnx_loss, 20, log=scanax.TensorBoard(tmp_path), log_every=4
    )
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    steps, windows = window_reduce(
        result.history["step"], {"loss": result.history["loss"]}, 4
    )
    assert [s for s, _ in got] == list(steps)
    np.testing.assert_allclose([v for _, v in got], windows["loss"], rtol=1e-6)


def test_a_failing_sink_keeps_the_result():
    def sink(step, metrics):
        if step >= 10:
            raise OSError("disk full")

    model, opt = nnx_pair()
    with pytest.raises(scanax.SinkError, match=r"step 10") as info:
        fit(model, opt, nnx_loss, 20, log=sink, log_every=5)
    assert info.value.result.steps == 20
    assert int(opt.step.get_raw_value()) == 20  # trained, not lost


def test_kill_and_resume_logs_each_step_once(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.csv"
    # (added to the PYTHONPATH there is: the packages may be installed there)
    path = os.pathsep.join(
        filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "PYTHONPATH": path}
    job = [sys.executable, str(HERE / "_fit_log_job.py"), str(ckpt), str(log)]
    proc = subprocess.Popen(job, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if ckpt.exists() and any(
            n.isdigit() and int(n) >= 16 for n in os.listdir(ckpt)
        ):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the job ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = subprocess.run(job, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    resumed = read_csv(log)
    whole = tmp_path / "whole.csv"
    if JOBS_RUN_ELSEWHERE:  # the same run, uninterrupted, as a job too
        subprocess.run(job[:2] + ["", str(whole)], env=env, check=True, timeout=300)
    else:  # ... in this process
        import _fit_log_job

        _fit_log_job.job(None, whole)
    reference = read_csv(whole)
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]
    for a, b in zip(resumed, reference):
        np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-6)


# ----------------------------------------------------------------------- plot


def test_plot_returns_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    model, opt = nnx_pair()
    result = fit(model, opt, nnx_loss, 10, eval_data=(XV, YV), eval_every=5)
    fig = result.plot(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").exists()
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert any("val_loss" in label for label in labels)


# --------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(eval_every=5), TypeError, "eval_every is given without eval_data"),
        *[  # (the callbacks' form: named as written, not as an EarlyStop's)
            (
                dict(callbacks=[evaluation]),
                TypeError,
                r"(?s)scanax.Eval is given without data, and no scanax.EarlyStop.*"
                r"Fix: pass the validation data, scanax.Eval\(\(x_val, y_val\)",
            )
            for evaluation in (scanax.Eval(), scanax.Eval(None, every=5))
        ],
        (
            dict(eval_data=(XV, YV)),
            TypeError,
            r"scanax.Eval \(eval_data=\) is given without `every` \(eval_every=\)",
        ),
        (dict(eval_fn=nnx_loss), TypeError, "`eval_fn` is given without eval_data"),
        (
            dict(
                eval_data=(XV, YV),
                eval_every=5,
                stop=scanax.EarlyStop("val_acc", patience=1),
            ),
            ValueError,
            r"val_acc.*val_loss",
        ),
        (
            dict(eval_every=5, stop=scanax.EarlyStop("val_loss", patience=1)),
            ValueError,
            "a validation metric, but no scanax.Eval has data",
        ),
        (dict(accumulate=0), ValueError, "accumulate"),
        (dict(accumulate=7), ValueError, r"accumulate=7 micro-batches .* 56 examples"),
        (dict(accumulate=2.0), TypeError, "accumulate"),
        (
            dict(eval_data=[XV], eval_every=2),
            TypeError,
            "the evaluation data must be arrays",
        ),
        (dict(stop="val_loss", eval_every=2), TypeError, "must be a scanax.EarlyStop"),
        # eval_fn's and eval_data's mistakes are named as theirs, not loss_fn's/data's
        (
            dict(eval_data=(XV, YV[:5]), eval_every=2),
            ValueError,
            r"(?s)arrays in `eval_data` must share.*eval_data\[1\]",
        ),
        (
            dict(eval_data=(XV, YV), eval_every=2, eval_fn=lambda m, b: "x"),
            TypeError,
            "`eval_fn` must return a scalar floating-point loss, got str",
        ),
        (
            dict(eval_data=(XV, YV), eval_every=2, eval_fn=lambda m, b, c, d: 1.0),
            TypeError,
            r"`eval_fn` takes 4 required .* fit calls eval_fn\(model, batch\)",
        ),
    ],
)
def test_errors(kwargs, exc, match):
    model, opt = nnx_pair()
    with pytest.raises(exc, match=match):
        fit(model, opt, nnx_loss, 5, **kwargs)
    assert int(opt.step.get_raw_value()) == 0  # nothing trained, nothing changed


def test_small_validation_sets_and_keyed_eval_fn():
    """A validation set smaller than batch_size is one batch; an eval_fn taking a
    key gets one although loss_fn does not."""

    def eval_fn(model, batch, key):
        loss, metrics = nnx_loss(model, batch)
        return loss, {"noise": jr.normal(key, ())}

    model, opt = nnx_pair()
    small = (XV[:5], YV[:5])
    result = fit(
        model, opt, nnx_loss, 10, eval_data=small, eval_every=5, eval_fn=eval_fn
    )
    assert result.history["val_noise"].shape == (2,)
    assert result.history["val_noise"][0] != result.history["val_noise"][1]
    model.eval()
    allclose(result.history["val_loss"][-1], nnx_loss(model, small)[0])


def test_reserved_metric_names():
    def loss(model, batch):
        return nnx_loss(model, batch)[0], {"step": jnp.zeros(())}

    model, opt = nnx_pair()
    with pytest.raises(ValueError, match="metric named 'step'"):
        fit(model, opt, loss, 5)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
@pytest.mark.parametrize("iterable", [False, True])
def test_accumulate_on_a_mesh_shards_the_batch_not_the_micro_batches(iterable):
    m = eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0))
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((4,), ("data",))
    if iterable:
        data, kw = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 48, 4)], {}
    else:
        data, kw = (X, Y), {"batch_size": 4}
    run = ft.partial(scanax.fit, m, tx, eqx_loss, data, steps=4, accumulate=3)
    one = run(progress=False, **kw)
    sharded = run(progress=False, mesh=mesh, **kw)
    allclose(
        eqx.filter(sharded.model, eqx.is_array), eqx.filter(one.model, eqx.is_array)
    )


def test_a_first_call_that_ends_before_its_first_check_warns():
    """Eval(every=50) in a 20-step call from step 0: no evaluation and no
    EarlyStop check in it, which the result shows only by absence (review
    2026-12-06); a warning says so. A call continuing the run does not warn
    (an epoch loop reaches the check in a later call)."""
    params = {"w": jnp.zeros((4, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    callbacks = [
        scanax.Eval((X, Y), every=50),
        scanax.EarlyStop("val_loss", patience=2),
    ]
    kw = dict(steps=20, batch_size=BS, progress=False, callbacks=callbacks)
    with pytest.warns(
        UserWarning,
        match=r"(?s)every 50 steps, first at step 50, "
        r"but this call runs 20 steps.*EarlyStop\('val_loss'\) is "
        r"never checked.*at most 20",
    ):
        first = scanax.fit(params, optax.sgd(0.1), loss, (X, Y), **kw)
    assert len(first.history["val_loss"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        more = scanax.fit(
            first.model, optax.sgd(0.1), loss, (X, Y), opt_state=first.optimizer, **kw
        )
        scanax.fit(params, optax.sgd(0.1), loss, (X, Y), **dict(kw, steps=50))
    assert len(more.history["val_loss"]) == 0  # (steps 21-40: none due)
