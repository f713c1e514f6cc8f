"""scanax.fit checkpoints: exact resume after kill -9, completeness, fallback."""

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scanax

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")

import _fit_kill_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
from fit_helpers import BS, TX, X, Y, nnx_loss  # noqa: E402
from helpers import JOBS_RUN_ELSEWHERE, leaves_equal, xla_flags  # noqa: E402

# A job's result (run on the CPU where a TPU admits one process: helpers) against
# this process's: bit for bit on one backend; a TPU's float32 arithmetic is not
# the CPU's (5e-6 relative measured on a TPU v5e).
JOB_RTOL = 1e-4 if JOBS_RUN_ELSEWHERE else 1e-6

HERE = pathlib.Path(__file__).parent


class Net(nnx.Module):
    """Dropout (an RNG stream) and BatchNorm (running statistics) in the state."""

    def __init__(self, rngs, dropout=True):
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(
            0.3, deterministic=not dropout, rngs=rngs if dropout else None
        )
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def make(dropout=True):
    model = Net(nnx.Rngs(0, dropout=1), dropout)
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def fit(model, opt, steps, **kwargs):
    # key=None: step t's batch depends on t % 6 only, so a run of 18 steps from a
    # copied state sees the same batches as steps 18..35 (used by the RNG test).
    return scanax.fit(
        model,
        opt,
        nnx_loss,
        (X, Y),
        steps=steps,
        batch_size=BS,
        steps_per_call=6,
        progress=False,
        **kwargs,
    )


