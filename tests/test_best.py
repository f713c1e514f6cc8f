"""``fit(best_dir=)`` and ``scanax.load_best``: the best model by a monitored
metric kept on disk, the newest best only, atomically, saved on a thread of
its own; loaded back equal to the best state ``stop=`` restores (for a
population: each member's, by its own monitored value)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import _best_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import JOBS_RUN_ELSEWHERE  # noqa: E402

import scanax
from scanax._fit import checkpoint as _checkpoint
from scanax._fit.callbacks import best as _best
from scanax._fit.models import adapt as _models

# A job's result (run on the CPU where a TPU admits one process: helpers) against
# this process's: bit for bit on one backend; a TPU's float32 arithmetic is not
# the CPU's (5e-6 relative measured on a TPU v5e).
JOB_RTOL = 1e-4 if JOBS_RUN_ELSEWHERE else 1e-6

HERE = Path(__file__).resolve().parent
XV = job.X[:16] + 0.5


def _fit(best_dir, steps=40, tx=None, p0=None, **kw):
    kw = {
        "stop": scanax.EarlyStop("val_loss", patience=None),
        "eval_data": (XV, job.Y[:16]),
        **kw,
    }
    return scanax.fit(
        job.P0 if p0 is None else p0, tx or optax.adam(0.3), job.loss_fn,
        (job.X, job.Y), steps=steps, batch_size=16, eval_every=4,
        progress=False, best_dir=best_dir, **kw,
    )  # fmt: skip


def test_the_saved_best_equals_the_restored_best(tmp_path):
    out = _fit(tmp_path)
    loaded, _ = scanax.load_best(tmp_path, job.P0, optax.adam(0.3))
    np.testing.assert_array_equal(loaded["w"], out.model["w"])  # restore_best
    i = int(np.argmin(out.history["val_loss"]))
    assert out.best_step == out.history["val_step"][i]
    np.testing.assert_allclose(
        job.loss_fn(loaded, (XV, job.Y[:16])), out.history["val_loss"][i], rtol=1e-6
    )
    assert len([n for n in os.listdir(tmp_path) if n.isdigit()]) == 1


def test_a_new_run_in_the_same_directory_replaces_the_best(tmp_path):
    """Run 2 (another optimizer, other bests) overwrites run 1's best, as
    Keras's ModelCheckpoint does."""
    _fit(tmp_path, steps=80)
    second = _fit(tmp_path, steps=16, tx=optax.sgd(0.01))
    loaded, _ = scanax.load_best(tmp_path, job.P0, optax.sgd(0.01))
    np.testing.assert_array_equal(loaded["w"], second.model["w"])


def test_with_ema_eval_the_average_is_saved(tmp_path):
    out = _fit(tmp_path, ema=0.8, ema_eval=True)
    loaded, _ = scanax.load_best(tmp_path, job.P0, optax.adam(0.3))
    np.testing.assert_array_equal(loaded["w"], out.ema["w"])  # at best_step


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="best_dir and checkpoint_dir are the same"):
        _fit(tmp_path, checkpoint_dir=tmp_path)
    with pytest.raises(TypeError, match="none is given"):
        _fit(tmp_path / "b", stop=None)
    with pytest.raises(ValueError, match="unknown|monitor"):
        _fit(tmp_path / "c", stop=scanax.EarlyStop("val_acc", patience=None))
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    with pytest.raises(FileNotFoundError, match="no best state saved"):
        scanax.load_best(tmp_path / "none", job.P0, optax.adam(0.3))


