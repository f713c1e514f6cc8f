"""The host side of ``scanax.fit`` between compiled calls, behind one small
protocol: the progress bar, checkpoints and log sinks are hooks that the driver
(``_fit_loop.Run``) calls from one place, the same for a single model and a
population's members. A new host-side feature is a new hook."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, NamedTuple, Protocol

import jax
import jax.random as jr
import numpy as np

from . import _checkpoint, _mesh, _progress
from ._errors import fit as errors
from ._fit_program import Carry

_CALL = errors.CALL
# ``best_dir=``: after a save that took d seconds, the next one starts no sooner
# than PAUSE * d later (unless fit waits for it): the saving thread's share of
# the host stays under 1 / (1 + PAUSE) however often the best improves.
PAUSE = 4.0


class Collected(NamedTuple):
    """One compiled call once the host has read it: what hooks are given."""

    start: int  # the call's first step (0-based global step)
    end: int  # the step it was asked to reach
    complete: bool  # it ran every step asked and nothing stopped it
    state: Carry  # the state after it (not a later call's)
    recorded: tuple  # (steps, values, sparse): what the history got (History.add)
    postfix: dict  # what the bar shows after it


class Hook(Protocol):
    """A host-side feature of one ``fit`` run (``run`` is ``_fit_loop.Run``)."""

    def start(self, run: Any) -> None:
        """After the last refusal, before the first step."""

    def after_call(self, run: Any, call: Collected) -> None:
        """After each call the host has read (in order)."""

    def end(self, run: Any) -> None:
        """After the last call (not after an error or an interrupt)."""

    def close(self, run: Any) -> None:
        """Always, last (also after an error)."""


class Bar:
    """The progress bar: steps done, and what the run's kind shows."""

    def __init__(self, spec: Any, label: str):
        self.spec, self.label = spec, label
        self.stack = contextlib.ExitStack()
        self.bar: Any = None
        self.mode = "fused"  # the execution the description shows

    def start(self, run: Any) -> None:
        self.mode = run.execution.mode
        self.bar = _progress.open_bar(
            self.spec,
            run.end,
            _CALL,
            desc=self._desc(self.mode),
            unit="step",
            initial=run.done,
        )
        self.stack.enter_context(_progress.showing(self.bar))

    def _desc(self, mode: str) -> str:
        """The default label, with how the calls run (``fit(execution=)``)."""
        return f"{self.label} [{mode}]"

    def after_call(self, run: Any, call: Collected) -> None:
        if run.execution.mode != self.mode and self.spec.desc is None:
            self.mode = run.execution.mode  # (auto chose)
            self.bar.set_description(self._desc(self.mode), refresh=False)
        # In-loop reports of the next call may have moved the bar ahead already:
        # it never moves back (``end`` sets the final count).
        if run.done > self.bar.n:
            self.bar.update(run.done - self.bar.n)
            if call.postfix:
                self.bar.set_postfix(call.postfix)

    def end(self, run: Any) -> None:
        if self.bar.n != run.done:
            self.bar.n = run.done  # e.g. a NaN stop: reported, not applied
            self.bar.refresh()

    def close(self, run: Any) -> None:
        self.stack.close()


class Saver:
    """Checkpoints (``_checkpoint.Checkpoints``): at every multiple of
    ``every`` a call reaches whole, and at the end."""

    def __init__(self, ckpt: Any):
        self.ckpt = ckpt

    def start(self, run: Any) -> None:
        """(the directory is only read until the first save)"""

    def after_call(self, run: Any, call: Collected) -> None:
        every = self.ckpt.every
        if call.complete and every and call.end % every == 0:
            saved = run.kind.saved(run, call.state)
            data = run.source.state_at(call.end - run.start)
            self.ckpt.save(call.end, saved, run.key, run.history.result(), data)

    def end(self, run: Any) -> None:
        saved = run.kind.saved(run, run.state)
        data = run.source.state_at(run.done - run.start)
        self.ckpt.save(run.done, saved, run.key, run.history.result(), data)

    def close(self, run: Any) -> None:
        """(the run closes its checkpoints: also when it was refused before
        its hooks started)"""


