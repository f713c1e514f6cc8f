"""Flax NNX adapter for ``scanax.Stack``: the only module of it that imports Flax."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu
from flax import nnx

from . import _eager, _errors as base_errors, _nnx, _stack
from ._errors import stack as errors
from ._scan import scan


def _signature(layer: Any) -> Any:
    if not nnx.graph.is_graph_node(layer):
        return _stack.pytree_signature(layer)
    graphdef, state = nnx.split(layer)
    return graphdef, [
        ("array", tuple(x.shape), x.dtype) for x in jtu.tree_leaves(state)
    ]


def _expand(x: Any) -> list[tuple[str, Any]] | None:
    """The parts of an NNX object, to compare two layers (``_stack._walk``)."""
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
                key = id(var)
                if key in seen and seen[key][0] != i:
                    j, _ = seen[key]
                    raise errors.shared(
                        j, i, jtu.keystr(tuple(jtu.GetAttrKey(str(p)) for p in path))
                    )
                seen.setdefault(key, (i, ""))


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


def _pure(
    graphdef: Any, leaves: list[Any], treedef: Any, fn, name: Callable[[tuple], str]
) -> tuple[Any, list]:
    """Run ``fn(module, x)`` on ``merge(graphdef, leaves)``; changed leaves come back.

    Which leaves ``fn`` changes (BatchNorm statistics, RNG counts) is found while
    tracing, by identity; parameters are not returned, so they are not copied. A
    module whose Variables or values ``fn`` adds or removes (``Module.sow``, with or
    without ``nnx.capture``) is refused, naming them by ``name(path)``: its leaves
    would no longer line up with the stacked ones.
    """
    changed: list[int] = []

    def run(leaves, x):
        module = nnx.merge(graphdef, jtu.tree_unflatten(treedef, leaves))
        y = fn(module, x)
        after_graphdef, after = nnx.split(module)
        if after_graphdef != graphdef or jtu.tree_structure(after) != treedef:
            before = _leaf_paths(jtu.tree_unflatten(treedef, leaves))
            now = _leaf_paths(after)
            raise errors.graph_changed(
                [name(p) for p in now if p not in before],
                [name(p) for p in before if p not in now],
            )
        new = jtu.tree_leaves(after)
        changed[:] = [k for k, (a, b) in enumerate(zip(leaves, new)) if a is not b]
        return y, [new[k] for k in changed]

    return run, changed


def _layer_name(i: int) -> Callable[[tuple], str]:
    """``layers[i]['h']`` for a Variable path inside layer ``i``."""
    return lambda path: f"layers[{i}]" + "".join(f"[{k!r}]" for k in path)


def _call_layer(layer: Any, x: Any, kwargs: dict, remat: Any, i: int) -> Any:
    if remat is False or not nnx.graph.is_graph_node(layer):
        return _stack.call_pytree_layer(layer, x, kwargs, remat)
    graphdef, state = nnx.split(layer)
    leaves, treedef = jtu.tree_flatten(state)
    run, changed = _pure(
        graphdef, leaves, treedef, lambda m, x: m(x, **kwargs), _layer_name(i)
    )
    y, new = _stack.checkpoint_call(run, (leaves, x), remat)
    if changed:
        _write_back(layer, leaves, treedef, changed, new)
    return y


def _write_back(node, leaves, treedef, changed, new) -> None:
    leaves = list(leaves)
    for k, v in zip(changed, new, strict=True):
        leaves[k] = v
    nnx.update(node, jtu.tree_unflatten(treedef, leaves))


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


class NNXStack(nnx.Module):
    """``scanax.Stack`` over Flax NNX layers (see ``scanax.Stack``): an ``nnx.Module``.

    A stacked run is an ``nnx.List`` of ``period`` modules whose Variables have a
    leading ``repeats`` axis; ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` updates
    them like any other parameter. State the layers change while running
    (BatchNorm statistics, RNG counts) is written back after the scan.
    """

    def __init__(
        self, layers: Sequence[Any], *, remat: Any = None, unroll: int | bool = 1
    ):
        layers = _stack.check_layers(layers)
        remat = _stack.check_remat(remat)
        _check_owned(layers)
        self.plan = _stack.plan(_stack.signature_ids([_signature(x) for x in layers]))
        pieces = []
        for s, p, r in self.plan:
            if r == 1:
                layer = layers[s]
                pieces.append(
                    nnx.clone(layer) if nnx.graph.is_graph_node(layer) else layer
                )
                continue
            blocks = [tuple(layers[s + j * p : s + (j + 1) * p]) for j in range(r)]
            graphdef, _ = nnx.split(blocks[0])
            states = [nnx.split(b)[1] for b in blocks]
            stacked = jtu.tree_map(lambda *xs: jax.numpy.stack(xs), *states)
            pieces.append(nnx.List(list(nnx.merge(graphdef, stacked))))
        self.pieces = nnx.List(pieces)
        self.remat = remat
        self.unroll = unroll
        self.n = len(layers)
        _stack.warn_unstacked(self.plan, layers, pieces, _expand)

    def __call__(self, x: Any, *, per_layer: dict | None = None, **kwargs: Any) -> Any:
        # Un-jitted: compile once per distinct program. Not inside `nnx.capture`,
        # which stores into the Stack's own modules (see `_without_captures`).
        if _eager.active() and "__captures__" not in vars(self):
            return _eager.call(
                NNXStack.__call__, self, x, per_layer=per_layer, **kwargs
            )
        try:
            return self._call(x, per_layer, kwargs)
        except Exception as err:
            # A layer changed an NNX object among the keyword arguments (an
            # nnx.Rngs): scan's message would speak of closures and carries.
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
                raise errors.kwarg_mutated(nodes, self.n) from err
            raise

    def _call(self, x: Any, per_layer: dict | None, kwargs: dict) -> Any:
        per_layer = _stack.check_per_layer(per_layer, self.n)
        runs = [p for p, (_, _, r) in zip(self.pieces, self.plan, strict=True) if r > 1]
        with (
            jax.named_scope("scanax.Stack"),
            _without_captures(self, [self.pieces, *runs]),
        ):
            for piece, data in zip(self.plan, self.pieces, strict=True):
                per = _stack.per_layer_slice(per_layer, piece)
                if piece[2] == 1:
                    kw = _stack.layer_kwargs(kwargs, per)
                    remat = _stack.single_remat(self.remat)
                    x = _call_layer(data, x, kw, remat, piece[0])
                else:
                    x = self._run(piece, data, x, kwargs, per)
            return x

    def _run(
        self, piece: _stack.Piece, block: Any, x: Any, kwargs: dict, per: dict
    ) -> Any:
        graphdef, state = nnx.split(block)
        leaves, treedef = jtu.tree_flatten(state)
        remat = _stack.run_remat(self.remat)

        start = piece[0]

        def apply(module, x, kw, per_j):
            for k, layer in enumerate(module):
                kw_k = _stack.layer_kwargs(kw, per_j, k)
                x = _call_layer(layer, x, kw_k, remat, start + k)
            return x

        def name(path: tuple) -> str:  # a path in the run's first block
            return _layer_name(start + path[0])(path[1:])

        changed: list[int] = []

        def body(x, inp):
            leaves_j, per_j, kw = inp
            run, found = _pure(
                graphdef, leaves_j, treedef, lambda m, x: apply(m, x, kw, per_j), name
            )
            y, new = run(leaves_j, x)
            changed[:] = found
            _stack.check_carry(piece, x, y)
            return y, new

        try:
            with jax.named_scope(f"scanax.Stack.{_stack.span(piece)}"):
                x, new = scan(
                    body,
                    x,
                    (leaves, per, kwargs),
                    length=piece[2],
                    unroll=self.unroll,
                    in_axes=(0, 0, None),
                    remat=_stack.scan_remat(self.remat),
                )
        except _stack.ShapeChange:
            ys = []
            for j in range(piece[2]):
                leaves_j = [a[j] for a in leaves]
                per_j = _stack.pytree_view(per, j)
                run, found = _pure(
                    graphdef,
                    leaves_j,
                    treedef,
                    lambda m, x, per_j=per_j: apply(m, x, kwargs, per_j),
                    name,
                )
                x, new_j = run(leaves_j, x)
                ys.append(new_j)
            changed = found
            new = [jax.numpy.stack(v) for v in zip(*ys, strict=True)] if ys else []
        if changed:
            _write_back(block, leaves, treedef, changed, new)
        return x

    def __repr__(self) -> str:
        return f"Stack({_stack.describe_plan(self.plan, list(self.pieces))})"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        k, j, m = _stack.locate(self.plan, self.n, i)
        if self.plan[k][2] == 1:
            return self.pieces[k]
        graphdef, state = nnx.split(self.pieces[k])
        return nnx.merge(graphdef, jtu.tree_map(lambda a: a[j], state))[m]

    def __iter__(self):
        return (self[i] for i in range(self.n))


_stack.Stack.register(NNXStack)  # isinstance(s, scanax.Stack)
