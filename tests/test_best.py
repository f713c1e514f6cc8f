"""``fit(best_dir=)`` and ``scanax.load_best``: the best model by a monitored
metric kept on disk, the newest best only, atomically; loaded back equal to
the best state ``stop=`` restores."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import _best_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scanax

HERE = Path(__file__).resolve().parent
XV = job.X[:16] + 0.5


def _fit(best_dir, steps=40, tx=None, p0=None, **kw):
    kw = {"stop": scanax.EarlyStop("val_loss", patience=None), **kw}
    return scanax.fit(
        job.P0 if p0 is None else p0, tx or optax.adam(0.3), job.loss_fn,
        (job.X, job.Y), steps=steps, batch_size=16, eval_data=(XV, job.Y[:16]),
        eval_every=4, progress=False, best_dir=best_dir, **kw,
    )  # fmt: skip


def test_the_saved_best_equals_the_restored_best(tmp_path):
    out = _fit(tmp_path)
    loaded, opt_state = scanax.load_best(tmp_path, job.P0, optax.adam(0.3))
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


def test_kill_9_leaves_a_complete_best(tmp_path):
    """Killed at random moments while it saves a new best at every check:
    load_best always finds a complete one."""
    rng = random.Random(0)
    directory = tmp_path / "best"
    cmd = [sys.executable, str(HERE / "_best_job.py"), str(directory)]
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
        loaded, _ = scanax.load_best(directory, job.P0, optax.sgd(0.01))
        assert np.isfinite(np.asarray(loaded["w"])).all()
    assert jnp.shape(loaded["w"]) == (3, 1)
