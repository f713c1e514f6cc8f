"""Equinox adapter for ``scanax.Stack``: the only module of it that imports Equinox."""

from __future__ import annotations

from typing import Any

import equinox as eqx

from . import _stack


class EqxStack(_stack.Body, eqx.Module):
    """``scanax.Stack`` over Equinox layers (see ``scanax.Stack``): an ``eqx.Module``.

    Stacked runs are fields holding arrays with a leading ``repeats`` axis, so
    ``eqx.filter_grad``, ``eqx.partition`` and optax see one array per parameter.
    Equinox layers are pytrees: ``_stack.Body`` handles them as it does plain ones.
    """

    pieces: tuple
    plan: tuple = eqx.field(static=True)
    remat: Any = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)
    n: int = eqx.field(static=True)


_stack.Stack.register(EqxStack)  # isinstance(s, scanax.Stack)
