"""How many steps each of ``scanax.fit``'s compiled calls runs."""

from __future__ import annotations

import time

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
        if not auto:
            self.per_call = min(length, steps_per_call or length)
        elif known is None:
            self.per_call = min(length, 8)
        else:
            self.per_call = self._size(known)
        self.last = None

    def want(self, start: int, end: int) -> int:
        want = min(self.per_call, end - start)
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
        self.per_call = self._size(per_step)
        self.last = now

    def _size(self, seconds_per_step: float) -> int:
        return max(1, min(self.length, int(_SECONDS_PER_CALL / seconds_per_step)))
