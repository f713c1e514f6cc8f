"""``progress=``: a tqdm bar updated from inside the compiled loop.

``scanax.scan`` runs the steps in chunks of ``every`` (``_remat.run_chunks``) and
ticks once per chunk, so a bar costs nothing per step. The loop carries an internal
step counter next to the user's carry. Before the steps ``[i, i + n)`` run, the
loop calls back to the host (``jax.debug.callback`` inside a ``lax.cond``) only if
that block holds a multiple of ``every`` or is the last one. The callback's
operands depend only on the counter: they are unbatched under ``vmap`` (one bar for
the batch), and under ``grad`` they are known values of the forward loop, so the
updates stay inside the forward loop (they depend on a carry, so they cannot be
hoisted out as loop-invariant). Every report is made inside the loop: a report
after it could run first, as XLA folds the final count to a constant.

The callbacks are unordered (ordered effects would not run on several devices),
so the host side tolerates reports that arrive permuted (see ``Bar``).

``scanax.fit`` takes the same ``progress=`` values and opens its bar with
``open_bar``. Its compiled loop is shared by every ``fit`` call of the same
structure, so it cannot close over one bar: it reports with ``tick_newest`` to the
newest bar that ``showing`` holds open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from ._errors import long as errors
from ._loop import Loop
from ._once import once_if

_DEFAULT_UPDATES = 20


@dataclasses.dataclass(frozen=True)
class Progress:
    """How ``scanax.scan(..., progress=...)`` shows its tqdm bar.

    Arguments:
        every: update the bar every ``every`` steps (a positive int). ``None``
            (default): about 20 updates per scan, and never every step for scans
            longer than one step. Each update is one host callback (tens of µs to about
            1 ms on CPU).
        desc: the bar's label.
        leave: keep the finished bar on screen (tqdm's ``leave``).
        position: tqdm's ``position`` (the line, for nested bars).
        unit: tqdm's ``unit``; ``None`` (default): ``"it"``, or ``"step"`` in
            ``scanax.fit``.

    ``progress=True`` is ``Progress()``; ``progress=n`` is ``Progress(every=n)``.
    ``scanax.fit(..., progress=...)`` takes the same values; there ``every=None``
    means about 10 updates a second (its calls vary in length).

    Example:
        >>> import scanax
        >>> spec = scanax.Progress(every=100, desc="simulate", leave=False)
    """

    every: int | None = None
    desc: str | None = None
    leave: bool = True
    position: int | None = None
    unit: str | None = None


def resolve(call: str, progress: Any) -> Progress | None:
    """The validated ``Progress`` for a ``progress=`` value, or None when off."""
    if progress is False or progress is None:
        return None
    if progress is True:
        spec = Progress()
    elif isinstance(progress, Progress):
        spec = progress
    elif isinstance(progress, int):
        spec = Progress(every=progress)
    else:
        raise errors.bad_progress(call, progress)
    every = spec.every
    bad_type = isinstance(every, bool) or not isinstance(every, int)
    if every is not None and (bad_type or every < 1):
        raise errors.bad_every(call, every, _DEFAULT_UPDATES)
    load_tqdm(call)
    return spec


def load_tqdm(call: str) -> Any:
    """``tqdm.auto.tqdm``, or an ImportError saying how to get it or turn it off."""
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise errors.no_tqdm(call) from err
    return tqdm


def open_bar(
    spec: Progress,
    total: int,
    call: str,
    *,
    desc: str | None = None,
    unit: str = "it",
    initial: int = 0,
) -> Any:
    """A new tqdm bar as ``spec`` asks; ``desc`` and ``unit`` are the caller's
    defaults for what ``spec`` leaves as None."""
    tqdm = load_tqdm(call)
    return tqdm(
        total=total,
        initial=initial,
        desc=spec.desc if spec.desc is not None else desc,
        leave=spec.leave,
        position=spec.position,
        unit=spec.unit if spec.unit is not None else unit,
        dynamic_ncols=True,
    )


# ------------------------------------------------------- bars of shared compiled loops

_OPEN: list[Any] = []  # bars that ``tick_newest`` reports to, newest last
# The named scope of ``tick_newest``'s reports alone (a scan's bar reports to
# its own ``Bar``, in "scanax.progress").
TICK_SCOPE = "scanax.fit.progress"


@contextlib.contextmanager
def showing(bar: Any) -> Iterator[Any]:
    """Hold ``bar`` open as the newest one while the block runs, then close it."""
    _OPEN.append(bar)
    try:
        yield bar
    finally:
        _OPEN.remove(bar)
        bar.close()


def report_newest(done: Any, loss: Any) -> None:
    """Host side of ``tick_newest``: move the newest bar to ``done`` steps and show
    ``loss``. Reports may arrive out of order, so the bar never moves back."""
    if _OPEN:
        bar, done = _OPEN[-1], int(done)
        if done > bar.n:
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{float(loss):.4g}")


def report_if(
    when: jax.Array,
    host: Callable[..., None],
    *args: jax.Array,
    scope: str = "scanax.progress",
) -> None:
    """In a compiled loop: call ``host(*args)`` on the host if ``when`` (a host
    callback behind ``_once.once_if``: a ``lax.cond``, or in fit's chunked
    loop a loop of at most one trip; nothing is sent when it is false)."""
    with jax.named_scope(scope):
        once_if(
            when,
            lambda *a: jax.debug.callback(host, *a),
            lambda *a: None,
            *args,
        )


def tick_newest(when: jax.Array, done: jax.Array, loss: jax.Array) -> None:
    """In a compiled loop: if ``when``, report ``done`` and ``loss`` to the newest
    bar (``report_newest``, looked up when called: one function for every
    program, so ``_fit/program.py`` may share the executable of a program
    whose only callbacks are these, found by ``TICK_SCOPE``)."""
    report_if(when, _report_newest, done, loss, scope=TICK_SCOPE)


def _report_newest(done: Any, loss: Any) -> None:
    """``report_newest``, looked up when called (the one callback every
    program holds)."""
    report_newest(done, loss)


def default_every(length: int) -> int:
    """About ``_DEFAULT_UPDATES`` updates; preferably (10 to 20 updates) a divisor
    of ``length``, so that the chunks are equal and no odd one is joined on."""
    base = max(2, math.ceil(length / _DEFAULT_UPDATES))
    for every in range(base, min(length, 2 * base, base + 1000) + 1):
        if length % every == 0:
            return every
    return base


class Bar:
    """Host-side state of one scan's bar.

    Callbacks without an order (``jax.debug.callback``) may arrive permuted within
    an unrolled group of steps, so the bar moves to the largest count seen, and a
    run ends after the number of reports it sends (``expected``), in any order.
    """

    def __init__(self, spec: Progress, total: int):
        self.spec = spec
        self.total = total
        self.expected = 0
        self.received = 0
        self.bar: Any = None

    def report(self, done: Any, last: Any) -> None:
        if self.bar is None:
            self.bar = open_bar(self.spec, self.total, "scanax.scan")
            self.received = 0
        done = self.total if bool(last) else int(done)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        self.received += 1
        if self.received >= self.expected:
            self.bar.close()
            self.bar = None


class Reporter:
    """The in-loop half of a progress bar: the counter and its ticks.

    Before the steps ``[count, count + n)`` run, one callback reports ``count`` if
    those steps hold a multiple of ``every`` (so step 0 opens the bar), or if they
    are the last ones (then the bar fills up and closes). Every report is made
    inside the loop: none can run before the loop or be hoisted out of it.
    """

    def __init__(self, spec: Progress, total: int):
        self.total = total
        self.every = spec.every if spec.every is not None else default_every(total)
        self._bar = Bar(spec, total)

    def init(self) -> jax.Array:
        return jnp.zeros((), jnp.int32)

    def hit(self, count: Any, n: int) -> Any:
        """Whether the steps ``[count, count + n)`` hold a multiple of ``every``."""
        if n == 1:
            return count % self.every == 0
        return (count + n - 1) // self.every * self.every >= count

    def plan(self, blocks: list[int]) -> None:
        """Expect one report per block (in run order) that hits or is the last."""
        count, reports = 0, 0
        for n in blocks:
            reports += bool(self.hit(count, n)) or count + n == self.total
            count += n
        self._bar.expected = reports

    def tick(self, count: jax.Array, n: int = 1) -> jax.Array:
        """Report (maybe) before ``n`` steps; returns the counter after them."""
        last = count + n == self.total
        bar = self._bar  # `bar.report` looked up when the callback runs
        report_if(self.hit(count, n) | last, lambda d, f: bar.report(d, f), count, last)
        return count + n

    def wrap(self, loop: Loop) -> Loop:
        """The loop with ``(carry, counter)`` as carry, ticking once per step."""
        body = loop.body
        t = loop.length
        self._bar.expected = -(-t // self.every) + ((t - 1) % self.every != 0)

        def counted(state, x):
            carry, count = state
            count = self.tick(count)
            carry, y = body(carry, x)
            return (carry, count), y

        return Loop(counted, (loop.init, self.init()), loop.xs, loop.length)
