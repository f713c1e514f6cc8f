"""``scanax.Stack``: a sequence of layers, with runs of identical layers scanned.

``Stack(layers)`` plans once, at construction: consecutive layers with identical
structure (pytree structure, static fields, leaf shapes and dtypes) form runs, and
repeating periods (``[attn, mlp] * 12``) form runs of blocks. Each run is stored
stacked (one array per parameter, with a leading axis of length ``repeats``) and
applied with one ``scanax.scan``; everything else is called directly.

``Stack(...)`` returns the class that fits the layers: an ``nnx.Module`` for Flax NNX
layers (``_stack_nnx.py``), an ``eqx.Module`` for Equinox layers (``_stack_eqx.py``),
and this module's pytree class for any other callables. All three are instances of
``scanax.Stack``. All three share one body (``Body``: build, call, index), which
asks the class's adapter (a ``Layers``) for what depends on the framework: how
layers are compared, stored, called and rebuilt from a run's arrays. This file is
framework-free: it holds that body, the adapter for pytree layers (plain callables
and Equinox modules), the scan over a run, and the registry the framework classes
plug into (``register_adapter``, filled by ``_stack_adapters.py``). The plan
(which layers form runs) is in ``_stack_plan.py``.
"""

from __future__ import annotations

import abc
import collections.abc
import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _backend, _caller, _eager, _remat
from ._errors import stack as errors
from ._loop import check_unroll
from ._scan import scan
from ._stack_plan import (
    Piece,
    describe_plan,
    locate,
    number_differences,
    plan,
    pytree_signature,
    signature_ids,
    span,
)
from ._tree import Partition, is_array, is_arraylike, leaf_type, partition, same_static


class ShapeChange(Exception):
    """A stacked run's block changes ``x``'s type: it cannot be a scan carry."""


class StackWarning(UserWarning):
    """``scanax.Stack`` left layers unstacked that differ only in a number (a
    per-layer ``idx: int``): they are traced one by one."""


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
        warnings.warn(message, StackWarning, stacklevel=_caller.user_level())


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


# ``remat`` as the user gives it: None (the default), False, True, "sqrt" or a
# policy: ``scanax.scan``'s values, and None. A layer is then called with False
# (store everything), True (recompute everything) or a policy (store what it
# allows); with "sqrt" the layers are called plainly and each run's scan
# checkpoints chunks of √repeats blocks (``scan_remat``).


def check_remat(remat: Any) -> Any:
    if callable(remat):
        _remat.check_not_a_factory(errors.CALL, remat)
    if remat is None or isinstance(remat, bool) or callable(remat):
        return remat
    if remat == "sqrt":
        return remat
    raise errors.bad_remat(remat)


def scan_remat(remat: Any) -> Any:
    """The ``remat=`` of a stacked run's ``scanax.scan``."""
    return "sqrt" if remat == "sqrt" else False


def default_policy(backend: str) -> Callable:
    """What the layers of a stacked run keep for the backward pass by default.

    CPU: every matmul result (``checkpoint_dots``), the cheap elementwise work
    between them recomputed: there, storing every residual of a scanned layer
    costs more than recomputing it (measured in bench_stack). Elsewhere: the
    results of matmuls without batch dimensions (``checkpoint_dots_with_no_batch
    _dims``, MaxText's "minimal" policy): the projections are kept, attention's
    batched matmuls (its ``[batch, heads, T, T]`` scores) and the elementwise
    work recomputed. Keeping every matmul stacked over the layers of a
    GPT-2-small on an H200 (its scores: 4.8 GB over 12 layers) made a step 1.41x
    the unrolled model's; this default is not yet measured on a GPU
    (``benchmarks/device_check.py`` prints it, the others, and the unrolled
    model under this policy). On a TPU v5e (GPT-2-small, batch 4), step time
    and peak memory against the unrolled model: this default 1.25 and 0.70,
    ``remat=True`` 1.28 and 0.51, ``checkpoint_dots`` 1.27 and 1.00,
    ``remat=False`` 1.45 and 1.81; the unrolled model's blocks under this
    policy 1.15 and 0.59 (the policy's own cost: attention's scores and
    softmax over ``[batch, heads, T, T]``, and the elementwise work,
    recomputed).
    """
    if backend == "cpu":
        return jax.checkpoint_policies.checkpoint_dots
    return jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims


def run_remat(remat: Any) -> Any:
    """How the layers of a stacked run are checkpointed (``remat=None``: the
    backend's ``default_policy``)."""
    if remat == "sqrt":
        return False  # the run's scan checkpoints (`scan_remat`)
    return default_policy(_backend.platform()) if remat is None else remat


