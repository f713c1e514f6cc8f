"""Messages of ``FitResult.plot``'s errors (``scanax._fit.plot.plot``): the history it
draws."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import short_type

CALL = "FitResult.plot"


def history_type(history: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `history` must be a dict of arrays (FitResult.history), got "
        f"{short_type(history)}.\nFix: pass result.history, or call result.plot()."
    )


def nothing_to_plot(keys: Iterable[str]) -> ValueError:
    return ValueError(
        f"{CALL}: the history has neither 'loss' nor any 'val_*' metric to draw; "
        f"its keys are: {', '.join(sorted(keys)) or 'none'}.\nFix: pass the "
        "history of a scanax.fit run (result.history)."
    )


def steps_mismatch(name: str, shape: tuple[int, ...], steps: str, n: int) -> ValueError:
    return ValueError(
        f"{CALL}: history[{name!r}] has shape {shape}, but history[{steps!r}] has "
        f"{n} entries; the last axis must have one entry per step (population "
        "histories: one row per member).\nFix: pass the history fit returned, "
        "unchanged."
    )
