"""``FitResult.plot``: training and validation curves of a ``scanax.fit`` history,
drawn with matplotlib (an optional extra, imported when called).

The figure is a ``matplotlib.figure.Figure`` made without ``pyplot``: nothing is
shown and no GUI backend is touched (saving uses Agg), so it works on machines
without a display; notebooks show the returned figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import log as log_errors, plot as errors

TRAIN_COLOR, VAL_COLOR = "C0", "C1"


def ema(values: np.ndarray) -> np.ndarray:
    """Bias-corrected exponential moving average along the last axis (as
    TensorBoard smooths), NaN entries skipped. Its span is about 1/50 of the
    length (``weight = 1 - 1/span``): the same look whatever the run's length."""
    values = np.asarray(values, np.float64)
    n = values.shape[-1]
    weight = min(0.999, 1.0 - 1.0 / max(1.0, n / 50))
    out = np.empty_like(values)
    flat, res = values.reshape(-1, n), out.reshape(-1, n)
    for row, dst in zip(flat, res):
        last, k = 0.0, 0
        for t, v in enumerate(row):
            if math.isfinite(v):
                last, k = last * weight + (1 - weight) * v, k + 1
            dst[t] = last / (1 - weight**k) if k else math.nan
    return out


def _rows(
    history: Mapping[str, Any], name: str, steps_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` with values ``[members, T]`` (one row for a single
    model)."""
    values = np.asarray(history[name], np.float64)
    if steps_key in history:
        steps = np.asarray(history[steps_key]).reshape(
            -1, np.shape(history[steps_key])[-1]
        )[0]
    else:
        steps = np.arange(1, values.shape[-1] + 1)
    if values.ndim not in (1, 2) or values.shape[-1] != len(steps):
        raise errors.steps_mismatch(name, values.shape, steps_key, len(steps))
    return steps, values.reshape(-1, len(steps))


def _scalar(history: Mapping[str, Any], name: str) -> bool:
    """Whether ``history[name]`` holds one number per step (per member): an
    array metric (``[T, ...]`` for one model, ``[members, T, ...]`` for a
    population, whose loss is ``[members, T]``) has no curve to draw."""
    shape = np.shape(history[name])
    if "loss" in history:
        return len(shape) <= np.ndim(history["loss"])
    steps = "val_step" if name.startswith("val_") else "step"
    return steps not in history or shape[-1:] == np.shape(history[steps])[-1:]


def _draw(
    ax: Any, steps: np.ndarray, rows: np.ndarray, label: str, **style: Any
) -> None:
    """One line per row; only the first is labelled (with the member count)."""
    many = len(rows) > 1
    for i, row in enumerate(rows):
        name = f"{label} ({len(rows)} members)" if many else label
        ax.plot(steps, row, label=name if i == 0 else "_nolegend_", **style)


def plot(history: Mapping[str, Any], path: str | os.PathLike | None = None) -> Any:
    """Draw the training loss (raw and smoothed) and every validation metric of a
    ``scanax.fit`` history against the step; return the ``matplotlib`` Figure.

    One panel for the loss (``loss`` raw and smoothed against ``history["step"]``,
    ``val_loss`` against ``history["val_step"]``), then one per other ``val_<m>``
    (with the training ``<m>``, smoothed, when the history has it). A population
    history (2-D arrays, one row per member) gives one thin line per member.
    The loss axis is logarithmic when the loss is positive and spans more than
    two decades.

    Arguments:
        history: ``FitResult.history``.
        path: if given, the figure is also saved there (format from the suffix).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ImportError: matplotlib is not installed (``pip install scanax[plot]``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise log_errors.missing_extra(
            errors.CALL, "plotting", "matplotlib", "plot"
        ) from err
    if not isinstance(history, Mapping):
        raise errors.history_type(history)
    vals = sorted(
        k
        for k in history
        if k.startswith("val_") and k != "val_step" and _scalar(history, k)
    )
    if "loss" not in history and not vals:
        raise errors.nothing_to_plot(history)
    panels = ["loss"] if "loss" in history or "val_loss" in vals else []
    panels += [k.removeprefix("val_") for k in vals if k != "val_loss"]
    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.8 * cols, 3.4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).reshape(-1)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, name in zip(axes, panels):
        positive = []
        if name in history and _scalar(history, name):
            steps, rows = _rows(history, name, "step")
            thin = len(rows) > 1
            if name == "loss":
                _draw(
                    ax,
                    steps,
                    rows,
                    name,
                    color=TRAIN_COLOR,
                    lw=0.5 if thin else 0.8,
                    alpha=0.15 if thin else 0.35,
                )
            _draw(
                ax,
                steps,
                ema(rows),
                f"{name} (smoothed)",
                color=TRAIN_COLOR,
                lw=0.8 if thin else 1.6,
            )
            positive.append(rows)
        if f"val_{name}" in history:
            steps, rows = _rows(history, f"val_{name}", "val_step")
            thin = len(rows) > 1
            _draw(
                ax,
                steps,
                rows,
                f"val_{name}",
                color=VAL_COLOR,
                lw=0.8 if thin else 1.6,
                marker=None if thin else "o",
                ms=3,
            )
            positive.append(rows)
        finite = np.concatenate([r[np.isfinite(r)] for r in positive] or [[]])
        wide = finite.size and finite.min() > 0 and finite.max() > 100 * finite.min()
        if name == "loss" and wide:
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=120)
    return fig