class Rows(NamedTuple):
    """A best state handed to ``BestWriter.offer``."""

    members: np.ndarray | None  # a population's members of the rows (None: one model)
    leaves: list  # the model's leaves (a population's: [group, ...], its rows first)
    steps: np.ndarray  # the best step (per member; -1: none yet)
    values: np.ndarray  # the monitored value there


class BestWriter:
    """``fit(best_dir=)``'s store (``_checkpoint.Checkpoints``, best-only),
    written on one background thread: at most one save at a time, the newest
    best offered saved after the one in progress (a best offered while another
    waits replaces it: a population's, per group), so that training never waits
    for a save; after a save of ``d`` seconds the next waits ``PAUSE * d``.
    ``flush`` waits for every offered best to be on disk (at once, no pause);
    ``close`` too, then ends the thread (``open`` starts one again: a
    population's next group). In a multi-process job the saves are made where
    they are offered (orbax's processes save together). A population's bests
    are kept on the host, every member's, and saved whole: one atomic save for
    each change."""

    def __init__(self, directory: Any, names: list[str], members: int | None):
        _checkpoint.require_orbax("best_dir")
        self.directory, self.names, self.members = directory, names, members
        self.threaded = jax.process_count() == 1
        self.cv = threading.Condition()
        self.pending: dict = {}  # group -> its newest Rows, not saved yet
        self.busy = self.closing = self.hurry = False
        self.resume_at = 0.0  # (time.monotonic) when the next save may start
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.store: Any = None
        self.key = None
        self.host: list | None = None  # a population's bests (host, all members)
        self.impls: list = []  # (per leaf: its key's implementation, or None)
        if members is not None:
            self.steps = np.full(members, -1, np.int64)
            self.values = np.full(members, np.nan, np.float64)

    def open(self) -> None:
        if self.threaded and self.thread is None:
            self.thread = threading.Thread(
                target=self._work, name="scanax-best-dir", daemon=True
            )
            self.thread.start()

    def offer(self, group: Any, rows: Rows) -> None:
        if not self.threaded:
            self._write({group: rows})
            return
        with self.cv:
            self._raise()
            self.pending[group] = rows
            self.cv.notify_all()

    def check(self) -> None:
        """Raise a failed save's error (in the caller's thread)."""
        with self.cv:
            self._raise()

    def flush(self) -> None:
        with self.cv:
            self.hurry = True
            self.cv.notify_all()
            while self.thread is not None and (self.pending or self.busy):
                self.cv.wait()
            self.hurry = False
            self._raise()

    def close(self) -> None:
        """Save what is offered, then stop (errors were ``flush``'s to raise)."""
        thread, self.thread = self.thread, None
        if thread is not None:
            with self.cv:
                self.closing = True
                self.cv.notify_all()
            thread.join()
            self.closing = False
        elif self.store is not None:
            self.store.close()
            self.store = None

    def _raise(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _next(self) -> dict | None:
        """The bests to save next, once the pause after the last save is over
        (not when ``flush`` or ``close`` waits); None: closing, none left."""
        with self.cv:
            while True:
                if self.pending:
                    wait = self.resume_at - time.monotonic()
                    if wait <= 0 or self.hurry or self.closing:
                        items, self.pending = self.pending, {}
                        self.busy = True
                        return items
                    self.cv.wait(wait)
                elif self.closing:
                    return None
                else:
                    self.cv.wait()

    def _work(self) -> None:
        while (items := self._next()) is not None:
            took = 0.0
            try:
                if self.error is None:  # (after a failed save: no more)
                    took = self._write(items)
            except BaseException as err:  # noqa: BLE001 - raised in fit's thread
                self.error = err
            finally:
                with self.cv:
                    self.resume_at = time.monotonic() + PAUSE * took
                    self.busy = False
                    self.cv.notify_all()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _write(self, items: dict) -> float:
        """Save ``items`` (group -> Rows); the seconds the save took."""
        if self.store is None:  # (orbax is imported here: off fit's thread)
            self.store = _checkpoint.Checkpoints(
                self.directory,
                None,
                self.names,
                _checkpoint.best_data(self.members),
                0,
                keep=1,
            )
            self.key = _checkpoint.best_key()
        if self.members is None:
            (rows,) = items.values()
            leaves, step = rows.leaves, int(rows.steps)
            steps, values = np.asarray([step], np.int64), rows.values[None]
        else:
            for rows in items.values():
                self._take(rows)
            leaves = [
                x if impl is None else jr.wrap_key_data(x, impl=impl)
                for x, impl in zip(self.host, self.impls)
            ]
            step, steps, values = int(self.steps.max()), self.steps, self.values
        history = {"step": steps.copy(), "value": values.astype(np.float64)}
        began = time.monotonic()
        self.store.save(step, leaves, self.key, history)
        return time.monotonic() - began

    def _take(self, rows: Rows) -> None:
        """A group's rows into the population's bests on the host."""
        k = len(rows.members)
        if self.host is None:
            self.impls = [
                jr.key_impl(x) if _checkpoint.is_key(x) else None for x in rows.leaves
            ]
        data = [jr.key_data(x) if _checkpoint.is_key(x) else x for x in rows.leaves]
        data = [np.asarray(_mesh.host_value(x))[:k] for x in data]
        if self.host is None:
            self.host = [np.zeros((self.members, *x.shape[1:]), x.dtype) for x in data]
        for h, x in zip(self.host, data):
            h[rows.members] = x
        self.steps[rows.members] = rows.steps
        self.values[rows.members] = rows.values


class BestSaver:
    """``fit(best_dir=)``: the best state that ``stop=`` keeps on device,
    offered to the ``BestWriter`` after each call that changed it (a
    population's: any of its members'); the run ends once it is saved. Only the
    model's own leaves (``pick``: not an average's or a rollout's; with
    ``ema_eval``, the average's). ``members``: a population group's real
    members (its first rows), None for one model."""

    def __init__(self, writer: BestWriter, pick: Any, members: Any = None):
        self.writer, self.pick, self.members = writer, pick, members
        self.offered: Any = None if members is None else np.full(len(members), -1)

    def start(self, run: Any) -> None:
        self.writer.open()

    def after_call(self, run: Any, call: Collected) -> None:
        extra = call.state.extra  # this call's early-stop carry, not a later one's
        steps = _mesh.host_value(extra.rule.best_step).astype(np.int64)
        if self.members is None:
            new = steps >= 0 and steps != self.offered
        else:
            steps = steps[: len(self.members)]
            new = bool(((steps >= 0) & (steps != self.offered)).any())
        if not new:
            self.writer.check()
            return
        values = _mesh.host_value(extra.rule.best).astype(np.float64)
        if self.members is not None:
            values = values[: len(self.members)]
        group = None if self.members is None else int(self.members[0])
        self.writer.offer(
            group, Rows(self.members, self.pick(extra.best), steps, values)
        )
        self.offered = steps

    def end(self, run: Any) -> None:
        self.writer.flush()

    def close(self, run: Any) -> None:
        self.writer.close()


class Logs:
    """``log=``: the logger (``_fit_checks.Logger``), its sinks opened at the
    start, given each call's steps and evaluations, closed at the end."""

    def __init__(self, logger: Any):
        self.logger = logger

    def start(self, run: Any) -> None:
        self.logger.open(*run.replay())

    def after_call(self, run: Any, call: Collected) -> None:
        steps, values, sparse = call.recorded
        self.logger.add(steps, values)
        for entry_steps, entries in sparse:  # evaluations, collections
            self.logger.add_val(entry_steps, entries)
        self.logger.write()

    def end(self, run: Any) -> None:
        self.logger.write(final=True)

    def close(self, run: Any) -> None:
        self.logger.sinks.close()
