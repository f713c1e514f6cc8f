"""What ``scanax.fit`` compiles: the chunk program (a ``lax.while_loop`` of steps)
and its cache by fingerprint, and the pieces of a step it is built from (tracing
once, finiteness, per-step keys, the state's dtypes)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .. import _backend, _conv_layout, _fingerprint, _progress
from .._errors import fit as errors
from . import scalars as _scalars

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
        self.cached = False  # (kept in ``PROGRAMS``: ``program``)
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

    @property
    def k(self) -> int:
        """The steps per chunk of its plan: 1 until the step is first traced,
        and on CPU."""
        plan = getattr(self.chunks, "plan", None)
        return 1 if plan is None else plan.k

    def executable(self, args: tuple) -> Callable:
        """The compiled program for arguments like ``args``: one already compiled
        for the same lowered program (by any earlier ``fit``) if there is one."""
        signature = self.signature(args)
        exe = self.executables.get(signature)
        if exe is None:
            began = time.perf_counter()
            lowered = self.jitted.trace(*args).lower()
            exe, seconds, self.digest = compiled(lowered, signature, began)
            self.compile_seconds = max(self.compile_seconds, seconds)
            self.executables[signature] = exe
        return exe

    def call(self, *args: Any) -> Any:
        """The program run on ``args`` (``evaluate``, ``predict``): through
        ``jax.jit``'s dispatch when the program is cached (the fastest per
        call); else as ``executable`` compiles it, once per lowered program
        (a function without a fingerprint is traced again at every call)."""
        if self.cached:
            return self.jitted(*args)
        return self.executable(args)(*args)

    def signature(self, args: tuple) -> tuple:
        """What a compiled program is specific to: the arguments' structure,
        shapes, dtypes and placements."""
        leaves, treedef = jtu.tree_flatten(args)
        return (treedef, *(_leaf_signature(x) for x in leaves))


def compiled(lowered: Any, signature: Any, began: float) -> tuple[Any, float, str]:
    """``lowered`` compiled, or the executable that any earlier ``fit``
    compiled for the same lowered program and argument ``signature``
    (``EXECUTABLES``; never for host callbacks, functions the text cannot
    show, unless every one is a progress report: ``_progress.tick_newest``'s
    one function, the same in every program); with the seconds it took since
    ``began`` (for one found: what its first trace and compile took), and the
    hash of the program's text."""
    text = lowered.as_text()
    digest = hashlib.sha256(text.encode())
    if calls_the_host(text) and not _only_progress(lowered):
        return lowered.compile(), time.perf_counter() - began, digest.hexdigest()
    key = (digest.digest(), signature)
    found = EXECUTABLES.get(key)
    if found is None:
        found = EXECUTABLES[key] = (lowered.compile(), time.perf_counter() - began)
        while len(EXECUTABLES) > _CACHE_SIZE:
            EXECUTABLES.popitem(last=False)
    return (*found, digest.hexdigest())


# How a lowered program calls the host: a custom call naming a Python callback
# (CPU, GPU) or host sends and receives (a TPU's callbacks lower to those, with
# no name that says "callback": measured, 2026-12-06).
_HOST_MARKS = ("callback", "is_host_transfer", "_xla_host_transfer")


_LOC = re.compile(r'^(#loc\d*) = loc\("([^"]*)"(?:\((#loc\d*)\))?', re.M)


def _only_progress(lowered: Any) -> bool:
    """Whether every host callback of ``lowered`` is a progress report: a
    Python callback's custom call (CPU, GPU) whose location is inside
    ``_progress.tick_newest``'s named scope. Not for a TPU's host sends and
    receives (their text is not read so: never shared)."""
    text = lowered.as_text(debug_info=True)
    if any(mark in text for mark in _HOST_MARKS[1:]):
        return False
    names = {m[1]: (m[2], m[3]) for m in _LOC.finditer(text)}
    sites = re.findall(r"custom_call @\w*callback\(.* loc\((#loc\d*)\)$", text, re.M)
    if not sites or len(sites) != text.count("callback("):
        return False

    def scoped(loc: str) -> bool:
        for _ in range(64):  # (a location's chain of names, innermost first)
            name, parent = names.get(loc, ("", None))
            if _progress.TICK_SCOPE in name.split("/"):
                return True
            if parent is None:
                return False
            loc = parent
        return False

    return all(scoped(loc) for loc in sites)


