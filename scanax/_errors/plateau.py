"""Messages of ``scanax.Plateau``'s errors (its arguments, the monitored metric)
and of ``scanax.fit``'s ``plateau=``. Where a message says what ``EarlyStop``'s
says of the same argument, it is ``EarlyStop``'s, for this call."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import short_type, stop
from .fit import CALL as FIT

CALL = "scanax.Plateau"


def _as_plateau(err: Exception) -> Exception:
    """``EarlyStop``'s message for the same mistake, said by ``scanax.Plateau``."""
    text = str(err).removeprefix(stop.CALL)
    text = text.replace("EarlyStop(", "Plateau(").replace("EarlyStop.", "Plateau.")
    return type(err)(CALL + text)


def monitor_type(monitor: Any) -> TypeError:
    return _as_plateau(stop.monitor_type(monitor))


def min_delta_type(min_delta: Any) -> TypeError:
    return _as_plateau(stop.min_delta_type(min_delta))


def min_delta_value(min_delta: float) -> ValueError:
    return _as_plateau(stop.min_delta_value(min_delta))


def bad_mode(mode: Any) -> ValueError:
    return _as_plateau(stop.bad_mode(mode))


def unknown_monitor(monitor: str, available: Iterable[str]) -> ValueError:
    return _as_plateau(stop.unknown_monitor(monitor, available))


def monitor_not_scalar(monitor: str, value: Any, per: str = "evaluation") -> ValueError:
    return _as_plateau(stop.monitor_not_scalar(monitor, value, per))


def count_type(name: str, value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `{name}` must be an int (a number of evaluations), got "
        f"{short_type(value)}.\nFix: pass e.g. {name}=5."
    )


def count_value(name: str, value: int) -> ValueError:
    what = {
        "patience": "evaluations without improvement before the learning rate "
        "is reduced (0: at the first)",
        "cooldown": "evaluations after a reduction before the rule counts "
        "again (0: none)",
    }[name]
    return ValueError(
        f"{CALL}: `{name}` must be 0 or more, got {value}: it is the number of "
        f"{what}.\nFix: pass e.g. {name}={5 if name == 'patience' else 0}."
    )


_EXAMPLES = {"factor": "0.1", "min_lr": "1e-6", "lr": "1e-3"}


def number_type(name: str, value: Any) -> TypeError:
    return TypeError(
        f"{CALL}: `{name}` must be a real number, got {short_type(value)}.\nFix: "
        f"pass e.g. {name}={_EXAMPLES[name]}."
    )


def factor_value(factor: float) -> ValueError:
    return ValueError(
        f"{CALL}: `factor` must be between 0 and 1 (both excluded), got "
        f"{factor!r}: the scale of the updates is multiplied by it at each "
        "reduction.\nFix: pass e.g. factor=0.1 (a tenth) or factor=0.5 (half)."
    )


def min_lr_value(min_lr: float) -> ValueError:
    return ValueError(
        f"{CALL}: `min_lr` must be finite and 0 or more, got {min_lr!r}: the rule "
        "never reduces below it.\nFix: pass e.g. min_lr=1e-6, or leave it out (0)."
    )


def min_lr_not_below(min_lr: float, lr: float | None) -> ValueError:
    what = f"`lr` ({lr!r})" if lr is not None else "1, the starting scale (no `lr`)"
    return ValueError(
        f"{CALL}: `min_lr` ({min_lr!r}) is not below {what}: the rule could "
        "never reduce the rate.\nFix: pass a min_lr below it, e.g. "
        f"min_lr={(lr if lr is not None else 1.0) / 100:g}, or leave it out (0)."
    )


def lr_value(lr: float) -> ValueError:
    return ValueError(
        f"{CALL}: `lr` must be a finite learning rate above 0, got {lr!r}: it is "
        "the optimizer's learning rate, which makes `min_lr` a bound on the rate "
        "`lr * scale`.\nFix: pass the rate your optimizer was built with, e.g. "
        "lr=1e-3, or leave it out (then `min_lr` bounds the scale itself)."
    )


# ------------------------------------------------------------------- scanax.fit


def plateau_type(plateau: Any) -> TypeError:
    return TypeError(
        f"{FIT}: `plateau` must be a scanax.Plateau, got {short_type(plateau)}.\n"
        'Fix: plateau=scanax.Plateau("val_loss", factor=0.5, patience=5), with '
        "eval_every=N."
    )


def eval_every_missing() -> TypeError:
    return TypeError(
        f"{FIT}: scanax.Plateau (plateau=) is given without a scanax.Eval's "
        "`every` (eval_every=): the plateau rule is checked every `every` steps, "
        "inside the compiled loop.\nFix: pass "
        "scanax.Eval(every=N) in callbacks (eval_every=N), e.g. N=100."
    )


def val_monitor_without_data(monitor: str) -> ValueError:
    return ValueError(
        f"{FIT}: scanax.Plateau monitors {monitor!r}, a validation metric, but "
        "no scanax.Eval has data (eval_data=).\nFix: pass scanax.Eval((x_val, "
        "y_val), every=N) "
        "(eval_data=...), or monitor a training metric such as 'loss' "
        "(Plateau('loss', ...))."
    )


def metric_name_taken(name: str) -> ValueError:
    return ValueError(
        f"{FIT}: loss_fn returns a metric named {name!r}, the name under which "
        "plateau= records the scale of each step's update in the history.\nFix: "
        "rename that metric."
    )


def state_without_plateau() -> TypeError:
    return TypeError(
        f"{FIT}: `plateau_state` was given without `plateau=`.\nFix: pass the "
        "same `plateau=scanax.Plateau(...)` as the call whose `result.plateau` "
        "this is, or drop `plateau_state`."
    )


def state_type(state: Any, want: str) -> TypeError:
    return TypeError(
        f"{FIT}: `plateau_state` (scanax.Plateau's `state`) must be the "
        f"`result.plateau` of an earlier fit with `plateau=` ({want}), got "
        f"{short_type(state)}.\nFix: pass `state=result.plateau` of the previous "
        "call to continue its scale, best value, wait and cooldown."
    )


def state_field(name: str, value: Any, want: str) -> TypeError:
    return TypeError(
        f"{FIT}: `plateau_state.{name}` (scanax.Plateau's `state`) must be {want}, "
        f"got {short_type(value)}.\nFix: pass scanax.Plateau(..., state="
        "result.plateau) (plateau_state=) of an "
        "earlier call (of the same model, or population of as many members), "
        "or change only its values with `._replace(...)`."
    )


def state_value(name: str, value: Any, rule: str) -> ValueError:
    return ValueError(
        f"{FIT}: `plateau_state.{name}` (scanax.Plateau's `state`) must be "
        f"{rule}, got {value!r}.\nFix: pass scanax.Plateau(..., state="
        "result.plateau) (plateau_state=) of an earlier call, or a value "
        "the rule can reach (the scale only falls from 1; wait and cooldown "
        "count evaluations)."
    )
