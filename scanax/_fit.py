"""``scanax.fit``: many optimizer steps fused into one compiled loop per call."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import (
    _checkpoint,
    _compile_cache,
    _data,
    _fingerprint,
    _mesh,
    _models,
    _progress,
)
from ._errors import fit as errors

_CALL = errors.CALL
# The wall time that the automatic schedule aims each call at (array data: calls
# grow from 8 steps to this, up to the source's compiled length).
_SECONDS_PER_CALL = 0.25
_REPORT_SECONDS = 0.1  # in-loop progress reports: about 10 a second
_CACHE_SIZE = 32

# Chunk programs (oldest dropped first), keyed on fingerprints of (loss_fn, model
# and optimizer structure, data layout, length): a second ``fit`` of a
# same-structured model with the same loss code reuses them, even when every
# object was rebuilt.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
# Compiled executables keyed on their lowered program: what a new structure that
# traces to an already compiled program (a re-defined model class) reuses.
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()


@dataclasses.dataclass
class FitResult:
    """What ``scanax.fit`` returns.

    Attributes:
        model: the trained model. NNX: the object passed in, updated in place;
            Equinox/pytree and TrainState: a new one.
        optimizer: NNX: the ``nnx.Optimizer`` passed in, updated in place; optax: the
            final optax state; TrainState: None (the state is ``model``).
        history: per-step numpy arrays, one entry per step of this call:
            ``"step"`` (the global step number: the optimizer's step count after
            that step, continuing across calls), ``"loss"`` and every metric that
            ``loss_fn`` returns.
        steps: the number of steps this result holds beyond the model passed in
            (those trained, and those restored from ``checkpoint_dir``).
    """

    model: Any
    optimizer: Any
    history: dict[str, np.ndarray]
    steps: int


def fit(
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any],
    data: Any,
    *,
    steps: int,
    batch_size: int | None = None,
    key: Any = None,
    steps_per_call: int | None = None,
    progress: bool | int | _progress.Progress = True,
    opt_state: Any = None,
    checkpoint_dir: Any = None,
    checkpoint_every: int | None = None,
    mesh: Any = None,
) -> FitResult:
    """Train ``model`` for ``steps`` more optimizer steps, fused into compiled
    loops (one ``lax.while_loop`` per call of ``steps_per_call`` steps).

    Conceptually equivalent to (NNX shown; the other kinds do the same with their
    own update)::

        start = optimizer.step  # 0 for a new optimizer
        for t in range(start, start + steps):
            batch = batch_at(data, t)  # array data: a function of t
            key_t = jax.random.fold_in(jax.random.split(key)[1], t)
            (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
                model, batch)  # or loss_fn(model, batch, key_t)
            if not all_finite(loss, grads):
                warn(...); break
            optimizer.update(model, grads)
            history.append(t + 1, loss, metrics)

    A call continues where the model's optimizer stopped: ``fit(steps=100)`` ten
    times gives exactly ``fit(steps=1000)`` once (the data order, the optimizer's
    schedule and moments, the per-step keys and the step numbers all continue).

    Compiling happens once per structure: a later call whose model, optimizer
    and ``loss_fn`` have the same structure and code (rebuilt objects, a new but
    equal ``optax.adam(1e-3)``, a re-defined ``loss_fn``), and any ``steps``,
    reuses the compiled loop; see ``docs/compile.md``.

    Arguments:
        model, optimizer: one of the supported pairs:
            ``(nnx.Module, nnx.Optimizer)``: both updated in place, starting from
            ``optimizer.step``;
            ``(Equinox module or any pytree of arrays, optax.GradientTransformation)``:
            the floating-point arrays are trained, starting from ``tx.init`` (or
            from ``opt_state``, at the step count it keeps);
            ``(flax TrainState, None)``: the state's own ``tx`` is used, starting
            from ``state.step``.
        loss_fn: ``loss_fn(model, batch)`` or ``loss_fn(model, batch, key)``
            (a fresh key per step: ``jax.random.fold_in(jax.random.split(key)[1],
            t)`` at global step ``t``), returning a scalar floating-point loss or
            ``(loss, metrics)`` with a dict of array metrics. For a TrainState it
            receives the state holding the parameters being differentiated.
        data: a pytree of arrays with a leading example axis (with ``batch_size``):
            minibatches are drawn on device, reshuffled every epoch from ``key`` (in
            order when ``key`` is None), an incomplete last batch dropped; or an
            iterable (a list, generator, data loader...) of batches, consumed in
            order; training ends early, cleanly, when it runs out. Typed PRNG key
            arrays may be leaves of either.
        steps: the number of optimizer steps to add (at most, for an iterable).
        batch_size: examples per step, for array data.
        key: a ``jax.random`` key: shuffles array data and, for a three-argument
            ``loss_fn``, gives the per-step keys.
        steps_per_call: steps run per compiled call; the progress bar, NaN check and
            checkpoints happen between calls. Results do not depend on it. Default:
            array data: sized automatically to about a quarter second per call
            (8 steps first, at most 1000); an iterable: 100 batches per call
            (fewer, rounded up to a power of two, when ``steps`` is smaller).
        progress: a tqdm bar with steps/s and the latest loss, updated between
            calls (and, for iterables or a given ``steps_per_call``, from inside
            the compiled loop). As in ``scanax.scan``: ``True``, ``False``
            (silent), an int (update every that many steps) or
            ``scanax.Progress(every=..., desc=..., ...)``.
        opt_state: for an optax pair only: the optax state to start from (the
            ``result.optimizer`` of an earlier ``fit``), to continue training exactly
            where it stopped. Default: ``tx.init`` of the model's parameters.
        checkpoint_dir, checkpoint_every: save, and resume from, checkpoints; see
            ``docs/checkpoint.md``.
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis to shard batches
            over; see ``docs/multi_device.md``.

    Returns:
        A :class:`FitResult` ``(model, optimizer, history, steps)``.

    Raises:
        TypeError: an unsupported (model, optimizer) pair, a non-scalar loss,
            ``steps`` or ``batch_size`` not an int, missing ``batch_size``,
            ``opt_state`` with a non-optax pair or unlike ``tx.init(params)``, a
            three-argument ``loss_fn`` without ``key``.
        ValueError: arrays in ``data`` with different leading sizes, a
            ``batch_size`` larger than the data, a non-positive ``steps``, a
            ``checkpoint_dir`` holding only steps past this call's end.

    A step whose loss or gradients are not finite is not applied: training stops
    there with a ``RuntimeWarning`` naming the step, and the result holds the last
    good state.
    If ``fit`` is interrupted (Ctrl-C) or fails, NNX objects hold the state after
    the last call checked to be finite, and the exception propagates.

    Example:
        >>> import jax.numpy as jnp, optax, scanax
        >>> x = jnp.arange(8.0)[:, None]
        >>> def loss_fn(params, batch):
        ...     xb, yb = batch
        ...     return jnp.mean((xb * params["w"] - yb) ** 2)
        >>> result = scanax.fit({"w": jnp.zeros(())}, optax.sgd(0.01), loss_fn,
        ...                     (x, 2 * x), steps=200, batch_size=4, progress=False)
        >>> round(float(result.model["w"]), 3), result.steps
        (2.0, 200)
    """
    steps = _data.positive_int("steps", steps)
    if not callable(loss_fn):
        raise errors.loss_fn_not_callable(loss_fn)
    takes_key = _takes_key(loss_fn)
    adapter = _models.adapt(model, optimizer, opt_state)
    source = _data.make_source(data, batch_size, key)
    if takes_key and key is None:
        raise errors.loss_key_without_key()
    if steps_per_call is not None:
        steps_per_call = _data.positive_int("steps_per_call", steps_per_call)
    length = source.length(steps, steps_per_call)
    if checkpoint_every is not None:
        if checkpoint_dir is None:
            raise errors.checkpoint_every_without_dir(checkpoint_every)
        checkpoint_every = _data.positive_int("checkpoint_every", checkpoint_every)
    if checkpoint_dir is not None:
        try:
            path = os.fspath(checkpoint_dir)
        except TypeError:
            raise errors.checkpoint_dir_type(checkpoint_dir) from None
        if os.path.exists(path) and not os.path.isdir(path):
            raise errors.checkpoint_dir_not_dir(path)
    if mesh is not None:
        _mesh.check(mesh)
        mesh = _mesh.auto(mesh)
        source.check_mesh(mesh)
    spec = _progress.resolve(_CALL, progress)
    start = adapter.start_step()
    if start is None:
        if opt_state is not None:
            warnings.warn(errors.no_step_count(), RuntimeWarning, stacklevel=2)
        start = 0
    _compile_cache.enable_from_env()

    leaves, treedef = jtu.tree_flatten(adapter.state)
    leaves = _strong(leaves)
    shardings = None
    if mesh is not None:
        shardings = tuple(_mesh.state_shardings(mesh, adapter, leaves))
        leaves = _mesh.place(leaves, shardings)
    # In-loop bar reports only where calls are not sized to a quarter second:
    # host batches, or a steps_per_call of the user's.
    ticks = spec is not None and mesh is None
    ticks = ticks and not source.sized_automatically(steps_per_call)
    program = _program(
        adapter, source, loss_fn, takes_key, length, treedef, mesh, shardings, ticks
    )
    schedule = _Schedule(
        program,
        length,
        fixed=min(length, steps_per_call or length),
        auto=source.sized_automatically(steps_per_call),
        checkpoint_every=checkpoint_every,
        bar_every=spec.every if spec is not None and not ticks else None,
    )
    how = (start, start + steps, spec, mesh, ticks)
    run = _Run(adapter, source, program, treedef, leaves, schedule, how)
    if checkpoint_dir is not None:
        run.resume(checkpoint_dir, checkpoint_every)
    return run.go()


def _takes_key(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` takes a per-step key: a third positional parameter
    without a default, or named ``key``/``rng`` (``key=None``), or ``*args``;
    more than three required, or a required keyword-only one, is an error."""
    try:
        params = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: call it with two
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 3:
        raise errors.loss_fn_arity(len(required), [p.name for p in required])
    for p in params:
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            raise errors.loss_key_keyword_only(p.name)
    if len(required) == 3:
        return True
    if len(positional) >= 3:
        return positional[2].name in ("key", "rng")
    return any(p.kind == p.VAR_POSITIONAL for p in params)


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