def calls_the_host(text: str) -> bool:
    """Whether a lowered program's text runs a host callback: its executable
    holds that Python function, which the text does not show, so it is never
    shared with another program of the same text."""
    return any(mark in text for mark in _HOST_MARKS)


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)
    return (np.shape(x), np.result_type(x), type(x))


def program(identity: tuple | None, build: Callable[[], Callable]) -> Program:
    """The chunk program for a structure, from the cache when an earlier ``fit``
    had the same one; else ``build()``'s chunk function. ``identity``: what the
    program depends on, by fingerprint where there is one (a rebuilt
    ``optax.adam(1e-3)`` or a re-defined ``loss_fn`` with the same code is the
    same), with JAX's trace context added; None: not cached (``identity``)."""
    cache_key = None
    if identity is not None:
        parts = (_fingerprint.trace_context(), _backend.platform(), *identity)
        # (an unhashable static part: compiled for this call only)
        with contextlib.suppress(TypeError):
            cache_key = _Key(parts)
    found = None if cache_key is None else PROGRAMS.get(cache_key)
    if found is not None:  # (one lookup: comparing keys is the costly part)
        return found
    program = Program(build())
    if cache_key is not None:
        PROGRAMS[cache_key] = program
        program.cached = True
        while len(PROGRAMS) > _CACHE_SIZE:
            PROGRAMS.popitem(last=False)
    return program


def identity(fingerprint: Any, loss_fn: Callable, *rest: Any) -> tuple | None:
    """Cache-key parts: ``loss_fn``'s and the model's (with its optimizer's)
    fingerprints, then ``rest`` (functions in it by ``_fingerprint.key``).
    None where one has no fingerprint: what it reads (an NNX model or an
    object it closes over, one a model's method or an optax schedule reads)
    may change in place, so each call traces its program again, reading the
    current values, and compiles only if the lowered program differs
    (``Program.executable``)."""
    model = _fingerprint.UNKNOWN if fingerprint is None else fingerprint
    parts = (_fingerprint.key(loss_fn), model, *rest)
    return parts if _fingerprint.cacheable(parts) else None


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


class Carry(NamedTuple):
    """The training state between calls (a population's: a member axis
    first): the state's leaves, stopped (by a non-finite step), the early-stop
    carry."""

    leaves: list
    stopped: Any
    extra: Any


class Report(NamedTuple):
    """What the host reads of a compiled call (per member for a population)."""

    applied: Any  # steps applied
    ran: Any  # steps the loop ran
    stopped: Any  # stopped by a non-finite step (a population: or before)
    ended: Any  # stopped by the early-stop rule
    # one model: no element of its parameters that was finite at the call's
    # start is non-finite at its end (``intact``: a step's non-finite gradients
    # were marked there, ``marked``)
    intact: Any = None

    def packed(self) -> Any:
        """Inside the call: the report as one int32 array, ``[field, *members]``
        (``ran`` broadcast), which the host reads in one transfer. A transfer
        per field cost 0.07 ms each on a TPU v5e (six: 0.4 ms a call)."""
        fields = [jnp.asarray(x) for x in self if x is not None]
        shape = jnp.broadcast_shapes(*(x.shape for x in fields))
        return jnp.stack([jnp.broadcast_to(x.astype(jnp.int32), shape) for x in fields])

    @classmethod
    def read(cls, packed: Any) -> Report:
        """On the host: the ``Report`` of a ``packed()`` one read from the device
        (``ran``: one number)."""
        applied, ran, *flags = np.asarray(packed)
        return cls(applied, ran.max(), *(f.astype(bool) for f in flags))


class Out(NamedTuple):
    """A compiled call's outputs."""

    leaves: list
    stopped: Any  # the next call's ``Chunk.stopped``
    report: Any  # ``Report.packed()``
    bufs: Any  # per-step outputs, ``[length, ...]`` ({"loss", "metrics", ...})
    extra: Any  # the early-stop carry


