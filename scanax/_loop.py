"""The loop core: a scan call reduced to a :class:`Loop` over arrays, and back.

``prepare`` validates a call (``f``, ``xs`` and ``in_axes``, ``length``) and reduces
it to a ``Loop``: a body over arrays only, with ``init`` split by a
:class:`CarryCodec` (arrays carried, static leaves checked, NNX objects as their
``nnx.split`` state) and ``xs`` by an :class:`XsPlan` (scanned arrays moved to axis
0, broadcast values in place). Every lowering runs a ``Loop``: ``run_lax`` (one
``lax.scan``) here, the long-scan options (``_remat``, ``_progress``, ``_thin``)
above. ``call_lowering`` runs one and ``CarryCodec.finish`` turns its carry back into
the user's.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _conv_layout, _errors, _nnx
from ._axes import first_difference, match_prefix, normalize_axis
from ._tree import as_int, is_array, is_arraylike, same_static, splice

# Bound at import: scanax.scan must keep working where users (or JAX's own test
# suite, in our compatibility check) replace `jax.lax.scan` by `scanax.scan`.
_lax_scan = jax.lax.scan


# ---------------------------------------------------------------------------- carry


class CarryCodec:
    """Splits a carry into traced arrays and static parts, and back.

    Arrays (and Python numbers, as in ``lax.scan``) are carried; any other leaf
    (functions, strings, Equinox static fields) is static and must come back from
    ``f`` unchanged; NNX objects are carried as their joint ``nnx.split`` state.
    """

    def __init__(self, call: str, init: Any):
        self.call = call
        leaves, self.treedef = jtu.tree_flatten_with_path(init, is_leaf=_nnx.is_node)
        self.paths = [p for p, _ in leaves]
        self.leaves = [x for _, x in leaves]
        self.node_idx = [i for i, x in enumerate(self.leaves) if _nnx.is_node(x)]
        self.dyn_idx = [
            i
            for i, x in enumerate(self.leaves)
            if not _nnx.is_node(x) and is_arraylike(x)
        ]
        self.carried = set(self.node_idx) | set(self.dyn_idx)
        self.nodes = [self.leaves[i] for i in self.node_idx]
        self.refs: dict = {}  # (the array refs the nodes' Variables hold)
        if self.nodes:
            if _nnx.maybe_outside(self.nodes):
                self._refuse_outside()  # before `f` is traced
            self.graphdef, state = _nnx.split(self.nodes, self.refs)
        else:
            self.graphdef, state = None, None
        self.dynamic = (state, [self.leaves[i] for i in self.dyn_idx])

    def decode(self, dynamic: Any) -> Any:
        state, arrays = dynamic
        nodes = _nnx.merge(self.graphdef, state) if self.nodes else []
        return self._rebuild(nodes, arrays)

    def _rebuild(self, nodes: list[Any], arrays: list[Any]) -> Any:
        leaves = splice(self.leaves, self.node_idx, nodes)
        return jtu.tree_unflatten(self.treedef, splice(leaves, self.dyn_idx, arrays))

    def encode(self, carry: Any, dynamic_in: Any) -> Any:
        """The dynamic part of a carry returned by ``f``, checked against ``init``."""
        leaves, treedef = jtu.tree_flatten(carry, is_leaf=_nnx.is_node)
        if treedef != self.treedef:
            init = jtu.tree_unflatten(self.treedef, self.leaves)
            path, was, now = first_difference(init, carry, _nnx.is_node) or (
                (),
                str(self.treedef),
                str(treedef),
            )
            raise _errors.carry_structure(
                self.call, "carry" + jtu.keystr(path), was, now
            )
        for i, (before, after) in enumerate(zip(self.leaves, leaves)):
            if i in self.carried:
                if not _nnx.is_node(after) and not is_arraylike(after):
                    raise _errors.carry_leaf_not_array(
                        self.call, "carry" + jtu.keystr(self.paths[i]), before, after
                    )
                if _nnx.is_node(before) != _nnx.is_node(after):
                    raise _errors.carry_structure(
                        self.call,
                        "carry" + jtu.keystr(self.paths[i]),
                        _kind_and_type(before),
                        _kind_and_type(after),
                    )
                continue
            if not same_static(before, after):
                raise _errors.static_changed(
                    self.call, jtu.keystr(self.paths[i]), before, after
                )
        state = None
        if self.nodes:
            graphdef, state = _nnx.split([leaves[i] for i in self.node_idx])
            if graphdef != self.graphdef:
                before = self._variable_names(self.nodes)
                after = self._variable_names([leaves[i] for i in self.node_idx])
                raise _errors.nnx_graph_changed(
                    self.call,
                    _node_desc(self.nodes),
                    [p for p in after if p not in before],
                    [p for p in before if p not in after],
                )
        arrays = [leaves[i] for i in self.dyn_idx]
        out = (state, arrays)
        self._check_types(dynamic_in, out)
        return out

    def shared_variables(self, given: Any, paths: dict) -> dict:
        """``{path: Variable}`` in ``given`` (the carry ``f`` gets) at the
        paths of ``variables_at`` over the carry's own NNX objects."""
        leaves = jtu.tree_leaves(given, is_leaf=_nnx.is_node)
        found = _nnx.variables_at([leaves[i] for i in self.node_idx])
        return {p: found[p] for p in paths if p in found}

    def check_places(self, given: Any, returned: Any) -> None:
        """Refuse a carry whose NNX objects ``f`` returns at other places than
        it was given them (a swap): each place's state is written back into the
        object passed there. (After ``encode``: the structures match.)"""
        if not self.nodes:
            return
        ins = jtu.tree_leaves(given, is_leaf=_nnx.is_node)
        outs = jtu.tree_leaves(returned, is_leaf=_nnx.is_node)
        for i in self.node_idx:
            if outs[i] is ins[i]:
                continue
            j = next((j for j in self.node_idx if ins[j] is outs[i]), None)
            if j is not None:
                path = "carry" + jtu.keystr(self.paths[j])
                raise _errors.nnx_carry_moved(
                    self.call, path, "carry" + jtu.keystr(self.paths[i])
                )

    def _refuse_outside(self, err: Exception | None = None) -> None:
        """Raise if NNX objects of the carry are from outside the current trace
        (closed over by a jitted function, passed beside the differentiated
        argument of ``jax.grad``): NNX would refuse to write them back. After
        NNX refused (``err``) where no Variable is to blame (an array attribute
        beside array refs, which NNX will not set from a closure): the objects
        made outside."""
        found = _nnx.outside(self.nodes)
        if not found and err is not None:
            found = [
                ((i,), n) for i, n in enumerate(self.nodes) if _nnx.maybe_outside([n])
            ]
        if not found:
            return
        names = [
            self._node_path(path) + f" ({type(obj).__name__})" for path, obj in found
        ]
        raise _errors.nnx_made_outside(self.call, names) from err

    def _node_path(self, path: tuple) -> str:
        """``carry[0]['l']`` for a path into the carry's NNX nodes (node index
        first)."""
        head, *rest = path
        return (
            "carry"
            + jtu.keystr(self.paths[self.node_idx[head]])
            + "".join(f"[{k!r}]" for k in rest)
        )

    def _variable_names(self, nodes: list[Any]) -> list[str]:
        """``carry[0]['l']['kernel']`` for each Variable of the carry's NNX nodes."""
        return [self._node_path(path) for path in _nnx.flatten(nodes)[2]]

    def _named_dynamic(self, dynamic: Any) -> list[tuple[str, Any]]:
        state, arrays = dynamic
        named = []
        if self.nodes:
            for path, leaf in jtu.tree_flatten_with_path(state)[0]:
                node_path = self.paths[self.node_idx[path[0].key]]
                named.append(("carry" + jtu.keystr((*node_path, *path[1:])), leaf))
        for i, a in zip(self.dyn_idx, arrays):
            named.append(("carry" + jtu.keystr(self.paths[i]), a))
        return named

    def _check_types(self, dynamic_in: Any, dynamic_out: Any) -> None:
        if all(
            _same_type(jax.typeof(a), jax.typeof(b))
            for a, b in zip(jtu.tree_leaves(dynamic_in), jtu.tree_leaves(dynamic_out))
        ):
            return  # the common case: no names to build
        rows = []
        for (path, a), (_, b) in zip(
            self._named_dynamic(dynamic_in), self._named_dynamic(dynamic_out)
        ):
            ta, tb = jax.typeof(a), jax.typeof(b)
            if not _same_type(ta, tb):
                rows.append((path, ta, tb))
        if rows:
            raise _errors.carry_mismatch(self.call, rows)

    def finish(self, dynamic: Any) -> Any:
        """The final carry, with the user's NNX objects updated in place."""
        state, arrays = dynamic
        if self.nodes:
            try:
                _nnx.update(self.nodes, state, self.refs)
            except _errors.RefNotWritable as err:  # (refs closed over by
                names = [self._node_path(p) for p in err.paths]  # vmap, grad)
                raise _errors.ref_not_writable(
                    names, err.paths, err.kind, self.call
                ) from None
            except Exception as err:
                # Objects from outside the trace that ``__init__`` did not see
                # (inside a new object made in the trace): name them.
                if _nnx.is_trace_level_error(err):
                    self._refuse_outside(err)
                raise
        return self._rebuild(self.nodes, arrays)


