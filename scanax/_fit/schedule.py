"""How many steps each of ``scanax.fit``'s compiled calls runs."""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import time
from typing import Any

import jax

from .. import _backend
from . import plan as _fit_plan, stepwise as _fit_stepwise

# The wall time that the automatic schedule aims each call at (array data: calls
# grow from 8 steps to this, up to the source's compiled length).
_SECONDS_PER_CALL = 0.25


class Schedule:
    """How many steps each call runs: ``steps_per_call`` if given, else sized from
    the speed of the last call to take about ``_SECONDS_PER_CALL`` (8 steps first,
    to time them, when nothing is known yet); calls also end on checkpoint steps
    and on multiples of the progress bar's ``every``."""

    def __init__(
        self, program, length, source, steps_per_call, checkpoint_every, bar_every
    ):
        self.program, self.length = program, length
        self.auto = auto = source.sized_automatically(steps_per_call)
        self.stops = [e for e in (checkpoint_every, bar_every) if e]
        known = program.seconds_per_step
        # ``fits``: the most steps one call may run (``per_call`` rounds it)
        if not auto:
            self.fits = min(length, steps_per_call or length)
        elif known is None:
            self.fits = min(length, 8)
        else:
            self.fits = self._fits(known)
        self.last = None

    @property
    def per_call(self) -> int:
        """The steps of a call fit sizes from a measured speed: ``fits`` in
        whole chunks of the program (``k``), when that fits its buffers; else
        ``fits``."""
        if not self.auto or self.program.seconds_per_step is None:
            return self.fits
        k = self.program.k
        return max(self.fits // k * k, min(k, self.length))

    def want(self, start: int, end: int) -> int:
        left = end - start
        want = min(self.per_call, left)
        if self.auto and want < left:
            if left <= self.fits:
                # The rest fits one call (its buffers, the time a call aims
                # at): one call, its last chunk cut (at most ``k - 1`` steps
                # masked), rather than a call of whole chunks and one more (a
                # TPU v5e measured a call's own cost at milliseconds, the
                # 784-256-10 MLP's step at 8 us).
                want = left
            else:
                # A call fit sized ends on the chunks' grid (off CPU, once the
                # plan is known): a call of whole chunks from a start off the
                # grid (after the 8-step timing call) spanned one more chunk,
                # its steps masked.
                k = self.program.k
                on_grid = (start + want) // k * k - start
                want = on_grid if on_grid > 0 else want
        for every in self.stops:
            want = min(want, every - start % every)
        return want

    @property
    def timing(self) -> bool:
        """Whether the next call must be timed before more are dispatched."""
        return self.auto and self.program.seconds_per_step is None

    def ran(self, steps: int, dispatched: float) -> None:
        """Size the next calls from the time the last one ran: from when it was
        dispatched (after compiling) or the previous one finished, to now."""
        if not self.auto:
            return
        now = time.perf_counter()
        began = max(dispatched, self.last or dispatched)
        per_step = max(now - began, 1e-9) / steps
        self.program.seconds_per_step = per_step
        self.fits = self._fits(per_step)
        self.last = now

    def _fits(self, seconds_per_step: float) -> int:
        """The steps a call of about ``_SECONDS_PER_CALL`` takes, at most the
        call's buffers."""
        return max(1, min(self.length, int(_SECONDS_PER_CALL / seconds_per_step)))


def cuts(setup: Any) -> tuple[int, ...]:
    """The run's ``host_cuts``: its checkpoints' and bar's ``every`` (whether
    the bar's reports are the host's or in-loop), and the length of the calls
    fit does not size (as ``Schedule`` sizes them: ``steps_per_call``, else
    the source's compiled length)."""
    auto = setup.source.sized_automatically(setup.steps_per_call)
    per_call = None if auto else min(setup.length, setup.steps_per_call or setup.length)
    bar_every = None if setup.spec is None else setup.spec.every
    return _fit_plan.host_cuts(setup.checkpoint_every, bar_every, per_call)


# ---------------------------------------------------------------------------- execution

EXECUTIONS = ("auto", "fused", "stepwise")
# ``execution="auto"`` tries the stepwise programs only when the steps left would
# take at least this long fused, and this many times the fused compile: the
# trial's compile (on another thread) and its one call must be worth it.
_TRIAL_SECONDS = 5.0
_TRIAL_COMPILES = 10.0
# The fused calls' times the trial is compared with: the fastest of the last few
# (other work on the machine slows some calls; a switch must beat fused at its
# best, not a slowed call).
_SAMPLES = 5
# No trial below this fused step: a dispatched step costs the host ~50-100 us on
# this CPU (the tiny MLP: 26 us fused, ~4x that stepwise), more than the 10%
# margin of any smaller step.
_MIN_STEP_SECONDS = 1e-3
# Stepwise is chosen only when its measured step is this much faster.
_MARGIN = 0.9
# A fused call shorter than this does not say how long the run's steps take: its
# time is mostly the call's own cost (the first calls are small) or one slow step
# (a rollout's collection every few steps); the trial waits for a longer one.
_MIN_CALL_SECONDS = 0.1
# Choices made, by the fused program's text and the backend: what a later
# process with the compile cache on reads (``choice_file``).
_CHOICE_DIR = "scanax-execution"


def choose(fused: float, stepwise: float) -> str:
    """The execution of measured seconds per step ``fused`` and ``stepwise``:
    stepwise only when it is clearly faster (``_MARGIN``), since a fused call
    also saves the host its dispatches."""
    return "stepwise" if stepwise < _MARGIN * fused else "fused"


# The trial compiles on another thread while the fused calls go on; where the
# steps run on the host's own cores (CPU) and there are at most this many, the
# compile takes a core from training for its whole length: a first fit of the
# Flax NNX tutorial's CNN (2 cores) measured 1.07-1.20x a fused one, its
# compile 5.4-5.6 s, to keep fused anyway. There, no trial: fused.
_TRIAL_MIN_CORES = 3


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        return os.cpu_count() or 1


def trial_competes() -> bool:
    """Whether a trial's background compile would take cores from the
    training it measures: the steps run on the CPU, which has at most
    ``_TRIAL_MIN_CORES - 1`` cores for this process."""
    return _backend.platform() == "cpu" and cores() < _TRIAL_MIN_CORES


def worth_a_trial(fused: float, steps_left: int, compile_seconds: float) -> bool:
    """Whether to try the other execution: a fused step of at least
    ``_MIN_STEP_SECONDS`` (below it, a dispatched step's own cost on the host
    would have to be won back from the loop), ``steps_left`` steps long
    enough for the trial's compile (about ``compile_seconds``) and its call,
    and a compile that does not compete with training (``trial_competes``)."""
    left = fused * steps_left
    return (
        fused >= _MIN_STEP_SECONDS
        and left >= max(_TRIAL_SECONDS, _TRIAL_COMPILES * compile_seconds)
        and not trial_competes()
    )


class Execution:
    """How a run's calls are executed, ``"fused"`` or ``"stepwise"``
    (``_fit_stepwise``), and ``execution="auto"``'s choice between them.

    ``"auto"``: the choice already made for this program (in this process, or
    on disk next to JAX's compilation cache when it is on), else fused first:
    the first call costs what it costs with ``"fused"``. Once a fused call is
    timed, if the steps left are worth it (``worth_a_trial``; never on a CPU
    of two cores or fewer, where the compile competes with training), the stepwise
    programs are traced and compiled on another thread while the fused calls go
    on; the next call after the compile runs stepwise, timed; the faster
    (``choose``) runs the rest, and the choice is kept with the program. The two
    give the same steps (the same step program, bit-identical on CPU), so a
    switch at a call boundary changes no result."""

    def __init__(self, program: Any, requested: str):
        self.program, self.requested = program, requested
        self.seconds: dict = {}  # measured seconds per step, by execution, by call
        self.long_call: float | None = None  # per step, the last long fused call
        self.trial: Any = None  # (the stepwise programs, the compile's future)
        self.pool: Any = None
        self.compile_seconds = 0.0
        self.fns: dict = {}  # the run's compiled calls, by execution
        self.read_at: float | None = None  # when the last call was read
        if requested != "auto":
            self.mode, self.deciding = requested, False
        elif jax.process_count() > 1:
            # Every process must run the same programs in the same order, and
            # a measured choice is each process's own: auto is fused there.
            self.mode, self.deciding = "fused", False
        else:
            self.mode = program.choice or "fused"
            self.deciding = program.choice is None

    def executable(self, args: Any, mode: str) -> Any:
        if mode == "stepwise":
            return _fit_stepwise.executable(self.program, args)
        return self.program.executable(args)

    def get(self, mode: str, compile: Any) -> Any:
        """The run's compiled call in ``mode`` (``compile()`` it the first
        time: for the first call's arguments)."""
        fn = self.fns.get(mode)
        if fn is None:
            fn = self.fns[mode] = compile()
        return fn

    def read(self, mode: str, steps: int, began: float) -> None:
        """A call of ``steps`` steps in ``mode``, dispatched at ``began``, was
        read: its time, from when it was dispatched or the one before it was
        read (calls overlap), to now, is auto's measurement."""
        now = time.perf_counter()
        since = began if self.read_at is None else max(began, self.read_at)
        self.read_at = now
        self.ran(mode, steps, now - since)

    def took(self, seconds: float) -> None:
        """The first call's program compiled in ``seconds``; with the compile
        cache on, a choice made by an earlier process for it applies."""
        # (a program found compiled costs nothing now, but a trial of the
        # stepwise programs costs about what compiling it did)
        self.compile_seconds = max(seconds, self.program.compile_seconds)
        if self.deciding and self.program.digest is not None:
            found = _read_choice(self.program.digest)
            if found is not None:
                self.decide(found)

    def ran(self, mode: str, steps: int, seconds: float) -> None:
        """A call of ``steps`` steps run in ``mode`` took ``seconds``."""
        if steps <= 0:
            return
        self.seconds.setdefault(mode, []).append(seconds / steps)
        if mode == "fused" and seconds >= _MIN_CALL_SECONDS:
            self.long_call = seconds / steps
        if self.deciding and mode == "stepwise" and "fused" in self.seconds:
            fused = min(self.seconds["fused"][-_SAMPLES:])
            self.decide(choose(fused, self.seconds["stepwise"][-1]))

    def next_mode(self, run: Any, args: Any) -> str:
        """The mode of the call about to be dispatched (``args``): under
        ``"auto"``, the trial's call once its programs are compiled, and the
        start of the trial once a fused call was timed."""
        if not self.deciding:
            return self.mode
        if self.trial is not None:
            if not self.trial[1].done():
                return "fused"
            if self.trial[1].exception() is not None:  # (fused runs: keep it)
                self.decide("fused", keep=False)
                return "fused"
            return "stepwise"
        fused = self.long_call
        if fused is not None and worth_a_trial(
            fused, run.end - run.done, self.compile_seconds
        ):
            try:
                self._start_trial(args)
            except Exception:  # noqa: BLE001 - (e.g. out of memory): fused runs
                self.decide("fused", keep=False)
        return "fused"

    def _start_trial(self, args: Any) -> None:
        programs = _fit_stepwise.lowered(self.program, args)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.trial = (programs, self.pool.submit(programs.compile))

    def decide(self, mode: str, keep: bool = True) -> None:
        """Run the rest in ``mode``; ``keep``: a measured choice, kept with the
        program (and on disk), else this run's only (a trial that failed)."""
        self.mode, self.deciding = mode, False
        if keep:
            self.program.choice = mode
            if self.program.digest is not None:
                _write_choice(self.program.digest, mode)

    def close(self) -> None:
        """(a trial's compile still running is left to finish on its own)"""
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def cache_directory() -> str | None:
    """JAX's persistent compilation cache's directory, if it is on."""
    return jax.config.jax_compilation_cache_dir or None


def _choice_file(digest: str) -> str | None:
    directory = cache_directory()
    if not directory:
        return None
    backend = jax.devices()[0].device_kind.replace(" ", "_").replace("/", "_")
    return os.path.join(directory, _CHOICE_DIR, f"{digest}-{backend}.txt")


def _read_choice(digest: str) -> str | None:
    path = _choice_file(digest)
    try:
        with open(path) as f:  # type: ignore[arg-type]
            found = f.read().strip()
    except (OSError, TypeError, ValueError):  # (missing, or not text)
        return None
    return found if found in ("fused", "stepwise") else None


def _write_choice(digest: str, mode: str) -> None:
    """Atomically (a temporary file renamed); never fails a run."""
    path = _choice_file(digest)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write(mode)
        os.replace(tmp, path)
    except OSError:
        pass
