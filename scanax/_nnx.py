"""Flax NNX adapter: the only module of the core that touches ``flax.nnx``.

NNX objects are graphs (they may share Variables), so they cross a scan boundary as
``nnx.split`` state and are rebuilt with ``nnx.merge``. Nothing here imports flax: if
the user has NNX objects, ``flax.nnx`` is already in ``sys.modules``.
"""

from __future__ import annotations

import dis
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

from . import _errors, _fingerprint

# The metadata a ``Stack`` gives the Variables of its stacked runs: their layer
# axis (what ``fit(shard="fsdp")`` leaves whole).
LAYER_AXIS = "scanax_layer_axis"


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


def split(nodes: Any, refs: dict | None = None) -> tuple[Any, Any]:
    """Split an NNX node, or a list of them jointly (shared Variables stay
    shared). Array
    refs (``nnx.var_defaults(ref=True)``) are split as the arrays they hold, so
    that the state can be carried through a loop; given a dict ``refs``, they
    are put in it by graph path, for ``update`` to write into."""
    graphdef, state = _nnx().split(nodes)
    if any(is_ref(x) for x in jtu.tree_leaves(state)):
        if refs is not None:
            refs.update(refs_of(nodes))
        graphdef, state = _nnx().split(without_refs(nodes))
    return graphdef, state


def flatten(nodes: list[Any]) -> tuple[Any, list[Any], list[tuple]]:
    """``(graphdef, leaves, paths)`` of NNX nodes, jointly: the leaves are the
    Variables themselves (about half the cost of ``nnx.split``)."""
    graphdef, flat = _nnx().graph.flatten(nodes, with_paths=True)
    return graphdef, list(flat.leaves), list(flat.paths)


def is_ref(x: Any) -> bool:
    """Whether ``x`` is an array ref (``jax.new_ref``), concrete or traced."""
    ref = getattr(jax, "ref", None)  # (JAX releases before refs have none)
    if ref is None:
        return False
    if type(x) is ref.Ref:  # (an isinstance check costs 20 times more)
        return True
    return isinstance(x, jax.core.Tracer) and isinstance(jax.typeof(x), ref.AbstractRef)


def written_consts(jaxpr: Any, consts: list[Any]) -> set[int]:
    """The ids of ``consts`` (a jaxpr's constants: closed-over arrays and array
    refs) that ``jaxpr`` writes into (JAX's ``WriteEffect``/``AccumEffect``)."""
    written = {
        id(getattr(e, "input", None))
        for e in jaxpr.effects
        if type(e).__name__ in ("WriteEffect", "AccumEffect")
    }
    return {id(c) for v, c in zip(jaxpr.constvars, consts) if id(v) in written}


def ref_of(variable: Any) -> Any:
    """The array ref a Variable holds, or None (a plain Variable, another leaf)."""
    raw = getattr(variable, "get_raw_value", lambda: None)()
    return raw if is_ref(raw) else None


def holds_refs(variables: list[Any]) -> bool:
    """Whether any of these Variables holds an array ref."""
    return any(ref_of(v) is not None for v in variables)


def without_refs(nodes: list[Any]) -> list[Any]:
    """Copies of NNX nodes whose Variables hold arrays, where they held array
    refs (``nnx.var_defaults(ref=True)``); a Variable shared by two attributes
    (tied weights) stays one Variable."""
    try:
        return _with_vars()(nodes, ref=False, allow_duplicates=True)
    except StopIteration as err:  # (flax's copy, where two Variables hold one
        raise _errors.shared_ref() from err  # ref: its graph holds it once)


def with_refs(node: Any) -> Any:
    """A copy of an NNX node whose Variables hold new array refs of its values."""
    return _with_vars()(node, ref=True, allow_duplicates=True)


def _with_vars() -> Callable:
    nnx = _nnx()
    return getattr(nnx, "with_vars", None) or nnx.vars_as


