"""Pytree leaves: which are arrays and which static, their shapes and dtypes as JAX
takes them in (``leaf_type``, ``same_types``), and new values put back.

Modules that pass part of a pytree through JAX (the arrays of a carry into a scan,
a layer's arrays through ``jax.checkpoint``, a call's arrays into a compiled
program) split its leaves into those that go through and those that stay, then
rebuild it with new values in the first ones' places: ``partition`` and ``splice``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def is_array(x: Any) -> bool:
    """Arrays that scanax passes as operands (never Python scalars)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def not_numeric(tree: Any) -> list[tuple[Any, Any]]:
    """``(path, leaf)`` of the arrays in ``tree`` that JAX cannot hold: NumPy
    arrays of strings, bytes, objects or dates."""
    return [
        (path, x)
        for path, x in jtu.tree_flatten_with_path(tree)[0]
        if isinstance(x, (np.ndarray, np.generic)) and x.dtype.kind in "OSUVMm"
    ]


def is_arraylike(x: Any) -> bool:
    """What ``lax.scan`` accepts as a carry leaf: arrays and Python numbers."""
    return is_array(x) or isinstance(x, (bool, int, float, complex))


def leaf_type(x: Any) -> tuple[tuple[int, ...], Any]:
    """An array leaf's shape and dtype as JAX takes it in (``jnp.result_type``): a
    NumPy float64 array is float32 unless x64 is on, as it would be as a ``lax.scan``
    carry; a Python number has its default dtype."""
    return tuple(jnp.shape(x)), jnp.result_type(x)


def same_types(a: Any, b: Any, dtypes: bool = True) -> bool:
    """Whether two pytrees of arrays have the same structure and leaves of the same
    shapes and (with ``dtypes``) dtypes, each leaf taken as ``leaf_type`` does."""
    la, ta = jtu.tree_flatten(a)
    lb, tb = jtu.tree_flatten(b)
    if ta != tb:
        return False
    pairs = [(leaf_type(x), leaf_type(y)) for x, y in zip(la, lb, strict=True)]
    return all(x == y if dtypes else x[0] == y[0] for x, y in pairs)


def same_static(a: Any, b: Any) -> bool:
    """Whether two static (non-array) leaves are the same value, of the same type
    (``1``, ``1.0`` and ``True`` compare equal but are not the same)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def splice(leaves: Sequence[Any], idx: Sequence[int], values: Iterable[Any]) -> list:
    """A copy of ``leaves`` with ``values`` at the positions ``idx``, in order."""
    new = list(leaves)
    for i, v in zip(idx, values, strict=True):
        new[i] = v
    return new


@dataclasses.dataclass(frozen=True)
class Partition:
    """A flattened pytree and the positions of the leaves ``partition`` picked."""

    treedef: Any
    leaves: list[Any]
    idx: list[int]

    @property
    def picked(self) -> list[Any]:
        return [self.leaves[i] for i in self.idx]

    def rebuild(self, values: Iterable[Any]) -> Any:
        """The pytree with ``values`` in place of the picked leaves."""
        return jtu.tree_unflatten(self.treedef, splice(self.leaves, self.idx, values))


def partition(
    tree: Any,
    pick: Callable[[Any], bool] = is_array,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Partition:
    """``tree``'s leaves (as ``jtu.tree_flatten(tree, is_leaf)``), those for which
    ``pick`` holds marked to be replaced (the arrays, by default)."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_leaf)
    return Partition(treedef, leaves, [i for i, x in enumerate(leaves) if pick(x)])


def real_numbers(x: Any, shape: tuple, fail: Callable[[], Exception]) -> np.ndarray:
    """``x`` (a Python number or an array) as a NumPy array of real numbers of
    ``shape``, else ``fail()`` raised (what a state handed back to ``fit``, e.g.
    ``plateau_state=``, holds in each field)."""
    a = np.asarray(x) if isinstance(x, (int, float, np.number)) or is_array(x) else None
    if (
        a is None
        or a.shape != shape
        or not np.issubdtype(a.dtype, np.number)
        or np.issubdtype(a.dtype, np.complexfloating)
    ):
        raise fail()
    return a


def out_of_range(x: Any, high: int) -> tuple[tuple[int, ...], int] | None:
    """The first entry of an integer array outside ``[0, high]`` (its index and
    value), or None: none, or ``x`` is traced (its values unknown; nothing is
    read)."""
    if isinstance(x, jax.core.Tracer):
        return None
    values = np.asarray(x)
    bad = np.argwhere((values < 0) | (values > high))
    if not len(bad):
        return None
    index = tuple(int(i) for i in bad[0])
    return index, int(values[index])


def as_int(value: Any) -> int | None:
    """``value`` as a Python int (an int-like object: ``operator.index``), or
    None for a bool or anything else: how scanax reads a count or an index."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def index_in(i: Any, n: int, fail: Callable[[Any], Exception]) -> int:
    """Index ``i`` of ``n`` items (negative counts from the end; an int-like
    object, not a bool), as ``0 <= i < n``; else ``fail(index)`` raised, with
    ``index`` the int ``i`` is when out of range, None when it is no int."""
    index = as_int(i)
    if index is None or not -n <= index < n:
        raise fail(index)
    return index % n
