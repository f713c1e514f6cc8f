"""Resumable iterables: an iterator with ``get_state``/``set_state`` (Grain's)
or ``state_dict``/``load_state_dict`` has its position saved in fit's
checkpoints at the step reached, and is set to it on resume: a resumed run
sees exactly the batches of an uninterrupted one, even from a new iterator
that would draw others."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import _iter_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import JOBS_RUN_ELSEWHERE

import scanax

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def whole():
    return job.job(None, seed=0)


def test_a_new_iterator_is_set_to_the_saved_position(whole, tmp_path):
    job.job(tmp_path, seed=0, steps=20)  # saves at 8, 16 and 20
    resumed = job.job(tmp_path, seed=99)  # another seed: other batches
    np.testing.assert_array_equal(resumed.history["loss"], whole.history["loss"])
    np.testing.assert_array_equal(resumed.model["w"], whole.model["w"])
    # (without the saved state, skipping forward would have drawn seed 99's)
    other = job.job(None, seed=99)
    assert not np.array_equal(other.history["loss"], whole.history["loss"])


class Poisoned(job.Stream):
    """``Stream(seed)`` with a NaN target in batch ``at``."""

    def __init__(self, seed, at):
        super().__init__(seed)
        self.at = at

    def __next__(self):
        x, y = super().__next__()
        return (x, np.full_like(y, np.nan)) if self.pos - 1 == self.at else (x, y)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_non_finite_stop_inside_a_call_saves_where_the_data_was(
    whole, tmp_path, accumulate
):
    """A NaN stop mid-call (step 12 of a call of 8..16) keeps the last good step;
    its checkpoint holds the state before that call's batches and how many of
    them were used, so a run restarted on a new iterator (the bad batch fixed)
    sees the uninterrupted run's batches (before: no state was saved there, and
    the new iterator's own batches were drawn and dropped)."""

    def run(stream, steps=32):
        return scanax.fit(
            {"w": jnp.zeros((3, 1))}, optax.adam(0.05), job.loss_fn, stream,
            steps=steps, accumulate=accumulate, progress=False,
            callbacks=[scanax.Checkpoint(tmp_path, every=8)],
        )  # fmt: skip

    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        stopped = run(Poisoned(0, at=12 * accumulate))
    assert stopped.steps == 12
    resumed = run(job.Stream(99))
    ref = scanax.fit(
        {"w": jnp.zeros((3, 1))}, optax.adam(0.05), job.loss_fn, job.Stream(0),
        steps=32, accumulate=accumulate, progress=False,
    )  # fmt: skip
    np.testing.assert_array_equal(resumed.history["loss"], ref.history["loss"])
    np.testing.assert_array_equal(resumed.model["w"], ref.model["w"])


