"""Eager (un-jitted) calls: traced every time, compiled once per distinct program.

``scanax.scan(f, ...)`` outside ``jax.jit`` used to bind a fresh ``lax.scan`` on
every call: the body is a new closure each time, so JAX traced it again (needed: a
closure may read values that changed since the last call) and compiled it again (not
needed when the program is the same). Here an eager call is traced whole into one
jaxpr, and that jaxpr's *structure* is the key of a cache of compiled programs:

* array inputs (``jax.Array``, NumPy arrays, the Variables of NNX objects) are the
  program's arguments; arrays the call closes over (a weight read by ``f``) are the
  jaxpr's constants, also passed as arguments: their values are never part of the
  program, so a changed closure value gives the new result without a compile;
* Python numbers become literals of the program, part of the key: a changed float
  compiles once more, as a Python number closed over by a ``jax.jit`` function
  does (unlike ``jax.jit``, this also holds for numbers passed as ``init``/``xs``
  leaves: pass ``jnp.asarray(x)`` to vary one without compiling);
* parameters that play no part in running the program forward (the derivative
  rules of ``custom_jvp``/``custom_vjp``, ``jax.checkpoint``'s policy) are left out
  of the key; these programs are only ever run, never differentiated.

NNX objects among the arguments are rebuilt from their Variables inside the trace
(as ``nnx.jit`` does); Variables the call changes are written back to the user's
objects afterwards, and NNX objects returned are the user's own. Under any JAX
transformation (``jit``, ``grad``, ``vmap``) or ``jax.disable_jit()``, nothing here
runs: the call is traced into the enclosing program exactly as before.
"""

from __future__ import annotations

import collections
import functools as ft
import threading
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from . import _nnx
from ._tree import splice

try:  # private JAX: the cheapest trace; without it, the public `jax.make_jaxpr`
    from jax._src import core as _core, linear_util as _lu
    from jax._src.interpreters import partial_eval as _pe

    _trace_state_clean = _core.trace_state_clean
    _Tracer = _core.Tracer
except (ImportError, AttributeError):  # pragma: no cover - another JAX
    _pe = None
    _trace_state_clean = None
    _Tracer = jax.core.Tracer

MAX_PROGRAMS = 64
# key -> the jitted program of the first call with that key; least recently used first
_programs: collections.OrderedDict[Any, Callable] = collections.OrderedDict()

# Parameters that only matter for differentiation or rematerialisation: the cached
# programs are only run forward.
_FORWARD_ONLY = {
    "custom_jvp_call": {"jvp_jaxpr_fun", "jvp_jaxpr_thunk"},
    "custom_vjp_call": {"fwd_jaxpr_thunk", "bwd", "out_trees"},
    "custom_vjp_call_jaxpr": {"fwd_jaxpr_thunk", "bwd", "out_trees"},
    "remat2": {"policy"},
    "checkpoint": {"policy"},
}


class _Fallback(Exception):
    """The call cannot be cached: run it the plain way."""


