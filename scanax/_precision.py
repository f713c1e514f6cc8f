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
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _nnx
from ._errors import fit as errors

_KNOWN = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check(precision: Any) -> Any:
    """``precision=`` checked: None (float32), or the dtype to compute in."""
    if precision is None:
        return None
    if not isinstance(precision, str) or precision not in _KNOWN:
        raise errors.precision_value(precision)
    return _KNOWN[precision]


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
            return cast(unscaled(x))

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
        else:
            out = call(jtu.tree_map(param, model), batch, key)
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
