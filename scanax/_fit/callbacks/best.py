"""``EarlyStop(best_dir=)``: the best state kept on device by the early stop,
saved on the host after each call that improved on it, on a thread of its own
(``BestWriter``), by a hook of the run (``BestSaver``); a population's: every
member's, in one atomic save per change."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import jax
import jax.random as jr
import numpy as np

from .. import checkpoint as _checkpoint, mesh as _mesh
from ..hooks import Collected
from . import checkpoint as _checkpointing

# ``best_dir=``: after a save that took d seconds, the next one starts no sooner
# than PAUSE * d later (unless fit waits for it): the saving thread's share of
# the host stays under 1 / (1 + PAUSE) however often the best improves.
PAUSE = 4.0


class Rows(NamedTuple):
    """A best state handed to ``BestWriter.offer``."""

    members: np.ndarray | None  # a population's members of the rows (None: one model)
    leaves: list  # the model's leaves (a population's: [group, ...], its rows first)
    steps: np.ndarray  # the best step (per member; -1: none yet)
    values: np.ndarray  # the monitored value there


class BestWriter:
    """``EarlyStop(best_dir=)``'s store (``_checkpoint.Checkpoints``, best-only),
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
                _checkpointing.best_data(self.members),
                0,
                keep=1,
            )
            self.key = _checkpointing.best_key()
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
    """``EarlyStop(best_dir=)``: the best state that the ``EarlyStop`` keeps on device,
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

    def failed(self, run: Any, err: BaseException) -> None:
        """(``close`` ends the writer: the best state offered so far)"""

    def close(self, run: Any) -> None:
        self.writer.close()