def _kind_and_type(x: Any) -> str:
    """``Param float32[2, 2]`` for an NNX object, ``float32[2, 2]`` for an array:
    what tells a Variable from its value."""
    if _nnx.is_node(x):
        return f"{type(x).__name__} {_errors.short_type(x)}"
    return _errors.short_type(x)


def _same_type(ta: Any, tb: Any) -> bool:
    # A weakly typed init leaf (a Python number) may change dtype: lax.scan
    # promotes it and traces again, exactly as without scanax.
    return ta.shape == tb.shape and (ta.dtype == tb.dtype or ta.weak_type)


def _node_desc(nodes: list[Any]) -> str:
    return "(" + ", ".join(type(n).__name__ for n in nodes) + ")"


# ---------------------------------------------------------------------------- xs


@dataclasses.dataclass
class XsPlan:
    """``xs`` split into scanned arrays (moved to axis 0) and broadcast values."""

    treedef: Any
    leaves: list[Any]  # broadcast values in place; scanned slots are filled per step
    scanned_idx: list[int]
    scanned: list[Any]  # the scanned arrays, scan axis first
    bcast_nodes: list[tuple[int, str, Any, Any]]  # (leaf index, path, graphdef, state)
    scan_nodes: list[tuple[int, str, Any]]  # (leaf index, path, graphdef)
    length: int

    def decode(self, x_slices: list[Any]) -> Any:
        n = len(self.scanned_idx)
        leaves = splice(self.leaves, self.scanned_idx, x_slices[:n])
        for i, _, graphdef, state in self.bcast_nodes:
            # Rebuild the Variables at this trace level (merging the captured ones
            # would make NNX refuse any write, hiding the mutation check below).
            leaves[i] = _nnx.merge(graphdef, jtu.tree_map(lambda a: a, state))
        for (i, _, graphdef), state in zip(self.scan_nodes, x_slices[n:]):
            # A copy too: writes must not reach the slices check_unchanged reads.
            leaves[i] = _nnx.merge(graphdef, jtu.tree_map(lambda a: a, state))
        return jtu.tree_unflatten(self.treedef, leaves), leaves

    def check_unchanged(
        self, call: str, leaves: list[Any], x_slices: list[Any]
    ) -> None:
        n = len(self.scanned_idx)
        given = [s for (*_, s) in self.bcast_nodes] + x_slices[n:]
        nodes = self.bcast_nodes + self.scan_nodes
        scanned = [False] * len(self.bcast_nodes) + [True] * len(self.scan_nodes)
        for (i, path, *_), state, is_scanned in zip(nodes, given, scanned):
            _, now = _nnx.split(leaves[i])
            before = jtu.tree_leaves_with_path(state)
            after = jtu.tree_leaves(now)
            changed = [jtu.keystr(p) for (p, a), b in zip(before, after) if a is not b]
            if changed or len(before) != len(after):
                raise _errors.nnx_input_mutated(
                    call, path, changed or ["structure"], is_scanned
                )


