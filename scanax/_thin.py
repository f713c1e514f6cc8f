"""``keep_every=`` and ``keep=``: thinned or reduced per-step outputs.

``keep_every=k`` keeps the outputs ``ys[k - 1::k]`` (the steps whose index ``i``
has ``(i + 1) % k == 0``; ``T // k`` of them; the same indices with
``reverse=True``). It runs as an outer scan over ``T // k`` chunks of ``k`` steps
(sliced from ``xs`` inside the loop), each an inner scan of ``k - 1`` steps
without outputs and one step whose output is kept, plus a scan without outputs
over the ``T mod k`` steps left over: nothing else is ever stored.

``keep`` then says what to return of the kept outputs: ``"all"`` (stacked, the
default), ``"last"`` (of the last step run), ``"sum"``, ``"mean"``, or a binary
function ``fn(acc, y) -> acc`` folded over each leaf in the order the steps run,
starting from the first kept output. The reductions keep one accumulator: O(1)
memory in ``T``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _caller, _remat
from ._errors import long as errors
from ._loop import Loop

_REDUCERS = ("all", "last", "sum", "mean")


def resolve(call: str, keep_every: Any, keep: Any) -> tuple[int, Any]:
    if isinstance(keep_every, bool) or not isinstance(keep_every, int):
        raise errors.keep_every_type(call, keep_every)
    if keep_every < 1:
        raise errors.keep_every_value(call, keep_every)
    if not (keep in _REDUCERS or callable(keep)):
        raise errors.bad_keep(call, keep)
    if keep not in _REDUCERS:
        refused = _caller.cannot_bind(keep, None, None)
        if refused is not None:
            raise errors.keep_arity(call, refused[0])
    return keep_every, keep


def check_length(call: str, length: int, keep_every: int, keep: Any) -> None:
    """Reductions without an identity need at least one kept output."""
    if keep in ("all", "sum") or length // keep_every > 0:
        return
    name = keep if isinstance(keep, str) else "a function"
    raise errors.nothing_kept(call, name, length, keep_every)


def _no_y(body: Callable) -> Callable:
    return lambda c, x: (body(c, x)[0], None)


def _index(tree: Any, i: int) -> Any:
    return jtu.tree_map(lambda a: a[i], tree)


def run_thinned(
    loop: Loop,
    reverse: bool,
    unroll: int | bool,
    keep_every: int,
    keep: Any,
    sqrt: bool = False,
    reporter: Any = None,
) -> tuple[Any, Any]:
    """Run ``loop`` keeping only the outputs ``keep_every`` and ``keep`` ask for.

    With ``sqrt``, ``remat="sqrt"``'s nested checkpointing runs the outer scan over
    chunks, and a progress ``reporter`` ticks outside the checkpointed region
    (without ``sqrt``, the caller wraps the body with the ticks instead).
    """
    k, n = keep_every, loop.length
    outer, rest = divmod(n, k)
    body, silent = loop.body, _no_y(loop.body)

    def chunk(carry, start):
        """Steps start..start + k - 1; returns the output of the last one.

        Slicing inside the loop (not slicing xs to whole chunks up front) keeps an
        O(T) copy of xs out of the program when k does not divide T.
        """
        if k == 1:  # the outer scan slices xs itself
            return body(carry, start)
        xs = jtu.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, k), loop.xs)
        first = _index(xs, slice(0, k - 1))
        if reverse:
            carry, y = body(carry, _index(xs, k - 1))
        carry, _ = jax.lax.scan(
            silent, carry, first, length=k - 1, reverse=reverse, unroll=unroll
        )
        if not reverse:
            carry, y = body(carry, _index(xs, k - 1))
        return carry, y

    def skip_tail(carry, count):
        if not rest:
            return carry, count
        if reporter is not None:
            count = reporter.tick(count, rest)
        tail = jtu.tree_map(lambda a: a[outer * k :], loop.xs)
        carry, _ = jax.lax.scan(
            silent, carry, tail, length=rest, reverse=reverse, unroll=unroll
        )
        return carry, count

    def outer_body(state, start):
        carry, acc, started = state
        carry, y = chunk(carry, start)
        acc, out = fold(keep, acc, y, started)
        return (carry, acc, jnp.ones((), bool)), out

    count = None
    if reporter is not None:
        blocks = _remat.blocks(outer, reverse, scale=k) if outer else []
        if rest:
            blocks = [rest, *blocks] if reverse else [*blocks, rest]
        reporter.plan(blocks)
        count = reporter.init()
    if outer == 0:  # fewer than k steps: none kept
        return _none_kept(loop, keep, lambda c: skip_tail(c, count)[0])
    starts = loop.xs if k == 1 else jnp.arange(outer, dtype=jnp.int32) * k
    with jax.named_scope("scanax.keep"):
        acc0 = y_shape = None
        if keep != "all":
            y_shape = _kept_shape(chunk, loop.init, starts)
            acc0 = acc_init(keep, y_shape)
        carry = loop.init
        if reverse:
            carry, count = skip_tail(carry, count)
        state = (carry, acc0, jnp.zeros((), bool))
        outer_unroll = unroll if k == 1 else 1
        if sqrt:
            chunks = Loop(outer_body, state, starts, outer)
            state, ys, count = _remat.run_sqrt(
                chunks, reverse, outer_unroll, reporter, count, scale=k
            )
        else:
            state, ys = jax.lax.scan(
                outer_body,
                state,
                starts,
                length=outer,
                reverse=reverse,
                unroll=outer_unroll,
            )
        carry, acc, _ = state
        if not reverse:
            carry, count = skip_tail(carry, count)
        if keep == "all":
            return carry, ys
        if keep == "mean":
            acc = jtu.tree_map(lambda a: a / outer, acc)
        if keep in ("sum", "mean"):  # back from the wider accumulator
            acc = jtu.tree_map(
                lambda a, s: a.astype(reduced_dtype(keep, s)), acc, y_shape
            )
        return carry, acc


def _none_kept(loop: Loop, keep: Any, skip_tail: Callable) -> tuple[Any, Any]:
    x0 = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), loop.xs)
    y_shape = jax.eval_shape(loop.body, loop.init, x0)[1]
    if keep == "all":
        out = jtu.tree_map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_shape)
    else:  # "sum" (the others need a kept output: checked before)
        out = jtu.tree_map(
            lambda s: jnp.zeros(s.shape, reduced_dtype(keep, s)), y_shape
        )
    return skip_tail(loop.init), out


def _kept_shape(chunk: Callable, init: Any, starts: Any) -> Any:
    x0 = jtu.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), starts)
    return jax.eval_shape(chunk, init, x0)[1]


def acc_init(keep: Any, y_shape: Any) -> Any:
    """The accumulator's start. Sums run in ``jnp.sum``'s dtype, widened to float32
    for 16-bit floats (a bfloat16 running sum of ones stops at 256); the result is
    cast back to ``jnp.sum``'s (``jnp.mean``'s) dtype at the end."""
    if keep == "all":
        return None
    if keep in ("sum", "mean"):

        def zero(s):
            dtype = reduced_dtype("sum", s)
            if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
                dtype = jnp.float32
            return jnp.zeros(s.shape, dtype)

        return jtu.tree_map(zero, y_shape)
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), y_shape)


def reduced_dtype(keep: str, s: Any) -> Any:
    """The dtype of ``jnp.sum`` (``jnp.mean``) of outputs like ``s``."""
    reduce = jnp.mean if keep == "mean" else jnp.sum
    return jax.eval_shape(reduce, jax.ShapeDtypeStruct((1,), s.dtype)).dtype


def fold(keep: Any, acc: Any, y: Any, started: jax.Array) -> tuple[Any, Any]:
    if keep == "all":
        return acc, y
    if keep == "last":
        return jtu.tree_map(lambda a, b: jnp.asarray(b, a.dtype), acc, y), None
    if keep in ("sum", "mean"):
        return jtu.tree_map(
            lambda a, b: a + jnp.asarray(b).astype(a.dtype), acc, y
        ), None

    def fold_leaf(a, b):
        b = jnp.asarray(b, a.dtype)
        out = jax.eval_shape(keep, a, b)
        if getattr(out, "shape", None) != a.shape or out.dtype != a.dtype:
            raise errors.keep_fn_output(out, a)
        return jax.lax.cond(started, keep, lambda _, b_: b_, a, b)

    return jtu.tree_map(fold_leaf, acc, y), None
