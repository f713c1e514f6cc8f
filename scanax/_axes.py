"""in_axes / out_axes: matching an axis prefix to a pytree, and where two differ."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu

from . import _errors

KeyPath = tuple[Any, ...]


def _is_axis_leaf(x: Any) -> bool:
    return x is None or isinstance(x, int)


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a dict with keys [{', '.join(sorted(map(repr, x)))}]"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of length {len(x)}"
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # (a traced array too)
        return f"one array, {_errors.short_type(x)}"
    return f"a {type(x).__name__}"


def _first_mismatch(
    prefix: Any, tree: Any, path: KeyPath, tree_name: str
) -> tuple[KeyPath, str] | None:
    if _is_axis_leaf(prefix):
        return None
    if isinstance(prefix, (tuple, list, dict)):
        same_kind = type(prefix) is type(tree) or (
            isinstance(prefix, tuple) and isinstance(tree, tuple)
        )
        if not same_kind:
            return path, f"{_describe(prefix)} where {tree_name} has {_describe(tree)}"
        if isinstance(prefix, dict):
            if set(prefix) != set(tree):
                return (
                    path,
                    f"{_describe(prefix)} where {tree_name} has {_describe(tree)}",
                )
            items = [(jtu.DictKey(k), prefix[k], tree[k]) for k in prefix]
        else:
            if len(prefix) != len(tree):
                return (
                    path,
                    f"{_describe(prefix)} where {tree_name} has {_describe(tree)}",
                )
            items = [
                (jtu.SequenceKey(i), p, t) for i, (p, t) in enumerate(zip(prefix, tree))
            ]
        for key, p, t in items:
            found = _first_mismatch(p, t, (*path, key), tree_name)
            if found:
                return found
        return None
    return path, f"{_describe(prefix)} where {tree_name} has {_describe(tree)}"


def first_difference(
    a: Any, b: Any, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[KeyPath, str, str] | None:
    """Where two pytrees first differ in structure: ``(path, a there, b there)``
    with each side described (``a dict with keys ['h', 'n']``, ``float32[3]``), or
    None when they have the same structure."""

    def level(x: Any) -> tuple[Any, list[tuple[Any, Any]]] | None:
        if is_leaf is not None and is_leaf(x):
            return None
        if jtu.tree_structure(x).num_leaves == 1 and jtu.treedef_is_leaf(
            jtu.tree_structure(x)
        ):
            return None  # a leaf (None is a node without children)
        kids, top = jtu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        return top, [(p[0], c) for p, c in kids]

    def describe(x: Any) -> str:
        return _errors.short_type(x) if level(x) is None else _describe(x)

    def walk(a: Any, b: Any, path: KeyPath) -> tuple[KeyPath, str, str] | None:
        la, lb = level(a), level(b)
        if la is None and lb is None:
            return None
        if la is None or lb is None or la[0] != lb[0]:
            return path, describe(a), describe(b)
        for (key, x), (_, y) in zip(la[1], lb[1]):
            found = walk(x, y, (*path, key))
            if found:
                return found
        return None

    return walk(a, b, ())


def match_prefix(
    call: str,
    what: str,
    tree_name: str,
    prefix: Any,
    tree: Any,
    is_leaf: Callable[[Any], bool] | None = None,
) -> list[tuple[KeyPath, int | None, Any]]:
    """Flatten ``tree`` to its leaves, each paired with the axis ``prefix`` gives it.

    Returns ``(path, axis, leaf)`` triples in ``jtu.tree_flatten(tree, is_leaf)`` order.
    """
    axis_leaves, axis_def = jtu.tree_flatten_with_path(prefix, is_leaf=_is_axis_leaf)
    for path, ax in axis_leaves:
        if isinstance(ax, bool) or not _is_axis_leaf(ax):
            raise _errors.bad_axis_value(call, what, jtu.keystr(path), ax)
    if _is_axis_leaf(prefix):
        subtrees = [tree]
    else:
        try:
            subtrees = axis_def.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            found = _first_mismatch(prefix, tree, (), tree_name)
            if found is None:
                detail = (
                    f"{what} is {_describe(prefix)} and {tree_name} is "
                    f"{_describe(tree)}"
                )
            else:
                path, desc = found
                where = f" at {tree_name}{jtu.keystr(path)}" if path else ""
                detail = f"{what}{jtu.keystr(path)} is {desc}{where}"
            raise _errors.prefix_mismatch(call, what, tree_name, detail) from err
    out = []
    for (ppath, ax), sub in zip(axis_leaves, subtrees):
        for spath, leaf in jtu.tree_flatten_with_path(sub, is_leaf=is_leaf)[0]:
            out.append(((*ppath, *spath), ax, leaf))
    return out


def normalize_axis(call: str, what: str, path: str, leaf: Any, axis: int) -> int:
    ndim = len(leaf.shape)
    if not -ndim <= axis < ndim:
        raise _errors.axis_out_of_range(call, path, leaf, axis, what)
    return axis % ndim