# Errors of code that needs concrete values: eagerly, a layer a Stack calls directly
# used to get them (inside a scan body nothing does, and the plain call raises the
# same error again).
_NEEDS_VALUES = (
    _Fallback,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


class _Local(threading.local):
    plain = False  # inside a call run the plain way (a class default: no getattr)


_local = _Local()


def active() -> bool:
    """Whether a call runs eagerly: outside every JAX transformation, jit enabled
    (and not inside a call this module runs the plain way)."""
    if _trace_state_clean is None:  # pragma: no cover - another JAX
        return False
    return _trace_state_clean() and not _local.plain and not jax.config.jax_disable_jit


def transformed() -> bool:
    """Whether the caller runs inside a JAX transformation (``jit``, ``vmap``,
    ``grad``...): there every operation gives a tracer."""
    if _trace_state_clean is not None:
        return not _trace_state_clean()
    return isinstance(jax.numpy.zeros(()), _Tracer)  # pragma: no cover - another JAX


def _value(leaf: Any) -> Any:
    """An NNX graph leaf's value: a Variable's, or the leaf itself (an array
    attribute of a module is data in flax 0.12, flattened as it is)."""
    get = getattr(leaf, "get_value", None)
    return leaf if get is None else get()


def _folded(x: Any) -> Any:
    """An output the trace folded to a constant (JAX's literal classes: an
    ``ndarray`` or a Python number subclass with a dtype) as the ``jax.Array``
    a compiled call returns; anything else (static leaves) as it is."""
    exact = (np.ndarray, int, float, complex, bool)
    if isinstance(x, exact) and type(x) not in exact and hasattr(x, "dtype"):
        return jax.numpy.asarray(x, x.dtype)
    return x


def _plain(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` as without this module: nothing inside is cached."""
    before = _local.plain
    _local.plain = True
    try:
        return fn(*args, **kwargs)
    finally:
        _local.plain = before


def call(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, traced now and run by the compiled program of an
    earlier call with the same program (compiled now if there is none)."""
    is_node = _nnx.is_node if _nnx.loaded() else None
    leaves, treedef = jtu.tree_flatten((args, kwargs), is_leaf=is_node)
    dyn_idx, node_idx = [], []
    for i, x in enumerate(leaves):
        kind = _KINDS.get(type(x))
        if kind is None:
            kind = _kind(x, is_node)
        if kind is _INPUT:
            dyn_idx.append(i)
        elif kind is _NODE:
            node_idx.append(i)
    inputs = [leaves[i] for i in dyn_idx]
    if node_idx:
        nodes = [leaves[i] for i in node_idx]
        try:
            graphdef, variables, _ = _nnx.flatten(nodes)
        except Exception:  # e.g. `nnx.capture`'s attributes next to a list's items
            variables = None
        if variables is None:
            return _plain(fn, args, kwargs)
        refs = _nnx.holds_refs(variables)
        if refs:  # (array refs: traced as plain Variables)
            graphdef = _nnx.flatten(_nnx.without_refs(nodes))[0]
        values = [_value(v) for v in variables]
        var_idx = [k for k, v in enumerate(values) if _is_input(v)]
        inputs += [values[k] for k in var_idx]
    else:
        nodes, variables, values, var_idx, graphdef = [], [], [], [], None
        refs = False
    copies: list[Any] = []
    found: dict[str, Any] = {}

    def traced(*tracers):
        n = len(dyn_idx)
        new = splice(leaves, dyn_idx, tracers[:n])
        if nodes:
            vals = splice(values, var_idx, tracers[n:])
            copies[:] = _nnx.unflatten(graphdef, vals)
            new = splice(new, node_idx, copies)
        a, kw = jtu.tree_unflatten(treedef, new)
        out = fn(*a, **kw)
        out_leaves, out_tree = jtu.tree_flatten(out, is_leaf=is_node)
        arrays, where, node_out = [], [], []
        for i, x in enumerate(out_leaves):
            if isinstance(x, _Tracer):
                where.append(i)
                arrays.append(x)
            elif is_node and is_node(x):
                j = next((j for j, c in enumerate(copies) if c is x), None)
                if j is None:
                    raise _Fallback  # an NNX object made inside the call
                node_out.append((i, j))
        changed, set_static = [], []
        if nodes:
            after, new_vars, _ = _nnx.flatten(copies)
            if after != graphdef:
                raise _Fallback  # Variables added or removed: let scanax say so
            for k, (old, var) in enumerate(zip(vals, new_vars)):
                value = _value(var)
                if value is old:
                    continue
                if value is var:  # (an array attribute set anew: no Variable
                    raise _Fallback  # to write it back into)
                if isinstance(value, _Tracer):
                    changed.append(k)
                    arrays.append(value)
                else:
                    set_static.append((k, value))
        found.update(
            leaves=out_leaves,
            tree=out_tree,
            where=where,
            node_out=node_out,
            changed=changed,
            set_static=set_static,
        )
        return arrays

    plain = False
    try:
        jaxpr, consts = _trace(traced, inputs)
    except _NEEDS_VALUES:  # a layer called directly branches on a value: run as
        plain = True  # before (an error inside a scan comes again, unchanged)
    except Exception as err:
        if not _nnx.is_trace_level_error(err):  # flax: a closed-over Variable was
            raise  # written: the plain call says what happened
        plain = True
    if not plain and refs:  # `fn` writes into the objects' refs through its
        held = {id(_nnx.ref_of(v)) for v in variables}  # closure: the call
        plain = bool(held & _nnx.written_consts(jaxpr, consts))  # says so
    if plain:  # outside the `except`: its error is not the context of another
        return _plain(fn, args, kwargs)
    outs = _program(jaxpr)(*consts, *inputs)
    n = len(found["where"])
    out_leaves = splice([_folded(x) for x in found["leaves"]], found["where"], outs[:n])
    for i, j in found["node_out"]:
        out_leaves[i] = nodes[j]
    for k, a in zip(found["changed"], outs[n:]):
        variables[k].set_value(a)
    for k, value in found["set_static"]:
        variables[k].set_value(value)
    return jtu.tree_unflatten(found["tree"], out_leaves)


# What a leaf of a call's arguments is, by its type: an array input of the program,
# an NNX object, or static. Array types are added as they are met (an isinstance
# check against `jax.Array` costs more than this lookup); other types are checked on
# every call (flax may register a new kind of NNX object), except these builtins.
_INPUT, _NODE, _STATIC = "input", "node", "static"
_KINDS: dict[type, str] = dict.fromkeys(
    (int, float, bool, str, type(None), types.FunctionType, types.MethodType),
    _STATIC,
)


def _kind(x: Any, is_node: Callable | None) -> str:
    if _is_input(x):
        _KINDS[type(x)] = _INPUT
        return _INPUT
    return _NODE if is_node and is_node(x) else _STATIC


def _is_input(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, _Tracer)


def _trace(fun: Callable, inputs: list[Any]) -> tuple[Jaxpr, list[Any]]:
    """The jaxpr of ``fun(*inputs)`` (closed-over arrays as its constvars), and
    the constants' values."""
    avals = [jax.typeof(x) for x in inputs]
    if _pe is not None:
        try:
            wrapped = _lu.wrap_init(fun, debug_info=_debug_info(len(inputs)))
        except Exception:  # pragma: no cover - another JAX's signature
            pass
        else:
            jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, avals)
            return jaxpr, consts
    closed = jax.make_jaxpr(fun)(*inputs)  # pragma: no cover - another JAX
    return closed.jaxpr, closed.consts  # pragma: no cover


@ft.lru_cache(maxsize=64)
def _debug_info(n: int) -> Any:
    names = tuple(f"inputs[{i}]" for i in range(n))
    return _core.DebugInfo("scanax (eager)", "scanax", names, None)


def _program(jaxpr: Jaxpr) -> Callable:
    """The compiled program for ``jaxpr``'s structure: ``run(*consts, *inputs)``."""
    key = _jaxpr_key(jaxpr, {})
    run = _programs.get(key)
    if run is not None:
        _programs.move_to_end(key)
        return run

    n_consts = len(jaxpr.constvars)

    @jax.jit
    def run(*args):  # flat arguments: the cheapest dispatch
        return jaxpr_as_fun(ClosedJaxpr(jaxpr, args[:n_consts]))(*args[n_consts:])

    _programs[key] = run
    if len(_programs) > MAX_PROGRAMS:
        _programs.popitem(last=False)
    return run


# ---------------------------------------------------------------------------- keys


class _Identity:
    """An unhashable parameter, compared by identity (and kept alive by the key)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _jaxpr_key(jaxpr: Jaxpr, memo: dict[int, Any]) -> Any:
    """A hashable value equal for two jaxprs exactly when they compute the same
    thing: equations, data flow, avals, literal values and parameters.

    One flat tuple, built in a single pass: each variable is its binding's number,
    each list is preceded by its length and an equation's parameters end with
    ``_END`` (so the sequence reads back one way)."""
    cached = memo.get(id(jaxpr))
    if cached is not None:
        return cached
    ids: dict[Any, int] = {}
    key: list[Any] = []
    push = key.append
    for binders in (jaxpr.constvars, jaxpr.invars):
        push(len(binders))
        for v in binders:
            ids[v] = len(ids)
            push(v.aval)
    for e in jaxpr.eqns:
        primitive = e.primitive
        push(primitive)
        push(len(e.invars))
        for v in e.invars:
            push(_literal_key(v) if type(v) is Literal else ids[v])
        skip = _FORWARD_ONLY.get(primitive.name, ())
        for k, p in e.params.items():
            if k in skip:
                continue
            t = type(p)
            push(k)
            push(t)  # True, 1 and 1.0 are equal keys, but not the same parameter
            push(p if t in _EXACT else _param_key(p, memo))
        push(_END)
        push(e.ctx)
        push(len(e.outvars))
        for v in e.outvars:
            ids[v] = len(ids)
            push(v.aval)
    push(len(jaxpr.outvars))
    for v in jaxpr.outvars:
        push(_literal_key(v) if type(v) is Literal else ids[v])
    memo[id(jaxpr)] = result = tuple(key)
    return result


def _literal_key(v: Literal) -> Any:
    return ("literal", v.aval, _array_key(v.val))


_END = ("end of parameters",)  # compared by value, like every part of a key


# Parameter values that are their own key (not float: -0.0 == 0.0, nan != nan)
_EXACT = frozenset({int, bool, str, type(None)})


def _param_key(x: Any, memo: dict[int, Any]) -> Any:
    if isinstance(x, float):
        return (float, x.hex())
    if isinstance(x, (int, str, type(None), np.dtype)):
        return (type(x), x)
    if isinstance(x, ClosedJaxpr):
        consts = tuple(_array_key(c) for c in x.consts)
        return ("closed", _jaxpr_key(x.jaxpr, memo), consts)
    if isinstance(x, Jaxpr):
        return ("jaxpr", _jaxpr_key(x, memo))
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_param_key(v, memo) for v in x))
    if isinstance(x, dict):
        return (dict, tuple((k, _param_key(v, memo)) for k, v in x.items()))
    if isinstance(x, (np.ndarray, jax.Array, np.generic)):
        return _array_key(x)
    if isinstance(x, ft.partial):
        return (
            ft.partial,
            _param_key(x.func, memo),
            _param_key(x.args, memo),
            _param_key(x.keywords, memo),
        )
    try:
        hash(x)
    except TypeError:
        return _Identity(x)
    return x


def _array_key(x: Any) -> Any:
    if isinstance(x, _Tracer):  # pragma: no cover - a leaked tracer
        return _Identity(x)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return ("key", str(x.dtype), _array_key(jax.random.key_data(x)))
    a = np.asarray(x)
    return (a.dtype.str, a.shape, a.tobytes())