def test_load_best_messages_name_it_and_the_best_step(tmp_path):
    """load_best's refusals start with its own name and give the best state's
    training step (they said "scanax.fit: the checkpoint at step 1", the
    store's save count); a Checkpoint directory is named as one (it was "holds
    other arrays ... stop.rule.best")."""
    out = _fit(tmp_path / "best")
    with pytest.raises(
        ValueError,
        match=rf"^scanax.load_best: the best state \(step {out.best_step}\) in .* "
        r"does not fit this training state; first mismatching leaf",
    ):
        scanax.load_best(tmp_path / "best", {"w": job.P0["w"][:1]}, optax.adam(0.3))
    scanax.fit(job.P0, optax.adam(0.3), job.loss_fn, (job.X, job.Y), steps=4,
               batch_size=16, progress=False,
               callbacks=[scanax.Checkpoint(tmp_path / "ck", every=2)])  # fmt: skip
    with pytest.raises(
        ValueError, match=r"holds scanax.Checkpoint's checkpoints, not a best state"
    ):
        scanax.load_best(tmp_path / "ck", job.P0, optax.adam(0.3))


@pytest.mark.parametrize("pop", [False, True])
def test_kill_9_leaves_a_complete_best(tmp_path, pop):
    """Killed at random moments while it saves a new best at every check:
    load_best always finds a complete one (a population's: every member's)."""
    rng = random.Random(0)
    directory = tmp_path / "best"
    cmd = [sys.executable, str(HERE / "_best_job.py"), str(directory)]
    cmd += ["pop"] if pop else []
    for _ in range(3):
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if directory.exists() and any(n.isdigit() for n in os.listdir(directory)):
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        for i in range(len(job.LRS)) if pop else [None]:
            loaded, _ = scanax.load_best(directory, job.P0, optax.sgd(0.01), member=i)
            assert np.isfinite(np.asarray(loaded["w"])).all()
    assert jnp.shape(loaded["w"]) == (3, 1)


def test_without_restore_the_saved_best_is_the_best(tmp_path):
    """restore_best=False: the model ends at its last state, the directory holds
    the best one (the state a restoring run ends with)."""
    last = _fit(
        tmp_path / "a",
        stop=scanax.EarlyStop("val_loss", patience=None, restore_best=False),
    )
    best = _fit(tmp_path / "b")
    loaded, _ = scanax.load_best(tmp_path / "a", job.P0, optax.adam(0.3))
    np.testing.assert_array_equal(loaded["w"], best.model["w"])
    assert last.best_step is None
    assert not np.array_equal(loaded["w"], last.model["w"])


def test_saves_made_inline_equal_threaded_ones(tmp_path, monkeypatch):
    """Where saves cannot run on a thread (a multi-process job: orbax's
    processes save together), they are made where they are offered: the same
    best on disk."""
    threaded = _fit(tmp_path / "a")
    init = _best.BestWriter.__init__

    def inline(self, *args):
        init(self, *args)
        self.threaded = False

    monkeypatch.setattr(_best.BestWriter, "__init__", inline)
    _fit(tmp_path / "b")
    a, _ = scanax.load_best(tmp_path / "a", job.P0, optax.adam(0.3))
    b, _ = scanax.load_best(tmp_path / "b", job.P0, optax.adam(0.3))
    np.testing.assert_array_equal(a["w"], b["w"])
    np.testing.assert_array_equal(a["w"], threaded.model["w"])


def test_a_slow_save_never_holds_training_back(tmp_path, monkeypatch):
    """The first save lasts ten calls: training goes on, the bests found
    meanwhile replace one another (the newest is saved next), and fit returns
    once the last best is on disk: the best state."""
    save, after = _checkpoint.Checkpoints.save, _best.BestSaver.after_call
    calls, steps = [], []

    def counted(self, run, call):
        after(self, run, call)
        calls.append(call.end)

    def slow(self, step, *args):
        deadline = time.monotonic() + 60
        while len(calls) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        save(self, step, *args)
        steps.append(step)

    monkeypatch.setattr(_best.BestSaver, "after_call", counted)
    monkeypatch.setattr(_checkpoint.Checkpoints, "save", slow)
    out = _fit(
        tmp_path, 80, optax.sgd(0.02), steps_per_call=4, eval_data=(job.X, job.Y)
    )
    assert np.all(np.diff(out.history["val_loss"]) < 0)  # a new best at each check
    assert len(calls) == 20 and len(steps) <= 11  # (waiting: 20 saves, 60 s)
    assert steps[-1] == out.best_step == 80
    loaded, _ = scanax.load_best(tmp_path, job.P0, optax.sgd(0.02))
    np.testing.assert_array_equal(loaded["w"], out.model["w"])