def values(nodes: list[Any]) -> tuple[Any, list[Any]]:
    """``(graphdef, values)``: the values of the nodes' Variables, in ``flatten``'s
    order, and the graphdef to check the nodes' structure against."""
    graphdef, leaves = _nnx().graph.flatten(nodes, with_paths=False)
    if any(is_ref(x) for x in leaves):  # (read, as plain Variables)
        graphdef, leaves = _nnx().graph.flatten(without_refs(nodes), with_paths=False)
    return graphdef, list(leaves)


def unflatten(graphdef: Any, values: list[Any]) -> list[Any]:
    """New nodes from ``flatten``'s graphdef and a list of values."""
    return _nnx().graph.unflatten(graphdef, values)


def merge(graphdef: Any, state: Any) -> list[Any]:
    return _nnx().merge(graphdef, state)


def with_params(model: Any, cast: Any, other: Any = None) -> tuple[Any, Any]:
    """A copy of the NNX ``model`` whose ``nnx.Param`` values are ``cast(value)``
    (and its other Variables' ``other(value)``, when given; differentiable: the
    copy's values are functions of the model's), and a function that writes the
    copy's other Variables back into ``model`` (what a call changed: BatchNorm
    statistics, RNG counts; they keep their dtype)."""
    nnx = _nnx()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if other is not None:
        rest = jtu.tree_map(other, rest)
    copy = nnx.merge(graphdef, jtu.tree_map(cast, params), rest)

    def write_back() -> None:
        nnx.update(model, nnx.state(copy, nnx.Not(nnx.Param)))

    return copy, write_back


def eval_mode(tree: Any) -> None:
    """``Module.eval()`` on every NNX module in ``tree`` (one, or a dict, list
    or tuple of them): Dropout off, BatchNorm on its running averages."""
    nnx = _nnx()
    for x in jtu.tree_leaves(tree, is_leaf=is_node):
        if isinstance(x, nnx.Module):
            x.eval()


def dropout_off(tree: Any) -> list[str]:
    """Attribute paths of the ``nnx.Dropout`` layers in ``tree`` with a rate
    above 0 that are in eval mode (``deterministic``), when the whole model is
    as ``model.eval()`` leaves it (every Dropout deterministic, every BatchNorm
    on its running averages): ``[".drop"]``. A model with one of them in train
    mode was set up so on purpose: ``[]``."""
    nnx = _nnx()
    found = []
    for path, x in nnx.graph.iter_graph(tree):
        if isinstance(x, nnx.BatchNorm) and not x.use_running_average:
            return []
        if isinstance(x, nnx.Dropout):
            if not x.deterministic:
                return []
            if x.rate > 0:
                found.append(attribute_path(path) or "(the model)")
    return found


