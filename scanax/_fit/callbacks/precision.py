"""``fit(..., precision=)``: compute in a lower precision, keep float32 master
parameters and optimizer state.

Inside the step, the loss is computed on a copy of the model whose floating
parameters are cast to the lower precision, on batches whose floating leaves
are cast too; the loss and metrics come back as float32. The gradient flows
through the casts, so it arrives in the parameters' own dtype (float32), and
the optimizer updates the float32 parameters: the usual mixed-precision recipe
(Keras's ``mixed_bfloat16`` policy, jmp's ``Policy(param=f32, compute=bf16,
output=f32)``).

``"float16"`` also needs loss scaling (its smallest normal number is 6e-5:
small gradients underflow to zero): a ``Cast`` given a scale (``scaled``)
differentiates ``scale * loss`` through the low precision and divides the
gradient by ``scale`` in the parameters' dtype; the scale itself, its rule and
the steps it skips are ``_loss_scale``'s.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ... import _nnx
from ..._errors import fit as errors
from .. import feature as _feature
from ..models.eqx_state import is_state
from . import loss_scale as _loss_scale

_KNOWN = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_KNOWN_DTYPES = ("bfloat16", "float16")  # scanax.Precision's


def check(precision: Any) -> Any:
    """``precision=`` checked: None (float32), or the dtype to compute in."""
    if precision is None:
        return None
    if not isinstance(precision, str) or precision not in _KNOWN:
        raise errors.precision_value(precision)
    return _KNOWN[precision]


@dataclasses.dataclass(frozen=True)
class Precision(_feature.Feature):
    """Compute the loss in a lower precision, keeping float32 parameters and
    optimizer state (``scanax.fit(..., callbacks=[scanax.Precision(
    "bfloat16")])``): Keras's ``mixed_bfloat16``, jmp's ``Policy(param=f32,
    compute=bf16, output=f32)``.

    Inside the step, the loss (and evaluations) are computed on a copy of the
    model whose floating parameters are cast to ``dtype``, on batches whose
    floating leaves are cast; the gradient flows back through the casts into
    the float32 parameters; loss and metrics are float32.

    ``"float16"`` also scales the loss dynamically (Keras's
    ``LossScaleOptimizer``): the gradient of ``scale * loss``, divided by
    ``scale``; a step whose gradients are not finite is skipped and halves the
    scale (down to 1), 2000 good steps in a row double it (up to 2**15). It
    starts at 2**15 unless continued from ``state``; ``history["loss_scale"]``
    records each step's, checkpoints save it, ``result.loss_scale`` gives it
    back (a population's: per member). A non-finite loss, or non-finite
    gradients at scale 1, stop training as usual.

    Arguments:
        dtype: ``"bfloat16"`` or ``"float16"``.
        state: float16 only: ``result.loss_scale`` of an earlier ``fit`` (a
            ``LossScale``): the scale continues from it instead of 2**15, so
            that an epoch loop of calls skips no step twice to find it. Not
            part of the compiled program.

    Example:
        >>> import scanax
        >>> scanax.Precision("bfloat16")
        Precision(dtype='bfloat16')
    """

    dtype: str
    _: dataclasses.KW_ONLY
    state: Any = dataclasses.field(default=None, compare=False, repr=False)

    phase: ClassVar[int] = 30
    field: ClassVar[str] = "loss_scale"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or self.dtype not in _KNOWN_DTYPES:
            raise errors.precision_value(self.dtype, "scanax.Precision")
        if self.state is not None:
            if not self.scaling:
                raise errors.loss_scale_state_without_float16(self.dtype)
            if not isinstance(self.state, _loss_scale.LossScale):
                raise errors.loss_scale_state_type(self.state, "a LossScale")

    @property
    def compute(self) -> Any:
        """The dtype the loss is computed in."""
        return check(self.dtype)

    @property
    def scaling(self) -> bool:
        """Whether the loss is scaled (float16)."""
        return needs_scaling(self.compute)

    def wrap_loss(self, call: Callable, kind: str) -> Cast:
        return Cast(call, kind, self.compute)

    def leaf_names(self, base: Any) -> list[str]:
        return list(_loss_scale.NAMES) if self.scaling else []

    def init_member(self, base: Any, model: list) -> list:
        return list(_loss_scale.start()) if self.scaling else []

    def given_leaves(self, base: Any) -> list | None:
        if self.state is None:
            return None
        return list(_loss_scale.checked_state(self.state, base.members))

    def wrap_step(self, make: Callable, base: Any, names: list[str]) -> Callable:
        """float16: the step on the loss scaled by the carried scale, then
        ``_loss_scale.judge`` and ``kept`` (a skipped step leaves every leaf
        before its own but the step counts), the scale recorded as
        ``loss_scale``."""
        if not self.scaling:
            return make
        at, period, judge = len(names), _loss_scale.PERIOD, _loss_scale.judge

        def wrapped(call_for: Callable) -> Callable:
            def step(leaves, batch, key, hp):
                held = _loss_scale.LossScale(*leaves[at:])
                inner = make(lambda hp: call_for(hp).scaled(held.scale))
                new, loss, metrics, grads = inner(leaves[:at], batch, key, hp)
                judged = judge(loss, grads, held, period)
                old = leaves[:at]
                counts = _loss_scale.counters(names, old)
                new = _loss_scale.kept(old, new, counts, judged.skipped)
                metrics = _loss_scale.with_scale(metrics, held.scale)
                return [*new, *judged.state], loss, metrics, judged.grads

            return step

        return wrapped

    def result(self, base: Any, leaves: list, at: int) -> Any:
        if not self.scaling:
            return None
        return _loss_scale.host(leaves[at : at + len(_loss_scale.NAMES)])


def needs_scaling(dtype: Any) -> bool:
    """Whether computing in ``dtype`` (``check``'s result) needs loss scaling:
    float16, whose range is too narrow for small gradients."""
    return dtype is not None and jnp.dtype(dtype) == jnp.float16


def wrap(call: Callable, kind: str, dtype: Any) -> Cast:
    """``call(model, batch, key)`` computing in ``dtype`` (a ``Cast``)."""
    return Cast(call, kind, dtype)


@dataclasses.dataclass(frozen=True)
class Cast:
    """``call(model, batch, key)`` computing in ``dtype``: the model's floating
    parameters and the batch's floating leaves cast to it, the result's
    floating values to float32. ``kind``: the model's (``"nnx"``, ``"optax"``,
    ``"trainstate"``).

    With ``scale`` (a float32 scalar, traced: ``scaled``), the value is the
    same, and the gradient is that of ``scale * loss``, divided by ``scale``
    in each parameter's dtype after it has come back through the casts
    (so that the low-precision cotangents are ``scale`` times larger and do not
    underflow): jmp's ``scale(loss)`` then ``unscale(grads)``."""

    call: Callable
    kind: str
    dtype: Any
    scale: Any = None

    def scaled(self, scale: Any) -> Cast:
        """The same call with its gradient scaled by ``scale`` (see above)."""
        return dataclasses.replace(self, scale=scale)

    def __call__(self, model: Any, batch: Any, key: Any) -> Any:
        dtype, scale = self.dtype, self.scale

        def cast(x: Any) -> Any:
            if _floating(x):
                return x.astype(dtype)
            return x

        def unscaled(x: Any) -> Any:  # (the gradient divided on its way out)
            if scale is not None and _inexact(x):
                return _unscaled(x, scale)
            return x

        def param(x: Any) -> Any:
            return x if is_state(x) else cast(unscaled(x))

        batch = jtu.tree_map(cast, batch)
        kind, call = self.kind, self.call
        if kind == "nnx":  # (every Variable unscaled: an optimizer may train any)
            other = None if scale is None else unscaled
            copy, write_back = _nnx.with_params(model, param, other)
            out = call(copy, batch, key)
            write_back()
        elif kind == "trainstate":
            out = call(
                model.replace(params=jtu.tree_map(param, model.params)), batch, key
            )
        else:  # (an Equinox model's eqx.nn.State: statistics, kept float32)
            out = call(jtu.tree_map(param, model, is_leaf=is_state), batch, key)
        out = jtu.tree_map(_float32, out)
        if scale is None:
            return out
        # the loss: ``loss``, ``(loss, metrics)`` or a TrainState's ``(loss,
        # metrics, updates)`` (``_model_step.split_loss`` checks it after)
        if isinstance(out, tuple) and out and _floating(out[0]):
            return (_scaled(out[0], scale), *out[1:])
        return _scaled(out, scale) if _floating(out) else out


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _inexact(x: Any) -> bool:  # (floating or complex: what can be trained)
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _float32(x: Any) -> Any:
    if _floating(x):
        return x.astype(jnp.float32)
    return x


@ft.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rescaled(x: Any, scale: Any, divide: bool) -> Any:
    """``x``, whose cotangent is multiplied by ``scale`` (``divide``: divided by
    it), in the cotangent's dtype."""
    return x


def _rescaled_fwd(x: Any, scale: Any, divide: bool) -> tuple:
    return x, scale


def _rescaled_bwd(divide: bool, scale: Any, ct: Any) -> tuple:
    with jax.named_scope("scanax.loss_scale"):
        s = scale.astype(ct.dtype)
        return (ct / s if divide else ct * s), jnp.zeros_like(scale)


_rescaled.defvjp(_rescaled_fwd, _rescaled_bwd)


def _scaled(loss: Any, scale: Any) -> Any:
    """``loss``, whose cotangent is multiplied by ``scale``."""
    return _rescaled(loss, scale, False)


def _unscaled(x: Any, scale: Any) -> Any:
    """``x``, whose cotangent is divided by ``scale`` (in ``x``'s dtype)."""
    return _rescaled(x, scale, True)