def _plan_xs(call: str, xs: Any, in_axes: Any, length: int | None) -> XsPlan:
    triples = match_prefix(call, "in_axes", "xs", in_axes, xs, is_leaf=_nnx.is_node)
    treedef = jtu.tree_structure(xs, is_leaf=_nnx.is_node)
    leaves: list[Any] = []
    scanned_idx, scanned, bcast_nodes, scan_nodes = [], [], [], []
    node_states = []
    lengths: list[tuple[str, int, Any]] = []  # (name, length, leaf)
    for i, (path, axis, leaf) in enumerate(triples):
        name = "xs" + jtu.keystr(path)
        leaves.append(leaf)
        if _nnx.is_node(leaf):
            graphdef, state = _nnx.split(leaf)
            if axis is None:
                bcast_nodes.append((i, name, graphdef, state))
                continue
            moved = []
            for spath, a in jtu.tree_flatten_with_path(state)[0]:
                sname = name + jtu.keystr(spath)
                ax = _scan_axis(call, sname, a, axis)
                lengths.append((sname, a.shape[ax], a))
                moved.append(jnp.moveaxis(a, ax, 0) if ax else a)
            scan_nodes.append((i, name, graphdef))
            node_states.append(jtu.tree_unflatten(jtu.tree_structure(state), moved))
            continue
        if axis is None:
            if is_array(leaf) and not isinstance(leaf, jax.Array):
                leaves[-1] = jnp.asarray(
                    leaf
                )  # f sees jax arrays, as for scanned leaves
            continue
        ax = _scan_axis(call, name, leaf, axis)
        lengths.append((name, leaf.shape[ax], leaf))
        scanned_idx.append(i)
        scanned.append(jnp.moveaxis(leaf, ax, 0) if ax else leaf)
    n = _infer_length(call, xs, lengths, length)
    return XsPlan(
        treedef, leaves, scanned_idx, scanned + node_states, bcast_nodes, scan_nodes, n
    )


