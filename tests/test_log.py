"""Logging: sinks (TensorBoard read back with TensorBoard's own reader, CSV,
callables), their failures, the resume rule after kill -9, and the window
reduction against a plain Python loop."""

import math
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import read_csv, read_tensorboard

import scanax
from scanax._fit.callbacks.sinks import CSV
from scanax._fit.logs import Sinks, merge, window_reduce

ROOT = Path(__file__).resolve().parents[1]


def f32(values):
    """Event files store float32."""
    return [float(np.float32(v)) for v in values]


# ------------------------------------------------------------------------ sinks


def test_csv_round_trip(tmp_path):
    path = tmp_path / "sub" / "m.csv"
    steps = np.arange(10, 60, 10)
    loss = np.array([1.0, 0.5, 1 / 3, 0.25, 1e-8])
    acc = np.array([0.1, 0.2, 0.3, 0.4, 0.5], np.float32)
    sinks = Sinks(scanax.CSV(path))
    sinks.resume(0)
    sinks.write(steps, {"loss": loss, "acc": acc})
    sinks.close()
    sinks.raise_pending()
    rows = read_csv(path)
    assert list(rows[0]) == ["step", "loss", "acc"]
    assert [int(r["step"]) for r in rows] == list(steps)
    assert [float(r["loss"]) for r in rows] == list(loss)  # exact: repr round trip
    assert [float(r["acc"]) for r in rows] == [float(a) for a in acc]


def test_csv_quotes_odd_names_and_survives_a_resume(tmp_path):
    path = tmp_path / "m.csv"
    sink = CSV(path)
    sink(1, {'top-1, "val"': 0.5})
    sink(2, {'top-1, "val"': 0.25})
    sink.resume(1)
    sink(2, {'top-1, "val"': 0.75})
    sink.close()
    assert read_csv(path) == [
        {"step": "1", 'top-1, "val"': "0.5"},
        {"step": "2", 'top-1, "val"': "0.75"},
    ]


def test_tensorboard_read_back_exactly(tmp_path):
    pytest.importorskip("tensorboardX")
    steps = np.array([5, 10, 15, 17])
    loss = np.array([2.0, 1.5, 1.25, 1.2])
    sinks = Sinks([scanax.TensorBoard(tmp_path / "tb")])
    sinks.resume(0)
    sinks.write(steps, {"loss": loss, "lr": np.array([1e-3, 1e-3, 5e-4, 5e-4])})
    sinks.close()
    sinks.raise_pending()
    got = read_tensorboard(tmp_path / "tb")
    assert sorted(got) == ["loss", "lr"]
    assert got["loss"] == list(zip(steps.tolist(), f32(loss)))
    assert [s for s, _ in got["lr"]] == steps.tolist()


