"""What ``scanax.fit`` compiles: the chunk program (a ``lax.while_loop`` of steps)
and its cache by fingerprint, and the pieces of a step it is built from (tracing
once, finiteness, per-step keys, the state's dtypes)."""

from __future__ import annotations

import collections
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import _fingerprint, _mesh, _progress
from ._errors import fit as errors

_CALL = errors.CALL
_CACHE_SIZE = 32

# Chunk programs (oldest dropped first), keyed on fingerprints of (loss_fn, model
# and optimizer structure, data layout, length): a second ``fit`` of a
# same-structured model with the same loss code reuses them, even when every
# object was rebuilt.
PROGRAMS: collections.OrderedDict = collections.OrderedDict()
# Compiled executables keyed on their lowered program: what a new structure that
# traces to an already compiled program (a re-defined model class) reuses.
EXECUTABLES: collections.OrderedDict = collections.OrderedDict()


# ---------------------------------------------------------------------------- compile


class _Key:
    """A cache key hashed once (hashing a fingerprint takes about a millisecond)."""

    def __init__(self, parts: tuple):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Key) and (
            self is other or (self.hash == other.hash and self.parts == other.parts)
        )


class Program:
    """The chunk function of one structure: jitted, compiled once per argument
    signature, and the time per step it last ran at (to size the calls of the
    next ``fit`` with it from the start)."""

    def __init__(self, fn: Callable):
        self.jitted = jax.jit(fn)
        self.seconds_per_step: float | None = None
        self.executables: dict = {}

    def executable(self, args: tuple) -> Callable:
        """The compiled program for arguments like ``args``: one already compiled
        for the same lowered program (by any earlier ``fit``) if there is one."""
        leaves, treedef = jtu.tree_flatten(args)
        signature = (treedef, *(_leaf_signature(x) for x in leaves))
        exe = self.executables.get(signature)
        if exe is None:
            lowered = self.jitted.trace(*args).lower()
            text = lowered.as_text()
            if "callback" in text:  # host callbacks: functions the text cannot show
                exe = lowered.compile()
            else:
                key = (hashlib.sha256(text.encode()).digest(), signature)
                exe = EXECUTABLES.get(key)
                if exe is None:
                    exe = EXECUTABLES[key] = lowered.compile()
                    while len(EXECUTABLES) > _CACHE_SIZE:
                        EXECUTABLES.popitem(last=False)
            self.executables[signature] = exe
        return exe


def _trace_context() -> Any:
    """The JAX configuration that ``jax.jit`` keys its caches on (matmul
    precision, PRNG implementation...): a program traced under other settings is
    another program."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - another JAX: every setting counts
        return tuple(sorted((k, repr(v)) for k, v in jax.config.values.items()))
    return config.trace_context()


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
    return (np.shape(x), np.result_type(x), type(x))


def program(identity: tuple, build: Callable[[], Callable]) -> Program:
    """The chunk program for a structure, from the cache when an earlier ``fit``
    had the same one; else ``build()``'s chunk function. ``identity``: what the
    program depends on, by fingerprint where there is one (a rebuilt
    ``optax.adam(1e-3)`` or a re-defined ``loss_fn`` with the same code is the
    same), with JAX's trace context added."""
    try:
        cache_key = _Key((_trace_context(), *identity))
    except TypeError:  # an unhashable static part: compile for this call only
        cache_key = None
    found = None if cache_key is None else PROGRAMS.get(cache_key)
    if found is not None:  # (one lookup: comparing keys is the costly part)
        return found
    program = Program(build())
    if cache_key is not None:
        PROGRAMS[cache_key] = program
        while len(PROGRAMS) > _CACHE_SIZE:
            PROGRAMS.popitem(last=False)
    return program


def identity(fingerprint: Any, fallback: Any, loss_fn: Callable, *rest: Any) -> tuple:
    """Cache-key parts: the model's and ``loss_fn``'s fingerprints (the objects
    themselves where there is none), then ``rest``."""
    loss_key = _fingerprint.of(loss_fn)
    return (
        loss_fn if loss_key is None else loss_key,
        fallback if fingerprint is None else fingerprint,
        *rest,
    )


