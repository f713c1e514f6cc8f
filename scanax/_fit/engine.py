"""The driver of ``scanax.fit``: ``Run`` runs one ``fit`` of one model or of a
group of a population's members with a chunk program from ``_fit_program``:
it dispatches the compiled calls, keeps one in flight while the host reads the
one before, and hands each to the host-side hooks (``_fit_hooks``). What it
trains is a strategy (``Kind``: ``_fit_solo.Model`` or ``_fit_members.Group``)
whose methods return what changes (``Carry``, ``Read``); the run keeps it."""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from .. import _caller
from .._errors import checkpoint as ckpt_errors, fit as errors
from . import (
    checkpoint as _checkpoint,
    hooks as _fit_hooks,
    logs as _fit_logs,
    scalars as _scalars,
    schedule as _fit_schedule,
)
from .history import History
from .program import Carry, Chunk, Report, false

_REPORT_SECONDS = 0.1  # in-loop progress reports: about 10 a second


class Setup(NamedTuple):
    """What ``fit``'s arguments come to, checked (``_fit_config``): the inputs
    of one model's run or of a population's."""

    steps: int
    loss_fn: Any
    takes_hp: bool  # loss_fn takes a member's hyperparameters (a population)
    takes_key: bool  # loss_fn takes a per-step key
    key: Any  # fit's key, or None
    source: Any  # ``_data.ArraySource`` or ``_iterables.IterSource``
    accumulate: int
    steps_per_call: int | None
    length: int  # the compiled call's buffers
    checkpoint_dir: Any
    checkpoint_every: int | None
    place: Any  # ``_mesh.Placement``: the default device, or a mesh
    shard: str | None
    spec: Any  # the progress bar's ``_progress.Progress``, or None
    checks: Any  # ``_fit_checks.Checks`` (evaluation, early stop), or None
    eval_arrays: Any
    eval_call: Any  # eval_fn (or loss_fn) as given, with evaluation
    loggers: tuple  # ``_fit_logs.Logger`` per window length of the sinks
    features: tuple  # the features with state or step parts (``_feature``)
    best_dir: Any  # ``EarlyStop(best_dir=)``, or None
    execution: str = "auto"  # ``execution=``: "auto", "fused" or "stepwise"


class How(NamedTuple):
    """Where a run starts and ends, and how it shows and places its work."""

    start: int  # the global step it starts from
    end: int  # the global step it ends at, unless something stops it
    spec: Any  # the bar's ``_progress.Progress``, or None
    place: Any  # ``_mesh.Placement``
    ticks: bool  # in-loop bar reports
    execution: str = "fused"  # ``fit(execution=)``: "auto", "fused", "stepwise"


class Extras(NamedTuple):
    """A run's evaluation, early stop, logs and best-only store."""

    checks: Any  # ``_fit_checks.Checks``, or None
    eval_data: Any  # the eval arrays, on the devices
    loggers: tuple  # ``_fit_logs.Logger``s
    best: Any = None  # ``_best.BestSaver`` (``best_dir=``), or None


class Read(NamedTuple):
    """What a kind reads of one call (``Kind.collect``)."""

    ran: int  # global steps the run's clock moves on by
    halted: bool  # nothing more to train after it
    redone: Carry | None  # the state to continue from instead (a redone call)
    call: Any  # ``_fit_hooks.Collected``: what the hooks are given


