"""scanax.fit across the processes of a jax.distributed job, with real processes.

Every job runs ``tests/_mp_job.py`` in 1, 2 or 4 processes on localhost (CPU
collectives: gloo; forced host devices, 4 in all), each process with a timeout, so
that a hang fails. The processes run on CPU on every machine (``CPU_ONLY``): on a
one-GPU machine two processes cannot each own the GPU (NCCL refuses to start), and
what is tested (fit across processes) is the same program on any backend. The one-process job is the reference: the same mesh shape (4
devices) in one process. Compiled programs are shared between the jobs through
JAX's persistent compilation cache.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")

import _mp_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
from helpers import xla_flags  # noqa: E402


def _loopback() -> str | None:
    """Why this machine cannot host a jax.distributed job on localhost, or None:
    some sandboxes (the TPU machines this project was measured on) refuse every
    TCP socket, the loopback's too, and the coordinator needs one."""
    try:
        with socket.socket() as s:
            s.bind(("localhost", 0))
    except OSError as err:
        return f"no TCP socket on localhost here ({err}): jax.distributed cannot start"
    return None


_NO_LOOPBACK = _loopback()
pytestmark = pytest.mark.skipif(_NO_LOOPBACK is not None, reason=str(_NO_LOOPBACK))

HERE = Path(__file__).parent
TIMEOUT = 240  # seconds for one job (a hang fails the test, not the suite)
SCENARIOS = ["differ", "array", "iter", "fsdp", "fsdp_2x2", "population", "ckpt"]
# Against one process ("population": 4 members split over the processes' devices
# by a "members" axis, each process reading every member's history).
COMPARED = ["array", "iter", "fsdp", "fsdp_2x2", "population"]
# Slower runs only when asked for: a 4-process job (4 more JAX processes on the
# machine) and killing every process of a job at once (one is killed by default).
SLOW = os.environ.get("SCANAX_SLOW_TESTS") == "1"
# Two processes against one: the gradient all-reduce sums in another order.
TOL = dict(rtol=1e-6, atol=1e-6)
# The environment of every process a test starts: CPU only (see above).
CPU_ONLY = {"JAX_PLATFORMS": "cpu"}


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Job:
    """One job's processes, started at once, with their output in ``out``."""

    def __init__(self, out, processes, devices, scenarios, cache):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **CPU_ONLY)
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
        port = str(_free_port())
        self.logs = [self.out / f"log.{i}.txt" for i in range(processes)]
        self.procs = []
        for i in range(processes):
            cmd = [sys.executable, str(HERE / "_mp_job.py"), str(i), str(processes)]
            cmd += [port, str(devices), str(self.out), *scenarios]
            with open(self.logs[i], "w") as log:
                self.procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
                )
        self.deadline = time.monotonic() + TIMEOUT

    def log(self, i):
        return self.logs[i].read_text(errors="replace")

    def wait(self, seconds=None):
        """Every process's exit code; all of them killed (and the test failed)
        when one is still running after ``seconds`` (default: the job's time)."""
        deadline = self.deadline if seconds is None else time.monotonic() + seconds
        codes = []
        for i, p in enumerate(self.procs):
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"process {i} hung:\n{self.log(i)[-3000:]}")
        return codes

    def finish(self):
        codes = self.wait()
        for i, code in enumerate(codes):
            assert code == 0, f"process {i} exited {code}:\n{self.log(i)[-3000:]}"

    def kill(self, which=None):
        for i, p in enumerate(self.procs):
            if which is None or i in which:
                p.send_signal(signal.SIGKILL)
        for i, p in enumerate(self.procs):
            if which is None or i in which:
                p.wait()

    def result(self, scenario, process=0):
        return dict(np.load(self.out / f"{scenario}.{process}.npz"))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The jobs of the module, run side by side: 2 processes x 2 devices, 4 x 1,
    and the one-process reference (1 x 4)."""
    root = tmp_path_factory.mktemp("multiprocess")
    cache = root / "jax-cache"
    started = {
        2: Job(root / "two", 2, 2, SCENARIOS, cache),
        1: Job(root / "one", 1, 4, COMPARED, cache),
    }
    if SLOW:
        started[4] = Job(root / "four", 4, 1, ["array", "fsdp"], cache)
    recipe = _start_recipe(root / "docs", cache)
    for j in started.values():
        j.finish()
    started["cache"] = cache
    started["recipe"] = _finish_recipe(recipe, started[2].deadline)
    return started


def _start_recipe(directory, cache):
    """docs/multi_device.md's launch.py and train.py, written out and started:
    ``python launch.py 2 train.py`` with 2 forced devices per process."""
    text = (HERE.parent / "docs" / "multi_device.md").read_text()
    files = dict(re.findall(r'```python title="(\w+\.py)"\n(.*?)\n```', text, re.S))
    assert set(files) == {"launch.py", "train.py"}
    directory.mkdir()
    for name, code in files.items():
        (directory / name).write_text(code + "\n")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), **CPU_ONLY)
    env["XLA_FLAGS"] = xla_flags(2)
    with open(directory / "log.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "2", "train.py"],
            cwd=directory,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,  # the launcher and its processes: one group
        )
    return proc, directory / "log.txt"


def _finish_recipe(recipe, deadline):
    proc, log = recipe
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, log.read_text(errors="replace")


def _state(result):
    return [result[k] for k in sorted(result) if k.startswith("leaf")]


def _same(a, b):
    for k in a:
        if k != "seconds":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("scenario", COMPARED + ["ckpt"])
def test_every_process_holds_the_same_history_and_state(jobs, scenario):
    _same(jobs[2].result(scenario, 0), jobs[2].result(scenario, 1))


@pytest.mark.parametrize("scenario", COMPARED)
def test_two_processes_train_as_one(jobs, scenario):
    """2 processes x 2 devices against 1 process x 4 devices: the same steps."""
    two, one = jobs[2].result(scenario), jobs[1].result(scenario)
    np.testing.assert_array_equal(two["history_step"], np.arange(1, job.STEPS + 1))
    np.testing.assert_allclose(two["history_loss"], one["history_loss"], **TOL)
    for a, b in zip(_state(two), _state(one), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.skipif(not SLOW, reason="set SCANAX_SLOW_TESTS=1")
@pytest.mark.parametrize("scenario", ["array", "fsdp"])
def test_four_processes_train_as_one(jobs, scenario):
    four, one = jobs[4].result(scenario), jobs[1].result(scenario)
    for process in (1, 2, 3):
        _same(jobs[4].result(scenario, process), four)
    np.testing.assert_allclose(four["history_loss"], one["history_loss"], **TOL)
    for a, b in zip(_state(four), _state(one), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_a_member_of_a_population_across_processes(jobs):
    """``result.model[i]`` of a population whose members span the processes:
    member 1 (held by process 0's second device) as an ordinary NNX model, in
    every process, equal to its row of the population's state."""
    for process in (0, 1):
        out = jobs[2].result("population", process)
        np.testing.assert_array_equal(out["member1_kernel"], out["row1_kernel"])
    one = jobs[1].result("population")
    np.testing.assert_allclose(
        two_kernel := out["member1_kernel"], one["row1_kernel"], **TOL
    )
    assert two_kernel.shape == (4, 64)


def test_process_local_rows_are_the_global_dataset(jobs):
    """Each process passing only its rows (a global array; the fsdp job) trains
    as every process passing the whole arrays: the same batches in the same
    order."""
    local, full = jobs[2].result("fsdp"), jobs[2].result("array")
    np.testing.assert_allclose(local["history_loss"], full["history_loss"], **TOL)
    for a, b in zip(_state(local), _state(full), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_fsdp_splits_the_state_and_trains_as_replicated(jobs):
    replicated = jobs[1].result("array")
    runs = [jobs[n].result("fsdp") for n in ([1, 2, 4] if SLOW else [1, 2])]
    for got in runs:
        np.testing.assert_allclose(
            got["history_loss"], replicated["history_loss"], **TOL
        )
        for a, b in zip(_state(got), _state(replicated), strict=True):
            np.testing.assert_allclose(a, b, **TOL)
        # Bytes on one device: 385 parameters (l1: 4x64 + 64, l2: 64 + 1) and
        # Adam's two moments in float32, plus two int32 step counts. Replicated:
        # all of it; fsdp over 4: a quarter, but for l2's bias (1 element).
        assert got["full_bytes"] == replicated["bytes"] == 3 * 385 * 4 + 8
        assert got["bytes"] == 3 * (384 // 4 + 1) * 4 + 8  # 1172: 25.3%
    # 2x2 (data x model), l1's kernel also split over 'model' by its annotation.
    assert jobs[2].result("fsdp_2x2")["bytes"] == 3 * (256 // 4 + 128 // 2 + 1) * 4 + 8


def test_the_docs_recipe_trains_with_two_processes(jobs):
    code, log = jobs["recipe"]
    assert code == 0, log[-3000:]
    lines = re.findall(r"2 processes, 4 devices: loss ([\d.]+) -> ([\d.]+)", log)
    assert len(lines) == 1, log[-3000:]  # printed by process 0 only
    first, last = map(float, lines[0])
    assert last < first


def test_progress_bar_on_process_zero_only(jobs):
    assert "scanax.fit" in jobs[2].log(0)
    assert "scanax.fit" not in jobs[2].log(1)


def test_processes_with_different_arguments_fail_at_start(jobs):
    for process in (0, 1):
        error = str(jobs[2].result("differ", process)["error"])
        assert error.startswith("scanax.fit: the processes of the mesh called fit")
        assert "batch_size  process 0: 16, process 1: 32" in error


def _checkpoints(directory):
    if not directory.exists():
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def _start_and_kill(jobs, out, directory, which):
    """Start the checkpointed job, kill ``which`` processes (None: all) with
    SIGKILL once it saves a new checkpoint; returns the job."""
    before = max(_checkpoints(directory), default=0)
    run = Job(out, 2, 2, [f"ckpt:{directory}"], jobs["cache"])
    while max(_checkpoints(directory), default=0) <= before:
        assert all(p.poll() is None for p in run.procs), run.log(0)[-3000:]
        assert time.monotonic() < run.deadline, "no checkpoint written"
        time.sleep(0.01)
    run.kill(which)
    return run


def test_kill_one_process_then_resume_is_exact(jobs, tmp_path):
    directory = tmp_path / "ckpt"
    # One process dies: the other ends too (jax.distributed's heartbeat), no hang.
    run = _start_and_kill(jobs, tmp_path / "a", directory, which=[1])
    began = time.monotonic()
    code = run.wait(seconds=60)[0]
    assert code != 0 and time.monotonic() - began < 60
    if SLOW:  # a restart of both resumes; all processes die together
        _start_and_kill(jobs, tmp_path / "b", directory, which=None)
    # The last restart finishes: exactly the uninterrupted run.
    run = Job(tmp_path / "c", 2, 2, [f"ckpt:{directory}"], jobs["cache"])
    run.finish()
    straight = jobs[2].result("ckpt")
    for process in (0, 1):
        _same(run.result("ckpt", process), straight)
    # One checkpoint per step (orbax's multi-process save), the newest kept.
    every, steps = job.CKPT_EVERY, job.CKPT_STEPS
    assert _checkpoints(directory) == [steps - 2 * every, steps - every, steps]
