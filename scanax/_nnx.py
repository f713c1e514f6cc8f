"""Flax NNX adapter: the only module of the core that touches ``flax.nnx``.

NNX objects are graphs (they may share Variables), so they cross a scan boundary as
``nnx.split`` state and are rebuilt with ``nnx.merge``. Nothing here imports flax: if
the user has NNX objects, ``flax.nnx`` is already in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax.tree_util as jtu


def _nnx():
    return sys.modules.get("flax.nnx")


def is_node(x: Any) -> bool:
    """True for NNX graph nodes (Modules, Optimizers, Rngs, Variables, ...)."""
    nnx = _nnx()
    return nnx is not None and nnx.graph.is_graph_node(x)


def contains_node(tree: Any) -> bool:
    if _nnx() is None:
        return False
    return any(is_node(x) for x in jtu.tree_leaves(tree, is_leaf=is_node))


def split(nodes: list[Any]) -> tuple[Any, Any]:
    """Split a list of NNX nodes jointly (shared Variables stay shared)."""
    return _nnx().split(nodes)


def merge(graphdef: Any, state: Any) -> list[Any]:
    return _nnx().merge(graphdef, state)


def update(nodes: list[Any], state: Any) -> None:
    """Write ``state`` back into the user's own objects, in place."""
    _nnx().update(nodes, state)


def trace_context_error() -> type[Exception] | None:
    """The error NNX raises when a Variable is set from another trace level."""
    if _nnx() is None:
        return None
    from flax import errors

    return errors.TraceContextError


def variable_paths(state: Any) -> list[str]:
    return [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(state)[0]]


def reachable_nodes(f: Any) -> list[str]:
    """Names of NNX objects that ``f`` reaches through closure cells or globals."""
    if _nnx() is None:
        return []
    names: list[str] = []
    fn = getattr(f, "__func__", f)
    code = getattr(fn, "__code__", None)
    if code is None:
        return names
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if contains_node(value):
            names.append(f"`{name}` ({type(value).__name__})")
    globs = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in globs and contains_node(globs[name]):
            names.append(f"`{name}` ({type(globs[name]).__name__})")
    return names
