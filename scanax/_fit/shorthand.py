"""``scanax.fit``'s keywords of the release before features became objects,
kept for one release as shorthand: one function (``callbacks``) maps them to
the feature objects before anything else sees them, and refuses a keyword given
with its object, or a keyword ``fit`` does not know.

- ``eval_data=, eval_every=, eval_fn=, eval_batch_size=``:
  ``scanax.Eval(data, every=, fn=, batch_size=)``;
- ``stop=EarlyStop(...), best_dir=``: ``scanax.EarlyStop(..., best_dir=)``;
- ``plateau=Plateau(...), plateau_state=``: ``scanax.Plateau(..., state=)``;
- ``ema=, ema_eval=, ema_state=``: ``scanax.Ema(decay, on_eval=, state=)``;
- ``precision=, loss_scale_state=``: ``scanax.Precision(dtype, state=)``;
- ``checkpoint_dir=, checkpoint_every=``: ``scanax.Checkpoint(directory,
  every=)``;
- ``log=sinks, log_every=``: ``scanax.Log(sink, every=)`` for each sink
  (``scanax.TensorBoard``, ``CSV`` and ``MLflow`` take ``every=`` themselves).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import fit as errors, plateau as plateau_errors
from . import feature as _feature
from .callbacks import (
    checkpoint as _checkpointing,
    early_stop as _stop,
    ema as _ema,
    evaluation as _eval,
    plateau as _plateau,
    precision as _precision,
    sinks as _log,
)
from .data import arrays as _data

# keyword -> the feature class it makes (its group's)
KEYWORDS = {
    "eval_data": _eval.Eval,
    "eval_every": _eval.Eval,
    "eval_fn": _eval.Eval,
    "eval_batch_size": _eval.Eval,
    "stop": _stop.EarlyStop,
    "best_dir": _stop.EarlyStop,
    "plateau": _plateau.Plateau,
    "plateau_state": _plateau.Plateau,
    "ema": _ema.Ema,
    "ema_eval": _ema.Ema,
    "ema_state": _ema.Ema,
    "precision": _precision.Precision,
    "loss_scale_state": _precision.Precision,
    "checkpoint_dir": _checkpointing.Checkpoint,
    "checkpoint_every": _checkpointing.Checkpoint,
    "log": _log.Log,
    "log_every": _log.Log,
}


def callbacks(given: Any, keywords: dict, parameters: list[str]) -> list:
    """``fit``'s ``callbacks=`` list with the shorthand ``keywords`` mapped to
    objects and appended (``parameters``: fit's own, for the message about an
    unknown keyword)."""
    if given is None:
        given = []
    if isinstance(given, _feature.Feature) or not isinstance(given, (list, tuple)):
        raise errors.callbacks_type(given)
    given = list(given)
    for name in keywords:
        if name not in KEYWORDS:
            raise errors.unexpected_keyword(name, [*parameters, *KEYWORDS])
    for name, kind in KEYWORDS.items():
        if name in keywords and any(isinstance(f, kind) for f in given):
            raise errors.keyword_and_object(name, kind.__name__)
    kw = {name: keywords.get(name) for name in KEYWORDS}
    kw["log_every"] = keywords.get("log_every", 10)
    kw["ema_eval"] = keywords.get("ema_eval", False)
    return given + _objects(**kw)


def _objects(
    eval_data, eval_every, eval_fn, eval_batch_size, stop, best_dir, plateau,
    plateau_state, ema, ema_eval, ema_state, precision, loss_scale_state,
    checkpoint_dir, checkpoint_every, log, log_every,
) -> list:  # fmt: skip
    """The objects of the shorthand keywords, checked as they were."""
    out: list = []
    if stop is not None and not isinstance(stop, _stop.EarlyStop):
        raise errors.stop_type(stop)
    if best_dir is not None:
        if stop is None:
            raise errors.best_dir_without_stop()
        stop = dataclasses.replace(stop, best_dir=best_dir)
    if plateau_state is not None and plateau is None:
        raise plateau_errors.state_without_plateau()
    if plateau is not None:
        if not isinstance(plateau, _plateau.Plateau):
            raise plateau_errors.plateau_type(plateau)
        if plateau_state is not None:
            plateau = dataclasses.replace(plateau, state=plateau_state)
    checked = stop is not None or plateau is not None
    if eval_data is not None or eval_every is not None:
        if eval_data is None and not checked:
            raise errors.eval_every_without_data()
        every, size = (
            _own("eval_every", eval_every),
            _own("eval_batch_size", eval_batch_size),
        )
        out.append(_eval.Eval(eval_data, every=every, fn=eval_fn, batch_size=size))
    else:
        for name, value in (("eval_fn", eval_fn), ("eval_batch_size", eval_batch_size)):
            if value is not None:
                raise errors.eval_option_without_data(name)
    out += [f for f in (stop, plateau) if f is not None]
    if ema is None:
        if ema_eval or ema_state is not None:
            raise errors.ema_option_without_ema("ema_eval" if ema_eval else "ema_state")
    else:
        out.append(_ema.Ema(ema, on_eval=bool(ema_eval), state=ema_state))
    if precision is not None and _precision.check(precision) is not None:
        out.append(_precision.Precision(precision, state=loss_scale_state))
    elif loss_scale_state is not None:
        raise errors.loss_scale_state_without_float16(precision)
    if checkpoint_every is not None and checkpoint_dir is None:
        raise errors.checkpoint_every_without_dir(checkpoint_every)
    if checkpoint_dir is not None:
        every = _own("checkpoint_every", checkpoint_every)
        out.append(_checkpointing.Checkpoint(checkpoint_dir, every=every))
    if log is not None:
        every = _own("log_every", log_every)
        out += [_log.Log(sink, every=every) for sink in _log.resolve(log)]
    return out


def _own(name: str, value: Any) -> Any:
    """A count given to one of fit's keywords, checked under its own name (not
    as the ``every`` of the object it makes)."""
    return None if value is None else _data.positive_int(name, value)
