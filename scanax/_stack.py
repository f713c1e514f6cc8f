"""``scanax.Stack``: a sequence of layers, with runs of identical layers scanned.

``Stack(layers)`` plans once, at construction: consecutive layers with identical
structure (pytree structure, static fields, leaf shapes and dtypes) form runs, and
repeating periods (``[attn, mlp] * 12``) form runs of blocks. Each run is stored
stacked (one array per parameter, with a leading axis of length ``repeats``) and
applied with one ``scanax.scan``; everything else is called directly.

``Stack(...)`` returns the class that fits the layers: an ``nnx.Module`` for Flax NNX
layers (``_stack_nnx.py``), an ``eqx.Module`` for Equinox layers (``_stack_eqx.py``),
and this module's pytree class for any other callables. All three are instances of
``scanax.Stack``. This file is framework-free; it holds the plan, the pytree path and
the registry the adapters plug into (``register_adapter``, filled by
``_stack_adapters.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _eager, _remat
from ._axes import is_array, is_arraylike, same_static
from ._errors import stack as errors
from ._scan import scan

# A plan is a tuple of pieces ``(start, period, repeats)``: layers
# ``start : start + period * repeats``, ``repeats`` blocks of ``period`` layers.
# ``repeats == 1`` (then ``period == 1``) is a single layer called directly.
Piece = tuple[int, int, int]


class ShapeChange(Exception):
    """A stacked run's block changes ``x``'s type: it cannot be a scan carry."""


class StackWarning(UserWarning):
    """``scanax.Stack`` left layers unstacked that differ only in a number (a
    per-layer ``idx: int``): they are traced one by one."""


def span(piece: Piece) -> str:
    start, period, repeats = piece
    return f"layers[{start}:{start + period * repeats}]"


# ---------------------------------------------------------------------------- plan


def pytree_signature(layer: Any) -> tuple[Any, list[Any]]:
    """What must match for two layers to be stacked: structure, statics, types."""
    leaves, treedef = jtu.tree_flatten(layer)
    sig = [
        ("array", tuple(x.shape), jnp.result_type(x)) if is_array(x) else ("static", x)
        for x in leaves
    ]
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
        return (
            is_array(a)
            and is_array(b)
            and jnp.shape(a) == jnp.shape(b)
            and jnp.result_type(a) == jnp.result_type(b)
        )
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


def warn_unstacked(
    plan_: tuple[Piece, ...], layers: Sequence[Any], pieces: Sequence[Any], expand=None
) -> None:
    """Warn (once, at construction) if layers of one class were left out of a run
    only because they differ in numbers: each layer against the next of its class."""
    run_of = {
        i: k for k, (s, p, r) in enumerate(plan_) if r > 1 for i in range(s, s + p * r)
    }
    found, next_of = [], {}
    for i in reversed(range(len(layers))):
        j = next_of.get(type(layers[i]))
        next_of[type(layers[i])] = i
        if j is None or (i in run_of and run_of.get(j) == run_of[i]):
            continue
        diffs = number_differences(layers[i], layers[j], expand)
        if diffs:
            found.append((i, j, diffs))
    if found:
        found.reverse()
        described = describe_plan(plan_, pieces)
        message = errors.unstacked_by_numbers(found, layers, described)
        warnings.warn(message, StackWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside scanax and the frameworks."""
    frame, level = sys._getframe(1), 1
    while frame is not None and any(
        part in frame.f_code.co_filename
        for part in ("scanax", "equinox", "flax", "<frozen")
    ):
        frame, level = frame.f_back, level + 1
    return level


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


# ---------------------------------------------------------------------------- pytrees


def stack_blocks(blocks: list[tuple]) -> tuple:
    """One block whose arrays carry a leading axis over ``blocks``."""
    return jtu.tree_map(
        lambda *xs: jnp.stack(xs) if is_array(xs[0]) else xs[0], *blocks
    )


def _is_stacked(x: Any) -> bool:
    """Whether a leaf of a stacked block carries the leading ``repeats`` axis.

    Only arrays were stacked. Other leaves (Python numbers, shared by the run) stay
    as they are, but become 0-d tracers when the Stack passes through ``jax.jit``
    or ``jax.grad``: a stacked leaf always has at least one axis.
    """
    return is_array(x) and jnp.ndim(x) >= 1


def pytree_view(stacked: Any, j: int) -> Any:
    return jtu.tree_map(lambda x: x[j] if _is_stacked(x) else x, stacked)