def unseeded_draws(tree: Any, run: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``run()``'s result and the RNG streams in ``tree`` it drew from without
    reseeding them (the stream's count moved, its key did not), named by
    attribute path: ``["rngs.noise"]``. Checked while tracing: costs nothing
    at run time."""
    nnx = _nnx()
    _, flat = nnx.graph.flatten(tree, with_paths=True)
    streams: dict = {}
    for path, var in zip(flat.paths, flat.leaves):
        for i, kind in enumerate((nnx.RngKey, nnx.RngCount)):
            if isinstance(var, kind):
                streams.setdefault(path[:-1], [None, None])[i] = var
    before = {
        p: [v if v is None else v.get_raw_value() for v in pair]
        for p, pair in streams.items()
    }
    out = run()
    drawn = []
    for p, (key, count) in streams.items():
        key0, count0 = before[p]
        moved = count is not None and count.get_raw_value() is not count0
        if moved and (key is None or key.get_raw_value() is key0):
            drawn.append(attribute_path(p).lstrip("."))
    return out, drawn


def attribute_path(path: tuple) -> str:
    """``.enc.layers[0]`` for a graph path ``("enc", "layers", 0)``."""
    return "".join(
        f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in path
    )


def has_refs(node: Any) -> bool:
    """Whether ``node``'s Variables hold array refs (``nnx.var_defaults(ref=True)``)."""
    return holds_refs(flatten([node])[1])


def plain(node: Any) -> Any:
    """``node`` itself, or a copy holding arrays where it held array refs."""
    return without_refs([node])[0] if has_refs(node) else node


def refs_of(nodes: Any) -> dict:
    """The array refs the Variables of ``nodes`` (a node or a list of them)
    hold, by graph path (``update``'s)."""
    _, variables, paths = flatten(nodes)
    found = {p: ref_of(v) for p, v in zip(paths, variables)}
    return {p: ref for p, ref in found.items() if ref is not None}


def update(nodes: Any, state: Any, refs: dict | None = None) -> None:
    """Write ``state`` (all of the nodes' Variables, or some) back into the
    user's own objects, in place; where their Variables hold the array refs
    ``refs`` (from ``split``), into the refs, which the Variables keep. (Writing
    into a ref is what a ``jax.jit`` closure over such a model may do; NNX
    refuses to replace a Variable's value from another trace.)"""
    nnx = _nnx()
    if not refs:
        nnx.update(nodes, state)
        return
    flat = state.flat_state()
    rest = [(p, v) for p, v in flat if p not in refs]
    if rest:
        nnx.update(nodes, nnx.State.from_flat_path(rest))
    if len(rest) == len(flat):
        return
    _, variables, paths = flatten(nodes)
    held = dict(zip(paths, variables))
    writes = [
        (path, refs[path], v.get_raw_value() if isinstance(v, nnx.Variable) else v)
        for path, v in flat
        if path in refs
    ]
    # (checked before any write: JAX refuses a batched or differentiated value
    # for a ref outside the transformation, after writing some)
    foreign = [
        (path, _TRANSFORMED[type(value).__name__])
        for path, ref, value in writes
        if type(value).__name__ in _TRANSFORMED and not isinstance(ref, jax.core.Tracer)
    ]
    if foreign:
        paths = [p for p, _ in foreign]
        names = [attribute_path(p).lstrip(".") or "the model" for p in paths]
        raise _errors.ref_not_writable(names, paths, foreign[0][1])
    for path, ref, value in writes:
        write_ref(held[path], ref, value)


# Tracers of the transformations that run eagerly, value by value (not traced
# to a program first): their values cannot go into a ref made outside them.
_TRANSFORMED = {
    "BatchTracer": "batched",
    "JVPTracer": "differentiated",
    "LinearizeTracer": "differentiated",
}


def write_ref(variable: Any, ref: Any, value: Any) -> None:
    """``value`` written into ``ref``, the array ref ``variable`` holds; where
    it is placed otherwise (on a mesh, where the ref is on one device), a new
    ref holding it, which ``variable`` holds instead."""
    traced = isinstance(value, jax.core.Tracer) or isinstance(ref, jax.core.Tracer)
    placed = None if traced else value.sharding
    if placed is None or placed.is_equivalent_to(ref.sharding, value.ndim):
        ref[...] = value
    else:
        variable.set_raw_value(jax.new_ref(value))


def rngs(seed: int) -> Any:
    """``nnx.Rngs(seed)``."""
    return _nnx().Rngs(seed)


def loaded() -> bool:
    return _nnx() is not None


def is_trace_level_error(err: Exception) -> bool:
    """NNX's refusal to touch a Variable created outside the current trace.

    NNX raises ``TraceContextError`` when such a Variable is written, and a
    ``ValueError`` ("Cannot extract graph node from different trace level") when one
    is passed to an NNX transform such as ``nnx.value_and_grad``.
    """
    if _nnx() is None:  # no NNX object anywhere: not NNX's error
        return False
    from flax import errors

    if isinstance(err, errors.TraceContextError):
        return True
    return isinstance(err, ValueError) and "different trace level" in str(err)


def maybe_outside(nodes: list[Any]) -> bool:
    """Whether one of ``nodes`` itself was made outside the trace now running
    (outside the jitted or transformed function): cheap, the nodes only, not what
    they hold. Such a node's Variables are an outer trace's; see :func:`outside`."""
    nnx = _nnx()
    for node in nodes:
        if isinstance(node, nnx.Variable):
            if not node._can_update:
                return True
            continue
        state = getattr(node, "_pytree__state", None)
        if state is not None and not state.trace_state.is_valid():
            return True
    return False


def variable_ids(nodes: list[Any]) -> set[int]:
    """The ids of the Variables in ``nodes`` (what two objects share)."""
    nnx = _nnx()
    return {
        id(v) for _, v in nnx.graph.iter_graph(nodes) if isinstance(v, nnx.Variable)
    }


def variables_at(nodes: list[Any], ids: set[int] | None = None) -> dict:
    """``{path: Variable}`` of ``nodes``' Variables (those whose id is in
    ``ids``, when given, and not RNG state: an ``nnx.Rngs`` shared by two
    objects is the common idiom): the paths find the same Variables in a copy."""
    nnx = _nnx()
    return {
        path: v
        for path, v in nnx.graph.iter_graph(nodes)
        if isinstance(v, nnx.Variable)
        and (ids is None or (id(v) in ids and not isinstance(v, nnx.RngState)))
    }


def outside(nodes: list[Any]) -> list[tuple[tuple, Any]]:
    """``(path, object)`` of the outermost objects in ``nodes`` that hold a
    Variable NNX will not let the current trace write (it belongs to an outer
    one: NNX's ``TraceContextError``), each path starting with the index of its
    node; hijax Variables, which any trace may write, are not among them."""
    nnx = _nnx()
    found = dict(nnx.graph.iter_graph(nodes))
    out: dict[tuple, Any] = {}
    for path, var in found.items():
        if not isinstance(var, nnx.Variable) or var._can_update:
            continue
        if ref_of(var) is not None:  # (written through its ref: any trace may)
            continue
        for k in range(1, len(path) + 1):
            obj = found.get(path[:k])
            state = getattr(obj, "_pytree__state", None)
            if obj is var or (state is not None and not state.trace_state.is_valid()):
                out.setdefault(path[:k], obj)
                break
    return list(out.items())


def reachable_nodes(f: Any) -> list[str]:
    """Names of NNX objects that ``f`` reaches through closure cells or globals."""
    if _nnx() is None:
        return []
    return [
        f"`{name}` ({type(value).__name__})"
        for name, value in _outer_reads(f)
        if contains_node(value)
    ]


def _outer_reads(f: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of what ``f``'s own code reads from outside: its
    closure cells, and its globals as ``LOAD_GLOBAL`` reads them (an
    attribute of that name is no read)."""
    fn = getattr(f, "__func__", f)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:  # (a cell not yet filled)
            continue
    globs = getattr(fn, "__globals__", {})
    names = dict.fromkeys(
        ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"
    )
    out += [(name, globs[name]) for name in names if name in globs]
    return out


def reads_itself(f: Any, node: Any) -> str | None:
    """The name under which ``f`` reads ``node`` itself from its closure or
    its globals (not through its arguments), or None (``_outer_reads``)."""
    return next((name for name, value in _outer_reads(f) if value is node), None)


def graphdef_fingerprint(graphdef: Any) -> Any:
    """``_fingerprint.of`` for an NNX GraphDef, about 20x faster: the node
    definitions compare by their own value, and what they hold by identity is
    fingerprinted: the static attribute values (an ``nnx.Optimizer``'s optax
    transform, activation functions...) and the module classes (their methods,
    which may read globals). None when one of them cannot be described."""
    graph = _nnx().graph
    parts = []
    for key, attr in graphdef.attributes:
        if isinstance(attr, graph.Static):
            value = _fingerprint.of(attr.value)
            if value is None:
                return None
            parts.append((key, value))
        else:
            parts.append((key, attr))
    classes = []
    for cls in dict.fromkeys(getattr(n, "type", None) for n in graphdef.nodes):
        value = _fingerprint.of(cls)
        if value is None:
            return None
        classes.append(value)
    return (type(graphdef), tuple(graphdef.nodes), tuple(parts), tuple(classes))
