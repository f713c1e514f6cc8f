"""Messages of the logging errors: ``scanax.fit``'s ``log=`` sinks
(``scanax.TensorBoard``, ``scanax.CSV``, callables), a sink that raises while
training runs, and the optional packages that sinks and plots need."""

from __future__ import annotations

import os
import types
from typing import Any

from . import short_type
from .fit import CALL

_SINKS = (
    "scanax.TensorBoard(logdir), scanax.CSV(path), or a function "
    "sink(step, metrics) -> None."
)


def sink_name(sink: Any) -> str:
    """How a message names a sink: a function by its qualified name, an object
    by its repr when its class defines one (``scanax.CSV('m.csv')``), else by
    its type."""
    if isinstance(
        sink, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)
    ):
        return f"function {sink.__qualname__}"
    if type(sink).__repr__ is not object.__repr__:
        text = repr(sink)
        return text if len(text) <= 80 else text[:77] + "..."
    return f"a {type(sink).__name__} object"


def missing_extra(call: str, what: str, package: str, extra: str) -> ImportError:
    return ImportError(
        f"{call}: {what} needs the `{package}` package, which is not installed.\n"
        f"Fix: `pip install scanax[{extra}]` (or `pip install {package}`)."
    )


def bad_sink(
    index: int | None, entry: Any, call: str = CALL, name: str = "log"
) -> TypeError:
    where = f"`{name}`" if index is None else f"`{name}[{index}]`"
    hint = ""
    if isinstance(entry, (str, os.PathLike)):
        path = os.fspath(entry)
        maker = "CSV" if str(path).endswith(".csv") else "TensorBoard"
        hint = f" A path alone does not say the format: use scanax.{maker}({path!r})."
    elif isinstance(entry, dict) and name == "log":
        hint = " A dict is not a sink; to log to several places pass a list."
    # fit's log= takes a list; scanax.Log(sink) takes one (one Log per sink)
    takes = "a sink or a list of sinks" if name == "log" else "one sink"
    return TypeError(
        f"{call}: {where} is {short_type(entry)}, which is not a sink (a callable "
        f"sink(step, metrics)).{hint}\nFix: pass {takes}: {_SINKS}"
    )


def path_type(call: str, name: str, path: Any) -> TypeError:
    return TypeError(
        f"{call}: `{name}` must be a path (str or os.PathLike), got "
        f"{short_type(path)}.\nFix: pass e.g. {call}('runs/exp1')."
    )


def rows_mismatch(n_steps: int, name: str, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"{CALL} (logging): {n_steps} log steps but window values {name!r} have "
        f"shape {shape}; each must have one row per step (a leading axis of "
        f"{n_steps}).\nFix: pass one value per step and metric."
    )


def steps_not_increasing(last: int | None, steps: list[int]) -> ValueError:
    after = "" if last is None else f" after step {last} (already written)"
    return ValueError(
        f"{CALL} (logging): log steps must increase strictly{after}, got "
        f"{steps[:10]}{' ...' if len(steps) > 10 else ''}: each step is written "
        "once.\nFix: write each window once, in order; after a restart call "
        "`resume(step)` first."
    )


class SinkError(RuntimeError):
    """A ``log=`` sink raised while ``scanax.fit`` ran. Training went on without
    it (the other sinks kept writing).

    Attributes:
        failures: ``(sink, step, exception)`` for each sink that failed: the step
            being written (None when it failed on flush/close before any write).
        result: the training's result when the error is raised after training
            (``scanax.FitResult``), else None.
    """

    def __init__(
        self,
        message: str,
        failures: list[tuple[Any, int | None, BaseException]],
        result: Any = None,
    ):
        super().__init__(message)
        self.failures = failures
        self.result = result


def sink_failed(
    failures: list[tuple[Any, int | None, BaseException]], result: Any = None
) -> SinkError:
    lines = []
    for sink, step, err in failures:
        at = "before writing any step" if step is None else f"at step {step}"
        lines.append(
            f"  {sink_name(sink)} raised {type(err).__name__} {at}: {err}".rstrip()
        )
    kept = (
        " The training result is kept: it is this error's `.result`."
        if result is not None
        else ""
    )
    n = len(failures)
    return SinkError(
        f"{CALL}: {'a log sink' if n == 1 else f'{n} log sinks'} raised while "
        "training ran; each was skipped from then on, the other sinks went on "
        f"writing.{kept}\n"
        + "\n".join(lines)
        + "\nFix: see each sink's error (the first "
        "is chained as __cause__); a callable sink must accept "
        "(step: int, metrics: dict[str, float | numpy.ndarray]).",
        failures,
        result,
    )


def sink_open_failed(
    failures: list[tuple[Any, int | None, BaseException]],
) -> SinkError:
    lines = [
        f"  {sink_name(sink)}: {type(err).__name__}: {err}".rstrip()
        for sink, _, err in failures
    ]
    n = len(failures)
    return SinkError(
        f"{CALL}: {'a log sink' if n == 1 else f'{n} log sinks'} cannot write "
        "its log, so nothing was trained (no step ran, the model and optimizer "
        "are as they were):\n"
        + "\n".join(lines)
        + "\nFix: give a path in a writable directory, or check the sink's error "
        "(chained as __cause__).",
        failures,
    )


def path_wrong_kind(path: str, directory: bool, wanted: str | None = None) -> OSError:
    kind = "a directory" if directory else "a file"
    made = f": {wanted} cannot be made" if wanted is not None else ""
    return (NotADirectoryError if directory else IsADirectoryError)(
        f"{path} is not {kind}{made}"
    )


def path_not_writable(path: str, wanted: str) -> PermissionError:
    made = "" if path == wanted else f": {wanted} cannot be made"
    return PermissionError(f"{path} is not writable{made}")


def every_type(call: str, every: Any) -> TypeError | ValueError:
    """An int that is not positive is a wrong value; anything else a wrong type."""
    kind = ValueError if type(every) is int else TypeError
    return kind(
        f"{call}: `every` must be a positive int (steps per window), got "
        f"{short_type(every)}.\nFix: pass e.g. every=10."
    )


def no_mlflow() -> ImportError:
    return missing_extra("scanax.MLflow", "logging to MLflow", "mlflow", "mlflow")


def log_one_sink(sink: Any) -> TypeError:
    return TypeError(
        f"scanax.Log: takes one sink, got {short_type(sink)} of "
        f"{len(sink)}.\nFix: one scanax.Log per sink, e.g. "
        "callbacks=[scanax.Log(f, every=10), scanax.Log(g, every=10)]."
    )