class Kind(Protocol):
    """What a ``Run`` trains, and what that changes on the host: one model
    (``_fit_solo.Model``) or a group of a population's members
    (``_fit_members.Group``). ``members``: the group's size (None: one model);
    ``hp``: the members' hyperparameters (None); ``label``: the bar's
    description."""

    members: int | None
    hp: Any
    label: str

    def init(self, run: Run, carry: Carry, key: Any) -> tuple[Carry, Any]:
        """The state to start from (``carry``: its leaves as given) and the
        key, placed."""

    def begin(self, run: Run) -> None:
        """Training starts (after a resume, before the first call)."""

    def names(self, run: Run) -> list[str]:
        """The names of the checkpointed leaves."""

    def describe(self, run: Run) -> dict:
        """What a checkpoint records of the run's inputs (a resume must match)."""

    def saved(self, run: Run, carry: Carry) -> list:
        """What a checkpoint holds of the state ``carry``."""

    def load(self, run: Run, saved: list) -> Carry:
        """The state a checkpoint's ``saved`` holds."""

    def use_key(self, run: Run, key: Any) -> Any:
        """The key to continue with, a checkpoint's (the shuffle too)."""

    def restored(self, run: Run, history: dict) -> None:
        """Count what a restored history holds."""

    def stopped_by_rule(self, run: Run) -> bool:
        """Whether a restored early stop leaves nothing to train."""

    def count(self, run: Run, steps: int) -> tuple[Any, int]:
        """A call's ``count`` and ``every`` arguments for ``steps`` steps."""

    def compile(self, run: Run, args: Chunk, mode: str) -> Any:
        """The executable for ``args`` in ``mode`` (errors named for this
        kind)."""

    def collect(self, run, start, end, out, args, report, ys, dispatched) -> Read:
        """One call read: the history updated, what changes for the run."""

    def hand_over(self, run: Run) -> None:
        """Before the last call is read (while it runs)."""

    def interrupted(self, run: Run) -> None:
        """After an error or an interrupt."""

    def result(self, run: Run) -> Any:
        """What the run gives back."""


