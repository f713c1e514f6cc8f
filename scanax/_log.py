"""``log=``: training metrics reduced over windows of steps and written by sinks
on the host while training runs.

``scanax.fit`` brings every step's metrics to the host at the end of each
compiled call (for ``history``); ``window_reduce`` turns them into windows (a
mean for floating metrics, the last value for integer and boolean ones: a count
or a flag has no mean) and ``Sinks`` (built from ``log=``) hands each window to
every sink as ``sink(step, metrics)``: ``TensorBoard``, ``CSV`` or any callable.

A window closes at every step that is a multiple of ``log_every`` (global step
numbers, so windows line up across calls and resumes) and at the last step of a
run; it is written under that step.
"""

from __future__ import annotations

import csv
import io
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _feature
from ._errors import log as errors

DEFAULT_EVERY = 10  # steps per window

# --------------------------------------------------------------------------- sinks


def flat_items(metrics: Mapping[str, Any]) -> list[tuple[str, float]]:
    """``(name, value)`` pairs of a sink's metrics, one per number: an array
    value (e.g. one per population member) gives ``name/0``, ``name/1``, ...;
    NaN entries (no value) are left out."""
    out = []
    for name, value in metrics.items():
        arr = np.asarray(value)
        if arr.ndim == 0:
            if not math.isnan(float(arr)):
                out.append((name, float(arr)))
            continue
        for idx in np.ndindex(arr.shape):
            v = float(arr[idx])
            if not math.isnan(v):
                out.append((f"{name}/{'/'.join(map(str, idx))}", v))
    return out


class TensorBoard(_feature.Feature):
    """A log sink writing TensorBoard event files into ``logdir``
    (``scanax.fit(..., callbacks=[scanax.TensorBoard("runs/exp1", every=20)])``).

    Each metric is a scalar summary under its name (population members:
    ``loss/0``, ``loss/1``, ...) at the window's step. Needs ``tensorboardX``
    (``pip install scanax[tensorboard]``), imported when the sink is made.
    Events are written synchronously (no writer thread): after ``flush()`` they
    are in the file, so a crash loses nothing flushed.

    Resuming: each run (each ``resume(step)``, or the first write) opens a new
    event file starting with a ``SessionLog.START`` event at ``step + 1`` (what
    ``tensorboardX.SummaryWriter(purge_step=step + 1)`` writes), so readers that
    follow TensorBoard's rule (TensorBoard itself, its ``EventAccumulator``,
    ``tbparse``) hide the events of earlier files from that step on: after a
    crash and a resume from a checkpoint at step S, every step appears once.
    Event files are named so that they sort in the order they were written.

    Arguments:
        logdir: the directory for the event files (created if needed).
        every: in ``fit``, steps per window: each window's means are written
            at its last step (default 10).

    Example:
        >>> import scanax
        >>> sink = scanax.TensorBoard("runs/exp1")  # doctest: +SKIP
    """

    def __init__(self, logdir: str | os.PathLike, *, every: int = DEFAULT_EVERY):
        if not isinstance(logdir, (str, os.PathLike)):
            raise errors.path_type("scanax.TensorBoard", "logdir", logdir)
        self.every = _every("scanax.TensorBoard", every)
        _tensorboardx()  # fail now, not in the middle of training
        self.logdir = os.fspath(logdir)
        self._writer: Any = None

    def __repr__(self) -> str:
        return f"scanax.TensorBoard({self.logdir!r})"

    def check(self) -> None:
        """Raise ``OSError`` if ``logdir`` cannot be created or written (nothing
        is created here)."""
        writable(self.logdir, directory=True)

    def resume(self, step: int) -> None:
        """Start writing after ``step``: a new event file that hides later steps
        of the earlier ones."""
        self.close()
        tbx = _tensorboardx()
        os.makedirs(self.logdir, exist_ok=True)
        # time.time_ns keeps files of the same second in the order written
        self._writer = tbx.event_file_writer.EventsWriter(
            os.path.join(self.logdir, "events"), f".{time.time_ns():020d}"
        )
        event_pb2 = tbx.proto.event_pb2
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.write_event(
            event_pb2.Event(
                wall_time=time.time(), step=int(step) + 1, session_log=start
            )
        )

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            self.resume(step - 1)
        tbx = _tensorboardx()
        value = tbx.proto.summary_pb2.Summary.Value  # (what tbx.summary.scalar
        # makes, without its per-value conversions: a third of the time)
        values = [value(tag=t, simple_value=v) for t, v in flat_items(metrics)]
        summary = tbx.proto.summary_pb2.Summary(value=values)
        event = tbx.proto.event_pb2.Event(
            wall_time=time.time(), step=int(step), summary=summary
        )
        self._writer.write_event(event)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()