def _scan_axis(call: str, name: str, leaf: Any, axis: int) -> int:
    if not is_array(leaf) or leaf.ndim == 0:
        raise _errors.not_scannable(call, name, leaf, axis)
    return normalize_axis(call, "in_axes", name, leaf, axis)


def _infer_length(
    call: str, xs: Any, lengths: list[tuple[str, int, Any]], length: int | None
) -> int:
    if length is not None:
        given, length = length, as_int(length)
        if length is None or length < 0:
            raise _errors.bad_length(call, given)
    found = {n for _, n, _ in lengths}
    named = lambda: [(p, n, _errors.short_type(leaf)) for p, n, leaf in lengths]
    if len(found) > 1:
        raise _errors.lengths_differ(call, named())
    if found:
        (n,) = found
        if length is not None and length != n:
            raise _errors.length_mismatch(call, length, named())
        return n
    if length is None:
        if xs is None or not jtu.tree_leaves(xs, is_leaf=_nnx.is_node):
            raise _errors.no_length(call)
        raise _errors.all_broadcast(call)
    return length


# ---------------------------------------------------------------------------- loop


@dataclasses.dataclass
class Loop:
    """A scan reduced to arrays: what every lowering (plain, remat, progress...) runs.

    ``body(carry, x) -> (carry, y)`` takes and returns only arrays; ``init`` and
    ``xs`` are pytrees of arrays with ``xs`` scanned along axis 0.
    """

    body: Callable[[Any, Any], tuple[Any, Any]]
    init: Any
    xs: Any
    length: int


def check_unroll(call: str, unroll: Any) -> None:
    """``unroll`` as ``jax.lax.scan`` takes it (a bool or an int >= 0), else
    scanax's error before anything is traced (JAX's has no call's name)."""
    if isinstance(unroll, bool):
        return
    value = as_int(unroll)
    if value is None or value < 0:
        raise _errors.bad_unroll(call, unroll)