class _Program:
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
                exe = _EXECUTABLES.get(key)
                if exe is None:
                    exe = _EXECUTABLES[key] = lowered.compile()
                    while len(_EXECUTABLES) > _CACHE_SIZE:
                        _EXECUTABLES.popitem(last=False)
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


def _program(
    adapter: Any,
    source: Any,
    loss_fn: Callable,
    takes_key: bool,
    length: int,
    treedef: Any,
    mesh: Any,
    shardings: tuple | None,
    ticks: bool,
) -> _Program:
    """The chunk program for this structure, from the cache when an earlier
    ``fit`` had the same one: same loss code, same model structure and optimizer
    (by fingerprint: a rebuilt ``optax.adam(1e-3)`` or a re-defined ``loss_fn``
    with the same code is the same), same data layout."""
    loss_key = _fingerprint.of(loss_fn)
    static_key = adapter.fingerprint()
    parts = (
        _trace_context(),  # JAX settings that change programs, as jax.jit keys on
        loss_fn if loss_key is None else loss_key,
        adapter.static if static_key is None else static_key,
        takes_key,
        treedef,
        source.static,
        length,
        shardings,
        ticks,
    )
    try:
        cache_key = _Key(parts)
    except TypeError:  # an unhashable static part: compile for this call only
        cache_key = None
    found = None if cache_key is None else _PROGRAMS.get(cache_key)
    if found is not None:  # (one lookup: comparing keys is the costly part)
        return found
    call = loss_fn if takes_key else (lambda model, batch, key: loss_fn(model, batch))
    step = adapter.make_step(call)
    sampler = source.sampler()  # what the compiled loop needs: no data, no iterator
    program = _Program(
        _build_chunk(step, sampler, length, treedef, mesh, shardings, ticks, takes_key)
    )
    if cache_key is not None:
        _PROGRAMS[cache_key] = program
        while len(_PROGRAMS) > _CACHE_SIZE:
            _PROGRAMS.popitem(last=False)
    return program


