"""``scanax.Eval``: evaluation inside ``fit``'s compiled loop, and the cadence
of the rules checked at evaluations (``EarlyStop``, ``Plateau``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..._errors import fit as errors
from .. import feature as _feature
from ..data import arrays as _data

_CALL = "scanax.Eval"


@dataclasses.dataclass(frozen=True)
class Eval(_feature.Feature):
    """Evaluate the model on held-out arrays every ``every`` steps, inside the
    compiled loop (``scanax.fit(..., callbacks=[scanax.Eval((x_val, y_val),
    every=100)])``); the checks of ``scanax.EarlyStop`` and ``scanax.Plateau``
    run at the same steps.

    Conceptually equivalent to, after every ``every``-th global step ``t``::

        metrics = mean over every example of data (in eval mode) of
                  fn(model, batch)  # batches of batch_size
        history["val_<name>"].append(metrics[name]); history["val_step"].append(t)

    (a ``scanax.Ratio`` metric is the ratio of its sums over the dataset).

    Arguments:
        data: a pytree of arrays with a leading example axis (the whole of it
            is evaluated), or None: no evaluation, only the rules' checks
            every ``every`` steps (on a training metric, or a rollout's).
        every: steps between evaluations. Default: with ``fit(epochs=)``, one
            epoch's steps (Keras validates every epoch); otherwise required.
        fn: ``fn(model, batch)`` (or with a key, as ``loss_fn``) returning a
            loss or ``(loss, metrics)``; default ``fit``'s ``loss_fn``.
        batch_size: examples per evaluation batch (default 1024, or ``fit``'s
            ``batch_size`` if larger).

    ``data`` and ``fn`` are not part of the compiled program's identity by
    value: the program depends on the arrays' shapes and on ``fn``'s code (its
    fingerprint, see ``docs/compile.md``), as it does on ``loss_fn``'s.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> scanax.Eval((jnp.zeros((8, 2)), jnp.zeros(8)), every=100)
        Eval(every=100, batch_size=None)
    """

    data: Any = dataclasses.field(default=None, compare=False, repr=False)
    _: dataclasses.KW_ONLY
    every: int | None = None
    fn: Callable | None = dataclasses.field(default=None, compare=False, repr=False)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.every is not None:
            every = _data.positive_int("every", self.every, _CALL)
            object.__setattr__(self, "every", every)
        if self.batch_size is not None:
            size = _data.positive_int("batch_size", self.batch_size, _CALL)
            object.__setattr__(self, "batch_size", size)
        if self.fn is not None and not callable(self.fn):
            raise errors.eval_fn_not_callable(self.fn)
        data = self.data
        if data is not None and (
            isinstance(data, list) or not _data.is_array_data(data)
        ):
            raise errors.eval_data_not_arrays(data)
