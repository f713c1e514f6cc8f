"""What ``scanax.fit`` compiles: the chunk program (a ``lax.while_loop`` of steps)
and its cache by fingerprint, and the pieces of a step it is built from (tracing
once, finiteness, per-step keys, the state's dtypes)."""

from __future__ import annotations

import abc
import collections
import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import _conv_layout, _fingerprint, _progress, _rollout
from ._errors import fit as errors

_CALL = errors.CALL
_CACHE_SIZE = 32

# Chunk programs (oldest dropped first), keyed on fingerprints of (loss_fn, model
# and optimizer structure, data layout, length): a second ``fit`` of a
# same-structured model with the same loss code reuses them, even when every
# object was rebuilt.
PROGRAMS: collections.OrderedDict = collections.OrderedDict()
# Compiled executables keyed on their lowered program, with the seconds their
# tracing and compile took: what a new structure that traces to an already
# compiled program (a re-defined model class) reuses.
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
        self.chunks = fn  # (a ``Chunks``: its pieces make the stepwise programs)
        self.jitted = jax.jit(fn)
        self.seconds_per_step: float | None = None
        self.executables: dict = {}
        self.stepwise: dict = {}  # ``_fit_stepwise``'s, by argument signature
        # ``execution="auto"``'s measured choice for this program, once made
        # (``_fit_schedule.Execution``), and the fused program's text's hash
        # (the choice's key on disk)
        self.choice: str | None = None
        self.digest: str | None = None
        # the longest this program took to trace and compile (by this fit or
        # the one that compiled it first): what auto's trial of the stepwise
        # programs is expected to cost, also when a later call finds it compiled
        self.compile_seconds = 0.0

    def executable(self, args: tuple) -> Callable:
        """The compiled program for arguments like ``args``: one already compiled
        for the same lowered program (by any earlier ``fit``) if there is one."""
        signature = self.signature(args)
        exe = self.executables.get(signature)
        if exe is None:
            began = time.perf_counter()
            lowered = self.jitted.trace(*args).lower()
            text = lowered.as_text()
            self.digest = hashlib.sha256(text.encode()).hexdigest()
            if "callback" in text:  # host callbacks: functions the text cannot show
                exe, seconds = lowered.compile(), None
            else:
                key = (hashlib.sha256(text.encode()).digest(), signature)
                exe, seconds = EXECUTABLES.get(key, (None, None))
                if exe is None:
                    exe = lowered.compile()
                    EXECUTABLES[key] = (exe, time.perf_counter() - began)
                    while len(EXECUTABLES) > _CACHE_SIZE:
                        EXECUTABLES.popitem(last=False)
            seconds = time.perf_counter() - began if seconds is None else seconds
            self.compile_seconds = max(self.compile_seconds, seconds)
            self.executables[signature] = exe
        return exe

    def signature(self, args: tuple) -> tuple:
        """What a compiled program is specific to: the arguments' structure,
        shapes, dtypes and placements."""
        leaves, treedef = jtu.tree_flatten(args)
        return (treedef, *(_leaf_signature(x) for x in leaves))


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


class Chunk(NamedTuple):
    """A compiled call's arguments (a population's with a member axis first)."""

    leaves: list  # the training state
    stopped: Any  # bool: stopped before the call (per member)
    start: Any  # int32: the global step of the call's first step
    count: Any  # int32: the steps to run (per member)
    every: Any  # int32: steps between in-loop progress reports
    data: Any  # array data (None for host batches)
    key: Any  # fit's key (the members' keys)
    xs: Any  # the call's example orders, or its stacked host batches
    hp: Any  # the members' hyperparameters, else None
    aux: Any  # {"eval": eval arrays, "stop": early-stop carry}, or None


class Report(NamedTuple):
    """What the host reads of a compiled call (per member for a population)."""

    applied: Any  # steps applied
    ran: Any  # steps the loop ran
    stopped: Any  # stopped by a non-finite step (a population: or before)
    ended: Any  # stopped by the early-stop rule
    loss_ok: Any = None  # one model: the last step run's loss was finite
    grads_ok: Any = None  # and its gradients


class Out(NamedTuple):
    """A compiled call's outputs."""

    leaves: list
    stopped: Any  # the next call's ``Chunk.stopped``
    report: Report
    bufs: Any  # per-step outputs, ``[length, ...]`` ({"loss", "metrics", ...})
    extra: Any  # the early-stop carry