def test_kill_9_then_resume_is_exact(whole, tmp_path):
    directory, out = tmp_path / "ckpt", tmp_path / "digest"

    def cmd(seed):
        return [sys.executable, str(HERE / "_iter_job.py"), str(directory), str(out),
                str(seed)]  # fmt: skip

    proc = subprocess.Popen(cmd(0), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if directory.exists() and any(n.isdigit() for n in os.listdir(directory)):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    assert steps and max(steps) < job.STEPS
    done = subprocess.run(cmd(7), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    if JOBS_RUN_ELSEWHERE:  # (the same run, uninterrupted, as a job too)
        ref = tmp_path / "whole"
        subprocess.run(cmd(0)[:2] + ["", str(ref), "0"], check=True, timeout=300)
        assert out.read_text() == ref.read_text()
    else:
        assert out.read_text() == job.digest(whole)


def test_grain_iterators(tmp_path):
    grain = pytest.importorskip("grain")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)

    def loader(seed):
        ds = grain.MapDataset.range(64).shuffle(seed=seed).repeat(None)
        ds = ds.map(lambda i: (x[i], x[i].sum(keepdims=True))).batch(8)
        return iter(ds.to_iter_dataset())

    def run(it, steps, directory=None):
        return scanax.fit(
            {"w": jnp.zeros((3, 1))}, optax.adam(0.05), job.loss_fn, it,
            steps=steps, steps_per_call=4, progress=False, checkpoint_dir=directory,
            checkpoint_every=None if directory is None else 8,
        )  # fmt: skip

    whole = run(loader(0), 40)
    run(loader(0), 20, tmp_path)
    # A new iterator of the same pipeline (Grain's state is its position): set
    # to the saved position, not drawn forward.
    fresh = loader(0)
    drawn = []
    fresh_next = type(fresh).__next__

    class Counted(type(fresh)):
        def __next__(self):
            drawn.append(1)
            return fresh_next(self)

    fresh.__class__ = Counted
    resumed = run(fresh, 40, tmp_path)
    np.testing.assert_array_equal(resumed.history["loss"], whole.history["loss"])
    assert len(drawn) == 20  # the 20 steps trained, none to skip forward


def test_a_state_a_checkpoint_cannot_hold_is_refused_before_anything(tmp_path):
    class Odd(job.Stream):
        def state_dict(self):
            return {"pos": self.pos, "rng": object()}

    p = {"w": jnp.zeros((3, 1))}
    with pytest.raises(TypeError, match="iterator's state .* a checkpoint cannot"):
        scanax.fit(
            p, optax.sgd(0.1), job.loss_fn, Odd(0), steps=8, steps_per_call=4,
            progress=False, checkpoint_dir=tmp_path / "c", checkpoint_every=4,
        )  # fmt: skip
    assert not (tmp_path / "c").exists()
    # without checkpoints its state is never read
    out = scanax.fit(p, optax.sgd(0.1), job.loss_fn, Odd(0), steps=8, progress=False)
    assert out.steps == 8


class Loader:
    """As PyTorch's StatefulDataLoader: the loader has state_dict /
    load_state_dict, and a loaded state applies to its next iterator."""

    def __init__(self, seed):
        self.seed, self.pos, self.start = seed, 0, 0

    def __iter__(self):
        self.pos = self.start
        stream = job.Stream(self.seed)
        stream.pos = self.start
        while True:
            self.pos += 1
            yield next(stream)

    def state_dict(self):
        return {"seed": self.seed, "pos": self.pos}

    def load_state_dict(self, state):
        self.seed, self.start = state["seed"], state["pos"]


def test_a_loader_whose_state_applies_to_its_next_iterator(whole, tmp_path):
    def run(loader, steps, directory):
        return scanax.fit(
            {"w": jnp.zeros((3, 1))}, optax.adam(0.05), job.loss_fn, loader,
            steps=steps, steps_per_call=4, progress=False, checkpoint_dir=directory,
            checkpoint_every=8,
        )  # fmt: skip

    run(Loader(0), 20, tmp_path)
    resumed = run(Loader(5), job.STEPS, tmp_path)
    np.testing.assert_array_equal(resumed.history["loss"], whole.history["loss"])


class Interrupted(job.Stream):
    """``Stream(seed)`` raising KeyboardInterrupt (once) when batch ``at`` is
    asked for, as Ctrl-C while the next call's batches are read."""

    def __init__(self, seed, at):
        super().__init__(seed)
        self.at = at

    def __next__(self):
        if self.pos == self.at:
            self.at = None
            raise KeyboardInterrupt
        return super().__next__()


def test_ctrl_c_sets_a_resumable_iterator_back_to_the_step_the_model_holds():
    """Ctrl-C at batch 23 of calls of 6 steps: the NNX objects hold step 18 and
    the iterator, which had given batches 18..22 to a read that never
    trained, is set back to batch 18 (before: left at 23, so the same
    iterator given again trained on other batches); the same fit given it
    again ends as an uninterrupted run does."""
    nnx = pytest.importorskip("flax.nnx")

    def pair():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)

    def loss(model, batch):
        return jnp.mean((model(batch[0]) - batch[1]) ** 2)

    def run(model, opt, stream, steps):
        return scanax.fit(model, opt, loss, stream, steps=steps, steps_per_call=6,
                          progress=False)  # fmt: skip

    model, opt = pair()
    stream = Interrupted(0, at=23)
    with pytest.raises(KeyboardInterrupt) as caught:
        run(model, opt, stream, 40)
    assert int(opt.step[...]) == 18 and stream.pos == 18
    if hasattr(caught.value, "__notes__"):
        assert "was set back to step 18" in caught.value.__notes__[0]
    run(model, opt, stream, 22)
    ref, ref_opt = pair()
    run(ref, ref_opt, job.Stream(0), 40)
    np.testing.assert_array_equal(model.kernel[...], ref.kernel[...])
    np.testing.assert_array_equal(opt.opt_state[0].mu["kernel"][...],
                                  ref_opt.opt_state[0].mu["kernel"][...])  # fmt: skip