# ---------------------------------------------------------------------------- chunk


def build_chunk(
    step: Callable,
    source: Any,
    length: int,
    mesh: Any,
    shardings: tuple | None,
    ticks: bool,
    takes_key: bool,
    checks: Any = None,
    accumulate: int = 1,
) -> Callable:
    """``chunk(leaves, stopped, start, count, every, data, key, xs, hp, aux)``: up
    to ``count`` steps of ``step(leaves, batch, key, hp)`` from global step
    ``start``, ending early at a non-finite step (``hp``: a population member's
    hyperparameters, else None). With ``checks`` (``_fit_checks.Checks``): an
    evaluation over ``aux["eval"]`` and the early-stop rule (its carry
    ``aux["stop"]``, returned updated) every ``checks.every`` steps; the loop also
    ends when the rule says stop.
    With ``ticks`` (a bar, and calls not sized automatically: host batches or a
    ``steps_per_call``), every ``every``-th global step reports to the host from
    inside the loop (``_progress.tick_newest``), so the bar moves during long
    calls. Automatically sized calls (array data) take about a quarter second
    each, so the bar moves between them: their program has no host callback,
    is the same with and without a bar, and can be stored in JAX's persistent
    compilation cache.

    A ``lax.while_loop`` rather than a scan: the number of steps per call varies
    (the automatic schedule, the last call, a NaN) without recompiling, and steps
    that do not run cost nothing. Per-step outputs go to ``length``-long buffers.
    """

    def guarded(leaves, batch, key, hp):
        """One step, and whether its loss and gradients are finite.

        A non-finite step is applied here and the loop stops after it; the host
        then recomputes the good steps of that call from the call's input (the
        same program on the same inputs: bit-identical). Keeping the previous
        state at every step instead (a select per leaf) made small models ~2x
        slower on CPU.
        """
        new, loss, metrics, grads = step(leaves, batch, key, hp)
        loss_ok, grads_ok = finite(loss, grads)
        return (
            new,
            {"loss": loss, "metrics": metrics},
            loss_ok,
            grads_ok,
        )

    def batch_at(data, xs, perm, t, i):
        batch = source.batch(perm, data, xs, t, i)
        if mesh is None:
            return batch
        return _mesh.batch_constraint(mesh, batch, 1 if accumulate > 1 else 0)

    def chunk(leaves, stopped, start, count, every, data, key, xs, hp, aux):
        with jax.named_scope(_CALL):
            perm = source.first(key, start)
            root = jr.split(key)[1] if takes_key else None

            def key_at(t):
                return step_key(root, t, accumulate) if takes_key else None

            def one(leaves, batch, t, extra):
                """A step, then (``checks``) evaluation and early stopping."""
                leaves, out, loss_ok, grads_ok = guarded(leaves, batch, key_at(t), hp)
                early = jnp.array(False)
                if checks is not None:
                    # (fit's key, or a placeholder: an eval_fn may take a key
                    # when loss_fn does not)
                    eval_key = jr.fold_in(jr.split(key)[0], t)
                    val, due, extra, early = checks.run(
                        t + 1,
                        leaves,
                        out,
                        loss_ok & grads_ok,
                        aux["eval"],
                        eval_key,
                        hp,
                        extra,
                    )
                    out = {**out, "val": val, "evaluated": due}
                return leaves, out, loss_ok, grads_ok, extra, early

            extra = None if aux is None else aux["stop"]
            first = batch_at(data, xs, perm, start, 0)
            one, shapes = trace_once(one, leaves, first, start, extra)
            out_type = shapes[1]
            # (loss_ok, grads_ok) of the last step run: the bad one, if any.
            flags = (jnp.array(True), jnp.array(True))
            bufs = jtu.tree_map(
                lambda s: jnp.zeros((length, *s.shape), s.dtype), out_type
            )

            def cond(carry):
                i, _, stopped, _, _, _, _, early = carry
                return (i < count) & ~stopped & ~early

            def body(carry):
                i, leaves, _, perm, bufs, _, extra, _ = carry
                t = start + i
                perm = source.advance(perm, key, t)
                leaves, out, loss_ok, grads_ok, extra, early = one(
                    leaves, batch_at(data, xs, perm, t, i), t, extra
                )
                bufs = jtu.tree_map(
                    lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0),
                    bufs,
                    out,
                )
                stop = ~(loss_ok & grads_ok)
                if ticks:
                    _progress.tick_newest((t + 1) % every == 0, t + 1, out["loss"])
                flags = (loss_ok, grads_ok)
                return i + 1, leaves, stop, perm, bufs, flags, extra, early & ~stop

            init = (jnp.int32(0), leaves, stopped, perm, bufs, flags, extra, False)
            i, leaves, stopped_out, _, bufs, flags, extra, early = jax.lax.while_loop(
                cond, body, (*init[:-1], jnp.array(False))
            )
            applied = jnp.where(stopped_out & ~stopped, i - 1, i)
            if shardings is not None:  # the state keeps its placement
                leaves = [
                    jax.lax.with_sharding_constraint(x, s)
                    for x, s in zip(leaves, shardings)
                ]
            # A stop by the rule also stops the next call (already dispatched).
            return leaves, stopped_out | early, (applied, *flags, early), bufs, extra

    return chunk


