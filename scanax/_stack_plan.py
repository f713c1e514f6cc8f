"""``scanax.Stack``'s plan: which layers are stacked into runs, framework-free.

Layers are compared by a signature (what must match for two layers to be stacked:
structure, static values, array shapes and dtypes); ``plan`` splits the sequence
into pieces, single layers and runs of repeated blocks. ``number_differences``
says when two layers miss a run only by a Python number, and ``describe_plan``
writes a plan for people.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax.tree_util as jtu
import numpy as np

from ._errors import stack as errors
from ._tree import is_array, leaf_type, same_static

# A plan is a tuple of pieces ``(start, period, repeats)``: layers
# ``start : start + period * repeats``, ``repeats`` blocks of ``period`` layers.
# ``repeats == 1`` (then ``period == 1``) is a single layer called directly.
Piece = tuple[int, int, int]


def span(piece: Piece) -> str:
    start, period, repeats = piece
    return f"layers[{start}:{start + period * repeats}]"


# ---------------------------------------------------------------------------- plan


def pytree_signature(layer: Any) -> tuple[Any, list[Any]]:
    """What must match for two layers to be stacked: structure, statics, types."""
    leaves, treedef = jtu.tree_flatten(layer)
    sig = [("array", *leaf_type(x)) if is_array(x) else ("static", x) for x in leaves]
    return treedef, sig


def same_signature(a: tuple[Any, list[Any]], b: tuple[Any, list[Any]]) -> bool:
    (ta, la), (tb, lb) = a, b
    if not same_static(ta, tb) or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if x[0] != y[0]:
            return False
        if x[0] == "array" and x[1:] != y[1:]:
            return False
        if x[0] == "static" and not same_static(x[1], y[1]):
            return False
    return True


def signature_ids(signatures: list[Any]) -> list[int]:
    """Equal ids for layers with the same signature."""
    reps: list[Any] = []
    ids = []
    for sig in signatures:
        for k, rep in enumerate(reps):
            if same_signature(sig, rep):
                ids.append(k)
                break
        else:
            ids.append(len(reps))
            reps.append(sig)
    return ids


def plan(ids: list[int], max_period: int = 64) -> tuple[Piece, ...]:
    """Split layers into pieces, minimising the layers traced, then the pieces.

    A run of ``repeats`` blocks of ``period`` layers costs ``period`` traced layers
    (one scan body); a single layer costs one. Dynamic programming over the start.
    """
    n = len(ids)
    best: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    choice: list[tuple[int, int]] = [(1, 1)] * n
    for i in reversed(range(n)):
        best[i] = (1 + best[i + 1][0], 1 + best[i + 1][1])
        choice[i] = (1, 1)
        for p in range(1, min(max_period, (n - i) // 2) + 1):
            block = ids[i : i + p]
            r = 1
            while ids[i + r * p : i + (r + 1) * p] == block:
                r += 1
            for rr in range(2, r + 1):
                rest = best[i + rr * p]
                cost = (p + rest[0], 1 + rest[1])
                if cost < best[i]:
                    best[i], choice[i] = cost, (p, rr)
    pieces, i = [], 0
    while i < n:
        p, r = choice[i]
        pieces.append((i, p, r))
        i += p * r
    return tuple(pieces)


# ---------------------------------------------------------------------------- why not


def _is_number(x: Any) -> bool:
    """A Python number that could have been an array (flags are not: bools pick
    code paths)."""
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def number_differences(
    a: Any, b: Any, expand: Callable[[Any], Any] | None = None
) -> list[tuple[str, Any, Any]] | None:
    """``[(path, value in a, value in b), ...]``: the Python numbers in which two
    layers differ, when that is all they differ in (same types, same structure,
    arrays of the same shapes and dtypes, equal other values); else None.

    ``expand(x)``: ``[(key, child), ...]`` for objects of a framework (NNX modules
    and Variables), None for others.
    """
    diffs: list[tuple[str, Any, Any]] = []
    same = _walk(a, b, "", diffs, expand)
    return diffs if same and diffs else None


def _walk(a: Any, b: Any, path: str, diffs: list, expand: Any) -> bool:
    if is_array(a) or is_array(b):
        return is_array(a) and is_array(b) and leaf_type(a) == leaf_type(b)
    if _is_number(a) and _is_number(b):
        if not same_static(a, b):
            diffs.append((path, a, b))
        return True
    if type(a) is not type(b):
        return False
    kids_a, kids_b = _children(a, expand), _children(b, expand)
    if kids_a is None or kids_b is None:
        return same_static(a, b)
    if [k for k, _ in kids_a] != [k for k, _ in kids_b]:
        return False
    return all(
        _walk(x, y, path + k, diffs, expand)
        for (k, x), (_, y) in zip(kids_a, kids_b, strict=True)
    )


def _children(x: Any, expand: Any) -> list[tuple[str, Any]] | None:
    kids = expand(x) if expand is not None else None
    if kids is not None:
        return kids
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # Equinox modules
        return [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x)]
    if isinstance(x, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(x)]
    if isinstance(x, dict):
        return [(f"[{k!r}]", v) for k, v in x.items()]
    return None


def locate(plan_: tuple[Piece, ...], n: int, i: Any) -> tuple[int, int, int]:
    """(piece index, block index, index in block) of layer ``i``."""
    try:
        index = None if isinstance(i, bool) else operator.index(i)  # np/jnp ints too
    except TypeError:
        index = None
    if index is None:
        raise errors.bad_index_type(i)
    if not -n <= index < n:
        raise errors.bad_index(index, n)
    i = index % n
    for k, (start, period, repeats) in enumerate(plan_):
        if start <= i < start + period * repeats:
            j, m = divmod(i - start, period)
            return k, j, m
    raise errors.bad_index(i, n)  # unreachable: i was checked above


def describe_plan(plan_: tuple[Piece, ...], pieces: Sequence[Any]) -> str:
    """``8 layers: Linear(3→4), 6 × Block scanned, Linear(4→2)``: how a Stack
    applies its layers (a run of a period of several: ``12 × [Mix, Gate]``)."""
    parts = []
    n = 0
    for (_, p, r), data in zip(plan_, pieces, strict=True):
        n += p * r
        if r == 1:
            parts.append(_layer_name(data))
            continue
        names = ", ".join(_layer_name(x) for x in data)
        parts.append(f"{r} × {names if p == 1 else f'[{names}]'} scanned")
    return f"{n} layer{'s' * (n != 1)}: " + ", ".join(parts)


def _layer_name(layer: Any) -> str:
    name = getattr(layer, "__name__", None) or type(layer).__name__
    d_in = getattr(layer, "in_features", None)
    d_out = getattr(layer, "out_features", None)
    if isinstance(d_in, (int, np.integer)) and isinstance(d_out, (int, np.integer)):
        return f"{name}({d_in}→{d_out})"
    return name
