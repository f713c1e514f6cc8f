"""Equinox adapter for ``scanax.Stack``: the only module of it that imports Equinox."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from . import _eager, _stack


class EqxStack(eqx.Module):
    """``scanax.Stack`` over Equinox layers (see ``scanax.Stack``): an ``eqx.Module``.

    Stacked runs are fields holding arrays with a leading ``repeats`` axis, so
    ``eqx.filter_grad``, ``eqx.partition`` and optax see one array per parameter.
    """

    pieces: tuple
    plan: tuple = eqx.field(static=True)
    remat: Any = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)
    n: int = eqx.field(static=True)

    def __init__(
        self, layers: Sequence[Any], *, remat: Any = None, unroll: int | bool = 1
    ):
        self.plan, self.pieces = _stack.build_pytree(layers)
        self.remat = _stack.check_remat(remat)
        self.unroll = unroll
        self.n = len(layers)

    def __call__(self, x: Any, *, per_layer: dict | None = None, **kwargs: Any) -> Any:
        if _eager.active():  # un-jitted: compile once per distinct program
            return _eager.call(
                EqxStack.__call__, self, x, per_layer=per_layer, **kwargs
            )
        per_layer = _stack.check_per_layer(per_layer, self.n)
        with jax.named_scope("scanax.Stack"):
            return _stack.apply_pytree(
                self.pieces, self.plan, x, kwargs, per_layer, self.remat, self.unroll
            )

    def __repr__(self) -> str:
        return f"Stack({_stack.describe_plan(self.plan, self.pieces)})"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return _stack.pytree_layer(self.plan, self.pieces, self.n, i)

    def __iter__(self):
        return (self[i] for i in range(self.n))


_stack.Stack.register(EqxStack)  # isinstance(s, scanax.Stack)