def single_remat(remat: Any) -> Any:
    """How a layer outside any run (called directly) is checkpointed."""
    return False if remat is None or remat == "sqrt" else remat


def checkpoint_call(fn: Callable, args: tuple, remat: Any, looped: bool) -> Any:
    """``fn(*args)`` under ``jax.checkpoint`` (``remat`` True or a policy). Only array
    leaves cross the checkpoint: other leaves of ``args`` (functions, strings,
    None) and of the result pass around it unchanged. ``looped``: the call
    runs inside a scan's loop (``_remat.in_loop``), where (as ``jax.checkpoint``
    documents) CSE cannot undo the checkpoint and its prevention only costs
    (optimization barriers, which can foil XLA's fusion and scheduling,
    "especially on GPU"); in straight-line code, ``jax.checkpoint``'s default
    ``prevent_cse=True``."""
    parts = partition(args)
    out_parts: list[Partition] = []

    def inner(arrays):
        out = partition(fn(*parts.rebuild(arrays)))
        out_parts.append(out)
        return out.picked

    out = _remat.checkpoint(inner, remat, prevent_cse=not looped)(parts.picked)
    return out_parts[-1].rebuild(out)


def call_pytree_layer(
    layer: Any, x: Any, kwargs: dict, remat: Any, looped: bool
) -> Any:
    if remat is False:
        return layer(x, **kwargs)
    return checkpoint_call(
        lambda f, x, kw: f(x, **kw), (layer, x, kwargs), remat, looped
    )


def check_carry(piece: Piece, x: Any, out: Any) -> None:
    """Raise ``ShapeChange`` unless ``out`` can be the scan carry ``x`` again: the
    same structure, array shapes and dtypes, and the same non-array values."""

    def types(t):
        return jtu.tree_structure(t), [
            leaf_type(v) if is_arraylike(v) else "static" for v in jtu.tree_leaves(t)
        ]

    if types(x) != types(out):
        raise ShapeChange(piece)
    for a, b in zip(jtu.tree_leaves(x), jtu.tree_leaves(out), strict=True):
        if is_arraylike(a):
            # (under a mesh of explicit axes, a sharding is part of the type)
            if _sharding(a) != _sharding(b):
                raise ShapeChange(piece)
        elif not same_static(a, b):
            raise ShapeChange(piece)


def _sharding(x: Any) -> Any:
    return getattr(jax.typeof(x), "sharding", None)


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


# ---------------------------------------------------------------------------- adapters


class Run:
    """A stacked run's arrays (``arrays``, each with a leading ``repeats`` axis)
    and its blocks rebuilt from slices of them (``block``): for pytree layers,
    which do not change while running. An adapter whose layers hold state they
    change (NNX BatchNorm statistics) returns the new values from ``changes`` and
    writes the stacked ones back with ``write_back``."""

    def __init__(self, data: Any):
        self.parts = partition(data, _is_stacked)
        self.arrays = self.parts.picked

    def block(self, arrays: list[Any]) -> Any:
        """The block (a sequence of ``period`` layers) holding ``arrays``."""
        return self.parts.rebuild(arrays)

    def changes(self, block: Any, arrays: list[Any]) -> list[Any]:
        """After ``block`` ran: the values of its leaves that changed."""
        return []

    def leaf_name(self, k: int) -> str:
        """How a message names the run's leaf ``arrays[k]``."""
        return f"leaf {k}"

    def write_back(self, new: list[Any]) -> None:
        """Store ``changes``' values (stacked over the blocks) in the run."""


class Layers:
    """How a Stack builds, calls and rebuilds its layers: this one for plain
    callables and Equinox modules (pytrees). A framework's adapter subclasses it
    (``_stack_nnx.NNXLayers``) and sets it as its Stack class's ``_adapter``."""

    expand: Callable[[Any], Any] | None = None  # see `number_differences`

    def check(self, layers: list[Any]) -> None:
        """Refuse layers that cannot be stacked (before planning)."""

    def signature(self, layer: Any) -> Any:
        """What must match for two layers to be stacked (``same_signature``)."""
        return pytree_signature(layer)

    def single(self, layer: Any) -> Any:
        """A layer outside any run, as the Stack stores it."""
        return layer

    def stacked(self, blocks: list[tuple]) -> Any:
        """A run of ``blocks`` (tuples of ``period`` layers), as the Stack stores it."""
        return stack_blocks(blocks)

    def store(self, pieces: list[Any]) -> Any:
        return tuple(pieces)

    def open(self, data: Any, start: int) -> Run:
        """The stored run ``data`` of the layers from ``start``, to run or index."""
        return Run(data)

    def call(
        self, layer: Any, x: Any, kwargs: dict, remat: Any, i: int, looped: bool
    ) -> Any:
        """``layer(x, **kwargs)`` (layer ``i``), checkpointed as ``remat`` says
        (``looped``: inside a scan's loop, ``checkpoint_call``)."""
        return call_pytree_layer(layer, x, kwargs, remat, looped)

    def eager(self, stack: Any) -> bool:
        """Whether an un-jitted call may go through ``_eager``."""
        return True

    def calling(self, stack: Any, kwargs: dict) -> Any:
        """A context manager around a call of ``stack``."""
        return contextlib.nullcontext()