def outputs(loss: Any, metrics: dict) -> dict:
    """A step's outputs for the buffers: ``{"loss", "metrics"}``."""
    return {"loss": loss, "metrics": dict(metrics)}


def trace_once(fn: Callable, *args: Any) -> tuple[Callable, Any]:
    """``fn`` traced once, for arguments like ``args``: a function that replays
    its equations, and the shapes of its output. The loop needs the shapes of a
    step's outputs before the loop (its buffers) and the step inside it; tracing
    the step twice (``eval_shape``, then the loop body) made a model's trace, the
    Python part of the first call, about a third longer. Values ``fn`` closes
    over (the call's tracers) are kept as the replay's constants. On CPU, its
    convolutions are replayed in the layout XLA runs fast inside a loop body
    (``_conv_layout``); a step without convolutions replays as traced.

    The replay carries ``jaxpr`` (what was traced: its inputs are ``args``'
    leaves, the data it closes over are its constants, so that ``chunk_length``
    reads a step's own inputs). A step traced by ``jax.jit`` and called as one
    equation its trace cache answers traced the loop 6 ms faster on CPU, but
    made the first call no faster on a TPU v5e (fresh processes: 883-967 ms
    against 817-945 replayed, docs/compile.md): one path for every backend."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree = jtu.tree_structure(shapes)

    def replay(*args: Any) -> Any:
        flat = _conv_layout.replay(closed, *jtu.tree_leaves(args))
        return jtu.tree_unflatten(out_tree, flat)

    replay.jaxpr = closed.jaxpr
    return replay, shapes


def marked(new: list, trained: list[int], grads: Any) -> tuple[list, list]:
    """A step's new state with its non-finite gradients marked, and the
    gradient leaves left to test each step (``finite``).

    Where the gradients' leaves match the trained parameters (``trained``:
    their positions in ``new``) one to one in shape, each parameter is NaN
    wherever its gradient is not finite: an elementwise select that XLA fuses
    into the update, where a finite test is a reduction per leaf every step
    (on a TPU v5e that reduction cost 1.29-1.35x a step of a small MLP, the
    marks 1.02-1.06x). ``intact`` then finds a bad step once per call, and
    the host replays the call to find which (``_fit_solo``). Otherwise (a
    feature that reports its own gradients, as float16's loss scale does)
    ``new`` is unchanged and every gradient leaf is tested each step."""
    gs = [g for g in jtu.tree_leaves(grads) if g.size]
    at = [i for i in trained if new[i].size]
    inexact = all(jnp.issubdtype(g.dtype, jnp.inexact) for g in gs)
    if not inexact or [g.shape for g in gs] != [new[i].shape for i in at]:
        return new, gs
    out = list(new)
    for g, i in zip(gs, at):  # (lax's primitives: a first call traces less)
        ok = jnp.isfinite(g) if jnp.iscomplexobj(g) else jax.lax.is_finite(g)
        out[i] = jax.lax.select(ok, out[i], jax.lax.full_like(out[i], jnp.nan))
    return out, []


def intact(before: list, after: list) -> Any:
    """Whether no element of ``before`` (a call's parameters at its start)
    that was finite is non-finite in ``after`` (at its end): a reduction per
    leaf, once per call. An element non-finite from the start (a parameter
    the loss does not use) is not a bad step's."""
    lax = jax.lax  # (its primitives: a first call traces less than jnp's)
    ok = lax.full((), True)
    for b, a in zip(before, after):
        if a.size:
            isfinite = jnp.isfinite if jnp.iscomplexobj(a) else lax.is_finite
            lost = lax.bitwise_and(isfinite(b), lax.bitwise_not(isfinite(a)))
            any_lost = lax.reduce_or(lost, tuple(range(a.ndim)))
            ok = lax.bitwise_and(ok, lax.bitwise_not(any_lost))
    return ok


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


def false() -> Any:
    """A device ``False``, kept (``_scalars``; ``jnp.array(False)`` compiles a
    program, ~20 ms): a call's ``stopped`` before the first."""
    return _scalars.device_scalar(np.False_)
