"""Flax NNX adapter for ``scanax.Stack``: the only module of it that imports Flax."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
from flax import nnx

from . import _errors as base_errors, _nnx, _stack
from ._errors import stack as errors
from ._stack_plan import pytree_signature
from ._tree import splice


def _signature(layer: Any) -> Any:
    if not nnx.graph.is_graph_node(layer):
        return pytree_signature(layer)
    graphdef, state = nnx.split(layer)
    # (a Variable's Python number is data, stacked as the array it becomes)
    return graphdef, [
        ("array", tuple(jax.numpy.shape(x)), jax.numpy.result_type(x))
        for x in jtu.tree_leaves(state)
    ]


def _expand(x: Any) -> list[tuple[str, Any]] | None:
    """The parts of an NNX object, to compare two layers
    (``_stack_plan.number_differences``)."""
    if isinstance(x, nnx.Variable):
        return [("[...]", x.get_value())]
    if nnx.graph.is_graph_node(x):
        return [
            (f"[{k}]" if k.isdigit() else f".{k}", v)
            for k, v in vars(x).items()
            if not k.startswith("_")
        ]
    return None


def _check_owned(layers: list[Any]) -> None:
    """Stacking copies each layer's Variables: none may be shared between layers."""
    seen: dict[int, tuple[int, str]] = {}
    first_node = next(k for k, x in enumerate(layers) if nnx.graph.is_graph_node(x))
    for i, layer in enumerate(layers):
        if not nnx.graph.is_graph_node(layer):
            if any(not callable(x) for x in jtu.tree_leaves(layer)):
                raise errors.mixed(first_node, layers[first_node], i, layer)
            continue
        for path, var in nnx.graph.iter_graph(layer):
            if isinstance(var, nnx.Variable):
                _check_value(i, path, var)
                key = id(var)
                if key in seen and seen[key][0] != i:
                    j, _ = seen[key]
                    rng = isinstance(var, nnx.RngState)
                    raise errors.shared(j, i, _path_name(path), rng)
                seen.setdefault(key, (i, ""))


def _path_name(path: tuple) -> str:
    """``.block.kernel`` for a graph path ``('block', 'kernel')``."""
    return jtu.keystr(tuple(jtu.GetAttrKey(str(p)) for p in path))


def _leaf_paths(state: Any) -> list[tuple]:
    """Plain keys (``('l', 'kernel')``) of each leaf of an NNX state."""
    out = []
    for path, _ in jtu.tree_flatten_with_path(state)[0]:
        keys = []
        for k in path:
            if isinstance(k, jtu.GetAttrKey):
                if k.name != "value":  # a Variable's own level: not part of its name
                    keys.append(k.name)
            else:
                keys.append(getattr(k, "key", getattr(k, "idx", k)))
        out.append(tuple(keys))
    return out


class Run(_stack.Run):
    """An NNX node (a layer, or a stacked run's ``nnx.List`` of ``period`` modules)
    as its state's leaves, rebuilt from them by ``block``; the leaves a call
    changes come back from ``changes`` and are written to the node by
    ``write_back``.

    Which leaves change (BatchNorm statistics, RNG counts) is found while tracing,
    by identity; parameters are not returned, so they are not copied. A module
    whose Variables or values the call adds or removes (``Module.sow``, with or
    without ``nnx.capture``) is refused, naming them by ``name(path)``: its leaves
    would no longer line up with the stacked ones.
    """

    def __init__(self, node: Any, name: Callable[[tuple], str], stacked: bool = False):
        self.node, self.name = node, name
        self.refs: dict = {}  # (array refs: run as the arrays they hold)
        self.graphdef, state = _nnx.split(node, self.refs)
        self.arrays, self.treedef = jtu.tree_flatten(state)
        # (a block's Variables: a stacked run's without the layer axis in
        # their sharding annotations)
        self.block_graph, self.block_def = self.graphdef, self.treedef
        if stacked and _annotated(state):  # (else a block's are the run's)
            one = nnx.clone(node)
            _layer_axis(nnx.state(one), add=False)
            self.block_graph, state = _nnx.split(one)
            self.block_def = jtu.tree_structure(state)
        self.changed: list[int] = []

    def block(self, arrays: list[Any]) -> Any:
        return nnx.merge(self.block_graph, jtu.tree_unflatten(self.block_def, arrays))

    def leaf_name(self, k: int) -> str:
        """``layers[3]['attn']['cached_key']``: the run's leaf ``k`` in the
        run's first layer."""
        state = jtu.tree_unflatten(self.treedef, self.arrays)
        return self.name(_leaf_paths(state)[k])

    def changes(self, block: Any, arrays: list[Any]) -> list[Any]:
        graphdef, after = nnx.split(block)
        if graphdef != self.block_graph or jtu.tree_structure(after) != self.block_def:
            before = _leaf_paths(jtu.tree_unflatten(self.block_def, arrays))
            now = _leaf_paths(after)
            raise errors.graph_changed(
                [self.name(p) for p in now if p not in before],
                [self.name(p) for p in before if p not in now],
            )
        new = jtu.tree_leaves(after)
        self.changed[:] = [k for k, (a, b) in enumerate(zip(arrays, new)) if a is not b]
        return [new[k] for k in self.changed]

    def write_back(self, new: list[Any]) -> None:
        if not self.changed:
            return
        leaves = splice(self.arrays, self.changed, new)
        state = jtu.tree_unflatten(self.treedef, leaves)
        if self.refs:  # only what changed, into the refs (as a jit closure may)
            ids = {id(x) for x in new}
            state = nnx.State.from_flat_path(
                [(p, v) for p, v in state.flat_state() if id(_raw(v)) in ids]
            )
        _nnx.update(self.node, state, self.refs)


