"""``progress=``: a tqdm bar updated from inside the compiled loop.

The loop carries an internal step counter next to the user's carry. Before the
steps ``[i, i + n)`` run, the loop calls back to the host (``jax.debug.callback``
inside a ``lax.cond``) only if that block holds a multiple of ``every``; after the
loop, one last callback closes the bar. The callback's only operand is the counter:
it is unbatched under ``vmap`` (one bar for the batch), and under ``grad`` it is a
known value in the forward loop, so the update stays inside the forward loop
(it depends on the carry, so it cannot be hoisted out as loop-invariant).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
from typing import Any

import jax
import jax.numpy as jnp

from ._scan import Loop

_DEFAULT_UPDATES = 50


@dataclasses.dataclass(frozen=True)
class Progress:
    """How ``scanax.scan(..., progress=...)`` shows its tqdm bar.

    Arguments:
        every: update the bar every ``every`` steps (a positive int). ``None``
            (default): about 50 updates per scan, and never every step for scans
            longer than one step. Each update is one host callback (~60 µs on CPU).
        desc: the bar's label.
        leave: keep the finished bar on screen (tqdm's ``leave``).
        position: tqdm's ``position`` (the line, for nested bars).
        unit: tqdm's ``unit``.

    ``progress=True`` is ``Progress()``; ``progress=n`` is ``Progress(every=n)``.

    Example:
        >>> import scanax
        >>> spec = scanax.Progress(every=100, desc="simulate", leave=False)
    """

    every: int | None = None
    desc: str | None = None
    leave: bool = True
    position: int | None = None
    unit: str = "it"


def resolve(call: str, progress: Any) -> Progress | None:
    """The validated ``Progress`` for a ``progress=`` value, or None when off."""
    if progress is False or progress is None:
        return None
    if progress is True:
        return Progress()
    if isinstance(progress, Progress):
        spec = progress
    elif isinstance(progress, int):
        spec = Progress(every=progress)
    else:
        raise TypeError(
            f"{call}: `progress` must be False, True, a positive int (steps between "
            f"updates) or scanax.Progress(...), got {type(progress).__name__} "
            f"{progress!r}.\nFix: pass progress=True, progress=100 or "
            "progress=scanax.Progress(every=100, desc=...)."
        )
    every = spec.every
    if every is not None and (
        isinstance(every, bool) or not isinstance(every, int) or every < 1
    ):
        raise ValueError(
            f"{call}: the progress bar's `every` must be a positive int (steps "
            f"between updates) or None, got {every!r}.\nFix: pass e.g. "
            "progress=100, or progress=scanax.Progress(every=100); None picks about "
            f"{_DEFAULT_UPDATES} updates per scan."
        )
    _load_tqdm(call)
    return spec


def _load_tqdm(call: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError(
            f"{call}: `progress=` draws its bar with tqdm, which is not installed.\n"
            "Fix: `pip install tqdm` (or `pip install scanax[progress]`), or drop "
            "`progress=`."
        ) from err
    return tqdm


def default_every(length: int) -> int:
    return max(2, math.ceil(length / _DEFAULT_UPDATES))


class _Bar:
    """Host-side state of one scan's bar. A new tqdm bar opens at step 0 of each run."""

    def __init__(self, spec: Progress, total: int):
        self.spec = spec
        self.total = total
        self.bar: Any = None

    def report(self, done: Any, closing: bool) -> None:
        done = int(done)
        if self.bar is not None and done == 0 and not closing:
            self.bar.close()  # a run that did not finish (an error, or a retrace)
            self.bar = None
        if self.bar is None:
            tqdm = _load_tqdm("scanax.scan")
            self.bar = tqdm(
                total=self.total,
                desc=self.spec.desc,
                leave=self.spec.leave,
                position=self.spec.position,
                unit=self.spec.unit,
                dynamic_ncols=True,
            )
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if closing:
            self.bar.close()
            self.bar = None


def _host_report(bar: _Bar, done: Any, closing: bool) -> None:
    """Every callback lands here (tests patch this to count them)."""
    bar.report(done, closing)


def _dispatch(bar: _Bar, closing: bool, done: Any) -> None:
    _host_report(bar, done, closing)


class Reporter:
    """The in-loop half of a progress bar: counter, ticks, and the closing call."""

    def __init__(self, spec: Progress, total: int):
        self.total = total
        self.every = spec.every if spec.every is not None else default_every(total)
        self._bar = _Bar(spec, total)

    def init(self) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    def tick(self, count: jax.Array, n: int = 1) -> jax.Array:
        """Before the steps ``[count, count + n)``: report if they hold a multiple
        of ``every``. Returns the counter after them."""
        with jax.named_scope("scanax.progress"):
            if n == 1:
                hit = count % self.every == 0
            else:
                hit = (count + n - 1) // self.every * self.every >= count
            jax.lax.cond(
                hit,
                lambda c: jax.debug.callback(
                    ft.partial(_dispatch, self._bar, False), c
                ),
                lambda c: None,
                count,
            )
            return count + n

    def close(self, count: jax.Array) -> None:
        with jax.named_scope("scanax.progress"):
            jax.debug.callback(ft.partial(_dispatch, self._bar, True), count)

    def wrap(self, loop: Loop) -> Loop:
        """The loop with ``(carry, counter)`` as carry, ticking once per step."""
        body = loop.body

        def counted(state, x):
            carry, count = state
            count = self.tick(count)
            carry, y = body(carry, x)
            return (carry, count), y

        return Loop(counted, (loop.init, self.init()), loop.xs, loop.length)
