"""``plateau=``: reduce the learning rate when a monitored metric stops improving,
as a static description (``Plateau``) plus pure JAX functions on a small state
that the compiled training loop carries.

The rule is Keras 3's ``keras.callbacks.ReduceLROnPlateau`` (``factor``,
``patience``, ``min_delta``, ``cooldown``, ``min_lr``, ``mode``), checked on
device at each evaluation (``_fit_checks.Checks``). What it lowers is a scale of
the updates, not an optimizer's hyperparameter, so that it works for every optax
transform as built: each step's update of the trained parameters is multiplied
by it (``scaled``), inside the model's step, before anything that follows the
parameters (``ema=``) sees them. Its state joins the training state after the
model's (a feature, ``_feature``: the same for one model and a population's
members), so that checkpoints, resumes and a population's per-member selects
cover it. The functions are elementwise
in the state: under ``jax.vmap`` each member of a population has its own scale.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _tree
from ..._errors import plateau as errors
from .. import feature as _feature, scalars as _scalars
from .early_stop import MODES, auto_mode, beats

# The history entry of the scale each step's update was multiplied by.
METRIC = "lr_scale"


class PlateauState(NamedTuple):
    """What ``Plateau`` carries from one evaluation to the next (a pytree).

    Attributes:
        best: the best monitored value so far (``+inf``/``-inf`` before any).
        wait: evaluations without improvement since the last improvement or
            reduction (Keras's ``wait``).
        cooldown: evaluations left before the rule counts again after a
            reduction (Keras's ``cooldown_counter``).
        scale: what each step's update is multiplied by (1 before any
            reduction).
    """

    best: jax.Array
    wait: jax.Array
    cooldown: jax.Array
    scale: jax.Array


class PlateauCarry(NamedTuple):
    """What ``fit`` carries of the rule in the training state: its state, and the
    running sum and count of a monitored training metric since the last check
    (its mean is the value checked)."""

    rule: PlateauState
    total: jax.Array
    seen: jax.Array


# Checkpoint names of the carry's leaves (``plateau.lr_scale``...), in order.
NAMES = [f"plateau.{n}" for n in ("best", "wait", "cooldown", METRIC, "total", "seen")]


@dataclasses.dataclass(frozen=True)
class Plateau(_feature.Feature):
    """Reduce the learning rate when a monitored metric stops improving
    (``scanax.fit(..., callbacks=[scanax.Plateau(...)])``): each step's update of the
    trained parameters is multiplied by a scale that the rule lowers, which is
    lowering the learning rate for optimizers whose last stage is the rate
    (``sgd``, ``adam``, ``adamw``, ``lion``...; not ``rmsprop(momentum=)``,
    ``lars``, ``adafactor(momentum=)``: see ``docs/training_features.md``).

    Conceptually equivalent to, at each evaluation (monitored value ``value``;
    ``scale`` starts at 1)::

        if cooldown_counter > 0:
            cooldown_counter -= 1
            wait = 0
        if value < best - min_delta:  # "max": value > best + min_delta
            best, wait = value, 0
        elif cooldown_counter == 0:
            wait += 1
            if wait >= patience and scale > min_scale:
                scale = max(scale * factor, min_scale)
                cooldown_counter, wait = cooldown, 0

    with every step's parameters ``p_new = p + scale * (p_stepped - p)``
    (``p_stepped``: the optimizer's step from ``p``), which is
    ``keras.callbacks.ReduceLROnPlateau(monitor, factor=factor,
    patience=patience, min_delta=min_delta, cooldown=cooldown, min_lr=min_lr,
    mode=mode)`` evaluated once per evaluation instead of once per epoch, on an
    optimizer whose learning rate is ``lr * scale``: for every optax optimizer
    whose last stage is the learning rate (``optax.sgd``, ``adam``, ``adamw``
    with its weight decay...), scaling the update is lowering the rate. Only the
    trained parameters move less: the optimizer's state (Adam's moments, step
    counts) and the model's other state (BatchNorm statistics) are as they
    would be, as with a lower learning rate in Keras.

    Differences from Keras: ``min_lr`` bounds the scale (``min_scale =
    min_lr``) unless ``lr=`` gives the optimizer's learning rate, then the rate
    ``lr * scale`` (``min_scale = min_lr / lr``); ``mode="auto"`` decides from
    the name alone, as ``EarlyStop``'s does (see ``direction``); ``min_delta``
    must be ``>= 0``; a NaN value is never an improvement, even the first. Each
    ``fit`` call starts the rule again with the scale at 1 unless it is given
    the previous call's ``Plateau(..., state=result.plateau)`` (Keras resets
    ``best``, ``wait`` and the cooldown at each ``model.fit`` and keeps the
    lowered rate).

    Unlike ``optax.contrib.reduce_on_plateau``, an optax transform chained
    after the optimizer that is given each step's training loss
    (``update(..., value=loss)``) and counts in steps, ``Plateau`` is checked at
    the evaluations on any monitored metric (``val_loss``, a training metric's
    mean since the last check, a rollout's), needs nothing in the optimizer, and
    records its scale in ``history["lr_scale"]``.

    Arguments:
        monitor: the metric to watch: an evaluation metric ``"val_<name>"``
            (default ``"val_loss"``), ``"loss"`` or another metric ``loss_fn``
            returns (its mean over the steps since the last check).
        factor: what the scale is multiplied by at each reduction, in ``(0, 1)``.
        patience: evaluations without improvement after which the scale is
            reduced (``0``: at every evaluation without improvement).
        min_delta: how much a value must beat the best by to count as an
            improvement (``>= 0``, in the direction of ``direction``).
        cooldown: evaluations after a reduction during which the rule does not
            count evaluations without improvement.
        min_lr: the rule never reduces below it: a bound on the scale, or with
            ``lr=`` on the learning rate ``lr * scale``.
        mode: ``"auto"`` (default: ``"max"`` for accuracies and other scores
            that grow, by the metric's name, ``"min"`` otherwise; the rule of
            ``EarlyStop.direction``), ``"min"`` or ``"max"``.
        lr: the optimizer's learning rate, when ``min_lr`` is one (optional).

    Example:
        >>> import jax.numpy as jnp
        >>> import scanax
        >>> rule = scanax.Plateau("val_loss", factor=0.5, patience=1, min_delta=0.0)
        >>> state = rule.init()
        >>> for value in [3.0, 2.0, 2.5, 2.4, 2.6]:
        ...     state, reduced = rule.update(state, jnp.float32(value))
        ...     print(value, bool(reduced), float(state.scale))
        3.0 False 1.0
        2.0 False 1.0
        2.5 True 0.5
        2.4 True 0.25
        2.6 True 0.125
    """

    monitor: str = "val_loss"
    _: dataclasses.KW_ONLY
    factor: float = 0.1
    patience: int = 10
    min_delta: float = 1e-4
    cooldown: int = 0
    min_lr: float = 0.0
    mode: str = "auto"
    lr: float | None = None
    state: Any = dataclasses.field(default=None, compare=False, repr=False)

    phase: ClassVar[int] = 10
    field: ClassVar[str] = "plateau"

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            raise errors.monitor_type(self.monitor)
        if self.state is not None and not isinstance(self.state, PlateauState):
            raise errors.state_type(self.state, "a PlateauState (result.plateau)")
        for name in ("patience", "cooldown"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise errors.count_type(name, value)
            if value < 0:
                raise errors.count_value(name, value)
        for name in ("factor", "min_lr", "lr"):
            value = getattr(self, name)
            if value is None and name == "lr":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise errors.number_type(name, value)
        if not 0.0 < self.factor < 1.0:
            raise errors.factor_value(self.factor)
        if not math.isfinite(self.min_lr) or self.min_lr < 0:
            raise errors.min_lr_value(self.min_lr)
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise errors.lr_value(self.lr)
        if self.min_lr >= (1.0 if self.lr is None else self.lr):
            raise errors.min_lr_not_below(self.min_lr, self.lr)
        if isinstance(self.min_delta, bool) or not isinstance(
            self.min_delta, numbers.Real
        ):
            raise errors.min_delta_type(self.min_delta)
        if not math.isfinite(self.min_delta) or self.min_delta < 0:
            raise errors.min_delta_value(self.min_delta)
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise errors.bad_mode(self.mode)

    @property
    def direction(self) -> str:
        """``"min"`` or ``"max"``: ``mode``, or with ``mode="auto"`` the direction
        of the metric's name, by ``EarlyStop.direction``'s rule."""
        return auto_mode(self.monitor) if self.mode == "auto" else self.mode

    @property
    def min_scale(self) -> float:
        """The smallest scale the rule reduces to: ``min_lr``, or ``min_lr /
        lr`` with ``lr=``."""
        return self.min_lr if self.lr is None else self.min_lr / self.lr

    def check_monitor(self, available: Iterable[str]) -> None:
        """Raise ``ValueError`` naming the available metrics if ``monitor`` is not
        among ``available`` (the names the run's history will have: ``loss``,
        ``loss_fn``'s metrics, ``val_*``). Call it before compiling."""
        names = list(available)
        if self.monitor not in names:
            raise errors.unknown_monitor(self.monitor, names)

    def init(self, dtype: Any = jnp.float32) -> PlateauState:
        """The state before the first evaluation (values compared in ``dtype``;
        the scale is float32). For a population, ``jax.vmap`` it over a dummy
        axis or broadcast it."""
        return PlateauState(*(jnp.asarray(v, t) for v, t in _start(self, dtype)))

    def update(
        self, state: PlateauState, value: jax.Array
    ) -> tuple[PlateauState, jax.Array]:
        """One evaluation: ``(new state, reduced)``.

        ``value`` is the monitored metric (a scalar; per member under
        ``jax.vmap``). ``reduced``: the scale was lowered at this evaluation.
        Pure and branch-free: usable inside ``lax.while_loop`` and ``jax.vmap``.
        """
        value = jnp.asarray(value)
        if value.ndim != 0:
            raise errors.monitor_not_scalar(self.monitor, value)
        with jax.named_scope("scanax.plateau"):
            value = value.astype(state.best.dtype)
            better = beats(value, state.best, self.min_delta, self.direction)
            improved = ~jnp.isnan(value) & better
            cooling = state.cooldown > 0
            cooldown = jnp.where(cooling, state.cooldown - 1, state.cooldown)
            wait = jnp.where(cooling, 0, state.wait)
            counts = ~improved & (cooldown == 0)
            wait = jnp.where(improved, 0, jnp.where(counts, wait + 1, wait))
            floor = jnp.asarray(self.min_scale, state.scale.dtype)
            reduced = counts & (wait >= self.patience) & (state.scale > floor)
            factor = jnp.asarray(self.factor, state.scale.dtype)
            new = PlateauState(
                best=jnp.where(improved, value, state.best),
                wait=jnp.where(reduced, 0, wait),
                cooldown=jnp.where(reduced, self.cooldown, cooldown).astype(
                    state.cooldown.dtype
                ),
                scale=jnp.where(
                    reduced, jnp.maximum(state.scale * factor, floor), state.scale
                ),
            )
            return new, reduced

    # ------------------------------------------------------------ as a feature

    def leaf_names(self, base: Any) -> list[str]:
        return list(NAMES)

    def init_member(self, base: Any, model: list) -> list:
        return jtu.tree_leaves(start(self))

    def given_leaves(self, base: Any) -> list | None:
        """``state=``: the rule continues from it (a population's: each
        member's), with an empty window of the monitored metric."""
        if self.state is None:
            return None
        rule = checked_state(self.state, base.members)
        shape = () if base.members is None else (base.members,)
        window = [jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32)]
        return [*rule, *window]

    def wrap_step(self, make: Callable, base: Any, names: list[str]) -> Callable:
        """Each step's update of the trained parameters multiplied by the
        carried scale (``scaled``), recorded as ``lr_scale``."""
        where, at = base.trained(), len(names)

        def wrapped(call_for: Callable) -> Callable:
            inner = make(call_for)

            def step(leaves, batch, key, hp):
                new, loss, metrics, grads = inner(leaves[:at], batch, key, hp)
                scale = read(leaves, at).rule.scale
                new = [*scaled(leaves[:at], new, where, scale), *leaves[at:]]
                return new, loss, with_scale(metrics, scale), grads

            return step

        return wrapped

    def result(self, base: Any, leaves: list, at: int) -> PlateauState:
        """The rule's state after the run (``PlateauState`` of host values; a
        population's: leaves ``[members]``)."""
        return PlateauState(*(jax.device_get(x) for x in read(leaves, at).rule))


# ------------------------------------------------------------ in fit's loop


def _start(rule: Plateau, dtype: Any) -> tuple:
    """The initial state's values and dtypes (``init``'s, ``kept_init``'s)."""
    worst = jnp.inf if rule.direction == "min" else -jnp.inf
    return (worst, dtype), (0, jnp.int32), (0, jnp.int32), (1.0, jnp.float32)


def kept_init(rule: Plateau, dtype: Any = jnp.float32) -> PlateauState:
    """``rule.init(dtype)`` as device scalars kept by value (``_scalars``), as
    ``early_stop.kept_init``: the carry a fit call starts from, with no transfer
    when a call repeats (a subclass's own ``init`` as it is). Shared arrays:
    for fit's carry alone."""
    if type(rule).init is not Plateau.init:
        return rule.init(dtype)
    return PlateauState(*(_scalars.constant(v, t) for v, t in _start(rule, dtype)))


def start(plateau: Plateau, state: PlateauState | None = None) -> PlateauCarry:
    """The carry of a ``fit`` call before its first check: the rule's initial
    state (``kept_init``), or ``state`` (``plateau_state=``: an earlier call's,
    checked), with an empty window of the monitored training metric (kept
    zeros: the carry stays inside fit)."""
    rule = kept_init(plateau) if state is None else state
    zero = _scalars.constant(0, jnp.float32), _scalars.constant(0, jnp.int32)
    return PlateauCarry(rule, *zero)


def checked_state(state: Any, members: int | None = None) -> PlateauState:
    """``plateau_state=``: an earlier ``result.plateau`` (a ``PlateauState`` of
    numbers; a population's: each leaf ``[members]``), checked, as arrays of
    the rule's dtypes."""
    shape = () if members is None else (members,)
    each = "a number" if members is None else f"[{members}] numbers, one per member"
    if not isinstance(state, PlateauState):
        raise errors.state_type(state, f"a PlateauState of {each}")
    best, wait, cooldown, scale = (
        _tree.real_numbers(x, shape, lambda n=name, v=x: errors.state_field(n, v, each))
        for name, x in state._asdict().items()
    )
    if np.isnan(best).any():
        raise errors.state_value("best", state.best, "a number or ±inf, not NaN")
    for name, a in (("wait", wait), ("cooldown", cooldown)):
        if not ((a >= 0).all() and (a == np.floor(a)).all()):
            raise errors.state_value(name, getattr(state, name), "a whole number >= 0")
    # (0 included: with min_lr=0 repeated reductions reach it, as Keras's rate)
    if not (np.isfinite(scale).all() and (scale >= 0).all() and (scale <= 1).all()):
        raise errors.state_value("scale", state.scale, "in [0, 1]")
    like = Plateau().init()
    return PlateauState(
        *(jnp.asarray(a, y.dtype) for a, y in zip((best, wait, cooldown, scale), like))
    )


def read(leaves: list, at: int) -> PlateauCarry:
    """The carry from the training state's flat ``leaves`` (it starts at
    ``at``)."""
    return jtu.tree_unflatten(_CARRY_DEF, leaves[at : at + len(NAMES)])


def write(leaves: list, at: int, carry: PlateauCarry) -> list:
    """``leaves`` with the carry at ``at`` replaced by ``carry``."""
    return [*leaves[:at], *jtu.tree_leaves(carry), *leaves[at + len(NAMES) :]]


def scaled(old: list, new: list, where: list[int], scale: jax.Array) -> list:
    """``new`` with each trained leaf (positions ``where``) moved ``scale`` of
    the way from ``old``: ``p + scale * (p_new - p)``, in the leaf's dtype."""
    out = list(new)
    with jax.named_scope("scanax.plateau"):
        for i in where:
            p, q = old[i], new[i]
            out[i] = (p + scale.astype(q.dtype) * (q - p)).astype(q.dtype)
    return out


def with_scale(metrics: dict, scale: jax.Array) -> dict:
    """A step's metrics with the scale its update was multiplied by."""
    if METRIC in metrics:
        raise errors.metric_name_taken(METRIC)
    return {**metrics, METRIC: scale}


_CARRY_DEF = jtu.tree_structure(
    PlateauCarry(PlateauState(0, 0, 0, 0), 0, 0)  # (the structure only)
)