def apply(
    adapter: Layers,
    plan_: tuple[Piece, ...],
    pieces: Sequence[Any],
    x: Any,
    kwargs: dict,
    per_layer: dict,
    remat: Any,
    unroll: int | bool,
) -> Any:
    """Apply a Stack's pieces to ``x``: single layers called, runs scanned."""
    for piece, data in zip(plan_, pieces, strict=True):
        per = per_layer_slice(per_layer, piece)
        if piece[2] == 1:
            kw = layer_kwargs(kwargs, per)
            x = _called(adapter, data, x, kw, single_remat(remat), piece[0], False)
        else:
            run = adapter.open(data, piece[0])
            x = _run(adapter, piece, run, x, kwargs, per, remat, unroll)
    return x


def _called(
    adapter: Layers, layer: Any, x: Any, kwargs: dict, remat: Any, i: int, looped: bool
) -> Any:
    """``adapter.call``; an error a layer raises while traced on ``x`` (data of
    another width than it takes, a keyword it does not take) named with the
    layer's index and its input, the original chained."""
    try:
        return adapter.call(layer, x, kwargs, remat, i, looped=looped)
    except (TypeError, ValueError) as err:
        if not _caller.about_the_input(err):
            raise
        raise errors.layer_failed(i, layer, x, sorted(kwargs), err) from err


def _run(
    adapter: Layers,
    piece: Piece,
    run: Run,
    x: Any,
    kwargs: dict,
    per: dict,
    remat: Any,
    unroll: int | bool,
) -> Any:
    """One scan over a run's blocks; if they change ``x``'s type, the first
    block called on its own and the rest scanned (a first layer that casts,
    say bfloat16 input to float32 layers), else a Python loop."""
    start, period, repeats = piece
    in_run = run_remat(remat)
    for k, a in enumerate(run.arrays):  # (a value added to the built Stack)
        if getattr(a, "ndim", 0) < 1 or a.shape[0] != repeats:
            raise errors.run_leaf_unstacked(span(piece), run.leaf_name(k), a, repeats)

    def block(x, arrays, per_j, kw, looped, j):
        layers = run.block(arrays)
        for k, layer in enumerate(layers):
            kw_k = layer_kwargs(kw, per_j, k)
            i = start + j * period + k
            x = _called(adapter, layer, x, kw_k, in_run, i, looped)
        return x, run.changes(layers, arrays)

    def scanned(x, first):
        """Blocks ``first`` on as one scan (``ShapeChange`` if they change x)."""
        looped = _remat.in_loop(unroll, repeats - first)

        def step(x, inp):
            y, new = block(x, *inp, looped=looped, j=first)
            check_carry(piece, x, y)
            return y, new

        def rest(a):
            return a[first:] if _is_stacked(a) else a

        arrays = [a[first:] for a in run.arrays]
        with jax.named_scope(f"scanax.Stack.{span(piece)}"):
            return scan(
                step,
                x,
                (arrays, jtu.tree_map(rest, per), kwargs),
                length=repeats - first,
                unroll=unroll,
                in_axes=(0, 0, None),
                remat=scan_remat(remat),
            )

    def called(x, j):
        # (straight-line code: the checkpoints keep CSE prevention)
        arrays = [a[j] for a in run.arrays]
        return block(x, arrays, pytree_view(per, j), kwargs, looped=False, j=j)

    try:
        x, new = scanned(x, 0)
    except ShapeChange:
        x, first = called(x, 0)
        try:
            if repeats < 3:  # (one block left: no scan for it)
                raise ShapeChange(piece) from None
            x, rest = scanned(x, 1)
            new = [
                jnp.concatenate([a[None], b]) for a, b in zip(first, rest, strict=True)
            ]
        except ShapeChange:
            # The blocks change x's type each time: no scan carry can hold it.
            news = [first]
            for j in range(1, repeats):
                x, new_j = called(x, j)
                news.append(new_j)
            new = [jnp.stack(v) for v in zip(*news, strict=True)]
    run.write_back(new)
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
    # (a list or tuple, or a sequence of modules such as an nnx.List; not a
    # string, nor an array: a stacked layer's parameters)
    sequence = isinstance(layers, collections.abc.Sequence) and not isinstance(
        layers, (str, bytes)
    )
    if not sequence:
        raise errors.not_sequence(layers)
    if not layers:
        raise errors.empty()
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise errors.not_callable(i, layer)
    return list(layers)