class Lanes(abc.ABC):
    """How a call's steps advance the state: one model (``Solo``) or a
    population's members side by side (``_fit_population.Members``). The loop
    around them (``build_chunk``) is the same."""

    @abc.abstractmethod
    def begin(self, c: Chunk) -> tuple[Any, Any]:
        """``(env, lane)``: values fixed for the call (computed once, outside
        the loop) and the lanes' own carry."""

    @abc.abstractmethod
    def step(self, c: Chunk, env: Any, carry: tuple, perm: Any, t: Any, i: Any):
        """One step: ``(leaves, stopped, extra, lane)`` after it, and its
        outputs for the buffers. ``carry`` is ``(leaves, stopped, extra,
        lane)``."""

    @abc.abstractmethod
    def running(self, c: Chunk, i: Any, stopped: Any, extra: Any, lane: Any) -> Any:
        """Whether the loop takes step ``i``."""

    @abc.abstractmethod
    def finish(self, c: Chunk, i: Any, carry: tuple, bufs: Any) -> Out:
        """The call's outputs after ``i`` steps ran."""


class Solo(Lanes):
    """One model: a step stops the loop when its loss or gradients are not
    finite (it is applied; the host recomputes the call's good steps, see
    ``build_chunk``); with ``checks`` (``_fit_checks.Checks``), evaluation, the
    early-stop rule (which may end the loop too) and the plateau rule after
    each step."""

    def __init__(self, step, sampler, place, shardings, takes_key, checks, accumulate):
        self.fn, self.sampler, self.place = step, sampler, place
        self.shardings, self.takes_key = shardings, takes_key
        self.checks, self.accumulate = checks, accumulate

    def begin(self, c: Chunk) -> tuple[Any, Any]:
        root = jr.split(c.key)[1] if self.takes_key else None
        # (loss_ok, grads_ok) of the last step run: the bad one, if any; early
        return root, ((jnp.array(True), jnp.array(True)), jnp.array(False))

    def step(self, c, env, carry, perm, t, i):
        leaves, _, extra, _ = carry
        batch = self.sampler.batch(perm, c.data, c.xs, t, i)
        batch = self.place.constrain_batch(batch, 1 if self.accumulate > 1 else 0)
        key_t = step_key(env, t, self.accumulate) if self.takes_key else None
        leaves, loss, metrics, grads = self.fn(leaves, batch, key_t, c.hp)
        loss_ok, grads_ok = finite(loss, grads)
        out = outputs(loss, metrics)
        early = jnp.array(False)
        if self.checks is not None:
            # (fit's key, or a placeholder: an eval_fn may take a key when
            # loss_fn does not)
            eval_key = jr.fold_in(jr.split(c.key)[0], t)
            checked = self.checks.run(
                t + 1, leaves, out, loss_ok & grads_ok, c.aux["eval"], eval_key,
                c.hp, extra,
            )  # fmt: skip
            leaves, extra, early = checked.leaves, checked.carry, checked.stop
            out = {**out, "val": checked.val, "evaluated": checked.due}
        stop = ~(loss_ok & grads_ok)
        return (leaves, stop, extra, ((loss_ok, grads_ok), early & ~stop)), out

    def running(self, c, i, stopped, extra, lane):
        return (i < c.count) & ~stopped & ~lane[1]

    def finish(self, c, i, carry, bufs):
        leaves, stopped, extra, ((loss_ok, grads_ok), early) = carry
        applied = jnp.where(stopped & ~c.stopped, i - 1, i)
        if self.shardings is not None:  # the state keeps its placement
            leaves = [
                jax.lax.with_sharding_constraint(x, s)
                for x, s in zip(leaves, self.shardings)
            ]
        report = Report(applied, i, stopped, early, loss_ok, grads_ok)
        # A stop by the rule also stops the next call (already dispatched).
        return Out(leaves, stopped | early, report, bufs, extra)