class MLflow(_feature.Feature):
    """A log sink logging each window's metrics to MLflow's active run
    (``mlflow.log_metrics(metrics, step=step)``; start one with
    ``mlflow.start_run()`` around ``fit``, or MLflow starts one). Needs
    ``mlflow`` (or ``mlflow-skinny``), imported when the sink is made.

    Arguments:
        every: in ``fit``, steps per window (default 10).

    Example:
        >>> import scanax
        >>> sink = scanax.MLflow(every=50)  # doctest: +SKIP
    """

    def __init__(self, *, every: int = DEFAULT_EVERY):
        self.every = _every("scanax.MLflow", every)
        self._mlflow = _mlflow()

    def __repr__(self) -> str:
        return f"scanax.MLflow(every={self.every})"

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._mlflow.log_metrics(dict(flat_items(metrics)), step=int(step))


class Log(_feature.Feature):
    """Any log sink ``sink(step, metrics)`` with its window
    (``scanax.fit(..., callbacks=[scanax.Log(my_sink, every=50)])``): the
    means of each window of ``every`` steps are given to it at the window's
    last step, with the evaluations at theirs (see ``docs/training_features.md``).
    A sink may also have ``resume(step)``, ``flush()``, ``close()`` and
    ``check()`` methods, called as ``scanax.CSV``'s are.

    Arguments:
        sink: a callable ``sink(step, metrics)``.
        every: steps per window (default 10).
    """

    def __init__(self, sink: Callable, *, every: int = DEFAULT_EVERY):
        (self.sink,) = resolve(sink)
        self.every = _every("scanax.Log", every)

    def __repr__(self) -> str:
        return f"scanax.Log({self.sink!r}, every={self.every})"


def windows(features: list) -> dict[int, list]:
    """``{every: [sinks]}``: the log sinks among ``fit``'s features, by their
    windows."""
    out: dict[int, list] = {}
    for f in features:
        if isinstance(f, Log):
            out.setdefault(f.every, []).append(f.sink)
        elif isinstance(f, (TensorBoard, CSV, MLflow)):
            out.setdefault(f.every, []).append(f)
    return out