class Body:
    """What every Stack class does, whatever its framework (see ``Stack``): the
    pytree ``Stack`` below, ``_stack_eqx.EqxStack`` and ``_stack_nnx.NNXStack``.
    A class sets ``_adapter`` (a ``Layers``) for its framework's layers."""

    _adapter: Layers = Layers()

    def __init__(
        self, layers: Sequence[Any] = (), *, remat: Any = None, unroll: int | bool = 1
    ):
        layers = check_layers(layers)
        remat = check_remat(remat)
        check_unroll(errors.CALL, unroll)
        adapter = self._adapter
        adapter.check(layers)
        self.plan = plan(signature_ids([adapter.signature(x) for x in layers]))
        pieces = [
            adapter.single(layers[s])
            if r == 1
            else adapter.stacked(
                [tuple(layers[s + j * p : s + (j + 1) * p]) for j in range(r)]
            )
            for s, p, r in self.plan
        ]
        self.pieces = adapter.store(pieces)
        self.remat = remat
        self.unroll = unroll
        self.n = len(layers)
        warn_unstacked(self.plan, layers, pieces, adapter.expand)

    def __call__(self, x: Any, *, per_layer: dict | None = None, **kwargs: Any) -> Any:
        if _eager.active() and self._adapter.eager(self):
            # Un-jitted: compile once per distinct program.
            return _eager.call(Body.__call__, self, x, per_layer=per_layer, **kwargs)
        with self._adapter.calling(self, kwargs), jax.named_scope("scanax.Stack"):
            per_layer = check_per_layer(per_layer, self.n)
            return apply(
                self._adapter,
                self.plan,
                self.pieces,
                x,
                kwargs,
                per_layer,
                self.remat,
                self.unroll,
            )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        k, j, m = locate(self.plan, self.n, i)
        start, _, repeats = self.plan[k]
        if repeats == 1:
            return self.pieces[k]
        run = self._adapter.open(self.pieces[k], start)
        return run.block([a[j] for a in run.arrays])[m]

    def __iter__(self):
        return (self[i] for i in range(self.n))

    def __repr__(self) -> str:
        return f"Stack({describe_plan(self.plan, list(self.pieces))})"


_KEYWORDS = ("remat", "unroll")  # Body.__init__'s, after the layers
_NO_LAYERS: tuple = ()


class Stack(Body, metaclass=abc.ABCMeta):  # noqa: B024 (ABCMeta for Stack.register)
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
            (``jax.checkpoint_policies.checkpoint_dots``; off CPU only those
            without batch dimensions, ``checkpoint_dots_with_no_batch_dims``:
            attention's scores are recomputed) and recompute the elementwise
            work in between; single layers store everything. ``False``:
            every layer stores everything (a plain ``lax.scan``). ``True``: every
            layer is wrapped in ``jax.checkpoint`` and recomputed. A
            ``jax.checkpoint_policies`` policy: every layer, with that policy.
            ``"sqrt"`` (for long stacks): each stacked run is a scan with
            ``remat="sqrt"``, storing the activations of about √repeats blocks for
            one extra forward pass; single layers store everything.
        unroll: as in ``jax.lax.scan``, for every stacked run.

    ``len(stack)``, ``stack[i]`` and ``list(stack)`` give the layers back, equal to
    those given (for stacked runs, rebuilt from the stacked arrays: new objects,
    so writing to an NNX Variable of one changes nothing; build a new ``Stack``
    from edited layers instead).
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

    def __new__(
        cls, layers: Sequence[Any] = _NO_LAYERS, *more: Any, **kwargs: Any
    ) -> Any:
        # No arguments: copy.copy, copy.deepcopy and pickle making the object
        # before they fill it (a user's Stack() is refused by __init__).
        if more:  # (Stack(l1, l2): nnx.Sequential's habit)
            raise errors.layers_as_arguments(1 + len(more))
        if cls is Stack and (layers is not _NO_LAYERS or kwargs):
            for name in kwargs:
                if name not in _KEYWORDS:
                    raise errors.unexpected_keyword(name, list(_KEYWORDS))
            layers = check_layers(layers)
            for claims, build in _ADAPTERS:
                if claims(layers):
                    return build(layers, **kwargs)
        return super().__new__(cls)

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