def _split(
    tree: Any, stacked: bool = False
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """Array leaves of ``tree`` (with ``stacked``, those of a stacked block), and a
    function putting new arrays in their place."""
    leaves, treedef = jtu.tree_flatten(tree)
    keep = _is_stacked if stacked else is_array
    idx = [i for i, x in enumerate(leaves) if keep(x)]

    def rebuild(arrays: list[Any]) -> Any:
        new = list(leaves)
        for i, a in zip(idx, arrays, strict=True):
            new[i] = a
        return jtu.tree_unflatten(treedef, new)

    return [leaves[i] for i in idx], rebuild


# ``remat`` as the user gives it: None (the default), False, True, "sqrt" or a
# policy: ``scanax.scan``'s values, and None. A layer is then called with False
# (store everything), True (recompute everything) or a policy (store what it
# allows); with "sqrt" the layers are called plainly and each run's scan
# checkpoints chunks of √repeats blocks (``scan_remat``).


def check_remat(remat: Any) -> Any:
    if remat is None or isinstance(remat, bool) or callable(remat):
        return remat
    if remat == "sqrt":
        return remat
    raise errors.bad_remat(remat)


def scan_remat(remat: Any) -> Any:
    """The ``remat=`` of a stacked run's ``scanax.scan``."""
    return "sqrt" if remat == "sqrt" else False


def run_remat(remat: Any) -> Any:
    """How the layers of a stacked run are checkpointed.

    By default only matmul results are kept for the backward pass and the cheap
    elementwise work between them is recomputed: on CPU, storing every residual of a
    scanned layer costs more than recomputing them (measured in bench_stack).
    """
    if remat == "sqrt":
        return False  # the run's scan checkpoints (`scan_remat`)
    return jax.checkpoint_policies.checkpoint_dots if remat is None else remat


def single_remat(remat: Any) -> Any:
    """How a layer outside any run (called directly) is checkpointed."""
    return False if remat is None or remat == "sqrt" else remat


def checkpoint_call(fn: Callable, args: tuple, remat: Any) -> Any:
    """``fn(*args)`` under ``jax.checkpoint`` (``remat`` True or a policy). Only array
    leaves cross the checkpoint: other leaves of ``args`` (functions, strings,
    None) and of the result pass around it unchanged."""
    arrays, rebuild = _split(args)
    out_parts: list[Any] = []

    def inner(arrays):
        out_arrays, out_rebuild = _split(fn(*rebuild(arrays)))
        out_parts.append(out_rebuild)
        return out_arrays

    # prevent_cse as jax.checkpoint's default: single layers run outside any loop.
    out = _remat.checkpoint(inner, remat, prevent_cse=True)(arrays)
    return out_parts[-1](out)


def call_pytree_layer(layer: Any, x: Any, kwargs: dict, remat: Any) -> Any:
    if remat is False:
        return layer(x, **kwargs)
    return checkpoint_call(lambda f, x, kw: f(x, **kw), (layer, x, kwargs), remat)


def check_carry(piece: Piece, x: Any, out: Any) -> None:
    """Raise ``ShapeChange`` unless ``out`` can be the scan carry ``x`` again: the
    same structure, array shapes and dtypes, and the same non-array values."""

    def types(t):
        return jtu.tree_structure(t), [
            (tuple(jnp.shape(v)), jnp.result_type(v)) if is_arraylike(v) else "static"
            for v in jtu.tree_leaves(t)
        ]

    if types(x) != types(out):
        raise ShapeChange(piece)
    for a, b in zip(jtu.tree_leaves(x), jtu.tree_leaves(out), strict=True):
        if not is_arraylike(a) and not same_static(a, b):
            raise ShapeChange(piece)


def check_per_layer(per_layer: Any, n: int) -> dict:
    """``per_layer`` validated: a dict whose leaves have a leading axis of ``n``."""
    if per_layer is None:
        return {}
    if not isinstance(per_layer, dict):
        raise errors.per_layer_type(per_layer)
    for path, leaf in jtu.tree_flatten_with_path(per_layer)[0]:
        if not is_array(leaf) or leaf.ndim == 0 or leaf.shape[0] != n:
            raise errors.per_layer_leaf(jtu.keystr(path), leaf, n)
    return per_layer


def per_layer_slice(per_layer: dict, piece: Piece) -> dict:
    """The ``per_layer`` entries of a piece: ``[repeats, period, ...]`` for a run."""
    start, period, repeats = piece
    if repeats == 1:
        return jtu.tree_map(lambda a: a[start], per_layer)
    return jtu.tree_map(
        lambda a: a[start : start + period * repeats].reshape(
            repeats, period, *a.shape[1:]
        ),
        per_layer,
    )


def layer_kwargs(kwargs: dict, per: dict, k: int | None = None) -> dict:
    """The keyword arguments of one layer: shared ones, then its own entries."""
    if not per:
        return kwargs
    own = per if k is None else jtu.tree_map(lambda a: a[k], per)
    return {**kwargs, **own}


def _apply_block(block: tuple, x: Any, kwargs: dict, per: dict, remat: Any) -> Any:
    for k, layer in enumerate(block):
        x = call_pytree_layer(layer, x, layer_kwargs(kwargs, per, k), remat)
    return x


def apply_pytree(
    pieces: Sequence[Any],
    plan_: tuple[Piece, ...],
    x: Any,
    kwargs: dict,
    per_layer: dict,
    remat: Any,
    unroll: int | bool,
) -> Any:
    """Apply a plain or Equinox Stack's pieces to ``x``."""
    in_run = run_remat(remat)
    for piece, data in zip(plan_, pieces, strict=True):
        repeats = piece[2]
        per = per_layer_slice(per_layer, piece)
        if repeats == 1:
            x = call_pytree_layer(
                data, x, layer_kwargs(kwargs, per), single_remat(remat)
            )
            continue
        arrays, rebuild = _split(data, stacked=True)

        def step(x, inp, piece=piece, rebuild=rebuild):
            arrays, per_j, kw = inp
            y = _apply_block(rebuild(arrays), x, kw, per_j, in_run)
            check_carry(piece, x, y)
            return y, None

        try:
            with jax.named_scope(f"scanax.Stack.{span(piece)}"):
                x, _ = scan(
                    step,
                    x,
                    (arrays, per, kwargs),
                    length=repeats,
                    unroll=unroll,
                    in_axes=(0, 0, None),
                    remat=scan_remat(remat),
                )
        except ShapeChange:
            # The layers change x's shape: no scan carry can hold it; loop instead.
            for j in range(repeats):
                block = rebuild(pytree_view(arrays, j))
                x = _apply_block(block, x, kwargs, pytree_view(per, j), in_run)
    return x


# ---------------------------------------------------------------------------- public


# Framework adapters, in the order they are asked: ``(claims, build)``, where
# ``claims(layers)`` says whether the adapter takes these layers and
# ``build(layers, **kwargs)`` returns its Stack. Registered from above (see
# ``_stack_adapters``): this module knows none of them.
_ADAPTERS: list[tuple[Callable[[list[Any]], bool], Callable[..., Any]]] = []


def register_adapter(
    claims: Callable[[list[Any]], bool], build: Callable[..., Any]
) -> None:
    """Have ``Stack(layers, **kwargs)`` return ``build(layers, **kwargs)`` when
    ``claims(layers)``; adapters registered first are asked first."""
    _ADAPTERS.append((claims, build))


def check_layers(layers: Any) -> list[Any]:
    if not isinstance(layers, (list, tuple)):
        raise errors.not_sequence(layers)
    if not layers:
        raise errors.empty()
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise errors.not_callable(i, layer)
    return list(layers)


class Stack(metaclass=abc.ABCMeta):  # noqa: B024 (ABCMeta for Stack.register)
    """A sequence of layers applied in order; runs of identical layers are scanned.

    Conceptually equivalent to::

        class Stack:
            def __init__(self, layers):
                self.layers = list(layers)

            def __call__(self, x, **kwargs):
                for layer in self.layers:
                    x = layer(x, **kwargs)
                return x

    Consecutive layers with identical structure (pytree structure, static fields,
    leaf shapes and dtypes) are stored stacked, once, at construction, and applied
    by one ``scanax.scan``; so are repeating periods (``[attn, mlp] * 12`` is one
    scan over 12 two-layer blocks). Other layers are called directly. Compile time
    then grows with the number of *distinct* layers, not the depth.

    ``Stack(layers)`` is an ``nnx.Module`` when the layers are Flax NNX modules (it
    nests in NNX models and trains with ``nnx.Optimizer``), an ``eqx.Module`` when
    they are Equinox modules (``eqx.filter_grad``, optax), and a registered pytree
    otherwise. Each is an instance of ``scanax.Stack``.

    Arguments:
        layers: a list or tuple of callables ``layer(x, **kwargs) -> x``.
        remat: what the backward pass stores: ``scanax.scan``'s values, and
            ``None``. ``None`` (the default, where ``scanax.scan``'s is ``False``):
            the layers of stacked runs keep only their matmul results
            (``jax.checkpoint_policies.checkpoint_dots``) and recompute the
            elementwise work in between; single layers store everything. ``False``:
            every layer stores everything (a plain ``lax.scan``). ``True``: every
            layer is wrapped in ``jax.checkpoint`` and recomputed. A
            ``jax.checkpoint_policies`` policy: every layer, with that policy.
            ``"sqrt"`` (for long stacks): each stacked run is a scan with
            ``remat="sqrt"``, storing the activations of about √repeats blocks for
            one extra forward pass; single layers store everything.
        unroll: as in ``jax.lax.scan``, for every stacked run.

    ``len(stack)``, ``stack[i]`` and ``list(stack)`` give the layers back, equal to
    those given (for stacked runs, rebuilt from the stacked arrays: new objects).
    ``repr(stack)`` shows the plan (``Stack(8 layers: Linear(3→4), 6 × Block
    scanned, Linear(4→2))``); ``stack.plan`` holds it as ``(start, period,
    repeats)`` tuples.

    ``stack(x, **kwargs)`` passes the same keyword arguments to every layer;
    ``stack(x, per_layer={"key": keys})`` passes layer ``i`` the entries
    ``keys[i]`` (every leaf of ``per_layer`` has one entry per layer on axis 0).

    Raises:
        TypeError: ``layers`` not a list or tuple, a layer that is not callable,
            ``per_layer`` not a dict, ``remat`` not one of the values above.
        ValueError: no layers; NNX layers sharing a Variable; a ``per_layer`` leaf
            without one entry per layer.

    Warns:
        scanax.StackWarning: once, when built, if layers of one class were left
            out of a run only because they differ in a Python number (a per-layer
            ``idx: int``), naming the field and the fix.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> scale = lambda x: 2.0 * x
        >>> stack = scanax.Stack([jnp.abs] + [scale] * 4)  # abs, then one scan
        >>> float(stack(jnp.float32(-1.5)))
        24.0
    """

    def __new__(cls, layers: Sequence[Any] = (), **kwargs: Any) -> Any:
        if cls is Stack:
            layers = check_layers(layers)
            for claims, build in _ADAPTERS:
                if claims(layers):
                    return build(layers, **kwargs)
        return super().__new__(cls)

    def __init__(
        self, layers: Sequence[Any], *, remat: Any = None, unroll: int | bool = 1
    ):
        self.plan, self.pieces = build_pytree(layers)
        self.remat = check_remat(remat)
        self.unroll = unroll
        self.n = len(layers)

    def __call__(self, x: Any, *, per_layer: dict | None = None, **kwargs: Any) -> Any:
        if _eager.active():  # un-jitted: compile once per distinct program
            return _eager.call(Stack.__call__, self, x, per_layer=per_layer, **kwargs)
        per_layer = check_per_layer(per_layer, self.n)
        with jax.named_scope("scanax.Stack"):
            return apply_pytree(
                self.pieces, self.plan, x, kwargs, per_layer, self.remat, self.unroll
            )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return pytree_layer(self.plan, self.pieces, self.n, i)

    def __iter__(self):
        return (self[i] for i in range(self.n))

    def __repr__(self) -> str:
        return f"Stack({describe_plan(self.plan, self.pieces)})"

    def tree_flatten_with_keys(self):
        return (
            [(jtu.GetAttrKey("pieces"), self.pieces)],
            (self.plan, self.remat, self.unroll, self.n),
        )

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.plan, obj.remat, obj.unroll, obj.n = aux
        (obj.pieces,) = children
        return obj


jtu.register_pytree_with_keys_class(Stack)


def build_pytree(layers: Sequence[Any]) -> tuple[tuple[Piece, ...], tuple]:
    """The plan of pytree (and Equinox) layers, and its pieces: single layers as
    given, runs as stacked blocks (arrays with a leading ``repeats`` axis)."""
    layers = check_layers(layers)
    plan_ = plan(signature_ids([pytree_signature(x) for x in layers]))
    pieces = tuple(
        layers[s]
        if r == 1
        else stack_blocks(
            [tuple(layers[s + j * p : s + (j + 1) * p]) for j in range(r)]
        )
        for s, p, r in plan_
    )
    warn_unstacked(plan_, layers, pieces)
    return plan_, pieces


def pytree_layer(plan_: tuple[Piece, ...], pieces: tuple, n: int, i: int) -> Any:
    """Layer ``i`` of a pytree (or Equinox) Stack: stacked runs are sliced."""
    k, j, m = locate(plan_, n, i)
    if plan_[k][2] == 1:
        return pieces[k]
    return pytree_view(pieces[k], j)[m]


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