def test_resume_is_exact_and_needs_the_rng_state(tmp_path):
    model, opt = make()
    first = fit(model, opt, 18, checkpoint_dir=tmp_path, checkpoint_every=6)
    assert first.steps == 18
    # The saved state is complete: every array of nnx.split((model, optimizer)),
    # including the dropout RNG key/count and BatchNorm statistics.
    resumed_model, resumed_opt = make()
    resumed = fit(
        resumed_model, resumed_opt, 36, checkpoint_dir=tmp_path, checkpoint_every=6
    )
    straight_model, straight_opt = make()
    straight = fit(straight_model, straight_opt, 36)
    assert resumed.steps == 36
    np.testing.assert_array_equal(resumed.history["loss"], straight.history["loss"])
    leaves_equal(nnx.state(resumed_model), nnx.state(straight_model))
    leaves_equal(nnx.state(resumed_opt), nnx.state(straight_opt))
    assert int(resumed_model.drop.rngs.count[...]) == 36
    # Control: the same resume with everything but the RNG state restored (what
    # saving only nnx.Param + optimizer state gives) does not reproduce the run.
    partial_model, partial_opt = make()
    nnx.update(partial_model, nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    nnx.update(partial_opt, nnx.state(opt))
    fit(partial_model, partial_opt, 18)
    assert not np.array_equal(
        partial_model.out.kernel[...], straight_model.out.kernel[...]
    )


def test_a_resume_given_another_key_is_said_and_goes_on_from_the_saved_one(tmp_path):
    """A second experiment pointed at the first one's directory (a new seed)
    resumed it silently (review 2026-12-07): warned, naming the step. The run
    goes on from the saved key, exactly as the first run's own resume."""
    k0, k1 = jax.random.key(0), jax.random.key(1)
    kw = dict(checkpoint_dir=tmp_path, checkpoint_every=6)
    fit(*make(), 12, key=k0, **kw)
    other_model, other_opt = make()
    with pytest.warns(
        RuntimeWarning, match=r"resumed from step 12 in .*a run given another key="
    ):
        fit(other_model, other_opt, 18, key=k1, **kw)
    straight_model, straight_opt = make()
    fit(straight_model, straight_opt, 18, key=k0)
    leaves_equal(nnx.state(other_model), nnx.state(straight_model))


def test_checkpoint_without_rng_state_is_refused(tmp_path):
    # A checkpoint that lacks the dropout RNG stream (here: written by a model with
    # deterministic dropout) cannot silently resume a model that has one.
    model, opt = make(dropout=False)
    fit(model, opt, 6, checkpoint_dir=tmp_path, checkpoint_every=6)
    model, opt = make()
    with pytest.raises(
        ValueError,
        match=r"(?s)does not fit this training state: it holds other arrays.\n"
        r"  only in the checkpoint  none\n"
        r"  only in this run        model\['drop'\]\['rngs'\]\['count'\], "
        r"model\['drop'\]\['rngs'\]\['key'\]\n",
    ):
        fit(model, opt, 12, checkpoint_dir=tmp_path, checkpoint_every=6)


@pytest.mark.parametrize("added", [True, False])
def test_a_resume_with_other_callbacks_names_them(tmp_path, added):
    """A checkpoint written with an ``Ema`` resumed without it, or one
    written without it resumed with it: refused naming the callback and the
    fix (it said to pass the model that wrote it; review); nothing trained."""
    ema = [scanax.Ema(0.9)]
    model, opt = make(dropout=False)
    fit(model, opt, 6, checkpoint_dir=tmp_path, callbacks=[] if added else ema)
    model, opt = make(dropout=False)
    before = jax.tree.map(np.asarray, nnx.state(model))
    which = "this run adds scanax.Ema" if added else "written with scanax.Ema"
    with pytest.raises(
        ValueError,
        match=rf"(?s)holds other arrays.*The run's callbacks differ from those that "
        rf"wrote it \({which}\).\nFix: resume with the callbacks the checkpoint "
        "was written with",
    ):
        fit(model, opt, 12, checkpoint_dir=tmp_path, callbacks=ema if added else [])
    leaves_equal(nnx.state(model), before)


def test_corrupt_newest_checkpoint_falls_back(tmp_path):
    model, opt = make()
    fit(model, opt, 18, checkpoint_dir=tmp_path, checkpoint_every=6)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [
        6,
        12,
        18,
    ]
    for f in (tmp_path / "18" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    # A partial save left by a killed process is ignored too.
    (tmp_path / "24.orbax-checkpoint-tmp-1").mkdir()
    model, opt = make()
    with pytest.warns(
        RuntimeWarning,
        match=r"scanax.fit: checkpoint 18 in .* could "
        r"not be read .*falling back to an older one",
    ):
        result = fit(model, opt, 18, checkpoint_dir=tmp_path, checkpoint_every=6)
    straight_model, straight_opt = make()
    fit(straight_model, straight_opt, 18)
    assert result.steps == 18
    leaves_equal(nnx.state(model), nnx.state(straight_model))
    leaves_equal(nnx.state(opt), nnx.state(straight_opt))


def test_incompatible_checkpoint_is_refused(tmp_path):
    model, opt = make()
    fit(model, opt, 6, checkpoint_dir=tmp_path, checkpoint_every=6)
    model, opt = make()
    model.out = nnx.Linear(8, 2, rngs=nnx.Rngs(5))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    with pytest.raises(
        ValueError,
        match=r"(?s)scanax.fit: the checkpoint at step 6 in .* does not fit this "
        r"training state; first mismatching leaf model\['out'\]\['bias'\]:\n"
        r"  checkpoint  float32\[1\]\n"
        r"  expected    float32\[2\].*Fix:",
    ):
        scanax.fit(
            model,
            opt,
            lambda m, b: jnp.mean(m(b[0])),
            (X, Y),
            steps=12,
            batch_size=BS,
            progress=False,
            checkpoint_dir=tmp_path,
            checkpoint_every=6,
        )


def test_strong_types_the_carry_and_passes_strong_arrays_as_they_are():
    """``strong``: the loop's carry types (weak types dropped, host values in
    JAX's default dtypes, JAX arrays, values kept); a JAX array already
    strong, a PRNG key array too, is the same object."""
    from scanax._fit import checkpoint as _checkpoint

    w, key = jnp.zeros(3), jax.random.key(0)
    host = [jnp.asarray(1.0), 2, np.float64(0.5), np.arange(3), True]
    out = _checkpoint.strong([w, key, *host])
    assert out[0] is w and out[1] is key
    want = [jnp.float32, jnp.int32, jnp.float32, jnp.int32, jnp.bool_]
    for x, dtype, given in zip(out[2:], want, host, strict=True):
        assert isinstance(x, jax.Array) and x.dtype == dtype and not x.weak_type
        np.testing.assert_array_equal(x, np.asarray(given))


def test_iterable_resume_and_weak_types(tmp_path):
    # A weak-typed leaf (jnp.asarray(1.0)): orbax restores it strong; fit never
    # carries weak types, so the resumed carry has the uninterrupted run's types.
    params = {"w": jnp.zeros((3, 1)), "s": jnp.asarray(1.0)}
    assert params["s"].weak_type

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((p["s"] * (x @ p["w"]) - y) ** 2)

    batches = [(X[i : i + BS], Y[i : i + BS]) for i in range(0, 48, BS)] * 2
    tx = optax.sgd(0.1)
    kw = dict(steps_per_call=3, progress=False)
    scanax.fit(
        params,
        tx,
        loss_fn,
        batches[:6],
        steps=12,
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
        **kw,
    )
    resumed = scanax.fit(
        params,
        tx,
        loss_fn,
        batches,
        steps=12,
        checkpoint_dir=tmp_path,
        checkpoint_every=3,
        **kw,
    )
    straight = scanax.fit(params, tx, loss_fn, batches, steps=12, **kw)
    assert resumed.steps == 12
    np.testing.assert_array_equal(resumed.history["loss"], straight.history["loss"])
    leaves_equal(resumed.model, straight.model)


class Counted(nnx.Module):
    """A NumPy float64 parameter and a Python-int Variable: state that is not yet
    in the types the loop carries (float32, int32 without x64)."""

    def __init__(self):
        self.w = nnx.Param(np.linspace(-1.0, 1.0, 3).reshape(3, 1))
        self.calls = nnx.Variable(0)

    def __call__(self, x):
        self.calls[...] += 1
        return x @ self.w[...]


def test_resume_of_numpy_float64_and_python_int_state(tmp_path):
    def loss(m, b):
        return jnp.mean((m(b[0]) - b[1]) ** 2)

    def train(steps, directory=None):
        model = Counted()
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
        kw = dict(steps=steps, batch_size=BS, steps_per_call=3, progress=False)
        if directory is not None:
            kw.update(checkpoint_dir=directory, checkpoint_every=3)
        return scanax.fit(model, opt, loss, (X, Y), **kw)

    train(6, tmp_path)
    resumed = train(12, tmp_path)  # continues from step 6
    straight = train(12)
    assert resumed.steps == 12 and int(resumed.model.calls[...]) == 12
    np.testing.assert_array_equal(resumed.history["loss"], straight.history["loss"])
    leaves_equal(nnx.state(resumed.model), nnx.state(straight.model))


def test_resume_with_other_metrics_keeps_history_aligned(tmp_path):
    params, tx = {"w": jnp.zeros((3, 1))}, optax.sgd(0.1)

    def base(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    def train(steps, name):
        return scanax.fit(
            params,
            tx,
            lambda p, b: (base(p, b), {name: base(p, b) * 2}),
            (X, Y),
            steps=steps,
            batch_size=BS,
            progress=False,
            checkpoint_dir=tmp_path,
        )

    train(6, "a")
    with pytest.warns(
        RuntimeWarning,
        match=r"other metrics than the first 6 steps.*"
        r"new b; no longer returned: a",
    ):
        result = train(10, "b")
    h = result.history
    assert {k: v.shape for k, v in h.items()} == {
        "step": (10,),
        "loss": (10,),
        "a": (10,),
        "b": (10,),
    }
    np.testing.assert_array_equal(h["step"], np.arange(1, 11))
    np.testing.assert_allclose(h["a"][:6], 2 * h["loss"][:6], rtol=1e-6)
    np.testing.assert_allclose(h["b"][6:], 2 * h["loss"][6:], rtol=1e-6)
    assert np.isnan(h["a"][6:]).all() and np.isnan(h["b"][:6]).all()


def _run_job(directory, out, kill_after=None, during_save=False):
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(4)
    env["JAX_COMPILATION_CACHE_DIR"] = str(out.parent / "jax-cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_fit_kill_job.py"),
            str(directory or ""),
            str(out),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if kill_after is None:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
        return True
    before = _steps(directory)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        names = os.listdir(directory) if directory.exists() else []
        if during_save and any("tmp" in n for n in names):
            break  # a save is being written right now
        if during_save and _steps(directory) >= before + 2 * job.EVERY:
            break  # no save caught in the act: kill now anyway
        if not during_save and _steps(directory) > before:
            time.sleep(kill_after)
            break
        time.sleep(0.005)
    finished = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return not finished


def _steps(directory):
    if not directory.exists():
        return 0
    return max([int(n) for n in os.listdir(directory) if n.isdigit()], default=0)


def test_kill_9_at_random_moments_then_resume_is_exact(tmp_path):
    directory, out = tmp_path / "ckpt", tmp_path / "digest"
    rng = random.Random(0)
    killed = [
        _run_job(directory, out, kill_after=0.0, during_save=True),
        # (within ~2 saves: an idle 2-core machine runs the job's steps 8..120
        # in 0.7 s, so a longer wait let the third job finish)
        _run_job(directory, out, kill_after=rng.uniform(0.0, 0.1)),
        _run_job(directory, out, kill_after=rng.uniform(0.0, 0.1)),
    ]
    assert any(killed)  # at least one process really died mid-run
    assert 0 < _steps(directory) < job.STEPS
    _run_job(directory, out)
    if JOBS_RUN_ELSEWHERE:  # (the same run, uninterrupted, as a job too)
        ref = tmp_path / "whole"
        _run_job(None, ref)
        assert out.read_text() == ref.read_text()
    else:
        assert out.read_text() == job.digest(job.job(None))


def test_checkpoint_of_another_format_is_refused(tmp_path, monkeypatch):
    model, opt = make()
    fit(model, opt, 6, checkpoint_dir=tmp_path, checkpoint_every=6)
    from scanax._fit import checkpoint as _checkpoint

    monkeypatch.setattr(_checkpoint, "_FORMAT", _checkpoint._FORMAT + 1)
    model, opt = make()
    with pytest.raises(
        ValueError,
        match=rf"(?s)scanax.fit: the checkpoint at step 6 in .* has format "
        rf"{_checkpoint._FORMAT - 1}, expected {_checkpoint._FORMAT}\.\nFix:",
    ):
        fit(model, opt, 12, checkpoint_dir=tmp_path, checkpoint_every=6)


# ------------------------------------- issue 38: saves finished, failures named


def _clean(proc, expect):
    """The job exited 0, printed ``expect``, no orbax save overlapped another
    and nothing was raised on the way out."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expect in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "OVERLAP" not in proc.stdout  # (one orbax save at a time)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _resumes_at(tmp_path, steps, done):
    """``fit`` with the job's arguments finds checkpoint ``done`` complete:
    it says the run is already there, and holds that state."""
    import _save_job as save_job

    ckpt, best, _ = save_job.dirs(tmp_path)
    with pytest.warns(RuntimeWarning, match=f"already holds step {done}"):
        out = save_job.fit(ckpt, best, steps)
    assert out.steps == done
    ref = save_job.fit(None, None, steps)
    np.testing.assert_allclose(out.model["w"], ref.model["w"], rtol=JOB_RTOL)
    return out


def test_a_script_ending_after_fit_leaves_every_save_complete(tmp_path):
    """Checkpoints and best saves with slowed writes (a loaded machine):
    before, a best save started while a checkpoint's asynchronous save was
    still writing (orbax counts operations process-wide: such runs timed out
    after 300 s or exited with status 1). Now one save at a time, and the
    process exits 0 with the newest checkpoint and the best complete, after a
    fresh start and after kill -9 and the same call again."""
    import _save_job as save_job

    ckpt, best, _ = save_job.dirs(tmp_path)
    _clean(save_job.run("slow", tmp_path, 12), "RETURNED")
    assert save_job.saved_steps(ckpt) == ([8, 10, 12], [])
    _resumes_at(tmp_path, 12, 12)
    loaded, _ = scanax.load_best(best, save_job.P0, save_job.TX)
    assert loaded["w"].shape == (3, 1)
    proc = save_job.run("slow", tmp_path, 40, popen=True)
    deadline = time.time() + 120
    while max(save_job.saved_steps(ckpt)[0]) < 20 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    _clean(save_job.run("slow", tmp_path, 40), "RETURNED")
    done, partial = save_job.saved_steps(ckpt)
    assert done[-1] == 40 and not partial
    _resumes_at(tmp_path, 40, 40)


def test_an_unwritable_checkpoint_dir_raises_and_the_process_exits(tmp_path):
    """A checkpoint directory that stops taking new folders (a full disk, a
    permission change): fit raises a PermissionError naming the step and the
    newest complete checkpoint, and the process exits (before: orbax's threads
    waited for a directory that was never made, for 20 minutes); the same
    call resumes from that checkpoint once the directory is writable."""
    import _save_job as save_job

    proc = save_job.run("fault-ckpt", tmp_path, 16, timeout=120)
    _clean(proc, "END")
    assert (
        "RAISED PermissionError: scanax.fit: saving checkpoint 6 in "
        f"{save_job.dirs(tmp_path)[0]} failed: PermissionError: [Errno 13]"
    ) in proc.stdout
    assert "the newest, step 4, is where the same call resumes" in proc.stdout
    assert save_job.saved_steps(save_job.dirs(tmp_path)[0]) == ([2, 4], [])
    ckpt, best, _ = save_job.dirs(tmp_path)
    out = save_job.fit(ckpt, best, 16)  # (restored at 4: steps 5... trained)
    ref = save_job.fit(None, None, 16)
    np.testing.assert_array_equal(out.history["step"], np.arange(1, 17))
    np.testing.assert_allclose(out.history["loss"], ref.history["loss"], rtol=JOB_RTOL)
    np.testing.assert_allclose(out.model["w"], ref.model["w"], rtol=JOB_RTOL)


def test_a_home_relative_directory_is_expanded_and_a_url_refused(tmp_path, monkeypatch):
    """``"~/run"`` is the user's home (before: a directory named ``~`` in the
    working directory); a URL (``gs://...``) is refused when the object is
    made (before: mangled into a local ``gs:`` directory, then orbax's bare
    KeyError at the first save, after training had started)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    model, opt = make()
    fit(model, opt, 6, callbacks=[scanax.Checkpoint("~/run", every=6)])
    assert (tmp_path / "run" / "6").is_dir() and not (tmp_path / "~").exists()
    again, again_opt = make()
    with pytest.warns(RuntimeWarning, match="already holds step 6"):
        fit(again, again_opt, 6, checkpoint_dir="~/run")
    leaves_equal(nnx.state(again), nnx.state(model))

    url = r"'gs://bucket/run' is a URL; scanax writes checkpoints to local"
    with pytest.raises(ValueError, match="^scanax.Checkpoint: directory " + url):
        scanax.Checkpoint("gs://bucket/run", every=6)
    with pytest.raises(ValueError, match="^scanax.EarlyStop: best_dir " + url):
        scanax.EarlyStop("val_loss", patience=2, best_dir="gs://bucket/run")
    with pytest.raises(ValueError, match="^scanax.load_best: directory " + url):
        scanax.load_best("gs://bucket/run", *make())
    fresh, fresh_opt = make()
    before = nnx.state(nnx.clone(fresh))
    with pytest.raises(ValueError, match=url):
        fit(fresh, fresh_opt, 6, checkpoint_dir="gs://bucket/run")
    leaves_equal(nnx.state(fresh), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