def _build_chunk(
    step: Callable,
    source: Any,
    length: int,
    treedef: Any,
    mesh: Any,
    shardings: tuple | None,
    ticks: bool,
    takes_key: bool,
) -> Callable:
    """``chunk(leaves, stopped, start, count, every, data, key, xs)``: up to
    ``count`` steps from global step ``start``, ending early at a non-finite step.
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

    def guarded(leaves, batch, key):
        """One step, and whether its loss and gradients are finite.

        A non-finite step is applied here and the loop stops after it; the host
        then recomputes the good steps of that call from the call's input (the
        same program on the same inputs: bit-identical). Keeping the previous
        state at every step instead (a select per leaf) made small models ~2x
        slower on CPU.

        Takes and returns flat leaves: the step gets containers of its own (an NNX
        step mutates the Variables it merges).
        """
        new, loss, metrics, grads = step(
            jtu.tree_unflatten(treedef, leaves), batch, key
        )
        loss_ok = jnp.isfinite(loss)
        # Per leaf, the largest magnitude, finite iff every element is: one
        # reduction and a scalar test, cheaper to compile than an elementwise
        # finite test and its reduction (about 15% of a small model's compile).
        grads_ok = jnp.array(True)
        for g in jtu.tree_leaves(grads):
            if g.size:
                grads_ok = grads_ok & jnp.isfinite(jnp.max(jnp.abs(g)))
        return (
            jtu.tree_leaves(new),
            {"loss": loss, "metrics": metrics},
            loss_ok,
            grads_ok,
        )

    def batch_at(data, xs, perm, t, i):
        batch = source.batch(perm, data, xs, t, i)
        return batch if mesh is None else _mesh.batch_constraint(mesh, batch)

    def chunk(leaves, stopped, start, count, every, data, key, xs):
        with jax.named_scope(_CALL):
            perm = source.first(key, start)
            root = jr.split(key)[1] if takes_key else None

            def key_at(t):
                return jr.fold_in(root, t) if takes_key else None

            first = batch_at(data, xs, perm, start, 0)
            out_type = jax.eval_shape(guarded, leaves, first, key_at(start))[1]
            # (loss_ok, grads_ok) of the last step run: the bad one, if any.
            flags = (jnp.array(True), jnp.array(True))
            bufs = jtu.tree_map(
                lambda s: jnp.zeros((length, *s.shape), s.dtype), out_type
            )

            def cond(carry):
                i, _, stopped, _, _, _ = carry
                return (i < count) & ~stopped

            def body(carry):
                i, leaves, _, perm, bufs, _ = carry
                t = start + i
                perm = source.advance(perm, key, t)
                leaves, out, loss_ok, grads_ok = guarded(
                    leaves, batch_at(data, xs, perm, t, i), key_at(t)
                )
                bufs = jtu.tree_map(
                    lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0),
                    bufs,
                    out,
                )
                stop = ~(loss_ok & grads_ok)
                if ticks:
                    _progress.tick_newest((t + 1) % every == 0, t + 1, out["loss"])
                return i + 1, leaves, stop, perm, bufs, (loss_ok, grads_ok)

            i, leaves, stopped_out, _, bufs, flags = jax.lax.while_loop(
                cond, body, (jnp.int32(0), leaves, stopped, perm, bufs, flags)
            )
            applied = jnp.where(stopped_out & ~stopped, i - 1, i)
            if shardings is not None:  # the state keeps its placement
                leaves = [
                    jax.lax.with_sharding_constraint(x, s)
                    for x, s in zip(leaves, shardings)
                ]
            return leaves, stopped_out, (applied, *flags), bufs

    return chunk


@functools.cache
def _false() -> Any:
    return jnp.array(False)


def _strong(leaves: list) -> list:
    """The state as the loop carries it: JAX arrays in JAX's default dtypes (a
    float64 NumPy array is float32 unless x64 is on; a Python int is int32), with
    weak types dropped (a carry must keep its type; restored checkpoints lose them).
    Checkpoints are written and checked in these types."""
    out = []
    for x in leaves:
        a = x if isinstance(x, jax.Array) else jnp.asarray(x)
        out.append(jnp.asarray(a, a.dtype) if getattr(a, "weak_type", False) else a)
    return out


# ---------------------------------------------------------------------------- history


class _History:
    """Per-step values of one ``fit`` call, with their global step numbers."""

    def __init__(self):
        self.arrays: dict[str, list[np.ndarray]] = {"step": [], "loss": []}
        self.count = 0  # steps recorded
        self.warned = False

    def restore(self, saved: dict[str, np.ndarray], after: int, step: int) -> None:
        """The history of a checkpoint at ``step``, from step ``after + 1`` on (a
        checkpoint of an older format has no step numbers: they are counted back)."""
        saved = dict(saved)
        n = len(saved.get("loss", ()))
        steps = saved.pop("step", np.arange(step - n + 1, step + 1, dtype=np.int64))
        keep = np.asarray(steps) > after
        self.arrays = {"step": [np.asarray(steps)[keep]]}
        self.arrays.update({k: [np.asarray(v)[keep]] for k, v in saved.items()})
        self.arrays.setdefault("loss", [])
        self.count = int(keep.sum())

    def add(self, first: int, ys: dict, count: int) -> None:
        """``count`` steps from global step ``first`` (0-based; recorded 1-based,
        as the optimizer's step count after each)."""
        self.arrays["step"].append(np.arange(first + 1, first + count + 1))
        self.arrays["loss"].append(ys["loss"][:count])
        metrics = ys["metrics"]
        if set(metrics) != set(self.arrays) - {"loss", "step"}:
            self._align(metrics, count)
        for name, value in metrics.items():
            self.arrays[name].append(np.asarray(value)[:count])
        self.count += count

    def _align(self, metrics: dict, count: int) -> None:
        """Metric names differ from those of the history so far (a checkpoint of a
        ``loss_fn`` returning other metrics): NaN where a metric has no value, so
        that every history array keeps one entry per step."""
        known = set(self.arrays) - {"loss", "step"}
        new, gone = sorted(set(metrics) - known), sorted(known - set(metrics))
        if self.count and not self.warned:
            self.warned = True
            warnings.warn(
                errors.metrics_changed(self.count, new, gone),
                RuntimeWarning,
                stacklevel=2,
            )
        for name in new:
            self.arrays[name] = [np.full(self.count, np.nan, np.float32)]
        for name in gone:
            self.arrays[name].append(np.full(count, np.nan, np.float32))

    def result(self) -> dict[str, np.ndarray]:
        empty = {"step": np.zeros((0,), np.int64)}
        return {
            k: np.concatenate(v) if v else empty.get(k, np.zeros((0,), np.float32))
            for k, v in self.arrays.items()
        }


# ---------------------------------------------------------------------------- driver


class _Schedule:
    """How many steps each call runs: ``steps_per_call`` if given, else sized from
    the speed of the last call to take about ``_SECONDS_PER_CALL`` (8 steps first,
    to time them, when nothing is known yet); calls also end on checkpoint steps
    and on multiples of the progress bar's ``every``."""

    def __init__(self, program, length, fixed, auto, checkpoint_every, bar_every):
        self.program, self.length, self.auto = program, length, auto
        self.stops = [e for e in (checkpoint_every, bar_every) if e]
        known = program.seconds_per_step
        if not auto:
            self.per_call = fixed
        elif known is None:
            self.per_call = min(length, 8)
        else:
            self.per_call = self._size(known)
        self.last = None

    def want(self, start: int, end: int) -> int:
        want = min(self.per_call, end - start)
        for every in self.stops:
            want = min(want, every - start % every)
        return want

    @property
    def timing(self) -> bool:
        """Whether the next call must be timed before more are dispatched."""
        return self.auto and self.program.seconds_per_step is None

    def ran(self, steps: int, dispatched: float) -> None:
        """Size the next calls from the time the last one ran: from when it was
        dispatched (after compiling) or the previous one finished, to now."""
        if not self.auto:
            return
        now = time.perf_counter()
        began = max(dispatched, self.last or dispatched)
        per_step = max(now - began, 1e-9) / steps
        self.program.seconds_per_step = per_step
        self.per_call = self._size(per_step)
        self.last = now

    def _size(self, seconds_per_step: float) -> int:
        return max(1, min(self.length, int(_SECONDS_PER_CALL / seconds_per_step)))


class _Run:
    """One ``fit`` call: dispatch chunks, keep one in flight, collect history."""

    def __init__(self, adapter, source, program, treedef, leaves, schedule, how):
        self.adapter, self.source, self.program = adapter, source, program
        self.treedef, self.leaves, self.schedule = treedef, leaves, schedule
        self.start, self.end, self.spec, self.mesh, self.ticks = how
        self.done = self.start  # the global step reached
        self.fn = None  # the compiled chunk, for this call's argument signature
        self.ckpt = None
        self.stopped = _false()
        self.history = _History()
        self.halted = False
        self.bar = None
        self.good = leaves  # the last state checked to be finite
        self.data, self.key = source.arguments(self.mesh)

    def context(self) -> Any:
        """The mesh as context while tracing: NNX Variables with sharding
        annotations need one when the step merges them."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def resume(self, directory: Any, every: int | None) -> None:
        """Continue from the newest usable checkpoint in ``directory`` that lies
        between this call's start and end (see ``docs/checkpoint.md``)."""
        names = self.adapter.names()
        self.ckpt = _checkpoint.Checkpoints(
            directory, every, names, self.source.describe()
        )
        past = self.ckpt.steps_after(self.end)
        found = self.ckpt.restore(self.leaves, self.key, at_most=self.end)
        if past and found is None:  # nothing to resume but a longer run
            raise errors.checkpoint_past_end(
                self.ckpt.directory, past, self.start, self.end
            )
        if past and (found is None or found[0] < self.end):
            warnings.warn(
                errors.checkpoint_saves_dropped(self.ckpt.directory, past, self.end),
                RuntimeWarning,
                stacklevel=3,
            )
        if found is None or found[0] <= self.start:
            return
        step, self.leaves, self.key, history = found
        self.ckpt.last_saved = step
        self.history.restore(history, self.start, step)
        self.done = step
        self.good = self.leaves
        if step == self.end:
            warnings.warn(
                errors.checkpoint_at_end(self.ckpt.directory, step),
                RuntimeWarning,
                stacklevel=3,
            )
        self.source.skip(step - self.start)  # the batches those steps used

    def go(self) -> FitResult:
        shown: Any = contextlib.nullcontext()
        if self.spec is not None:
            self.bar = _progress.open_bar(
                self.spec,
                self.end,
                _CALL,
                desc=_CALL,
                unit="step",
                initial=self.done,
            )
            shown = _progress.showing(self.bar)
        with shown:
            result = self._go()
            if self.bar is not None and self.bar.n != self.done:
                self.bar.n = self.done  # e.g. a NaN stop: reported, not applied
                self.bar.refresh()
            return result

    def _call(self, leaves, stopped, start, count, every, xs):
        args = (
            leaves,
            stopped,
            np.int32(start),
            np.int32(count),
            np.int32(every),
            self.data,
            self.key,
            xs,
        )
        with self.context():
            if self.fn is None:
                self.fn = self.program.executable(args)
            return self.fn(*args)

    def _go(self) -> FitResult:
        pending = None
        first = self.leaves
        handed = False  # the model may hold a state not yet checked
        try:
            chunks = self.source.calls(self.done, self.end, self.schedule, self.mesh)
            nxt = next(chunks, None)
            while nxt is not None:
                start, end, xs = nxt
                inputs = (self.leaves, start, xs)
                self.leaves, self.stopped, applied, ys = self._call(
                    self.leaves,
                    self.stopped,
                    start,
                    end - start,
                    self._every(end - start),
                    xs,
                )
                # Compiling happens in the call above, running after it returns.
                inputs = (*inputs, time.perf_counter())
                if pending is not None:
                    self._collect(*pending)
                pending = (start, end, applied, ys, self.leaves, inputs)
                if self.schedule.timing:
                    # Time the first call before sizing the next ones.
                    self._collect(*pending)
                    pending = None
                if self.halted:
                    break
                # The next chunk (host batches: stacked and put on device) is
                # prepared while this one trains.
                nxt = next(chunks, None)
            if pending is not None:
                # Hand the result over while the last call runs (an NNX update
                # then overlaps it); a bad step found below replaces it.
                handed = True
                model, optimizer = self._finish(self.leaves)
                self._collect(*pending)
            if self.ckpt is not None:
                self.ckpt.save(self.done, self.leaves, self.key, self.history.result())
        except BaseException:
            # Interrupted or failed: NNX objects keep the last checked state.
            if handed or self.good is not first:
                self._finish(self.good)
            raise
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
        if not handed or self.halted:
            model, optimizer = self._finish(self.leaves)
        return FitResult(
            model, optimizer, self.history.result(), self.done - self.start
        )

    def _finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place)."""
        return self.adapter.finish(jtu.tree_unflatten(self.treedef, leaves))

    def _collect(
        self,
        start: int,
        end: int,
        applied: Any,
        ys: Any,
        leaves: list,
        inputs: tuple,
    ) -> None:
        applied, ys = jax.device_get((applied, ys))
        count, loss_ok, grads_ok = (int(a) for a in applied)
        self.schedule.ran(end - start, inputs[-1])
        self.history.add(start, ys, count)
        self.done += count
        # In-loop reports of the next call may have moved the bar ahead already: it
        # never moves back (go() sets the final count).
        if self.bar is not None and count and self.done > self.bar.n:
            self.bar.update(self.done - self.bar.n)
            self.bar.set_postfix(loss=f"{float(ys['loss'][count - 1]):.4g}")
        if not self.halted and start + count < end:
            self.halted = True
            self.leaves = self._redo(inputs, count)
            self._warn(start + count, ys["loss"][count], loss_ok, grads_ok)
        elif (
            self.ckpt is not None
            and self.ckpt.every
            and start + count == end
            and end % self.ckpt.every == 0
        ):
            self.ckpt.save(end, leaves, self.key, self.history.result())
        self.good = self.leaves if self.halted else leaves

    def _redo(self, inputs: tuple, count: int) -> list:
        """The state after the ``count`` good steps of a call that hit a bad one."""
        leaves, start, xs, _ = inputs
        out, _, applied, _ = self._call(
            leaves, _false(), start, count, count + 1, xs
        )  # count + 1: no reports
        if int(applied[0]) != count:  # the same program on the same inputs
            raise RuntimeError(
                f"{_CALL}: internal error: replaying {count} good steps applied "
                f"{int(applied[0])}. Please report this with your model and data."
            )
        return out

    def _every(self, count: int) -> int:
        """Steps between in-loop reports: ``Progress.every``, or about 10 a second
        once the speed is known, else 10 a call; more than ``count`` (none)
        without in-loop reports."""
        if not self.ticks:
            return count + 1
        if self.spec.every is not None:
            return self.spec.every
        known = self.program.seconds_per_step
        if known is None:
            return max(1, count // 10)
        return max(1, math.ceil(_REPORT_SECONDS / known))

    def _warn(self, t: int, loss: Any, loss_ok: Any, grads_ok: Any) -> None:
        warnings.warn(
            errors.nonfinite_step(
                t, loss, bool(loss_ok), bool(grads_ok), self.done - self.start
            ),
            RuntimeWarning,
            stacklevel=6,  # the user's fit(...) line
        )
