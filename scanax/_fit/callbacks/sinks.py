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

import numpy as np

from ..._errors import log as errors
from ..._tree import as_int
from .. import feature as _feature, processes as _processes

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
        self.logdir = os.path.expanduser(os.fspath(logdir))
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
        if isinstance(sink, (list, tuple)):
            raise errors.log_one_sink(sink)
        if sink is None:  # (resolve's "no sinks")
            raise errors.bad_sink(None, sink, "scanax.Log", "sink")
        (self.sink,) = resolve(sink, "scanax.Log", "sink")
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
    count = as_int(every)
    if count is None or count < 1:
        raise errors.every_type(call, every)
    return count


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
        self.path = os.path.expanduser(os.fspath(path))
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
        header = ["step", *self._columns]
        lines = [_line(header), *(_line([r.get(c, "") for c in header]) for r in rows)]
        _processes.write_atomically(self.path, "".join(lines))
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


def resolve(log: Any, call: str = errors.CALL, name: str = "log") -> tuple[Sink, ...]:
    """The sinks of a ``log=`` value (a sink, a list or tuple of sinks, or
    None), validated; errors name ``call``'s argument ``name``."""
    if log is None:
        return ()
    entries, listed = (log, True) if isinstance(log, (list, tuple)) else ([log], False)
    for i, entry in enumerate(entries):
        if not callable(entry) or isinstance(entry, type):
            raise errors.bad_sink(i if listed else None, entry, call, name)
    return tuple(entries)


# ---------------------------------------------------------------- window reduction