def test_missing_values_and_population(tmp_path):
    """NaN (no value) is left out everywhere; per-member values become
    ``name/i``; a metric that appears later widens the CSV's header."""
    pytest.importorskip("tensorboardX")
    train = (
        np.array([10, 20, 30]),
        {"loss": np.array([[3.0, 4.0], [2.0, 3.0], [1.0, 2.0]])},
    )
    evals = (np.array([15, 30]), {"val_loss": np.array([[2.5, 3.5], [np.nan, 1.5]])})
    steps, windows = merge(train, evals)
    assert steps.tolist() == [10, 15, 20, 30]
    seen = []
    tb, path = scanax.TensorBoard(tmp_path / "tb"), tmp_path / "m.csv"
    sinks = Sinks([tb, scanax.CSV(path), lambda s, m: seen.append((s, m))])
    sinks.resume(0)
    sinks.write(steps, windows)
    sinks.close()
    sinks.raise_pending()
    rows = read_csv(path)
    assert list(rows[0]) == ["step", "loss/0", "loss/1", "val_loss/0", "val_loss/1"]
    assert [r["val_loss/0"] for r in rows] == ["", "2.5", "", ""]
    assert [r["loss/1"] for r in rows] == ["4.0", "", "3.0", "2.0"]
    got = read_tensorboard(tmp_path / "tb")
    assert got["val_loss/0"] == [(15, 2.5)]
    assert got["val_loss/1"] == [(15, 3.5), (30, 1.5)]
    assert got["loss/0"] == [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert [s for s, _ in seen] == [10, 15, 20, 30]
    assert set(seen[1][1]) == {"val_loss"}  # no train window at step 15
    np.testing.assert_array_equal(seen[3][1]["val_loss"], [np.nan, 1.5])


_CRASHING_JOB = """
import os, signal, sys
import numpy as np
sys.path.insert(0, {root!r})
import scanax
from scanax._fit.logs import Sinks
sinks = Sinks([scanax.CSV({csv!r}), {tb}])
sinks.resume(0)
for start in range(1, 51, 10):  # chunks of 10 steps, flushed at their ends
    steps = np.arange(start, start + 10)
    sinks.write(steps, {{"loss": steps * 1.0}})
    sinks.flush()
with open({csv!r}, "a") as f:
    f.write("51,51.0")  # a row cut short by the kill
    f.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("tensorboard", [False, True], ids=["csv", "csv+tensorboard"])
def test_resume_after_kill_writes_each_step_once(tmp_path, tensorboard):
    """Steps 1..50 written and flushed, kill -9, resume from a checkpoint at step
    30, steps 31..60 written again: each step once, the resumed values win."""
    if tensorboard:
        pytest.importorskip("tensorboardX")
        pytest.importorskip("tensorboard")
    csv_path, tb_dir = str(tmp_path / "m.csv"), str(tmp_path / "tb")
    tb = f"scanax.TensorBoard({tb_dir!r})" if tensorboard else ""
    job = _CRASHING_JOB.format(root=str(ROOT), csv=csv_path, tb=tb)
    proc = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert Path(csv_path).read_text().endswith("\n50,50.0\n51,51.0")  # cut short

    sinks = Sinks(
        [scanax.CSV(csv_path)] + ([scanax.TensorBoard(tb_dir)] if tensorboard else [])
    )
    sinks.resume(30)
    for start in range(31, 61, 10):
        steps = np.arange(start, start + 10)
        sinks.write(steps, {"loss": steps + 0.5})
        sinks.flush()
    sinks.close()
    sinks.raise_pending()

    expected = [(s, s * 1.0 if s <= 30 else s + 0.5) for s in range(1, 61)]
    rows = read_csv(csv_path)
    assert [(int(r["step"]), float(r["loss"])) for r in rows] == expected
    if tensorboard:
        got = read_tensorboard(tb_dir)["loss"]
        assert got == [(s, float(np.float32(v))) for s, v in expected]


def test_a_new_run_starts_the_csv_over(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("step,loss\n1,9.0\n2,8.0\n")
    sink = CSV(path)
    sink(1, {"loss": 1.0})  # no resume: the first write resumes at step 0
    sink.close()
    assert read_csv(path) == [{"step": "1", "loss": "1.0"}]


def test_a_callable_sink_gets_floats_and_its_methods_are_called():
    calls = []

    class Sink:
        def __call__(self, step, metrics):
            calls.append(("write", step, metrics))

        def resume(self, step):
            calls.append(("resume", step))

        def flush(self):
            calls.append(("flush",))

        def close(self):
            calls.append(("close",))

    sinks = Sinks(Sink())
    sinks.resume(7)
    sinks.write(np.array([8, 9]), {"loss": np.array([0.5, np.nan], np.float32)})
    sinks.flush()
    sinks.close()
    assert calls == [
        ("resume", 7),
        ("write", 8, {"loss": 0.5}),  # step 9 has no value: no call
        ("flush",),
        ("flush",),
        ("close",),
    ]
    assert type(calls[1][2]["loss"]) is float


def test_mlflow_recipe(tmp_path, monkeypatch):
    """docs/training_features.md's MLflow recipe, a callable sink, in a real fit
    against MLflow's local file store: every window mean of the history, once."""
    mlflow = pytest.importorskip("mlflow")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    # MLflow 3 keeps the file store only on request (a database otherwise).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())

    def mlflow_sink(step, metrics):  # the recipe, as the docs write it
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def loss_fn(params, batch):
        x, y = batch
        loss = jnp.mean((x * params["w"] - y) ** 2)
        return loss, {"w": params["w"]}

    x = np.linspace(-1, 1, 16, dtype=np.float32)
    with mlflow.start_run() as run:
        result = scanax.fit(
            {"w": jnp.zeros(())}, optax.sgd(0.1), loss_fn, (x, 2 * x),
            steps=23, batch_size=4, log=mlflow_sink, log_every=5, progress=False,
        )  # fmt: skip
    client = mlflow.tracking.MlflowClient()
    for name in ("loss", "w"):
        got = client.get_metric_history(run.info.run_id, name)
        ref_steps, ref = ref_windows(
            result.history["step"].tolist(), result.history[name].tolist(), 5
        )
        assert [m.step for m in got] == ref_steps == [5, 10, 15, 20, 23]
        np.testing.assert_allclose([m.value for m in got], ref, rtol=1e-6)


# ----------------------------------------------------------------- sink errors


def test_a_failing_sink_is_skipped_and_reported_after(tmp_path):
    good = []

    def flaky(step, metrics):
        if step == 20:
            raise OSError("disk full")

    sinks = Sinks([flaky, lambda s, m: good.append(s)])
    sinks.resume(0)
    sinks.write(np.array([10, 20, 30]), {"loss": np.ones(3)})
    sinks.write(np.array([40]), {"loss": np.ones(1)})
    sinks.close()
    assert good == [10, 20, 30, 40]  # the other sink went on
    assert [(s, step) for s, step, _ in sinks.failures] == [(flaky, 20)]
    result = object()
    with pytest.raises(
        scanax.SinkError,
        match=r"(?s)a log sink raised.*function test_a_failing_sink_is_skipped_and_"
        r"reported_after.<locals>.flaky raised OSError at step 20: disk full",
    ) as info:
        sinks.raise_pending(result)
    assert info.value.result is result
    assert isinstance(info.value.__cause__, OSError)
    assert "`.result`" in str(info.value)


def test_several_failing_sinks_are_all_named(tmp_path):
    class Broken:
        def __call__(self, step, metrics):
            pass

        def flush(self):
            raise RuntimeError("no connection")

    def bad(step, metrics):
        raise ValueError("bad value")

    sinks = Sinks([Broken(), bad])
    sinks.write(np.array([3]), {"loss": np.ones(1)})
    sinks.close()
    with pytest.raises(
        scanax.SinkError,
        match=r"(?s)2 log sinks raised.*function .*bad raised ValueError at step 3: "
        r"bad value\n  a Broken object raised RuntimeError at step 3: no connection",
    ):
        sinks.raise_pending()


def test_no_failure_raises_nothing():
    sinks = Sinks(None)
    assert not sinks
    sinks.write(np.array([1]), {"loss": np.ones(1)})
    sinks.close()
    sinks.raise_pending()


@pytest.mark.parametrize(
    ("log", "match"),
    [
        ("runs/a", r"`log` is str, .*use scanax.TensorBoard\('runs/a'\)"),
        ("a.csv", r"use scanax.CSV\('a.csv'\)"),
        ([print, 3], r"`log\[1\]` is int 3, which is not a sink.*scanax.CSV\(path\)"),
        ({"tb": print}, r"`log` is dict.*pass a list"),
        (scanax.CSV, r"`log` is type"),
    ],
)
def test_bad_log_argument(log, match):
    with pytest.raises(TypeError, match=r"(?s)^scanax\.fit: .*" + match):
        Sinks(log)


def test_bad_sink_in_log_object_names_log():
    """scanax.Log(sink) names itself and its one sink, not fit's log=."""
    with pytest.raises(TypeError) as err:
        scanax.Log(3)
    assert str(err.value) == (
        "scanax.Log: `sink` is int 3, which is not a sink (a callable sink(step, "
        "metrics)).\nFix: pass one sink: scanax.TensorBoard(logdir), "
        "scanax.CSV(path), or a function sink(step, metrics) -> None."
    )
    with pytest.raises(TypeError, match=r"^scanax\.Log: `sink` is str.*scanax.CSV"):
        scanax.Log("a.csv")
    with pytest.raises(TypeError, match=r"^scanax\.Log: `sink` is NoneType, which"):
        scanax.Log(None)


def test_bad_paths():
    with pytest.raises(TypeError, match=r"scanax.CSV: `path` must be a path"):
        scanax.CSV(3)
    with pytest.raises(TypeError, match=r"scanax.TensorBoard: `logdir` must be a path"):
        scanax.TensorBoard(None)


def test_write_checks_rows_and_order():
    sinks = Sinks(print)
    with pytest.raises(
        ValueError, match=r"2 log steps but window values 'loss' have shape \(3,\)"
    ):
        sinks.write(np.array([1, 2]), {"loss": np.ones(3)})
    sinks.resume(10)
    with pytest.raises(ValueError, match=r"must increase strictly after step 10"):
        sinks.write(np.array([10, 11]), {"loss": np.ones(2)})


def test_missing_tensorboardx(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(
        ImportError,
        match=r"(?s)scanax.TensorBoard: writing TensorBoard files needs the `tensorboardX` "
        r"package.*pip install scanax\[tensorboard\]",
    ):
        scanax.TensorBoard("runs")


# ------------------------------------------------------------- window reduction


def ref_windows(steps, values, log_every):
    """A plain Python loop: close at multiples of log_every and at the end."""
    out_steps, out, acc = [], [], []
    for i, (s, v) in enumerate(zip(steps, values)):
        acc.append(v)
        if s % log_every == 0 or i == len(steps) - 1:
            out_steps.append(s)
            out.append(sum(acc) / len(acc))
            acc = []
    return out_steps, out


@pytest.mark.parametrize(
    ("first", "n", "every"), [(1, 25, 10), (1, 20, 10), (7, 9, 4), (3, 1, 5), (1, 6, 1)]
)
def test_window_reduce_is_a_windowed_mean(first, n, every):
    steps = np.arange(first, first + n)
    values = np.random.default_rng(n).normal(size=n)
    got_steps, got = window_reduce(steps, {"x": values}, every)
    ref_steps, ref = ref_windows(steps.tolist(), values.tolist(), every)
    assert got_steps.tolist() == ref_steps
    np.testing.assert_allclose(got["x"], ref, rtol=1e-6)


def test_window_means_written_to_csv_match_history(tmp_path):
    """What fit will do: history per step, window means to the CSV."""
    steps = np.arange(1, 26)
    loss = (1 / steps).astype(np.float32)
    sinks = Sinks(scanax.CSV(tmp_path / "m.csv"))
    sinks.resume(0)
    sinks.write(*window_reduce(steps, {"loss": loss}, 10))
    sinks.close()
    rows = read_csv(tmp_path / "m.csv")
    assert [int(r["step"]) for r in rows] == [10, 20, 25]
    ref = [
        float(np.mean(loss[a:b], dtype=np.float64))
        for a, b in [(0, 10), (10, 20), (20, 25)]
    ]
    assert [float(r["loss"]) for r in rows] == pytest.approx(ref, rel=1e-6)
    assert all(math.isfinite(float(r["loss"])) for r in rows)


def test_a_sink_that_stops_taking_writes_keeps_the_result_and_exits(tmp_path):
    """A CSV file whose disk fills mid-run (issue 38): training goes on to the
    end, the sink's error comes after with the result kept
    (``SinkError.result``), the checkpoints are complete, the process exits 0
    (run in a subprocess with a timeout)."""
    import _save_job as save_job

    proc = save_job.run("fault-log", tmp_path, 16, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RAISED SinkError: scanax.fit: a log sink raised" in proc.stdout
    assert "raised OSError at step" in proc.stdout
    assert "[Errno 28] No space left on device" in proc.stdout
    assert "RESULT STEPS 16" in proc.stdout and "END" in proc.stdout
    assert save_job.saved_steps(save_job.dirs(tmp_path)[0]) == ([12, 14, 16], [])
