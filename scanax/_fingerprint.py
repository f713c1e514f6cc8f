"""Fingerprints: hashable keys under which two calls trace the same program.

``jax.jit`` caches a compiled program on the *identity* of the function it wraps,
so a notebook cell or a sweep that rebuilds ``optax.adam(1e-3)`` or re-defines
``loss_fn`` with the same code pays a full compile every time. A fingerprint
describes a value by everything tracing it can read instead:

* functions of the user's code: their code (CPython's own code equality, nested
  functions included), defaults, closure cells and the globals the code names,
  each fingerprinted in turn (a module of the user's code, ``import mymodels``,
  named or closed over, by those of its attributes the code may read);
* classes of the user's code: their methods and class attributes (a model's
  ``__call__`` reading a global is seen);
* ``functools.partial`` and bound methods: the function and what is bound;
* ``jax.jit`` functions of the user's code: their identity (as ``jax.jit``'s own
  cache; a re-defined one is new);
* tuples, lists, mappings, dataclasses, named tuples (optax transforms and
  states) and pytree definitions (Equinox static fields): their type and fields;
* numbers, strings, dtypes: their value and type;
* arrays: small ones (at most ``_ARRAY_BYTES``) by value, large JAX arrays (which
  never change) by identity;
* other hashable values with an equality of their own: themselves;
* installed libraries (their modules, classes and top-level functions, found under
  the library directories: ``_library_dirs``) and builtins: their identity,
  since rebuilding a model or an optimizer never makes new ones.

Anything else could change without a new identity (an instance such as an NNX
model or a ``SimpleNamespace`` closed over, a module of the user's code held
in a container, a mutable NumPy array too large to compare): ``of``
then returns None, and the caller traces again at every call
(``_fit.program.identity``), which reads the current values. None too for a
value too large to describe cheaply.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import os
import sys
import sysconfig
import types
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import numpy as np

_BUDGET = 20_000  # values visited per fingerprint before giving up
_ARRAY_BYTES = 4096
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
# (a class's own bookkeeping: ``__dataclass_params__`` holds the dataclass
# decorator's options, the fields are in ``__dataclass_fields__``; a
# ``__repr__`` computes nothing a program holds, and the one ``dataclasses``
# writes closes over a set)
_SKIPPED_CLASS_ATTRS = (
    "__dict__",
    "__weakref__",
    "__doc__",
    "__module__",
    "_abc_impl",
    "__dataclass_params__",
    "__repr__",
)


class _Unknown(Exception):
    """The value may change without a new identity, or is too large."""


class _Same:
    """Compares by identity and keeps the object alive (so its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def trace_context() -> Any:
    """The JAX configuration that ``jax.jit`` keys its caches on (matmul
    precision, PRNG implementation, default device...): a program traced under
    other settings is another program."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - another JAX: every setting counts
        return tuple(sorted((k, repr(v)) for k, v in jax.config.values.items()))
    return config.trace_context()


def of(value: Any) -> Any:
    """A hashable fingerprint of ``value``, or None (see the module docstring)."""
    try:
        return _Walker().walk(value)
    except Exception:  # (_Unknown, a cycle too deep, an attribute that fails)
        return None


class _Unfingerprinted:
    def __repr__(self) -> str:
        return "UNKNOWN"


# What ``key`` gives for a function without a fingerprint: a cache key holding
# it (at its top level, or one tuple down) must not be cached, since what the
# function reads may change without a new object.
UNKNOWN = _Unfingerprinted()


def key(fn: Any) -> Any:
    """``fn``'s part of a cache key of compiled programs: its fingerprint, None
    for None, else ``UNKNOWN`` (``cacheable`` is then False: trace it again)."""
    if fn is None:
        return None
    found = of(fn)
    return UNKNOWN if found is None else found


def cacheable(parts: tuple) -> bool:
    """Whether a cache key built of ``parts`` (some made by ``key``) may be
    cached: no ``UNKNOWN`` among them or in a tuple among them."""
    return not any(
        p is UNKNOWN or (type(p) is tuple and any(q is UNKNOWN for q in p))
        for p in parts
    )


class _Walker:
    def __init__(self):
        self.left = _BUDGET
        self.active: dict[int, int] = {}  # id -> position, for cycles

    def walk(self, x: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _Unknown
        if type(x) in _SCALARS:
            return (type(x), repr(x)) if isinstance(x, float) else (type(x), x)
        if isinstance(x, np.dtype):
            return x
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return self._array(x)
        if isinstance(x, types.ModuleType):
            if _library(x.__name__):
                return _Same(x)
            raise _Unknown  # the user's module: its attributes may change
        ident = id(x)
        if ident in self.active:  # a cycle: refer back to where it started
            return ("cycle", self.active[ident])
        self.active[ident] = len(self.active)
        try:
            return self._container(x)
        finally:
            del self.active[ident]

    def _array(self, x: Any) -> Any:
        if isinstance(x, jax.core.Tracer):
            raise _Unknown
        if getattr(x, "nbytes", 0) > _ARRAY_BYTES:
            if isinstance(x, jax.Array):
                return _Same(x)  # immutable: its identity is its value
            raise _Unknown  # a large NumPy array may be changed in place
        try:
            a = np.asarray(x)
        except Exception:  # a PRNG key array, a deleted buffer...
            if isinstance(x, jax.Array):
                return _Same(x)
            raise _Unknown from None
        weak = getattr(x, "weak_type", False)  # (it promotes otherwise)
        return ("array", a.dtype, a.shape, a.tobytes(), type(x) is np.ndarray, weak)

    def _container(self, x: Any) -> Any:
        walk = self.walk
        if isinstance(x, types.FunctionType):
            return self._function(x)
        if isinstance(x, type):
            return self._class(x)
        if isinstance(x, jax.tree_util.PyTreeDef):
            return self._treedef(x)
        if isinstance(x, functools.partial):
            return ("partial", walk(x.func), walk(x.args), walk(x.keywords))
        if isinstance(x, types.MethodType):
            return ("method", walk(x.__func__), walk(x.__self__))
        if isinstance(x, _TUPLEGETTER):  # a named tuple's field (immutable)
            return (_TUPLEGETTER, x.__reduce__()[1])
        if isinstance(x, (staticmethod, classmethod)):
            return (type(x), walk(x.__func__))
        if isinstance(x, property):
            return (property, walk(x.fget), walk(x.fset), walk(x.fdel))
        if isinstance(x, dataclasses.Field):  # (a dataclass's, an eqx.Module's)
            return (
                dataclasses.Field,
                x.name,
                repr(x.type),
                walk(x.default),
                walk(x.default_factory),
                walk(dict(x.metadata)),
            )
        if isinstance(x, functools.cached_property):
            return (functools.cached_property, walk(x.func))
        if isinstance(x, types.MemberDescriptorType):  # (a ``__slots__`` slot)
            return (types.MemberDescriptorType, x.__name__)
        if isinstance(x, TypeVar):  # (a ``Generic`` class's parameters)
            return (TypeVar, x.__name__)
        if isinstance(x, logging.Logger):  # (one per name; nothing computed)
            return _Same(x)
        if callable(x) and hasattr(x, "cache_info") and hasattr(x, "__wrapped__"):
            return ("lru_cache", walk(x.__wrapped__))  # (functools.lru_cache)
        if isinstance(x, (tuple, list)):  # (a named tuple's class and methods too)
            return (self._type(type(x)), tuple(walk(v) for v in x))
        if isinstance(x, (dict, Mapping)):
            items = tuple((walk(k), walk(v)) for k, v in x.items())
            return (self._type(type(x)), items)
        if isinstance(x, frozenset):
            return (frozenset, frozenset(walk(v) for v in x))
        if dataclasses.is_dataclass(x):
            # its class by fingerprint (its methods' code and what they read),
            # its fields, and any other attribute set on it
            names = [f.name for f in dataclasses.fields(x)]
            fields = tuple(walk(getattr(x, name, None)) for name in names)
            own = dict(getattr(x, "__dict__", {}))
            for name in _slots(type(x)):  # (values in slots, not in __dict__)
                if hasattr(x, name):
                    own[name] = getattr(x, name)
            # (a library base's private bookkeeping left out: a linen module's
            # ``_id``, new for each instance, and ``_state``)
            kept = not _library_base(type(x))
            extra = {
                k: v
                for k, v in own.items()
                if k not in names and (kept or not k.startswith("_"))
            }
            return (walk(type(x)), fields, walk(extra) if extra else None)
        if isinstance(x, (types.BuiltinFunctionType, types.WrapperDescriptorType)):
            return _Same(x)
        if _importable(x):  # e.g. jax.nn.relu, a jitted function of jax's own
            return _Same(x)
        if isinstance(x, _JITTED):
            # a ``jax.jit`` of the user's (a module's helper): by identity, as
            # jax.jit caches it; re-defined, it is a new one
            return _Same(x)
        if isinstance(x, enum.Enum):  # (its class's fingerprint holds its value)
            return ("member", self._type(type(x)), x.name)
        if type(x).__eq__ is not object.__eq__ and _hashable(x):
            # a value with an equality of its own: a dtype, a sharding, a
            # PartitionSpec, an Enum, flax's HashableMapping... (a class of the
            # user's by its methods too)
            return (self._type(type(x)), x)
        if _stateless(x) or type(x) is object:
            # a library's sentinel (Equinox's ``Missing``), a bare ``object()``
            # (``jax.vmap``'s): nothing of their own
            return _Same(x)
        raise _Unknown  # an instance that may change in place (an NNX model...)

    def _function(self, fn: types.FunctionType) -> Any:
        if _importable(fn):  # a library's own function: the same object each time
            return _Same(fn)
        walk = self.walk
        code = fn.__code__
        globs, names = fn.__globals__, _global_names(code)
        read = names + _strings(code)  # (a module's attributes, also by a string)
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(self._global(cell.cell_contents, read))
            except ValueError:  # an empty cell (a name assigned later)
                cells.append(("empty",))
        named = tuple(
            (name, self._global(globs[name], read)) for name in names if name in globs
        )
        return (
            "function",
            code,
            walk(fn.__defaults__),
            walk(fn.__kwdefaults__),
            tuple(cells),
            named,
            # its attributes (``f.scale = 2.0``, ``functools.wraps``'s
            # ``__wrapped__``), which its code may read through its own name
            walk(dict(fn.__dict__)) if fn.__dict__ else None,
        )

    def _global(self, value: Any, names: tuple[str, ...]) -> Any:
        """A global that a function names, or a value it closes over: a
        module of the user's code by the attributes of it that the function
        may read (every name its code holds, as a name or a string, that the
        module defines: ``job.env_reset``, ``config.LR``, ``getattr(config,
        "LR")``), each fingerprinted in turn (a reassigned one is seen); a
        module with a ``__getattr__`` has none (its attributes are computed);
        anything else as ``walk`` does."""
        if not isinstance(value, types.ModuleType) or _library(value.__name__):
            return self.walk(value)
        defined = vars(value)  # (no attribute lookup: nothing of the module runs)
        if "__getattr__" in defined:
            raise _Unknown
        ident = id(value)
        if ident in self.active:
            return ("cycle", self.active[ident])
        self.active[ident] = len(self.active)
        try:
            read = tuple(
                (name, self._global(defined[name], names))
                for name in names
                if name in defined
            )
        finally:
            del self.active[ident]
        return ("module", value.__name__, read)

    def _type(self, cls: type) -> Any:
        """A value's class in its fingerprint: a library's (``tuple``,
        ``dict``...) as it is, the user's by ``_class`` (its methods, class
        attributes and what they read)."""
        return cls if _library(cls.__module__) else self._class(cls)

    def _class(self, cls: type) -> Any:
        if _library(cls.__module__):
            return _Same(cls)
        if isinstance(cls, enum.EnumMeta):  # (its members by name and value)
            members = tuple((m.name, self.walk(m.value)) for m in cls)
            attrs = tuple(
                (name, self.walk(value))
                for name, value in vars(cls).items()
                if name not in _SKIPPED_CLASS_ATTRS
                and not isinstance(value, cls)
                and not (name.startswith("_") and name.endswith("_"))
            )
            bases = tuple(self.walk(b) for b in cls.__bases__)
            return ("enum", cls.__qualname__, bases, members, attrs)
        attrs = tuple(
            (name, self.walk(value))
            for name, value in vars(cls).items()
            if name not in _SKIPPED_CLASS_ATTRS
        )
        bases = tuple(self.walk(b) for b in cls.__bases__)
        return ("class", cls.__qualname__, bases, attrs)

    def _treedef(self, treedef: Any) -> Any:
        """Node types and auxiliary data by fingerprint (an Equinox module's
        static fields ``0``, ``0.0`` and ``False`` are different programs, though
        ``PyTreeDef`` equality says they are equal)."""
        data = treedef.node_data()
        if data is not None and _registered_apart(data[0]):
            raise _Unknown  # (its flatten and unflatten cannot be read)
        node = None if data is None else (self.walk(data[0]), self.walk(data[1]))
        kids = tuple(self._treedef(c) for c in treedef.children())
        return ("treedef", node, kids)


_JITTED = type(jax.jit(lambda x: x))
_TUPLEGETTER = type(vars(collections.namedtuple("_Point", "x"))["x"])


def _registered_apart(cls: Any) -> bool:
    """A class of the user's registered as a pytree node with functions it
    does not hold (``jax.tree_util.register_pytree_node(cls, flatten,
    unflatten)``): what they compute is not in the class, and JAX offers no
    way to read them. Not an Equinox module or a ``flax.struct`` dataclass
    (theirs are made from the fields), a named tuple, or a class with its own
    ``tree_unflatten`` (``register_pytree_node_class``); a plain dataclass
    registered by ``jax.tree_util.register_dataclass`` is treated as one
    registered apart (its registration cannot be told from another)."""
    if not isinstance(cls, type) or _library(cls.__module__):
        return False
    made = dataclasses.is_dataclass(cls) and (
        getattr(cls, "_flax_dataclass", False) or _library_base(cls)
    )
    return not (made or issubclass(cls, tuple) or hasattr(cls, "tree_unflatten"))


def _slots(cls: type) -> list[str]:
    """The ``__slots__`` names of ``cls`` and its bases."""
    names = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]


def _library_base(cls: type) -> bool:
    """Whether a class of the user's derives from a library's (an
    ``eqx.Module``, a linen ``Module``, a ``flax.struct.PyTreeNode``)."""
    return any(_library(c.__module__) for c in cls.__mro__[1:-1])


def _stateless(x: Any) -> bool:
    """An instance of a library's class that holds nothing of its own: an
    empty ``__dict__``, no slots (its class's code is the library's)."""
    cls = type(x)
    if not _library(cls.__module__) or getattr(x, "__dict__", None) != {}:
        return False
    return not any("__slots__" in vars(c) for c in cls.__mro__[:-1])


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def _library(module_name: str | None) -> bool:
    """True for a module of an installed library, the standard library or a
    builtin one: code that does not change while a program runs."""
    if not module_name or module_name == "__main__":
        return False
    if module_name in sys.builtin_module_names or module_name == "builtins":
        return True
    if module_name.partition(".")[0] == __name__.partition(".")[0]:
        return True  # scanax's own (also installed editable, from a checkout)
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if path is None:
        return False
    path = os.path.realpath(path)
    search = tuple(p for p in sys.path if isinstance(p, str))  # (imports skip others)
    return any(path.startswith(d + os.sep) for d in _library_dirs(search, _users()))


def _users() -> tuple[str, ...]:
    """The user's own directories: the running script's and the current one."""
    script = sys.argv[0] if sys.argv and isinstance(sys.argv[0], str) else ""
    dirs = {os.path.realpath(os.curdir)}
    if script and script not in ("-c", "-m"):
        dirs.add(os.path.realpath(os.path.dirname(script) or os.curdir))
    return tuple(sorted(dirs))


@functools.lru_cache(maxsize=8)
def _library_dirs(
    search_path: tuple[str, ...], users: tuple[str, ...]
) -> tuple[str, ...]:
    """Where installed libraries live: the interpreter's library directories,
    the entries of ``search_path`` (``sys.path``) inside a ``site-packages`` or
    ``dist-packages`` directory, and its entries that hold a wheel's installed
    metadata (``pip install --target DIR`` put on ``PYTHONPATH``; a machine
    image's package directory), except the user's own directories (``users``:
    the running script's and the current one, whatever they hold) and a
    project's source directory (an editable install keeps its ``.dist-info``
    in ``site-packages``; the ``.egg-info`` setuptools leaves in a project's
    root does not count)."""
    paths = sysconfig.get_paths()
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    dirs = {os.path.realpath(paths[n]) for n in names if paths.get(n)}
    for p in search_path:
        real = os.path.realpath(p or os.curdir)
        packages = {"site-packages", "dist-packages"} & set(real.split(os.sep))
        if packages or (real not in users and _holds_wheels(real)):
            dirs.add(real)
    return tuple(sorted(dirs))


def _holds_wheels(directory: str) -> bool:
    """Whether ``directory`` holds an installed wheel's metadata."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n.endswith(".dist-info") for n in names)


def _importable(obj: Any) -> bool:
    """True for a library's function (or jitted function) found under its own
    name in its module: rebuilding a model or optimizer never makes a new one."""
    name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(name, str) or not isinstance(qualname, str):
        return False
    if not _library(name):
        return False
    return getattr(sys.modules[name], qualname, None) is obj


@functools.lru_cache(maxsize=4096)
def _strings(code: types.CodeType) -> tuple[str, ...]:
    """The string constants of ``code`` and of the code nested in it."""
    out = []
    for const in code.co_consts:
        if isinstance(const, str):
            out.append(const)
        elif isinstance(const, types.CodeType):
            out.extend(_strings(const))
    return tuple(dict.fromkeys(out))


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names that ``code`` or the code nested in it may read as globals."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return tuple(dict.fromkeys(names))