def _raw(v: Any) -> Any:
    return v.get_raw_value() if isinstance(v, nnx.Variable) else v


def _layer_name(i: int) -> Callable[[tuple], str]:
    """``layers[i]['h']`` for a Variable path inside layer ``i``."""
    return lambda path: f"layers[{i}]" + "".join(f"[{k!r}]" for k in path)


def _call_layer(
    layer: Any, x: Any, kwargs: dict, remat: Any, i: int, looped: bool
) -> Any:
    if remat is False or not nnx.graph.is_graph_node(layer):
        return _stack.call_pytree_layer(layer, x, kwargs, remat, looped)
    run = Run(layer, _layer_name(i))

    def pure(arrays, x):
        module = run.block(arrays)
        y = module(x, **kwargs)
        return y, run.changes(module, arrays)

    y, new = _stack.checkpoint_call(pure, (run.arrays, x), remat, looped)
    run.write_back(new)
    return y


@contextlib.contextmanager
def _without_captures(stack: Any, lists: list[Any]):
    """Hide ``nnx.capture``'s ``__captures__`` from the Stack's ``nnx.List``s.

    ``capture`` gives every module, lists included, a ``__captures__`` attribute;
    next to a list's integer keys it makes the list's state unflattenable (its keys
    cannot be sorted). Layers keep theirs: one called directly captures as usual,
    and one in a stacked run that sows is refused (``errors.graph_changed``). On an
    error ``capture`` leaves its attributes behind; the Stack drops its own, so that
    it stays usable.
    """
    hidden = [(x, vars(x)["__captures__"]) for x in lists if "__captures__" in vars(x)]
    for x, _ in hidden:
        del x.__captures__
    try:
        yield
    except BaseException:
        if hidden:
            for _, module in nnx.iter_modules(stack):
                if "__captures__" in vars(module):
                    del module.__captures__
        raise
    for x, value in hidden:
        x.__captures__ = nnx.data(value)


@contextlib.contextmanager
def _errors_named(stack: Any, kwargs: dict):
    """Hide the captures (see ``_without_captures``) and name an NNX object among
    the keyword arguments that a layer changed (an ``nnx.Rngs``): scan's message
    would speak of closures and carries."""
    runs = [p for p, (_, _, r) in zip(stack.pieces, stack.plan, strict=True) if r > 1]
    try:
        with _without_captures(stack, [stack.pieces, *runs]):
            yield
    except Exception as err:
        nodes = [
            f"{path[0].key}{jtu.keystr(path[1:])}"
            for path, leaf in jtu.tree_flatten_with_path(
                kwargs, is_leaf=nnx.graph.is_graph_node
            )[0]
            if nnx.graph.is_graph_node(leaf)
        ]
        mutation = isinstance(
            err, base_errors.NNXMutation
        ) or _nnx.is_trace_level_error(err)
        if nodes and mutation:
            raise errors.kwarg_mutated(nodes, stack.n) from err
        raise


