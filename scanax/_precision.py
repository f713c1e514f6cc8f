"""``fit(..., precision="bfloat16")``: compute in a lower precision, keep
float32 master parameters and optimizer state.

Inside the step, the loss is computed on a copy of the model whose floating
parameters are cast to the lower precision, on batches whose floating leaves
are cast too; the loss and metrics come back as float32. The gradient flows
through the casts, so it arrives in the parameters' own dtype (float32), and
the optimizer updates the float32 parameters: the usual mixed-precision recipe
(Keras's ``mixed_bfloat16`` policy, jmp's ``Policy(param=f32, compute=bf16,
output=f32)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu

from . import _nnx
from ._errors import fit as errors

_KNOWN = {"float32": None, "bfloat16": jnp.bfloat16}


def check(precision: Any) -> Any:
    """``precision=`` checked: None (float32), or the dtype to compute in."""
    if precision is None:
        return None
    if precision == "float16":
        raise errors.precision_float16()
    if not isinstance(precision, str) or precision not in _KNOWN:
        raise errors.precision_value(precision)
    return _KNOWN[precision]


def wrap(call: Callable, kind: str, dtype: Any) -> Callable:
    """``call(model, batch, key)`` computing in ``dtype``: the model's floating
    parameters and the batch's floating leaves cast to it, the result's
    floating values to float32. ``kind``: the model's (``"nnx"``, ``"optax"``,
    ``"trainstate"``)."""

    def cast(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    def low(model, batch, key):
        batch = jtu.tree_map(cast, batch)
        if kind == "nnx":
            copy, write_back = _nnx.with_params(model, cast)
            out = call(copy, batch, key)
            write_back()
        elif kind == "trainstate":
            out = call(
                model.replace(params=jtu.tree_map(cast, model.params)), batch, key
            )
        else:
            out = call(jtu.tree_map(cast, model), batch, key)
        return jtu.tree_map(_float32, out)

    return low


def _float32(x: Any) -> Any:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float32)
    return x