def test_a_failed_save_fails_the_fit(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception, match="file"):
        _fit(tmp_path / "file" / "best")


# ---------------------------------------------------------------- populations


def _pop():
    return scanax.population(job.make, 3, key=jr.key(1), lr=job.LRS * 10)


def _fit_pop(best_dir, pop=None, restore=True, **kw):
    stop = scanax.EarlyStop("val_loss", patience=3, restore_best=restore)
    return scanax.fit(
        pop or _pop(), None, job.loss_fn, (job.X, job.Y), steps=60,
        batch_size=16, eval_data=(XV, job.Y[:16]), eval_every=4,
        progress=False, stop=stop, best_dir=best_dir, **kw,
    )  # fmt: skip


def _member_pair(i):
    return job.make(jr.split(jr.key(1), 3)[i], job.LRS[i] * 10)


@pytest.mark.parametrize(
    "kw", [{}, {"restore": False}, {"members_per_call": 2}], ids=str
)
def test_each_members_best_is_saved(tmp_path, kw):
    """Each member's best by its own val_loss (stopping on its own): loaded
    back with member=i equal to the state a restoring run gives member i, and
    to its history's best (hand-tracked). Without restore_best, and trained
    in groups, the same."""
    ref = _fit_pop(tmp_path / "ref")
    out = _fit_pop(tmp_path / "b", **kw)
    vals, vsteps = ref.history["val_loss"], ref.history["val_step"]
    for i in range(3):
        loaded, _ = scanax.load_best(tmp_path / "b", *_member_pair(i), member=i)
        np.testing.assert_array_equal(loaded["w"], ref.model[i]["w"])
        j = int(np.nanargmin(vals[i]))
        assert ref.best_step[i] == vsteps[j]
        np.testing.assert_allclose(
            job.loss_fn(loaded, (XV, job.Y[:16])), vals[i, j], rtol=1e-6
        )
    assert len([n for n in os.listdir(tmp_path / "b") if n.isdigit()]) == 1
    if kw.get("restore") is False:
        assert out.best_step is None


def test_load_best_of_a_population_refusals(tmp_path):
    pop = scanax.population(
        job.make, 3, key=jr.key(1), lr=jnp.array([0.01, 1e30, 0.02])
    )
    with pytest.warns(RuntimeWarning, match="non-finite"):
        _fit_pop(tmp_path, pop)  # member 1 stops at its first step: no best
    pair = _member_pair(0)
    with pytest.raises(TypeError, match="(?s)population of 3 members.*member=i"):
        scanax.load_best(tmp_path, *pair)
    with pytest.raises(IndexError, match=r"member=3 of a population of 3"):
        scanax.load_best(tmp_path, *pair, member=3)
    with pytest.raises(IndexError, match=r"member=-4 of a population of 3"):
        scanax.load_best(tmp_path, *pair, member=np.int64(-4))  # (was a TypeError)
    with pytest.raises(TypeError, match="member= takes an int, got"):
        scanax.load_best(tmp_path, *pair, member=1.0)
    with pytest.raises(FileNotFoundError, match="member 1 has no best state"):
        scanax.load_best(tmp_path, *pair, member=-2)
    scanax.load_best(tmp_path, *pair, member=-1)
    _fit(tmp_path / "one")
    with pytest.raises(TypeError, match="holds one model's best state"):
        scanax.load_best(tmp_path / "one", *pair, member=0)
    out = _fit_pop(tmp_path / "one")  # (a population's best replaces it)
    loaded, _ = scanax.load_best(tmp_path / "one", *pair, member=0)
    np.testing.assert_array_equal(loaded["w"], out.model[0]["w"])
    assert len([n for n in os.listdir(tmp_path / "one") if n.isdigit()]) == 1


