"""``scanax.fit``'s logging on the host: the steps' metrics reduced over windows
(``window_reduce``, ``merge``), handed to the log sinks (``Sinks``: failures
recorded, never stopping training) by a ``Logger`` per window length, through
the run's ``Logs`` hook."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import log as errors
from .callbacks import sinks as _log
from .hooks import Collected


class Logger:
    """``log=``: the steps' metrics, reduced over windows of ``every`` steps
    (``window_reduce``: means of floating metrics, last values of the others)
    and handed to the sinks at the end of each compiled call, with the
    evaluations at their steps. ``fit`` brings every step's metrics to the host
    at the end of each call anyway (for ``history``), so the windows are reduced
    there, once per call, with the same values a reduction on device gives.

    A window closes at every multiple of ``every`` (global steps: windows line up
    across calls and resumes) and at the end of a run. After a restart from a
    checkpoint, the sinks drop what they hold after the step where the restored
    history begins (this call's start, when the checkpoint was written by a call
    that started there) and are given that history again, so that each step is
    logged exactly once, whatever earlier restarts cut: a call writes the same
    rows as the uninterrupted call did.
    """

    def __init__(self, sinks: Any, every: int, members: bool = False):
        self.sinks, self.every, self.members = sinks, every, members
        self.rows: list[tuple[np.ndarray, dict]] = []  # pending train steps
        self.val: list[tuple[np.ndarray, dict]] = []  # pending evaluations

    def open(self, cut: int, history: dict | None = None) -> None:
        """Open the sinks, keeping what they hold up to step ``cut``, then give
        them ``history``'s steps after it (a run restored from a checkpoint: its
        history since this call's start)."""
        self.sinks.open(cut)
        if history is None:
            return
        axis = 1 if self.members else 0
        steps = np.asarray(history["step"])
        keep = steps > cut
        sparse = ("val_", "rollout_")  # (entries at their own steps)
        names = [k for k in history if k != "step" and not k.startswith(sparse)]
        self.add(
            steps[keep], {k: np.compress(keep, history[k], axis=axis) for k in names}
        )
        for prefix in sparse:
            if prefix + "step" in history:
                vsteps = np.asarray(history[prefix + "step"])
                vkeep = vsteps > cut
                vnames = [
                    k for k in history if k.startswith(prefix) and k != prefix + "step"
                ]
                self.add_val(
                    vsteps[vkeep],
                    {k: np.compress(vkeep, history[k], axis=axis) for k in vnames},
                )

    def add(self, steps: np.ndarray, values: dict) -> None:
        """Per-step values (``[steps, ...]``; a population's ``[members, steps,
        ...]``)."""
        if len(steps):
            self.rows.append((np.asarray(steps), self._steps_first(values)))

    def add_val(self, steps: np.ndarray, values: dict) -> None:
        if len(steps):
            self.val.append((np.asarray(steps), self._steps_first(values)))

    def _steps_first(self, values: dict) -> dict:
        if not self.members:
            return {k: np.asarray(v) for k, v in values.items()}
        return {k: np.moveaxis(np.asarray(v), 1, 0) for k, v in values.items()}

    def write(self, final: bool = False) -> None:
        """Write the windows closed so far (all of them when ``final``)."""
        if not self.rows and not self.val:
            return
        steps = np.concatenate([s for s, _ in self.rows]) if self.rows else None
        last = max(int(s[-1]) for s, _ in [*self.rows, *self.val])
        cut = last if final else last // self.every * self.every
        parts = []
        if steps is not None:
            names = list(self.rows[0][1])
            values = {k: np.concatenate([v[k] for _, v in self.rows]) for k in names}
            done = steps <= cut
            if done.any():
                parts.append(
                    window_reduce(
                        steps[done], {k: v[done] for k, v in values.items()}, self.every
                    )
                )
            rest = ~done
            self.rows = (
                [(steps[rest], {k: v[rest] for k, v in values.items()})]
                if rest.any()
                else []
            )
        pending = []
        for names in dict.fromkeys(tuple(v) for _, v in self.val):
            # (each kind of entry apart: evaluations, a rollout's collections)
            group = [(s, v) for s, v in self.val if tuple(v) == names]
            vsteps = np.concatenate([s for s, _ in group])
            vvalues = {k: np.concatenate([v[k] for _, v in group]) for k in names}
            done = vsteps <= cut
            if done.any():
                parts.append((vsteps[done], {k: v[done] for k, v in vvalues.items()}))
            rest = ~done
            if rest.any():
                pending.append((vsteps[rest], {k: v[rest] for k, v in vvalues.items()}))
        self.val = pending
        if parts:
            self.sinks.write(*merge(*parts))
        self.sinks.flush()