def prepare(
    call: str, f: Callable, init: Any, xs: Any, length: Any, in_axes: Any
) -> tuple[Loop, CarryCodec]:
    """Validate a call and reduce it to a :class:`Loop` over arrays."""
    if not callable(f):
        raise _errors.not_callable(call, f)
    plan = _plan_xs(call, xs, in_axes, length)
    codec = CarryCodec(call, init)
    # Variables shared by the carry's NNX objects and those in xs: the carry
    # changing one while `f` reads the xs copy, fixed before the scan, is
    # refused (checked when `f` is traced: {path in the carry: xs name})
    shared: dict = {}
    if codec.nodes and (plan.bcast_nodes or plan.scan_nodes):
        for i, name, *_ in plan.bcast_nodes + plan.scan_nodes:
            ids = _nnx.variable_ids([plan.leaves[i]])
            for path in _nnx.variables_at(codec.nodes, ids):
                shared.setdefault(path, name)

    def body(dynamic, x_slices):
        x, x_leaves = plan.decode(x_slices)
        given = codec.decode(dynamic)
        watched = codec.shared_variables(given, shared) if shared else {}
        before = {p: v.get_raw_value() for p, v in watched.items()}
        out = f(given, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise _errors.not_a_pair(call, out)
        new_carry, y = out
        new_dynamic = codec.encode(new_carry, dynamic)
        codec.check_places(given, new_carry)
        for path, var in watched.items():
            if var.get_raw_value() is not before[path]:
                raise _errors.nnx_carried_and_in_xs(call, shared[path])
        if plan.bcast_nodes or plan.scan_nodes:
            plan.check_unchanged(call, x_leaves, x_slices)
        # (NNX Variables and modules are pytrees of arrays here, as lax.scan
        # stacks them)
        if not all(map(is_arraylike, jtu.tree_leaves(y))):
            for path, leaf in jtu.tree_flatten_with_path(y)[0]:
                if not is_arraylike(leaf):
                    raise _errors.bad_output_leaf(call, jtu.keystr(path), leaf)
        return new_dynamic, y

    # lax.scan asks for the body's signature on every call (to name its arguments
    # and the carry in messages): the same signature, computed once
    body.__signature__ = _BODY_SIGNATURE
    return Loop(body, codec.dynamic, plan.scanned, plan.length), codec


_BODY_SIGNATURE = inspect.signature(lambda dynamic, x_slices: None)


def run_lax(loop: Loop, reverse: bool, unroll: int | bool) -> tuple[Any, Any]:
    """The plain lowering: exactly one ``lax.scan``."""
    return _lax_scan(
        loop.body,
        loop.init,
        loop.xs,
        length=loop.length,
        reverse=reverse,
        unroll=unroll,
    )


def move_out_axes(call: str, ys: Any, out_axes: Any) -> Any:
    if isinstance(out_axes, int) and not isinstance(out_axes, bool) and out_axes == 0:
        return ys
    triples = match_prefix(call, "out_axes", "ys", out_axes, ys)
    moved = []
    for path, axis, leaf in triples:
        if axis is None:
            raise _errors.out_axis_none(call, jtu.keystr(path))
        ax = normalize_axis(call, "out_axes", "ys" + jtu.keystr(path), leaf, axis)
        with jax.named_scope("scanax.out_axes"):
            moved.append(jnp.moveaxis(leaf, 0, ax) if ax else leaf)
    return jtu.tree_unflatten(jtu.tree_structure(ys), moved)


def call_lowering(codec: CarryCodec, f: Callable, lowering: Callable[[], Any]) -> Any:
    """Run a lowering, turning NNX's closure-mutation error into scanax's.

    Its convolutions are made canonical where the backend needs it (the loop as
    traced is replayed, so ``f`` is traced once; without convolutions the same
    program), see ``_conv_layout``."""
    if codec.refs:  # (traced and replayed there, convolutions included)
        lowering = _refs_not_written_around(codec, lowering)
    else:
        lowering = _conv_layout.wrap(lowering)
    if not _nnx.loaded():
        return lowering()
    try:
        return lowering()
    except Exception as err:
        if not _nnx.is_trace_level_error(err):
            raise
        raise _errors.nnx_closure_mutation(
            codec.call, _nnx.reachable_nodes(f), err
        ) from err


def _refs_not_written_around(codec: CarryCodec, lowering: Callable[[], Any]) -> Any:
    """``lowering``, refused if ``f`` writes through its closure into an array ref
    the carry holds: the loop carries the ref's values, which are written back
    at the end over what ``f`` wrote (the Python loop would see both). Traced
    once to a program, which is then replayed (``_conv_layout.replay``: its
    convolutions canonical where the backend needs it, as ``wrap`` makes them)."""

    def checked() -> Any:
        closed, shapes = jax.make_jaxpr(lowering, return_shape=True)()
        jaxpr = closed.jaxpr
        written = _nnx.written_consts(jaxpr, closed.consts)
        paths = [p for p, ref in codec.refs.items() if id(ref) in written]
        if paths:
            names = [codec._node_path(p) for p in paths]
            raise _errors.nnx_ref_written_around(codec.call, names)
        flat = _conv_layout.replay(closed)
        return jtu.tree_unflatten(jtu.tree_structure(shapes), flat)

    return checked