def _stacked_leaf(*xs: Any) -> Any:
    """The layers' values of one leaf stacked; arrays placed on a mesh stay
    placed as they were, with the new leading (layer) axis not split."""
    out = jax.numpy.stack(xs)
    sharding = getattr(xs[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(
        out, jax.core.Tracer
    ):
        spec = jax.sharding.PartitionSpec(None, *sharding.spec)
        out = jax.device_put(out, jax.sharding.NamedSharding(sharding.mesh, spec))
    return out


def _variables(state: Any) -> list:
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _annotated(state: Any) -> bool:
    """Whether a Variable of ``state`` has a sharding annotation."""
    return any(
        isinstance(var, nnx.Variable) and var.get_metadata().get("out_sharding")
        for var in _variables(state)
    )


def _layer_axis(state: Any, add: bool) -> Any:
    """``state``'s Variables (stacked values) with the layer axis added to, or
    removed from, their sharding annotation (``out_sharding``), as
    ``nnx.vmap`` with ``transform_metadata={nnx.PARTITION_NAME: None}`` does;
    the Variables' own axis hooks are called. In place; returns ``state``."""

    for var in _variables(state):
        if not isinstance(var, nnx.Variable):
            continue
        names = var.get_metadata().get("out_sharding")
        if isinstance(names, (tuple, list)) and names:  # (short ones too)
            if add:
                var.set_metadata(out_sharding=(None, *names))
            elif names[0] is None:
                var.set_metadata(out_sharding=tuple(names[1:]))
        (var.add_axis if add else var.remove_axis)(0, None)
        if add:
            var.set_metadata(**{_nnx.LAYER_AXIS: 0})
    return state


def _as_refs_if(refs: bool, node: Any) -> Any:
    """``node``, or, if ``refs``, a copy whose Variables hold new array refs of
    its values (as the layers it was made of did)."""
    return _nnx.with_refs(node) if refs else node


def _check_value(i: int, path: tuple, var: Any) -> None:
    """A Variable's leaves are stacked as arrays: numbers or arrays only."""
    for leaf in jtu.tree_leaves(var.get_value()):
        if not isinstance(leaf, (bool, int, float, complex)) and not hasattr(
            leaf, "dtype"
        ):
            raise errors.variable_not_an_array(i, _path_name(path), var, leaf)


class NNXLayers(_stack.Layers):
    """``_stack.Layers`` for Flax NNX modules (and callables without state among
    them)."""

    expand = staticmethod(_expand)

    def check(self, layers: list[Any]) -> None:
        _check_owned(layers)

    def signature(self, layer: Any) -> Any:
        return _signature(layer)

    def single(self, layer: Any) -> Any:
        # (a Stack holds copies of the layers; of a layer whose Variables hold
        # array refs, a copy holding refs of its own)
        if not nnx.graph.is_graph_node(layer):
            return layer
        return _as_refs_if(_nnx.has_refs(layer), nnx.clone(_nnx.plain(layer)))

    def stacked(self, blocks: list[tuple]) -> Any:
        refs = any(_nnx.has_refs(b) for b in blocks)
        blocks = [_nnx.plain(b) for b in blocks]
        graphdef, _ = nnx.split(blocks[0])
        states = [nnx.split(b)[1] for b in blocks]
        stacked = _layer_axis(jtu.tree_map(_stacked_leaf, *states), add=True)
        return _as_refs_if(refs, nnx.List(list(nnx.merge(graphdef, stacked))))

    def store(self, pieces: list[Any]) -> Any:
        return nnx.List(pieces)

    def open(self, data: Any, start: int) -> Run:
        # A path in the run's first block: its first key is the layer in the block.
        name = lambda path: _layer_name(start + path[0])(path[1:])  # noqa: E731
        return Run(data, name, stacked=True)

    def call(
        self, layer: Any, x: Any, kwargs: dict, remat: Any, i: int, looped: bool
    ) -> Any:
        return _call_layer(layer, x, kwargs, remat, i, looped)

    def eager(self, stack: Any) -> bool:
        # Not inside `nnx.capture`, which stores into the Stack's own modules (see
        # `_without_captures`).
        return "__captures__" not in vars(stack)

    def calling(self, stack: Any, kwargs: dict) -> Any:
        return _errors_named(stack, kwargs)


class NNXStack(_stack.Body, nnx.Module):
    """``scanax.Stack`` over Flax NNX layers (see ``scanax.Stack``): an ``nnx.Module``.

    A stacked run is an ``nnx.List`` of ``period`` modules whose Variables have a
    leading ``repeats`` axis; ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` updates
    them like any other parameter. State the layers change while running
    (BatchNorm statistics, RNG counts) is written back after the scan.
    """

    _adapter = NNXLayers()


_stack.Stack.register(NNXStack)  # isinstance(s, scanax.Stack)