class Chunks:
    """A call's steps, as ``lanes`` take them: one body for the two ways a call
    runs. ``fused(*Chunk)``: up to ``count`` steps from global step ``start`` in
    one ``lax.while_loop`` (``execution="fused"``); ``begin``/``advance``/``close``
    : the same steps as programs of their own, dispatched one step at a time by
    the host (``execution="stepwise"``, ``_fit_stepwise``). Both return ``Out``.

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
    One model's non-finite step is applied and the loop stops after it; the host
    then recomputes the good steps of that call from the call's input (the same
    program on the same inputs: bit-identical). Keeping the previous state at
    every step instead (a select per leaf) made small models ~2x slower on CPU.

    The loop's state is ``(i, carry, perm, bufs)``: steps taken, the lanes'
    carry ``(leaves, stopped, extra, lane)``, the sampler's order and the
    per-step buffers.
    """

    def __init__(self, lanes: Lanes, sampler: Any, length: int, ticks: bool):
        self.lanes, self.sampler = lanes, sampler
        self.length, self.ticks = length, ticks

    def __call__(self, *args: Any) -> Out:
        return self.fused(*args)

    def fused(self, *args: Any) -> Out:
        c = Chunk(*args)
        with jax.named_scope(_CALL):
            env, loop, one = self._open(c)
            i, carry, _, bufs = self._loop(c, one, loop)
            return self.lanes.finish(c, i, carry, bufs)

    def begin(self, c: Chunk) -> tuple[Any, tuple]:
        """``(env, loop)`` before the first step."""
        with jax.named_scope(_CALL):
            env, loop, _ = self._open(c)
            return env, loop

    def advance(self, c: Chunk, env: Any, loop: tuple) -> tuple:
        """The loop's state after its next step, or as it is when the loop would
        have ended: the fused loop bounded to one iteration (the host dispatches
        ``max(count)`` of them without reading the device, and XLA compiles the
        step as the fused loop's body). ``c.leaves`` is unused (None)."""
        with jax.named_scope(_CALL):
            i, carry, perm, _ = loop
            one, _ = self._traced(c, env, carry, perm)
            return self._loop(c, one, loop, until=i + 1)

    def _loop(self, c: Chunk, one: Callable, loop: tuple, until: Any = None) -> tuple:
        """The loop: steps while the lanes run (and, ``until``, before step
        ``until``: the stepwise call's one step)."""

        def more(loop: tuple) -> Any:
            running = self.running(c, loop)
            return running if until is None else running & (loop[0] < until)

        return jax.lax.while_loop(more, lambda loop: self._body(c, one, loop), loop)

    def close(self, c: Chunk, loop: tuple) -> Out:
        """The call's outputs after the loop ``loop``."""
        with jax.named_scope(_CALL):
            i, carry, _, bufs = loop
            return self.lanes.finish(c, i, carry, bufs)

    def _traced(self, c: Chunk, env: Any, carry: tuple, perm: Any) -> tuple:
        def one(carry, perm, t, i):
            return self.lanes.step(c, env, carry, perm, t, i)

        # (traced once: the buffers' shapes, and the loop's step)
        return trace_once(one, carry, perm, c.start, jnp.int32(0))

    def _open(self, c: Chunk) -> tuple[Any, tuple, Callable]:
        perm = self.sampler.first(c.key, c.start)
        extra = None if c.aux is None else c.aux["stop"]
        env, lane = self.lanes.begin(c)
        carry = (c.leaves, c.stopped, extra, lane)
        one, shapes = self._traced(c, env, carry, perm)
        bufs = jtu.tree_map(
            lambda s: jnp.zeros((self.length, *s.shape), s.dtype), shapes[1]
        )
        return env, (jnp.int32(0), carry, perm, bufs), one

    def running(self, c: Chunk, loop: tuple) -> Any:
        i, (_, stopped, extra, lane), _, _ = loop
        return self.lanes.running(c, i, stopped, extra, lane)

    def _body(self, c: Chunk, one: Callable, loop: tuple) -> tuple:
        i, carry, perm, bufs = loop
        t = c.start + i
        perm = self.sampler.advance(perm, c.key, t)
        carry, out = one(carry, perm, t, i)
        bufs = jtu.tree_map(
            lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0), bufs, out
        )
        if self.ticks:
            _progress.tick_newest((t + 1) % c.every == 0, t + 1, out["loss"])
        return i + 1, carry, perm, bufs


def build_chunk(lanes: Lanes, sampler: Any, length: int, ticks: bool) -> Chunks:
    """The steps of a call as ``lanes`` take them (``Chunks``)."""
    return Chunks(lanes, sampler, length, ticks)


def outputs(loss: Any, metrics: dict) -> dict:
    """A step's outputs for the buffers: ``{"loss", "metrics"}``, and a
    rollout's collection (``"collected"``: whether the step collected, and
    ``"rollout"``: its metrics) where the step made its batch."""
    metrics = dict(metrics)
    rollout = metrics.pop(_rollout.METRICS, None)
    out = {"loss": loss, "metrics": metrics}
    if rollout is not None:
        out["collected"], out["rollout"] = rollout
    return out


def trace_once(fn: Callable, *args: Any) -> tuple[Callable, Any]:
    """``fn`` traced once, for arguments like ``args``: a function that replays
    its equations, and the shapes of its output. The loop needs the shapes of a
    step's outputs before the loop (its buffers) and the step inside it; tracing
    the step twice (``eval_shape``, then the loop body) made a model's trace, the
    Python part of the first call, about a third longer. Values ``fn`` closes
    over (the call's tracers) are kept as the replay's constants. On CPU, its
    convolutions are replayed in the layout XLA runs fast inside a loop body
    (``_conv_layout``); a step without convolutions replays as traced."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jtu.tree_structure(shapes)

    def replay(*args: Any) -> Any:
        flat = _conv_layout.replay(closed, *jtu.tree_leaves(args))
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