def _every(call: str, every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise errors.every_type(call, every)
    return every


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError as err:
        raise errors.no_mlflow() from err
    return mlflow


def _tensorboardx() -> Any:
    """The ``tensorboardX`` modules the sink uses (synchronous event writing)."""
    try:
        import tensorboardX.event_file_writer
        import tensorboardX.proto.event_pb2
        import tensorboardX.proto.summary_pb2
        import tensorboardX.summary
    except ImportError as err:
        raise errors.missing_extra(
            "scanax.TensorBoard",
            "writing TensorBoard files",
            "tensorboardX",
            "tensorboard",
        ) from err
    return tensorboardX


class CSV(_feature.Feature):
    """A log sink writing one CSV row per window: ``step`` first, then one
    column per metric (population members: ``loss/0``, ``loss/1``, ...), in the
    order first seen; an empty cell where a metric has no value at that step
    (e.g. ``val_loss`` between evaluations; pandas reads it as NaN). A metric
    that appears later rewrites the file once with the wider header.

    Resuming: ``resume(step)`` (or the first write, at ``step + 1``) rewrites the
    file keeping only the rows up to ``step``, so after a crash and a resume from
    a checkpoint at step S the file holds every step once. A new run (step 0)
    therefore starts the file over.

    Arguments:
        path: the CSV file (its directory is created if needed).
        every: in ``fit``, steps per window (default 10).

    Example:
        >>> import scanax
        >>> sink = scanax.CSV("metrics.csv")
        >>> sink(10, {"loss": 0.5}); sink(20, {"loss": 0.25}); sink.close()
        >>> print(open("metrics.csv").read().strip())
        step,loss
        10,0.5
        20,0.25
    """

    def __init__(self, path: str | os.PathLike, *, every: int = DEFAULT_EVERY):
        if not isinstance(path, (str, os.PathLike)):
            raise errors.path_type("scanax.CSV", "path", path)
        self.every = _every("scanax.CSV", every)
        self.path = os.fspath(path)
        self._columns: list[str] = []
        self._file: Any = None

    def __repr__(self) -> str:
        return f"scanax.CSV({self.path!r})"

    def check(self) -> None:
        """Raise ``OSError`` if ``path`` cannot be created or written (nothing
        is created here)."""
        writable(self.path, directory=False)

    def resume(self, step: int) -> None:
        """Keep the rows up to ``step`` (a partly written last row is dropped) and
        append after them."""
        self.close()
        columns, rows = self._read()
        rows = [r for r in rows if int(r["step"]) <= step]
        self._columns = [c for c in columns if c != "step"]
        self._rewrite(rows)

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._file is None:
            self.resume(step - 1)
        items = flat_items(metrics)
        new = [k for k, _ in items if k not in self._columns]
        if new:
            self._file.close()
            self._file = None
            _, rows = self._read()
            self._columns += new
            self._rewrite(rows)
        values = dict(items)
        cells = [str(int(step))] + [_cell(values.get(c)) for c in self._columns]
        self._file.write(_line(cells))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        """The header and the complete, well-formed rows of the file."""
        if not os.path.exists(self.path):
            return [], []
        with open(self.path, newline="") as f:
            lines = f.read().split("\n")
        if not lines or not lines[0]:
            return [], []
        # a line without its newline was cut short by a crash (rows end with "\n")
        body = lines[1:-1]
        columns = next(csv.reader([lines[0]]))
        rows = []
        for cells in csv.reader(body):
            if len(cells) != len(columns) or not cells[0].lstrip("-").isdigit():
                continue
            rows.append(dict(zip(columns, cells)))
        return columns, rows

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        """Write the header and ``rows`` atomically, then keep the file open for
        appending."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        header = ["step", *self._columns]
        with open(tmp, "w", newline="") as f:
            f.write(_line(header))
            for r in rows:
                f.write(_line([r.get(c, "") for c in header]))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")  # noqa: SIM115


def writable(path: str, directory: bool) -> None:
    """Raise ``OSError`` unless ``path`` (a file, or a directory) exists and can
    be written, or can be created: its nearest existing ancestor is a writable
    directory. Nothing is created."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if directory != os.path.isdir(path):
            raise errors.path_wrong_kind(path, directory)
        if not os.access(path, os.W_OK):
            raise errors.path_not_writable(path, path)
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise errors.path_wrong_kind(parent, True, path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise errors.path_not_writable(parent, path)


def _cell(value: float | None) -> str:
    return "" if value is None else repr(value)


def _line(cells: list[str]) -> str:
    """One CSV line (quoted where a cell needs it), ending in a newline."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(cells)
    return out.getvalue()


Sink = Callable[[int, Mapping[str, Any]], Any]


def resolve(log: Any) -> tuple[Sink, ...]:
    """The sinks of a ``log=`` value (a sink, a list or tuple of sinks, or
    None), validated."""
    if log is None:
        return ()
    entries, listed = (log, True) if isinstance(log, (list, tuple)) else ([log], False)
    for i, entry in enumerate(entries):
        if not callable(entry) or isinstance(entry, type):
            raise errors.bad_sink(i if listed else None, entry)
    return tuple(entries)


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
        >>> from scanax._log import Sinks
        >>> seen = []
        >>> sinks = Sinks(lambda step, m: seen.append((step, m)))
        >>> sinks.resume(0)
        >>> sinks.write(np.array([10, 20]), {"loss": np.array([0.5, 0.25])})
        >>> sinks.close(); sinks.raise_pending()
        >>> seen
        [(10, {'loss': 0.5}), (20, {'loss': 0.25})]
    """

    def __init__(self, log: Any):
        self.sinks = resolve(log)
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


# ---------------------------------------------------------------- window reduction


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
        >>> from scanax._log import window_reduce
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
