"""``fit(..., precision="float16")``: dynamic loss scaling, the recipe of Keras 3's
``LossScaleOptimizer`` and jmp's ``DynamicLossScale``.

Each model (each member of a population) carries a scale (float32, ``INITIAL``
at the start of each ``fit`` call) and a count of good steps. A step
differentiates ``scale * loss`` through the float16 casts and divides the
gradient by ``scale`` in float32 (``_precision.Cast.scaled``); then
(``judge``):

- finite loss and gradients: the update is applied; after ``PERIOD`` such
  steps in a row the scale doubles;
- a finite loss and a non-finite gradient, the scale above 1: the step is
  skipped (the state is the one before it, except its step counts: ``kept``)
  and the scale halved (never below 1);
- a non-finite loss, or a non-finite gradient at scale 1: the loop's usual
  stop on a non-finite step (a smaller scale cannot help).

The state joins the training state after the model's, as a part of
``_precision.Precision`` (a feature: the same for one model and a population's
members), so that checkpoints, resumes and a population's per-member selects
cover it. Its phase is above ``Ema``'s and ``Plateau``'s, so that a skipped
step leaves the average and the plateau rule as they were.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _tree
from ..._errors import fit as errors
from ..models import step as _model_step

INITIAL = 2.0**15  # the scale at the start of each fit call (Keras's, jmp's)
# The largest scale: a loss computed in float16 has the scale itself as its
# cotangent, and 2**16 is not a float16 number (its largest is 65504).
MAX = 2.0**15
PERIOD = 2000  # good steps in a row after which the scale doubles (jmp's)
METRIC = "loss_scale"  # the history entry of the scale each step used
NAMES = [f"{METRIC}.scale", f"{METRIC}.good_steps"]  # its checkpoint names


class LossScale(NamedTuple):
    """The dynamic loss scale of ``fit(..., precision="float16")`` (a pytree):
    ``result.loss_scale`` after a call, ``fit(..., loss_scale_state=...)`` to
    continue it in the next. A population's holds one value per member in each
    leaf.

    Attributes:
        scale: float32, what the loss's gradient is multiplied by (2**15 at the
            start; halved by each skipped step, doubled after 2000 good ones).
        good_steps: int32, good steps since the scale last changed.
    """

    scale: jax.Array  # float32: what the loss's gradient is multiplied by
    good_steps: jax.Array  # int32: good steps since the scale last changed


class Judged(NamedTuple):
    """What ``judge`` decides of a step."""

    state: LossScale  # the loss scale after the step
    skipped: jax.Array  # the step's update is dropped
    grads: jax.Array  # what the loop tests for finiteness in the gradients' place


def start() -> LossScale:
    """The loss scale at the start of a ``fit`` call."""
    return LossScale(jnp.asarray(INITIAL, jnp.float32), jnp.asarray(0, jnp.int32))


def checked_state(state: Any, members: int | None = None) -> LossScale:
    """``loss_scale_state=``: an earlier ``result.loss_scale`` (a ``LossScale``
    of scalars; a population's: each leaf ``[members]``), checked, as arrays of
    the rule's dtypes."""
    shape = () if members is None else (members,)
    each = "a number" if members is None else f"[{members}] numbers, one per member"
    if not isinstance(state, LossScale):
        raise errors.loss_scale_state_type(state, f"a LossScale of {each}")
    scale, good = (
        _tree.real_numbers(
            x, shape, lambda n=name, v=x: errors.loss_scale_state_field(n, v, each)
        )
        for name, x in state._asdict().items()
    )
    if not (np.isfinite(scale).all() and (scale >= 1).all() and (scale <= MAX).all()):
        raise errors.loss_scale_state_value(
            "scale", state.scale, "finite, between 1 and 2**15"
        )
    if not ((good >= 0).all() and (good == np.floor(good)).all()):
        raise errors.loss_scale_state_value(
            "good_steps", state.good_steps, "a whole number >= 0"
        )
    return LossScale(jnp.asarray(scale, jnp.float32), jnp.asarray(good, jnp.int32))


def host(state: Any) -> LossScale:
    """The state read back to the host (``result.loss_scale``)."""
    return LossScale(*(jax.device_get(x) for x in state))


def judge(loss: Any, grads: Any, held: LossScale, period: int) -> Judged:
    """The rule after a step whose loss is ``loss`` and (unscaled) gradients
    ``grads``, taken with ``held``. ``Judged.grads`` is NaN only where the loop
    must stop on the gradients (non-finite at scale 1), else 0: the loop's own
    test (``_fit_program.finite``) then stops exactly on the steps the rule
    cannot help, and never on a skipped one."""
    with jax.named_scope("scanax.loss_scale"):
        loss_ok = jnp.isfinite(loss)
        grads_ok = jnp.array(True)
        for g in jtu.tree_leaves(grads):  # (as ``_fit_program.finite``)
            if g.size:
                grads_ok = grads_ok & jnp.isfinite(jnp.max(jnp.abs(g)))
        scale = held.scale
        one = jnp.ones((), scale.dtype)
        two = jnp.asarray(2.0, scale.dtype)
        applied = loss_ok & grads_ok
        skipped = loss_ok & ~grads_ok & (scale > one)
        good = held.good_steps + 1
        grow = applied & (good >= period)
        new = LossScale(
            jnp.where(
                grow,
                jnp.minimum(scale * two, jnp.asarray(MAX, scale.dtype)),
                jnp.where(skipped, jnp.maximum(scale / two, one), scale),
            ),
            jnp.where(applied & ~grow, good, jnp.zeros_like(good)),
        )
        nan = jnp.asarray(jnp.nan, jnp.float32)
        reported = jnp.where(grads_ok | skipped, jnp.zeros_like(nan), nan)
        return Judged(new, skipped, reported)


def counters(names: list[str], leaves: list) -> list[bool]:
    """Which leaves of one model's training state (traced: their dtypes are
    the loop's) are step counts (``_model_step.is_counter`` by their checkpoint
    ``names``): those a skipped step still advances."""
    return [_model_step.is_counter(n, x) for n, x in zip(names, leaves, strict=True)]


def kept(old: list, new: list, counts: list[bool], skipped: Any) -> list:
    """The leaves after a step: ``old`` where it was ``skipped``, except the
    step counts (``counts``), which advance as for any step: fit's clock is the
    optimizer's step count, and a skipped step is a step (its batch is used,
    its history entry written, a later call continues after it)."""
    with jax.named_scope("scanax.loss_scale"):
        return [
            n if count else jnp.where(skipped, o, n)
            for o, n, count in zip(old, new, counts, strict=True)
        ]


def with_scale(metrics: dict, scale: jax.Array) -> dict:
    """A step's metrics with the loss scale it used."""
    if METRIC in metrics:
        raise errors.loss_scale_metric_taken(METRIC)
    return {**metrics, METRIC: scale}
