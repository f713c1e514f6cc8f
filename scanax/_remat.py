"""``remat=``: gradient checkpointing of the loop body, or of √T-step chunks.

``remat=True`` or a ``jax.checkpoint_policies`` policy checkpoints the body:
reverse mode stores only the carries (or what the policy saves) and recomputes the
rest of each step.

``remat="sqrt"`` splits the ``T`` steps into ``T // c`` chunks of ``c = ceil(√T)``
steps (plus one shorter chunk of the ``T mod c`` remaining steps) and runs an outer
scan over checkpointed inner scans. Reverse mode stores the carry at each chunk
boundary, then recomputes one chunk at a time: O(√T) carries and step residuals
in memory, for one extra forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._errors import long as errors
from ._loop import Loop


def resolve(call: str, remat: Any) -> Any:
    """``None`` (off), ``True``, ``"sqrt"`` or a policy; raises for anything else."""
    if remat is False or remat is None:
        return None
    if remat is True or remat == "sqrt":
        return remat
    if isinstance(remat, str):
        raise errors.remat_string(call, remat)
    if not callable(remat):
        raise errors.remat_type(call, remat)
    check_not_a_factory(call, remat)
    return remat


# ``jax.checkpoint_policies``' functions that make a policy (called with names
# or policies), not policies themselves: passed uncalled, JAX fails inside.
_FACTORIES = (
    "save_only_these_names",
    "save_any_names_but_these",
    "save_and_offload_only_these_names",
    "save_from_both_policies",
    "offload_dot_with_no_batch_dims",
)


def check_not_a_factory(call: str, remat: Any) -> None:
    """Refuses ``remat`` that is one of ``jax.checkpoint_policies``' policy
    factories, not called."""
    policies = jax.checkpoint_policies
    for name in _FACTORIES:
        if getattr(policies, name, None) is remat:
            raise errors.remat_factory(call, name)


def checkpoint(fn: Callable, remat: Any, prevent_cse: bool = False) -> Callable:
    """``jax.checkpoint(fn)`` for ``remat`` True (save nothing) or a policy.

    ``prevent_cse=False`` suits a function that runs inside a loop body (the loop
    already keeps XLA from merging the recomputation away); outside any loop pass
    True, as ``jax.checkpoint`` does by default.
    """
    policy = None if remat is True else remat
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def in_loop(unroll: int | bool, length: int) -> bool:
    """Whether every step of a scan of ``length`` steps unrolled ``unroll``
    times runs inside its loop, where a checkpoint needs no CSE prevention:
    not unrolled into straight-line code (``unroll=True``, or a remainder of
    ``length % unroll`` steps after the loop), and at least two trips (XLA
    removes a loop of one)."""
    k = length if unroll is True else max(1, int(unroll))
    return length >= 2 and length % k == 0 and length // k >= 2


def checkpoint_body(loop: Loop, remat: Any, unroll: int | bool = 1) -> Loop:
    """The loop with a checkpointed body (``remat`` True or a policy): with CSE
    prevention where a step may run as straight-line code (``in_loop``)."""
    prevent_cse = not in_loop(unroll, loop.length)
    body = checkpoint(loop.body, remat, prevent_cse=prevent_cse)
    return Loop(body, loop.init, loop.xs, loop.length)


def chunk_size(length: int) -> int:
    return max(1, math.isqrt(length - 1) + 1) if length > 1 else 1


def blocks(
    length: int, reverse: bool, scale: int = 1, chunk: int | None = None
) -> list[int]:
    """The steps of each chunk (``chunk`` steps, default √T), in the order they run
    (times ``scale``: the real steps per loop step, for a progress bar)."""
    c = chunk_size(length) if chunk is None else min(chunk, length)
    outer, rest = divmod(length, c)
    sizes = [c] * outer
    if rest:
        sizes = [rest, *sizes] if reverse else [*sizes, rest]
    return [s * scale for s in sizes]


def run_sqrt(
    loop: Loop,
    reverse: bool,
    unroll: int | bool,
    reporter: Any = None,
    count: Any = None,
    scale: int = 1,
) -> tuple[Any, Any, Any]:
    """Nested √T checkpointing. Returns ``(carry, ys, count)``.

    A progress ``reporter`` ticks ``count`` in the outer loop, before each chunk
    (by ``scale`` per loop step), outside the checkpointed region, so that
    recomputing a chunk in the backward pass does not report again. The caller
    plans the reports (see ``blocks``).
    """
    with jax.named_scope("scanax.remat_sqrt"):
        return run_chunks(
            loop,
            chunk_size(loop.length),
            reverse,
            unroll,
            reporter,
            count,
            scale,
            checkpoint=True,
        )


def run_chunks(
    loop: Loop,
    c: int,
    reverse: bool,
    unroll: int | bool,
    reporter: Any = None,
    count: Any = None,
    scale: int = 1,
    checkpoint: bool = False,
) -> tuple[Any, Any, Any]:
    """An outer scan over chunks of ``c`` steps (each an inner scan), then one
    shorter chunk of the remaining steps. Returns ``(carry, ys, count)``.

    With ``checkpoint``, each chunk is ``jax.checkpoint``-ed (``remat="sqrt"``).
    A ``reporter`` ticks once per chunk, outside any checkpoint: a progress bar
    then costs nothing per step (a per-step ``cond`` would).
    """
    n = loop.length
    c = min(c, n)
    outer, rest = divmod(n, c)

    def run_chunk(carry, xs, start, steps):
        # Slicing inside the loop (not slicing xs to whole chunks up front) keeps
        # O(T) copies of xs out of the program when c does not divide T.
        xs = jtu.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, steps), xs)
        return jax.lax.scan(
            loop.body, carry, xs, length=steps, reverse=reverse, unroll=unroll
        )

    def segment(state, start, steps, looped):
        carry, count = state
        if reporter is not None:
            count = reporter.tick(count, steps * scale)
        inner = lambda c_, x_, s_: run_chunk(c_, x_, s_, steps)
        if checkpoint:
            # (CSE prevention where the chunk is straight-line code: the tail,
            # or a head scan of one trip, which XLA removes)
            inner = jax.checkpoint(inner, prevent_cse=not looped)
        carry, ys = inner(carry, loop.xs, start)
        return (carry, count), ys

    def run_head(state):
        starts = jnp.arange(outer, dtype=jnp.int32) * c
        state, ys = jax.lax.scan(
            lambda s, start: segment(s, start, c, outer >= 2),
            state,
            starts,
            length=outer,
            reverse=reverse,
        )
        ys = jtu.tree_map(lambda a: a.reshape(outer * c, *a.shape[2:]), ys)
        return state, ys

    state = (loop.init, count)
    tail_start = jnp.int32(outer * c)
    if rest and reverse:
        state, ys_tail = segment(state, tail_start, rest, False)
    state, ys = run_head(state)
    if rest and not reverse:
        state, ys_tail = segment(state, tail_start, rest, False)
    if rest:
        ys = jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_tail)
    return state[0], ys, state[1]
