"""Which framework adapter builds a ``scanax.Stack``: NNX layers, then Equinox ones.

Registered from here, above both ``_stack`` and the adapters, so that ``_stack``
imports none of them and an adapter's framework is imported only when layers of
that framework are given. ``scanax/__init__.py`` imports this module.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _nnx, _stack


def _has_nnx(layers: list[Any]) -> bool:
    return any(_nnx.is_node(x) for x in layers)


def _has_eqx(layers: list[Any]) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and any(isinstance(x, eqx.Module) for x in layers)


def _nnx_stack(layers: list[Any], **kwargs: Any) -> Any:
    from ._stack_nnx import NNXStack

    return NNXStack(layers, **kwargs)


def _eqx_stack(layers: list[Any], **kwargs: Any) -> Any:
    from ._stack_eqx import EqxStack

    return EqxStack(layers, **kwargs)


_stack.register_adapter(_has_nnx, _nnx_stack)
_stack.register_adapter(_has_eqx, _eqx_stack)