class Sinks:
    """The sinks of one ``scanax.fit`` call, written from its host side.

    A sink is any callable ``sink(step, metrics)``; if it also has ``resume(step)``,
    ``flush()`` or ``close()`` methods (as ``TensorBoard`` and ``CSV`` do), they are
    called too. ``metrics`` maps each metric name to a Python float, or to a
    numpy array for per-member values (populations); a metric without a value at
    that step (NaN: e.g. ``val_*`` between evaluations) is left out.

    Failures: a sink that raises (in any method) does not stop training. ``Sinks``
    records ``(sink, step, exception)``, skips that sink from then on and goes on
    with the others; ``failures`` lists them. After training, ``close()`` then
    ``raise_pending(result)`` raises one ``scanax.SinkError`` naming each failed
    sink and its step, chained to the first sink's exception, with the training
    result attached as ``.result``.

    The integration, in order: ``Sinks(log)`` while validating arguments (raises
    ``TypeError`` for a bad entry); ``resume(start_step)`` once before the first
    chunk (the step the call starts from: 0 for a new model, the checkpoint's
    step after a restart); ``write(steps, windows)`` with the windows of each
    chunk, then ``flush()``; ``close()`` at the end (also on error: it never
    raises), then ``raise_pending(result)``.

    Example:
        >>> import numpy as np
        >>> from scanax._fit.logs import Sinks
        >>> seen = []
        >>> sinks = Sinks(lambda step, m: seen.append((step, m)))
        >>> sinks.resume(0)
        >>> sinks.write(np.array([10, 20]), {"loss": np.array([0.5, 0.25])})
        >>> sinks.close(); sinks.raise_pending()
        >>> seen
        [(10, {'loss': 0.5}), (20, {'loss': 0.25})]
    """

    def __init__(self, log: Any):
        self.sinks = _log.resolve(log)
        self.failures: list[tuple[Any, int | None, BaseException]] = []
        self._failed: set[int] = set()
        self.last_step: int | None = None

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def _each(self, method: str, step: int | None, *args: Any) -> None:
        for i, sink in enumerate(self.sinks):
            if i in self._failed:
                continue
            fn = sink if method == "__call__" else getattr(sink, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as err:  # the sink's own error, reported after training
                self._failed.add(i)
                self.failures.append((sink, step, err))

    def resume(self, step: int) -> None:
        """Start logging after global step ``step``: sinks with ``resume`` drop
        what they hold after it (left by a run that crashed past its last
        checkpoint)."""
        self.last_step = int(step)
        self._each("resume", self.last_step, self.last_step)

    def open(self, step: int) -> None:
        """``resume(step)``, raising ``scanax.SinkError`` at once if a sink
        cannot start (an unwritable path): before the first step, not after
        training. The sinks are closed again then."""
        self.resume(step)
        if self.failures:
            failures = self.failures
            self.close()
            raise errors.sink_open_failed(failures) from failures[0][2]

    def check(self) -> None:
        """Raise ``scanax.SinkError`` for a sink whose path cannot be written
        (a sink's ``check()``, as ``CSV`` and ``TensorBoard`` have), before
        anything is created or written."""
        failures = []
        for sink in self.sinks:
            check = getattr(sink, "check", None)
            if check is None:
                continue
            try:
                check()
            except OSError as err:
                failures.append((sink, None, err))
        if failures:
            raise errors.sink_open_failed(failures) from failures[0][2]

    def write(self, steps: np.ndarray, windows: Mapping[str, np.ndarray]) -> None:
        """Hand each row (one per window) to every sink: ``steps`` is ``int[n]``,
        each ``windows[name]`` is ``[n]`` or ``[n, *member_shape]``. Steps must
        increase, after the last one written."""
        steps = np.asarray(steps).reshape(-1)
        arrays = {k: np.asarray(v) for k, v in windows.items()}
        for name, arr in arrays.items():
            if arr.shape[:1] != steps.shape:
                raise errors.rows_mismatch(len(steps), name, arr.shape)
        as_list = [int(s) for s in steps]
        floor = -math.inf if self.last_step is None else self.last_step
        if any(b <= a for a, b in zip([floor, *as_list], as_list)):
            raise errors.steps_not_increasing(self.last_step, as_list)
        for i, step in enumerate(as_list):
            metrics = {}
            for name, arr in arrays.items():
                row = arr[i]
                if row.ndim == 0:
                    if not np.isnan(row):
                        metrics[name] = float(row)
                elif not np.all(np.isnan(row)):
                    metrics[name] = row
            self.last_step = step
            if metrics:
                self._each("__call__", step, step, metrics)

    def flush(self) -> None:
        """Flush every sink (at a chunk boundary)."""
        self._each("flush", self.last_step)

    def close(self) -> None:
        """Flush and close every sink; never raises (see ``raise_pending``)."""
        self._each("flush", self.last_step)
        self._each("close", self.last_step)

    def raise_pending(self, result: Any = None) -> None:
        """Raise ``scanax.SinkError`` if any sink failed, with ``result`` as its
        ``.result``; else do nothing."""
        if self.failures:
            raise errors.sink_failed(self.failures, result) from self.failures[0][2]


def merge(
    *parts: tuple[np.ndarray, Mapping[str, np.ndarray]],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One ``(steps, windows)`` from several (e.g. train windows and evaluations),
    over the sorted union of their steps, NaN where a part has no row; a step in
    several parts gives one row with the metrics of all."""
    steps = np.unique(np.concatenate([np.asarray(s).reshape(-1) for s, _ in parts]))
    out: dict[str, np.ndarray] = {}
    for s, windows in parts:
        idx = np.searchsorted(steps, np.asarray(s).reshape(-1))
        for name, v in windows.items():
            v = np.asarray(v)
            if name not in out:
                dtype = np.promote_types(v.dtype, np.float32)
                out[name] = np.full((len(steps), *v.shape[1:]), np.nan, dtype)
            out[name][idx] = v
    return steps, out


def _averaged(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _window_dtype(dtype: Any) -> Any:
    """A window value's dtype: sums in at least float32; as JAX stores it (no
    64-bit types unless ``jax_enable_x64``)."""
    if _averaged(dtype) and np.dtype(dtype).itemsize < 4:  # (any promotion mode)
        dtype = np.float32
    return jax.dtypes.canonicalize_dtype(dtype)


def window_reduce(
    steps: np.ndarray, values: Mapping[str, np.ndarray], log_every: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The window reduction: ``(window steps, windows)`` from
    per-step ``values`` (``[T, *shape]`` each) at global ``steps`` (``int[T]``).

    A window closes at each multiple of ``log_every`` and at the last step;
    floating metrics give the window's mean (summed in order in at least float32
    and multiplied by 1/count), the others the window's last value.

    Example:
        >>> import numpy as np
        >>> from scanax._fit.logs import window_reduce
        >>> window_reduce(np.arange(1, 6), {"loss": np.arange(1.0, 6.0)}, 2)
        (array([2, 4, 5]), {'loss': array([1.5, 3.5, 5. ], dtype=float32)})
    """
    steps = np.asarray(steps).reshape(-1)
    if steps.size == 0:
        return steps, {k: np.asarray(v)[:0] for k, v in values.items()}
    close = (steps % log_every == 0) | (np.arange(len(steps)) == len(steps) - 1)
    ends = np.flatnonzero(close)
    starts = np.concatenate([[0], ends[:-1] + 1])
    out = {}
    for name, v in values.items():
        v = np.asarray(v)
        dtype = np.dtype(_window_dtype(v.dtype))
        if _averaged(v.dtype):  # NaN (a population member not training) skipped
            rows = []
            for a, b in zip(starts, ends):
                w = v[a : b + 1].astype(dtype)
                seen = ~np.isnan(w)
                total = np.cumsum(np.where(seen, w, 0), axis=0, dtype=dtype)[-1]
                count = seen.sum(axis=0).astype(dtype)
                with np.errstate(invalid="ignore", divide="ignore"):
                    rows.append(np.where(count > 0, total * (1 / count), np.nan))
            out[name] = np.stack(rows).astype(dtype)
        else:
            out[name] = v[ends].astype(dtype)
    return steps[ends], out


class Logs:
    """``log=``: the logger (``_fit_checks.Logger``), its sinks opened at the
    start, given each call's steps and evaluations, closed at the end."""

    def __init__(self, logger: Any):
        self.logger = logger
        self.ended = False  # (the run's end wrote the last window)

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
        self.ended = True

    def failed(self, run: Any, err: BaseException) -> None:
        """(``close`` writes the last window)"""

    def close(self, run: Any) -> None:
        if not self.ended:
            # Interrupted or failed: the steps checked so far end a window, as
            # at a run's end (a continued call's windows then follow them);
            # their rows were dropped, and the continued call's first window
            # held only its own steps.
            with contextlib.suppress(Exception):  # (the run's own error goes on)
                self.logger.write(final=True)
        self.logger.sinks.close()