def test_a_populations_averages_are_saved_with_ema_eval(tmp_path):
    out = _fit_pop(tmp_path, ema=0.8, ema_eval=True)
    for i in range(3):
        loaded, _ = scanax.load_best(tmp_path, *_member_pair(i), member=i)
        np.testing.assert_array_equal(loaded["w"], out.ema[i]["w"])


def test_saves_pause_after_each_save(tmp_path, monkeypatch):
    """A best offered every 10 ms: after a save of d seconds the next starts
    PAUSE * d later (the newest best then), but flush saves at once."""
    save, spans = _checkpoint.Checkpoints.save, []

    def timed(self, step, *args):
        began = time.monotonic()
        time.sleep(0.05)
        save(self, step, *args)
        spans.append((step, began, time.monotonic()))

    monkeypatch.setattr(_checkpoint.Checkpoints, "save", timed)
    adapter = _models.adapt(job.P0, optax.sgd(0.01))
    state = _checkpoint.strong(jax.tree_util.tree_leaves(adapter.state))
    writer = _best.BestWriter(tmp_path, adapter.names(), None)
    writer.open()
    (i,) = [i for i, x in enumerate(state) if x.shape == (3, 1)]  # (w)
    for step in range(1, 151):
        leaves = [*state[:i], jnp.full((3, 1), float(step)), *state[i + 1 :]]
        rows = _best.Rows(None, leaves, np.asarray(step), np.asarray(0.0))
        writer.offer(None, rows)
        time.sleep(0.01)
    writer.flush()
    writer.close()
    assert 2 <= len(spans) < 40 and spans[-1][0] == 150
    for (_, a, b), (_, c, _) in zip(spans[:-2], spans[1:-1]):
        assert c - b >= _best.PAUSE * (b - a) * 0.99
    loaded, _ = scanax.load_best(tmp_path, job.P0, optax.sgd(0.01))
    np.testing.assert_array_equal(loaded["w"], np.full((3, 1), 150.0))


def test_a_population_split_over_devices(tmp_path):
    """Members on a "members" mesh (one per device): each member's best saved."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (conftest's XLA_FLAGS)")
    pop = scanax.population(job.make, 4, key=jr.key(1), lr=jnp.linspace(0.05, 0.3, 4))
    out = _fit_pop(tmp_path, pop, mesh=jax.make_mesh((4,), ("members",)))
    keys = jr.split(jr.key(1), 4)
    for i in range(4):
        pair = job.make(keys[i], 0.1)
        loaded, _ = scanax.load_best(tmp_path, *pair, member=i)
        np.testing.assert_array_equal(loaded["w"], out.model[i]["w"])


def test_an_unwritable_best_dir_raises_and_the_process_exits(tmp_path):
    """A best_dir that stops taking new folders mid-run: fit raises a
    PermissionError naming the best store, the previous best stays loadable,
    and the process exits 0 (issue 38; run in a subprocess with a timeout)."""
    import _save_job as save_job

    proc = save_job.run("fault-best", tmp_path, 16, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt, best, _ = save_job.dirs(tmp_path)
    assert (
        f"RAISED PermissionError: scanax.fit: saving the best state in {best} "
        "failed: PermissionError: [Errno 13]"
    ) in proc.stdout
    assert "The previous best state stays complete and loadable" in proc.stdout
    assert "END" in proc.stdout and "Traceback" not in proc.stderr
    first = save_job.fit(None, None, 4)  # (the best of the first 4 steps)
    loaded, _ = scanax.load_best(best, save_job.P0, save_job.TX)
    np.testing.assert_allclose(loaded["w"], first.model["w"], rtol=JOB_RTOL)