class Run:
    """One ``fit`` run of one model or of one group of a population's members
    (``kind``): dispatch the compiled calls, keep one in flight while the host
    reads the one before, and hand each to the hooks (``_fit_hooks``: bar,
    checkpoints, logs, best saves)."""

    def __init__(self, kind: Kind, source, program, schedule, leaves, how, extras):
        self.kind, self.source, self.program = kind, source, program
        self.schedule, self.how, self.extras = schedule, how, extras
        # fused or stepwise calls, and auto's choice (``_fit_schedule.Execution``)
        self.execution = _fit_schedule.Execution(program, how.execution)
        data, key = source.arguments(how.place)
        self.state, key = kind.init(self, Carry(leaves, false(), None), key)
        self.inputs = (data, key)  # the compiled call's data and key
        self.checked = self.state  # the last state checked (at ``done``)
        self.done = how.start  # the global step reached
        self.halted = False  # nothing more to train
        self.history = History(kind.members)
        self.ckpt: _checkpoint.Checkpoints | None = None  # (``resume``)

    # (what the kinds and hooks read)
    start = property(lambda self: self.how.start)
    good = property(lambda self: self.checked.leaves)  # (the leaves checked)
    end = property(lambda self: self.how.end)
    spec = property(lambda self: self.how.spec)
    place = property(lambda self: self.how.place)
    checks = property(lambda self: self.extras.checks)
    leaves = property(lambda self: self.state.leaves)
    stopped = property(lambda self: self.state.stopped)
    extra = property(lambda self: self.state.extra)
    key = property(lambda self: self.inputs[1])

    def context(self) -> Any:
        """The mesh as context while tracing (``_mesh.Placement.context``)."""
        return self.place.context()

    # ------------------------------------------------------------ resume

    def resume(self, directory: Any, every: int | None) -> None:
        """Continue from the newest usable checkpoint in ``directory`` that lies
        between this call's start and end (see ``docs/checkpoint.md``)."""
        self.source.keep_states()  # (a resumable iterator's, for the saves)
        names, describe = self.kind.names(self), self.kind.describe(self)
        ckpt = self.ckpt = _checkpoint.Checkpoints(
            directory, every, names, describe, self.start
        )
        past = ckpt.steps_after(self.end)
        found = ckpt.restore(
            self.kind.saved(self, self.state),
            self.key,
            at_most=self.end,
            start=self.start,
        )
        if past and found is None:  # nothing to resume but a longer run
            raise ckpt_errors.checkpoint_past_end(
                ckpt.directory, past, self.start, self.end
            )
        if past and (found is None or found[0] < self.end):
            self.warn(
                ckpt_errors.later_checkpoints_kept(ckpt.directory, past, self.end)
            )
        if found is None or found[0] <= self.start:
            return
        step, saved, key, history = found
        if not _same_key(key, self.key):  # (the saved one goes on: the run's)
            self.warn(ckpt_errors.checkpoint_other_key(ckpt.directory, step))
        self.state = self.kind.load(self, saved)
        self.inputs = (self.inputs[0], self.kind.use_key(self, key))
        ckpt.last_saved = step
        self.history.restore(history, self.start, step)
        self.done, self.checked = step, self.state
        self.kind.restored(self, self.history.result())
        if step == self.end:
            self.warn(ckpt_errors.checkpoint_at_end(ckpt.directory, step))
        elif self.kind.stopped_by_rule(self):  # the call ended there, by its rule
            self.halted = True
            self.warn(ckpt_errors.checkpoint_stopped(ckpt.directory, step))
        # the batches those steps used (a resumable iterator: set to its state)
        self.source.skip(step - self.start, ckpt.data_state, ckpt.data_skip)

    def replay(self) -> tuple[int, dict | None]:
        """What the log sinks keep (their rows up to a step) and the restored
        history they are given again after it (``Logger.open``): a resume never
        deletes a row it does not write again (an earlier restart may have cut
        them)."""
        if self.done == self.start:
            return self.start, None
        restored = self.history.result()
        steps = restored["step"]
        return (int(steps[0]) - 1 if len(steps) else self.done), restored

    # ------------------------------------------------------------ run

    def prepare(self) -> tuple:
        """The calls to make and the first one's batches, its program compiled:
        every refusal found while tracing ``loss_fn``/``eval_fn`` comes here,
        before any file, sink, model or optimizer changes."""
        calls = self.source.calls(self.done, self.end, self.schedule, self.place)
        first = None if self.halted else next(calls, None)
        if first is not None:
            began = time.perf_counter()
            with self.context():
                self.compiled(self.args(*first))
            self.execution.took(time.perf_counter() - began)
        return calls, first

    def hooks(self) -> list:
        """The host-side features of this run, in the order they are called."""
        out: list = []
        if self.spec is not None:
            out.append(_fit_hooks.Bar(self.spec, self.kind.label))
        # (the logs before the checkpoint: a save that fails or is interrupted
        # leaves the rows of the steps the objects hold written)
        out += [_fit_logs.Logs(logger) for logger in self.extras.loggers]
        if self.ckpt is not None:
            out.append(_fit_hooks.Saver(self.ckpt))
        if self.extras.best is not None:
            out.append(self.extras.best)
        return out

    def go(self) -> Any:
        """Train, then the kind's result (``Model``: a ``FitResult``)."""
        hooks, started = self.hooks(), []
        self.kind.begin(self)
        try:
            calls, first = self.prepare()
            for hook in hooks:
                hook.start(self)
                started.append(hook)
            self._loop(hooks, calls, first)
            for hook in hooks:
                hook.end(self)
        except BaseException as err:
            self.kind.interrupted(self)
            for hook in started:
                hook.failed(self, err)
            self._close(started, err)
            raise
        self._close(started, None)
        return self.kind.result(self)

    def _close(self, started: list, failing: BaseException | None) -> None:
        """Close the started hooks (last first), the checkpoints (waiting for
        the last save) and the execution. When an error ends the run, a save
        that failed in the background is added to it as a note: the run's own
        error goes on."""
        for hook in reversed(started):
            hook.close(self)
        try:
            if self.ckpt is not None:
                self.ckpt.close()
        except Exception as err:
            if failing is None:
                raise
            if hasattr(failing, "add_note"):
                failing.add_note(str(err))
        finally:
            self.execution.close()

    def args(self, start: int, end: int, xs: Any) -> Chunk:
        """The compiled chunk's arguments for the steps ``start`` to ``end``."""
        count, every = self.kind.count(self, end - start)
        aux = None
        if self.checks is not None:
            aux = {"eval": self.extras.eval_data, "stop": self.extra}
        data, key = self.inputs
        return Chunk(
            self.leaves,
            self.stopped,
            np.int32(start),
            count,
            np.int32(every),
            data,
            key,
            xs,
            self.kind.hp,
            aux,
        )

    def call(self, args: Chunk, mode: str | None = None) -> Any:
        """The call of ``args``, executed in ``mode`` (default: the run's)."""
        with self.context():
            return self.compiled(args, mode)(*self.launched(args))

    def launched(self, args: Chunk) -> Chunk:
        """``args`` as a launch takes them: with no mesh, the step numbers as
        device scalars kept by value (``_scalars``: none transferred when they
        repeat); on a mesh as they are (the executable places them)."""
        if not self.place.local:
            return args
        return Chunk(*map(_scalars.on_device, args))

    def compiled(self, args: tuple, mode: str | None = None) -> Any:
        """The compiled chunk in ``mode``, compiled for the first call's
        ``args``."""
        mode = mode or self.execution.mode
        return self.execution.get(mode, lambda: self.kind.compile(self, args, mode))

    def _loop(self, hooks: list, calls: Any, nxt: Any) -> None:
        pending = None
        while nxt is not None:
            start, end, xs = nxt
            args = self.args(start, end, xs)
            mode = self.execution.next_mode(self, args)
            trial = mode != self.execution.mode  # auto's timed stepwise call
            if trial and pending is not None:  # (timed alone: nothing overlaps it)
                self._collect(hooks, *pending)
                pending = None
                if self.halted:  # (a stop in the call before: nothing to time)
                    break
            if jax.config.jax_disable_jit:  # (turned on by a data iterator)
                raise errors.under_disable_jit()
            try:
                with self.context():
                    fn = self.compiled(args, mode)
                    began = time.perf_counter()
                    out = fn(*self.launched(args))
            except (Exception, KeyboardInterrupt):
                # (this call failed, or Ctrl-C while it was launched: the one
                # before it ran whole, and is checked and kept before the error
                # goes on)
                if pending is not None:
                    self._collect(hooks, *pending)
                raise
            self.state = Carry(out.leaves, out.stopped, out.extra)
            # Compiling happens in the call above, running after it returns.
            dispatched = time.perf_counter()
            if pending is not None:
                self._collect(hooks, *pending)
            pending = (start, end, out, args, dispatched, began, mode)
            if self.schedule.timing or trial:
                # Time the first call before sizing the next ones (and auto's
                # trial before choosing).
                self._collect(hooks, *pending)
                pending = None
            if self.halted:
                break
            # The next chunk (host batches: stacked and put on device) is
            # prepared while this one trains.
            try:
                nxt = next(calls, None)
            except (Exception, KeyboardInterrupt):
                # (the data failed, or Ctrl-C while it was read: the call in
                # flight is checked and kept, as any other, before the error
                # goes on: nothing it ran is lost)
                if pending is not None:
                    self._collect(hooks, *pending)
                raise
        if pending is not None:
            self.kind.hand_over(self)  # (while the last call runs)
            self._collect(hooks, *pending)

    def _collect(self, hooks, start, end, out, args, dispatched, began, mode):
        packed, ys = jax.device_get((out.report, out.bufs))
        report = Report.read(packed)
        self.execution.read(mode, int(np.max(report.ran)), began)
        read = self.kind.collect(self, start, end, out, args, report, ys, dispatched)
        # (one statement: a Ctrl-C between them cannot pair a step with
        # another call's state)
        self.done, self.checked = self.done + read.ran, read.call.state
        self.halted = self.halted or read.halted
        if read.redone is not None:
            self.state = read.redone
        for hook in hooks:
            hook.after_call(self, read.call)

    def warn(self, message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller.user_level())

    @property
    def restoring(self) -> bool:
        """Whether the early stop restores the best state it keeps."""
        stop = None if self.checks is None else self.checks.stop
        return stop is not None and stop.restore_best

    def every(self, count: int) -> int:
        """Steps between in-loop reports: ``Progress.every``, or about 10 a second
        once the speed is known, else 10 a call; more than ``count`` (none)
        without in-loop reports."""
        if not self.how.ticks:
            return count + 1
        if self.spec.every is not None:
            return self.spec.every
        known = self.program.seconds_per_step
        if known is None:
            every = max(1, count // 10)
        else:
            every = max(1, math.ceil(_REPORT_SECONDS / known))
        # a multiple of the chunk (off CPU, once the plan is known): each report
        # cuts a chunk, and a cut chunk runs the rest of its window masked
        k = self.program.k
        return -(-every // k) * k


def _same_key(saved: Any, given: Any) -> bool:
    """Whether a checkpoint's key is the one this call was given (by value;
    no key, or none saved: nothing to compare)."""
    if saved is None or given is None:
        return True
    data = [
        np.asarray(
            jax.random.key_data(k)
            if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)
            else k
        )
        for k in (saved, given)
    ]
    return data[0].shape == data[1].shape and bool((data[0] == data[1]).all())
