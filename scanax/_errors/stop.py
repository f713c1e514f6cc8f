"""Messages of ``scanax.EarlyStop``'s errors: its arguments and the monitored
metric's name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from . import short_type

CALL = "scanax.EarlyStop"


def monitor_type(monitor: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `monitor` must be the name of a metric (a non-empty str), got "
        f"{short_type(monitor)}.\nFix: pass e.g. EarlyStop('val_loss', patience=5)."
    )


def patience_type(patience: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `patience` must be an int (evaluations without improvement "
        f"before stopping), got {short_type(patience)}.\nFix: pass e.g. patience=5."
    )


def patience_value(patience: int) -> ValueError:
    return ValueError(
        f"{CALL}: `patience` must be 0 or more, got {patience}.\nFix: pass the "
        "number of evaluations without improvement to allow before stopping, "
        "e.g. patience=5 (0 stops at the first one)."
    )


def min_delta_type(min_delta: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `min_delta` must be a real number, got {short_type(min_delta)}."
        "\nFix: pass e.g. min_delta=1e-3."
    )


def min_delta_value(min_delta: float) -> ValueError:
    return ValueError(
        f"{CALL}: `min_delta` must be finite and 0 or more, got {min_delta!r}: it "
        "is the amount by which a value must beat the best to count as an "
        "improvement, in the direction `mode` gives.\nFix: pass its absolute "
        "value, e.g. min_delta=1e-3 (with mode='max' for metrics that should "
        "grow)."
    )


def bad_mode(mode: Any) -> ValueError:
    return ValueError(
        f"{CALL}: `mode` must be 'auto', 'min' or 'max', got {mode!r}.\nFix: "
        "leave it out ('auto': 'max' for accuracies and other scores by the "
        "metric's name, 'min' otherwise; see EarlyStop.direction), or pass "
        "mode='min' for losses and errors, mode='max' for metrics that should grow."
    )


def restore_best_type(restore_best: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `restore_best` must be True or False, got "
        f"{short_type(restore_best)}.\nFix: pass restore_best=True to end with the "
        "best model, False to end with the last one."
    )


def unknown_monitor(monitor: str, available: Iterable[str]) -> ValueError:
    names = sorted(available)
    listed = ", ".join(names) if names else "none"
    fixes = []
    close = difflib.get_close_matches(monitor, names, n=1)
    if close:
        fixes.append(f"Did you mean {close[0]!r}?")
    if monitor.startswith("val_") and not any(n.startswith("val_") for n in names):
        fixes.append(
            "Validation metrics (val_*) exist only with eval_data=... (and "
            "eval_every=...)."
        )
    fixes.append(
        f"{'Otherwise m' if fixes else 'M'}onitor one of the metrics above "
        "(loss_fn's metrics by name, evaluation metrics as val_<name>)."
    )
    return ValueError(
        f"{CALL}: monitor={monitor!r} is not a metric of this run; the metrics "
        f"are: {listed}.\nFix: " + " ".join(fixes)
    )


def monitor_not_scalar(monitor: str, value: Any, per: str = "evaluation") -> ValueError:
    """``per``: what the metric has one value per (an evaluation, a training
    step, a rollout's collection)."""
    source = {"step": "loss_fn", "collection": "the Rollout's collect"}
    return ValueError(
        f"{CALL}: the monitored metric {monitor!r} must be one number per "
        f"{per} (per member, under jax.vmap), got {short_type(value)}.\nFix: "
        f"return a scalar for it from {source.get(per, 'loss_fn/eval_fn')} (e.g. a "
        "mean), or monitor a scalar metric."
    )


def best_dir_type(directory: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `best_dir` must be a path (str or os.PathLike), got "
        f"{short_type(directory)}.\nFix: pass a directory path, e.g. "
        "best_dir='runs/best'."
    )


def best_dir_not_dir(path: str) -> ValueError:
    return ValueError(
        f"{CALL}: best_dir {path!r} exists and is not a directory.\nFix: pass a "
        "directory (it is created if missing), not a file."
    )


def monitor_never_finite(monitor: str, count: int, members: list | None) -> str:
    who = "" if members is None else f" for member(s) {members}"
    return (
        f"scanax.fit: EarlyStop's monitor {monitor!r} was never finite in this "
        f"call{who} ({count} value(s), all NaN or infinite): none improved, so "
        "no best state was kept, and the stop counted every check as one "
        "without improvement.\nFix: look at what computes it on one batch, e.g. "
        "`scanax.evaluate(model, eval_fn, val_data)`; a mean over an empty "
        "selection, log(0) or 0/0 give NaN."
    )
