"""The host side of ``scanax.fit`` between compiled calls, behind one small
protocol: the progress bar, checkpoints and log sinks are hooks that the driver
(``_fit_loop.Run``) calls from one place, the same for a single model and a
population's members. A new host-side feature is a new hook."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from . import _checkpoint, _progress
from ._errors import fit as errors

_CALL = errors.CALL


class Collected(NamedTuple):
    """One compiled call once the host has read it: what hooks are given."""

    start: int  # the call's first step (0-based global step)
    end: int  # the step it was asked to reach
    complete: bool  # it ran every step asked and nothing stopped it
    state: tuple  # (leaves, stopped, early-stop carry) after it (not a later call's)
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
            saved = run.kind.saved(run, *call.state)
            data = run.source.state_at(call.end - run.start)
            self.ckpt.save(call.end, saved, run.key, run.history.result(), data)

    def end(self, run: Any) -> None:
        saved = run.kind.saved(run, run.leaves, run.stopped, run.extra)
        data = run.source.state_at(run.done - run.start)
        self.ckpt.save(run.done, saved, run.key, run.history.result(), data)

    def close(self, run: Any) -> None:
        """(the run closes its checkpoints: also when it was refused before
        its hooks started)"""


class BestSaver:
    """``fit(best_dir=)``: the best state that ``stop=`` keeps on device, saved
    (atomically, by orbax) whenever it changes, after the call that found it;
    only the model's own leaves (``n``: not an average's or a rollout's)."""

    def __init__(self, store: Any, n: int, pick: Any = None):
        # ``pick(leaves)``: the model's leaves to save from the best state
        # (default: the first ``n``; ``ema_eval``: the average's)
        self.store, self.n, self.saved = store, n, None
        self.pick = pick or (lambda leaves: list(leaves[:n]))

    def start(self, run: Any) -> None:
        """(the directory is only written by the first save)"""

    def after_call(self, run: Any, call: Collected) -> None:
        extra = call.state[2]  # this call's early-stop carry, not a later one's
        step = int(jax.device_get(extra.rule.best_step))
        if step >= 0 and step != self.saved and extra.best:
            best = self.pick(extra.best)
            value = np.asarray(jax.device_get(extra.rule.best), np.float64)
            history = {"step": np.asarray([step], np.int64), "value": value[None]}
            self.store.save(step, best, _checkpoint.best_key(), history)
            self.saved = step

    def end(self, run: Any) -> None:
        """(saved after each call)"""

    def close(self, run: Any) -> None:
        self.store.close()


class Logs:
    """``log=``: the logger (``_fit_checks.Logger``), its sinks opened at the
    start, given each call's steps and evaluations, closed at the end."""

    def __init__(self, logger: Any):
        self.logger = logger

    def start(self, run: Any) -> None:
        self.logger.open(*run.replay)

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