def trace_once(fn: Callable, *args: Any) -> tuple[Callable, Any]:
    """``fn`` traced once, for arguments like ``args``: a function that replays
    its equations, and the shapes of its output. The loop needs the shapes of a
    step's outputs before the loop (its buffers) and the step inside it; tracing
    the step twice (``eval_shape``, then the loop body) made a model's trace, the
    Python part of the first call, about a third longer. Values ``fn`` closes
    over (the call's tracers) are kept as the replay's constants."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jtu.tree_structure(shapes)

    def replay(*args: Any) -> Any:
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jtu.tree_leaves(args))
        return jtu.tree_unflatten(out_tree, flat)

    return replay, shapes


def finite(loss: Any, grads: Any) -> tuple[Any, Any]:
    """``(loss_ok, grads_ok)``. Per gradient leaf, the largest magnitude, finite
    iff every element is: one reduction and a scalar test, cheaper to compile
    than an elementwise finite test and its reduction (about 15% of a small
    model's compile)."""
    grads_ok = jnp.array(True)
    for g in jtu.tree_leaves(grads):
        if g.size:
            grads_ok = grads_ok & jnp.isfinite(jnp.max(jnp.abs(g)))
    return jnp.isfinite(loss), grads_ok


def step_key(root: Any, t: Any, accumulate: int) -> Any:
    """The key of global step ``t`` from ``root`` (``split(key)[1]``); with
    ``accumulate=k``, one per micro-batch: those of data steps ``t*k ...
    t*k+k-1``."""
    if accumulate == 1:
        return jr.fold_in(root, t)
    micro = t * accumulate + jnp.arange(accumulate, dtype=jnp.int32)
    return jax.vmap(lambda m: jr.fold_in(root, m))(micro)


@functools.cache
def false() -> Any:
    """A device ``False`` (``jnp.array(False)`` compiles a program, ~20 ms)."""
    return jax.device_put(np.False_)


def strong(leaves: list) -> list:
    """The state as the loop carries it: JAX arrays in JAX's default dtypes (a
    float64 NumPy array is float32 unless x64 is on; a Python int is int32), with
    weak types dropped (a carry must keep its type; restored checkpoints lose them).
    Checkpoints are written and checked in these types."""
    out = []
    for x in leaves:
        a = x if isinstance(x, jax.Array) else jnp.asarray(x)
        out.append(jnp.asarray(a, a.dtype) if getattr(a, "weak_type", False) else a)
    return out
