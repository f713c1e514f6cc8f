"""What ``scanax.fit`` returns (``FitResult``), and the state an early stop
restores (``best_state``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._errors import population as pop_errors
from .callbacks import early_stop as _stop
from .models import population as _population, step as _model_step


@dataclasses.dataclass
class FitResult:
    """What ``scanax.fit`` returns.

    Attributes:
        model: the trained model. NNX: the object passed in, updated in place;
            Equinox/pytree and TrainState: a new one.
        optimizer: NNX: the ``nnx.Optimizer`` passed in, updated in place; optax: the
            final optax state; TrainState: None (the state is ``model``).
        history: per-step numpy arrays, one entry per step of this call:
            ``"step"`` (the global step number: the optimizer's step count after
            that step, continuing across calls), ``"loss"`` and every metric that
            ``loss_fn`` returns.
        steps: the number of steps this result holds beyond the model passed in
            (those trained, and those restored from a ``Checkpoint``'s directory).
        best_step: with ``EarlyStop(..., restore_best=True)``: the step
            whose state ``model`` holds (``steps`` still counts the steps
            trained); else None.
        ema: with ``Ema(decay)``: a model of the same kind (a new
            object) holding the moving average of the trained parameters (at
            ``best_step`` when the best state is restored); else None.
        execution: how the last call ran its steps, ``"fused"`` or
            ``"stepwise"`` (``fit(execution=)``; ``"auto"``'s choice).
        plateau: with ``Plateau(...)``: the rule's state in the state
            returned (a ``PlateauState``; a population's: leaves ``[members]``;
            with a restored best state, that step's);
            ``Plateau(..., state=result.plateau)`` continues it; else None.
        loss_scale: with ``Precision("float16")``: the dynamic loss
            scale in the state returned (a ``LossScale``: the scale and the
            count of good steps since it last changed; a population's: leaves
            ``[members]``; with a restored best state, that step's);
            ``Precision("float16", state=result.loss_scale)`` continues it; else
            None.

    For a population (``scanax.population``): ``model[i]`` and ``optimizer[i]``
    are member ``i`` as ordinary objects of its kind; ``history`` arrays other
    than ``"step"`` are ``[members, steps]`` (NaN where a member did not train);
    ``steps`` is an int array, one count per member; with ``stop=`` restoring
    the best, ``best_step`` is an int array too, ``-1`` for a member with no
    best state kept (it keeps its last state); validation entries are
    ``[members, evaluations]``.
    """

    model: Any
    optimizer: Any
    history: dict[str, np.ndarray]
    steps: Any
    best_step: Any = None
    ema: Any = None
    execution: str = "fused"
    plateau: Any = None
    loss_scale: Any = None

    def __repr__(self) -> str:
        """One screen, whatever the model and run: the counts, each history
        entry's shape, the last finite loss (and validation loss), the model
        and optimizer by type (their values: ``result.model``...)."""
        members = np.ndim(self.steps) == 1
        parts = [
            f"steps={np.asarray(self.steps).tolist() if members else self.steps}",
            f"execution={self.execution!r}",
        ]
        if self.best_step is not None:
            best = self.best_step
            parts.append(f"best_step={np.asarray(best).tolist() if members else best}")
        shapes = " ".join(
            f"{k}[{', '.join(map(str, np.shape(v)))}]" for k, v in self.history.items()
        )
        parts.append(f"history: {shapes or '(empty)'}")
        last = [f"{k}={_last(self.history.get(k))}" for k in ("loss", "val_loss")]
        last = [x for x in last if not x.endswith("=")]
        if last:
            parts.append("last " + ", ".join(last))
        parts.append(f"model: {_kind(self.model)}, optimizer: {_kind(self.optimizer)}")
        extras = [
            n for n in ("ema", "plateau", "loss_scale") if getattr(self, n) is not None
        ]
        if extras:
            parts.append("with " + ", ".join(extras))
        return "FitResult(" + ",\n          ".join(parts) + ")"

    def plot(self, path: Any = None) -> Any:
        """Train loss (raw and smoothed) and every validation metric against the
        step, saved to ``path`` if given; returns the matplotlib figure (the
        ``plot`` extra: ``pip install scanax[plot]``)."""
        from . import plot as _plot

        return _plot.plot(self.history, path)

    def best(self, metric: str = "loss", mode: str = "auto") -> int:
        """A population's best member: the index whose last finite value of
        ``metric`` is lowest (``mode="min"``) or highest (``"max"``); members
        with no finite value rank last. ``"auto"``: ``EarlyStop``'s rule (max for
        accuracies and similar names, min otherwise)."""
        if np.ndim(self.steps) != 1:
            raise pop_errors.best_not_population()
        names = sorted(
            k
            for k, v in self.history.items()
            if not k.endswith("step") and np.ndim(v) == 2
        )
        if metric not in names:
            raise pop_errors.best_metric(metric, names)
        values = self.history[metric]
        if mode not in ("auto", "min", "max"):
            raise pop_errors.best_mode(mode)
        if mode == "auto":
            mode = _stop.auto_mode(metric)
        values = np.asarray(values, np.float64)
        finite = np.isfinite(values)
        last = np.full(values.shape[0], np.nan)
        has = finite.any(axis=1)
        if has.any():  # (an empty history has no last value: all rank last)
            where = values.shape[1] - 1 - np.argmax(finite[:, ::-1], axis=1)
            last[has] = values[has, where[has]]
        sign = 1.0 if mode == "min" else -1.0
        return int(np.argmin(np.where(has, sign * last, np.inf)))


def _last(values: Any) -> str:
    """The last finite value of a history entry (per member: a list), as text;
    empty when it has none (or there is no such entry)."""
    if values is None or np.size(values) == 0:
        return ""
    rows = np.asarray(values, np.float64).reshape(-1, np.shape(values)[-1])
    out = []
    for row in rows:
        finite = row[np.isfinite(row)]
        out.append(f"{finite[-1]:.4g}" if finite.size else "nan")
    return out[0] if np.ndim(values) == 1 else "[" + ", ".join(out) + "]"


def _kind(x: Any) -> str:
    """A model's or optimizer's type, by name (a population's: how many;
    ``result.model[i]`` is member ``i``)."""
    if isinstance(x, _population.Members):
        return f"{len(x)} members"
    return "None" if x is None else type(x).__name__


def best_state(
    names: list[str], best: list, last: list, keeps_last: Any, where: Any = None
) -> list:
    """The state an early stop restores: ``best``'s leaves, except the step
    counts (``_model_step.is_counter``) and what a feature keeps at the last
    step (``keeps_last(name)``: a rollout's feed), which keep ``last``'s: the
    next ``fit`` continues after the last step run with the data it would have
    had. ``where``: a population's per-member mask of the members with a best
    state (the others keep ``last``)."""
    out = []
    for name, b, x in zip(names, best, last):
        if _model_step.is_counter(name, x, where is not None) or keeps_last(name):
            out.append(x)
        elif where is None:
            out.append(b)
        else:
            out.append(
                jnp.where(where.reshape(where.shape + (1,) * (x.ndim - 1)), b, x)
            )
    return out
