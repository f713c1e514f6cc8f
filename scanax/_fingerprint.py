"""Fingerprints: hashable keys under which two calls trace the same program.

``jax.jit`` caches a compiled program on the *identity* of the function it wraps,
so a notebook cell or a sweep that rebuilds ``optax.adam(1e-3)`` or re-defines
``loss_fn`` with the same code pays a full compile every time. A fingerprint
describes a value by what tracing it can see instead:

* functions: their code (``co_code``, constants, names: CPython's own code
  equality, nested functions included), defaults, closure cells and the globals
  the code names, each fingerprinted in turn;
* ``functools.partial`` and bound methods: the function and what is bound;
* tuples, lists, mappings, dataclasses and named tuples (optax transforms and states,
  NNX graphdefs): their type and fields;
* numbers, strings, dtypes, pytree definitions: their value and type;
* small arrays (at most ``_ARRAY_BYTES``): their bytes; larger ones their identity;
* other hashable values with an equality of their own: themselves;
* anything else (classes, modules, a library's own top-level functions, other
  objects): its identity, as ``jax.jit``.

Equal fingerprints mean the same traced program (the same rule ``jax.jit`` already
applies to the objects it caches on: an object mutated in place is not looked
into). ``of`` returns None for a value too large to describe cheaply: the caller
then falls back to its own slower path.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

_BUDGET = 20_000  # values visited per fingerprint before giving up
_ARRAY_BYTES = 4096
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))


class _TooLarge(Exception):
    pass


class _Same:
    """Compares by identity and keeps the object alive (so its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def of(value: Any) -> Any:
    """A hashable fingerprint of ``value``, or None when it is too large."""
    try:
        return _Walker().walk(value)
    except (_TooLarge, RecursionError):
        return None


class _Walker:
    def __init__(self):
        self.left = _BUDGET
        self.active: dict[int, int] = {}  # id -> position, for cycles

    def walk(self, x: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _TooLarge
        if type(x) in _SCALARS:
            return (type(x), repr(x)) if isinstance(x, float) else (type(x), x)
        if isinstance(x, (np.dtype, jax.tree_util.PyTreeDef)):
            return x
        if isinstance(x, (types.ModuleType, type)):
            return _Same(x)
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return self._array(x)
        ident = id(x)
        if ident in self.active:  # a cycle: refer back to where it started
            return ("cycle", self.active[ident])
        self.active[ident] = len(self.active)
        try:
            return self._container(x)
        finally:
            del self.active[ident]

    def _array(self, x: Any) -> Any:
        if isinstance(x, jax.core.Tracer) or getattr(x, "nbytes", 0) > _ARRAY_BYTES:
            return _Same(x)
        try:
            a = np.asarray(x)
        except Exception:  # a PRNG key array, a deleted buffer...
            return _Same(x)
        return ("array", a.dtype, a.shape, a.tobytes(), type(x) is np.ndarray)

    def _container(self, x: Any) -> Any:
        walk = self.walk
        if isinstance(x, types.FunctionType):
            return self._function(x)
        if isinstance(x, functools.partial):
            return ("partial", walk(x.func), walk(x.args), walk(x.keywords))
        if isinstance(x, types.MethodType):
            return ("method", walk(x.__func__), walk(x.__self__))
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(walk(v) for v in x))
        if isinstance(x, (dict, Mapping)):
            return (type(x), tuple((walk(k), walk(v)) for k, v in x.items()))
        if isinstance(x, (set, frozenset)):
            return _Same(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = tuple(
                walk(getattr(x, f.name, None)) for f in dataclasses.fields(x)
            )
            return (type(x), fields)
        if isinstance(x, types.BuiltinFunctionType):
            return _Same(x)
        if type(x).__eq__ is not object.__eq__:  # a value with its own equality
            try:
                hash(x)
            except TypeError:
                return _Same(x)
            return (type(x), x)
        return _Same(x)

    def _function(self, fn: types.FunctionType) -> Any:
        if _importable(fn):  # a library's own function: the same object each time
            return _Same(fn)
        walk = self.walk
        code = fn.__code__
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(walk(cell.cell_contents))
            except ValueError:  # an empty cell (a name assigned later)
                cells.append(("empty",))
        globs = fn.__globals__
        named = tuple(
            (name, walk(globs[name])) for name in _global_names(code) if name in globs
        )
        return (
            "function",
            code,
            walk(fn.__defaults__),
            walk(fn.__kwdefaults__),
            tuple(cells),
            named,
        )


def _importable(fn: types.FunctionType) -> bool:
    """True for a function found under its own name in its (non-``__main__``)
    module: rebuilding a model or optimizer never makes a new one of those."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    return getattr(module, fn.__qualname__, None) is fn


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names that ``code`` or the code nested in it may read as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))
