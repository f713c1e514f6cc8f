"""The host side of ``scanax.fit`` between compiled calls, behind one small
protocol: the progress bar, checkpoints and log sinks are hooks that the driver
(``_fit_loop.Run``) calls from one place, the same for a single model and a
population's members. A new host-side feature is a new hook."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Protocol

from .. import _progress
from .._errors import fit as errors
from .program import Carry

_CALL = errors.CALL


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

    def failed(self, run: Any, err: BaseException) -> None:
        """After an error or an interrupt ended the run (before ``close``)."""

    def close(self, run: Any) -> None:
        """Always, last (also after an error)."""


class Bar:
    """The progress bar: steps done, and what the run's kind shows."""

    def __init__(self, spec: Any, label: str):
        self.spec, self.label = spec, label
        self.stack = contextlib.ExitStack()
        self.bar: Any = None
        self.mode = "fused"  # the execution the description shows
        self.postfix: dict = {}  # the last read call's (its last good step's)

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
        if call.postfix:
            self.postfix = call.postfix
        if run.done > self.bar.n:
            self.bar.update(run.done - self.bar.n)
            if call.postfix:
                self.bar.set_postfix(call.postfix)

    def end(self, run: Any) -> None:
        if self.bar.n != run.done:
            # e.g. a NaN stop: steps reported by the call, not applied (and
            # their losses): the last good step's
            self.bar.n = run.done
            if self.postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.refresh()

    def failed(self, run: Any, err: BaseException) -> None:
        """(the bar closes as it stands)"""

    def close(self, run: Any) -> None:
        self.stack.close()


class Saver:
    """Checkpoints (``_checkpoint.Checkpoints``): at every multiple of
    ``every`` a call reaches whole, and at the end."""

    def __init__(self, ckpt: Any):
        self.ckpt = ckpt
        self.saving = False  # (a save under way: one that failed is not redone)

    def start(self, run: Any) -> None:
        """(the directory is only read until the first save)"""

    def after_call(self, run: Any, call: Collected) -> None:
        every = self.ckpt.every
        if call.complete and every and call.end % every == 0:
            self._save(run, call.end, call.state)

    def end(self, run: Any) -> None:
        self._save(run, run.done, run.state)

    def failed(self, run: Any, err: BaseException) -> None:
        """An error or Ctrl-C ended the run: the last checked state
        (``run.checked``, at ``run.done``; not a call in flight, unchecked) is
        saved (an Equinox or TrainState result is not returned then), unless a
        save was what failed (``Checkpoints.save`` skips a step saved already,
        and the start). A failure of this save is added to ``err`` as a
        note."""
        if self.saving:
            return
        try:
            self._save(run, run.done, run.checked)
        except Exception as second:  # noqa: BLE001 - the run's own error goes on
            if hasattr(err, "add_note"):
                err.add_note(errors.save_after_error_failed(run.done, second))

    def _save(self, run: Any, step: int, state: Carry) -> None:
        saved = run.kind.saved(run, state)
        data = run.source.state_at(step - run.start)
        self.saving = True
        self.ckpt.save(step, saved, run.key, run.history.result(), data)
        self.saving = False

    def close(self, run: Any) -> None:
        """(the run closes its checkpoints: also when it was refused before
        its hooks started)"""
