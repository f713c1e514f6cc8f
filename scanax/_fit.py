"""``scanax.fit``: many optimizer steps fused into one compiled loop per call."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _checkpoint, _data, _mesh, _models, _progress
from ._errors import fit as errors

_CALL = "scanax.fit"
# Default steps_per_call: compiled lengths, and the wall time that the automatic
# schedule aims each call at (array data: calls grow from 8 steps to this).
_MAX_STEPS_PER_CALL = {"array": 1000, "iter": 100}
_SECONDS_PER_CALL = 0.25
_REPORT_SECONDS = 0.1  # in-loop progress reports: about 10 a second
_CACHE_SIZE = 32

# Compiled chunk functions, keyed on (loss_fn, model structure, data layout, length):
# a second ``fit`` of a same-structured model with the same loss_fn reuses them.
_CHUNKS: collections.OrderedDict = collections.OrderedDict()


@dataclasses.dataclass
class FitResult:
    """What ``scanax.fit`` returns.

    Attributes:
        model: the trained model. NNX: the object passed in, updated in place;
            Equinox/pytree and TrainState: a new one.
        optimizer: NNX: the ``nnx.Optimizer`` passed in, updated in place; optax: the
            final optax state; TrainState: None (the state is ``model``).
        history: per-step numpy arrays, one entry per applied step: ``"loss"`` and
            every metric that ``loss_fn`` returns.
        steps: the number of optimizer steps applied.
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
    """Train ``model`` for ``steps`` optimizer steps, ``steps_per_call`` of them fused
    into each compiled loop (one ``lax.while_loop`` per call).

    Conceptually equivalent to (NNX shown; the other kinds do the same with their
    own update)::

        for t in range(steps):
            batch = next_batch(data, t)
            (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
                model, batch)
            if not all_finite(loss, grads):
                warn(...); break
            optimizer.update(model, grads)
            history.append(loss, metrics)

    Arguments:
        model, optimizer: one of the supported pairs:
            ``(nnx.Module, nnx.Optimizer)``: both updated in place;
            ``(Equinox module or any pytree of arrays, optax.GradientTransformation)``:
            the floating-point arrays are trained, starting from ``tx.init`` (or
            from ``opt_state``);
            ``(flax TrainState, None)``: the state's own ``tx`` is used.
        loss_fn: ``loss_fn(model, batch) -> loss`` or ``-> (loss, metrics)``, with a
            scalar floating-point loss and a dict of array metrics. For a
            TrainState it receives the state holding the parameters being
            differentiated.
        data: a pytree of arrays with a leading example axis (with ``batch_size``):
            minibatches are drawn on device, reshuffled every epoch from ``key`` (in
            order when ``key`` is None), an incomplete last batch dropped; or an
            iterable (a list, generator, data loader...) of batches, consumed in
            order; training ends early, cleanly, when it runs out.
        steps: the number of optimizer steps (at most, for an iterable).
        batch_size: examples per step, for array data.
        key: a ``jax.random`` key for shuffling array data.
        steps_per_call: steps run per compiled call; the progress bar, NaN check and
            checkpoints happen between calls. Results do not depend on it. Default:
            ``min(steps, 100)``.
        progress: a tqdm bar with steps/s and the latest loss, updated from inside
            the compiled loop and between calls. As in ``scanax.scan``: ``True``
            (about 10 updates a second), ``False`` (silent), an int (update every
            that many steps) or ``scanax.Progress(every=..., desc=..., ...)``.
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
            ``opt_state`` with a non-optax pair or unlike ``tx.init(params)``.
        ValueError: arrays in ``data`` with different leading sizes, a
            ``batch_size`` larger than the data, a non-positive ``steps``.

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
    adapter = _models.adapt(model, optimizer, opt_state)
    source = _data.make_source(data, batch_size, key)
    if steps_per_call is None:
        length = min(steps, _MAX_STEPS_PER_CALL[source.kind])
    else:
        length = min(steps, _data.positive_int("steps_per_call", steps_per_call))
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
        if source.kind == "array":
            _mesh.check_batch(mesh, source.batch_size, "batch_size")
    spec = _progress.resolve(_CALL, progress)
    run = _Run(adapter, source, loss_fn, steps, length, spec, mesh)
    run.auto = steps_per_call is None and source.kind == "array"
    if checkpoint_dir is not None:
        run.resume(checkpoint_dir, checkpoint_every)
    return run.go()


# ---------------------------------------------------------------------------- compile


class _Key:
    """A cache key hashed once (hashing an NNX GraphDef takes about a millisecond)."""

    def __init__(self, parts: tuple):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Key) and self.parts == other.parts


class _Compiled:
    """A jitted chunk function, and the time per step it last ran at (to size the
    calls of the next ``fit`` with it from the start)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.seconds_per_step: float | None = None


def _chunk_function(
    adapter: Any,
    source: Any,
    loss_fn: Callable,
    length: int,
    treedef: Any,
    mesh: Any,
    shardings: tuple | None,
    progress: bool,
):
    """The jitted ``chunk(leaves, stopped, start, count, every, data, key, xs)``,
    cached."""
    try:
        parts = (
            loss_fn,
            adapter.static,
            treedef,
            source.static,
            length,
            shardings,
            progress,
        )
        cache_key = _Key(parts)
    except TypeError:  # an unhashable static part: compile for this call only
        cache_key = None
    if cache_key is not None and cache_key in _CHUNKS:
        _CHUNKS.move_to_end(cache_key)
        return _CHUNKS[cache_key]
    step = adapter.make_step(loss_fn)
    sampler = source.sampler()  # what the compiled loop needs: no data, no iterator
    fn = _Compiled(
        jax.jit(_build_chunk(step, sampler, length, treedef, mesh, shardings, progress))
    )
    if cache_key is not None:
        _CHUNKS[cache_key] = fn
        while len(_CHUNKS) > _CACHE_SIZE:
            _CHUNKS.popitem(last=False)
    return fn


def _build_chunk(
    step: Callable,
    source: Any,
    length: int,
    treedef: Any,
    mesh: Any,
    shardings: tuple | None,
    progress: bool,
) -> Callable:
    """``chunk(leaves, stopped, start, count, every, data, key, xs)``: up to
    ``count`` steps from global step ``start``, ending early at a non-finite step.
    With ``progress``, every ``every``-th global step reports to the host from
    inside the loop (``_progress.tick_newest``), so the bar moves during long calls.

    A ``lax.while_loop`` rather than a scan: the number of steps per call varies
    (the automatic schedule, the last call, a NaN) without recompiling, and steps
    that do not run cost nothing. Per-step outputs go to ``length``-long buffers.
    """
    on_device = source is not None

    def guarded(leaves, batch):
        """One step, and whether its loss and gradients are finite.

        A non-finite step is applied here and the loop stops after it; the host
        then recomputes the good steps of that call from the call's input (the
        same program on the same inputs: bit-identical). Keeping the previous
        state at every step instead (a select per leaf) made small models ~2x
        slower on CPU.

        Takes and returns flat leaves: the step gets containers of its own (an NNX
        step mutates the Variables it merges).
        """
        new, loss, metrics, grads = step(jtu.tree_unflatten(treedef, leaves), batch)
        loss_ok = jnp.isfinite(loss)
        grads_ok = jnp.array(True)
        for g in jtu.tree_leaves(grads):
            grads_ok = grads_ok & jnp.all(jnp.isfinite(g))
        return (
            jtu.tree_leaves(new),
            {"loss": loss, "metrics": metrics},
            loss_ok,
            grads_ok,
        )

    def batch_at(data, key, xs, perm, t, i):
        if on_device:
            batch = source.batch(data, perm, t)
        else:
            batch = jtu.tree_map(
                lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs
            )
        return batch if mesh is None else _mesh.batch_constraint(mesh, batch)

    def chunk(leaves, stopped, start, count, every, data, key, xs):
        with jax.named_scope("scanax.fit"):
            perm = source.permutation(key, start) if on_device else None
            first = batch_at(data, key, xs, perm, start, 0)
            out_type = jax.eval_shape(guarded, leaves, first)[1]
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
                if on_device:
                    perm = source.next_permutation(key, t, perm)
                leaves, out, loss_ok, grads_ok = guarded(
                    leaves, batch_at(data, key, xs, perm, t, i)
                )
                bufs = jtu.tree_map(
                    lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0),
                    bufs,
                    out,
                )
                stop = ~(loss_ok & grads_ok)
                if progress:
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


# ---------------------------------------------------------------------------- driver


class _Run:
    """One ``fit`` call: dispatch chunks, keep one in flight, collect history."""

    def __init__(self, adapter, source, loss_fn, steps, length, spec, mesh):
        self.adapter, self.source, self.steps, self.length = (
            adapter,
            source,
            steps,
            length,
        )
        self.mesh = mesh
        leaves, self.treedef = jtu.tree_flatten(adapter.state)
        self.leaves = _strong(leaves)
        shardings = None
        if mesh is not None:
            shardings = tuple(_mesh.state_shardings(mesh, adapter, self.leaves))
            self.leaves = _mesh.place(self.leaves, shardings)
        self.in_loop = spec is not None and mesh is None
        self.compiled = _chunk_function(
            adapter,
            source,
            loss_fn,
            length,
            self.treedef,
            mesh,
            shardings,
            self.in_loop,
        )
        self.fn = self.compiled.fn
        self.ckpt = None
        self.auto = False  # grow steps per call towards _SECONDS_PER_CALL
        self.per_call = length
        self.last_collect = None
        self.stopped = _false()
        self.done = 0  # steps applied
        self.history: dict[str, list[np.ndarray]] = {"loss": []}
        self.halted = False
        self.warned_metrics = False
        self.spec = spec
        self.bar = None
        if source.kind == "array":
            self.data, self.key = source.data, source.key
        else:
            self.data, self.key = None, _data.unused_key()
        if mesh is None:
            self.data = jax.device_put(self.data)
        else:
            self.data, self.key = _mesh.replicate(mesh, (self.data, self.key))

    def context(self) -> Any:
        """The mesh as context while tracing: NNX Variables with sharding
        annotations need one when the step merges them."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def resume(self, directory: Any, every: int | None) -> None:
        """Continue from the newest usable checkpoint in ``directory``, if any."""
        desc = {"kind": self.source.kind}
        if self.source.kind == "array":
            desc.update(
                n=self.source.n,
                batch_size=self.source.batch_size,
                shuffle=self.source.shuffle,
            )
        names = self.adapter.names()
        self.ckpt = _checkpoint.Checkpoints(directory, every, names, desc)
        found = self.ckpt.restore(self.leaves, self.key)
        if found is None:
            return
        step, self.leaves, self.key, history = found
        self.ckpt.last_saved = step
        self.done = step
        self.history = {k: [v] for k, v in history.items()}
        if self.source.kind == "iter":
            self.source.skip(step)  # the batches those steps used

    def _chunks(self) -> Iterator[tuple[int, int, Any]]:
        """``(start, end, xs)`` for each call; host batches are put on device here,
        which for the next chunk overlaps the previous chunk's training."""
        start = self.done
        if self.auto:
            known = self.compiled.seconds_per_step
            if known is None:
                self.per_call = min(self.length, 8)
            else:
                self.per_call = self._size(known)
        while start < self.steps and not self.halted:
            want = min(self.per_call, self.steps - start)
            every = self.ckpt.every if self.ckpt is not None else None
            if every:  # calls end on checkpoint steps
                want = min(want, every - start % every)
            if self.source.kind == "array":
                yield start, start + want, None
                start += want
                continue
            taken = self.source.take(want, self.length)
            if taken is None:
                return
            xs, count = taken
            if self.mesh is None:
                xs = jax.device_put(xs)
            else:
                xs = _mesh.put_chunk(self.mesh, xs)
            yield start, start + count, xs
            start += count

    def go(self) -> FitResult:
        shown: Any = contextlib.nullcontext()
        if self.spec is not None:
            self.bar = _progress.open_bar(
                self.spec,
                self.steps,
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

    def _go(self) -> FitResult:
        pending = None
        first = self.good = self.leaves  # the last state checked to be finite
        handed = False  # the model may hold a state not yet checked
        try:
            chunks = self._chunks()
            nxt = next(chunks, None)
            while nxt is not None:
                start, end, xs = nxt
                inputs = (self.leaves, start, xs)
                with self.context():
                    self.leaves, self.stopped, applied, ys = self.fn(
                        self.leaves,
                        self.stopped,
                        np.int32(start),
                        np.int32(end - start),
                        np.int32(self._every(end - start)),
                        self.data,
                        self.key,
                        xs,
                    )
                # Compiling happens in the call above, running after it returns.
                inputs = (*inputs, time.perf_counter())
                if pending is not None:
                    self._collect(*pending)
                pending = (start, end, applied, ys, self.leaves, inputs)
                if self.auto and self.compiled.seconds_per_step is None:
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
                self.ckpt.save(self.done, self.leaves, self.key, self._history())
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
        return FitResult(model, optimizer, self._history(), self.done)

    def _finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place)."""
        return self.adapter.finish(jtu.tree_unflatten(self.treedef, leaves))

    def _history(self) -> dict[str, np.ndarray]:
        return {
            k: np.concatenate(v) if v else np.zeros((0,), np.float32)
            for k, v in self.history.items()
        }

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
        if self.auto:
            self._schedule(end - start, inputs[-1])
        self.history["loss"].append(ys["loss"][:count])
        metrics = ys["metrics"]
        if set(metrics) != set(self.history) - {"loss"}:
            self._align_history(metrics, count)
        for name, value in metrics.items():
            self.history[name].append(np.asarray(value)[:count])
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
            self.ckpt.save(end, leaves, self.key, self._history())
        self.good = self.leaves if self.halted else leaves

    def _align_history(self, metrics: dict, count: int) -> None:
        """Metric names differ from those of the history so far (a checkpoint of a
        ``loss_fn`` returning other metrics): NaN where a metric has no value, so
        that every history array keeps one entry per step."""
        known = set(self.history) - {"loss"}
        new, gone = sorted(set(metrics) - known), sorted(known - set(metrics))
        if self.done and not self.warned_metrics:
            self.warned_metrics = True
            warnings.warn(
                errors.metrics_changed(self.done, new, gone),
                RuntimeWarning,
                stacklevel=2,
            )
        for name in new:
            self.history[name] = [np.full(self.done, np.nan, np.float32)]
        for name in gone:
            self.history[name].append(np.full(count, np.nan, np.float32))

    def _redo(self, inputs: tuple, count: int) -> list:
        """The state after the ``count`` good steps of a call that hit a bad one."""
        leaves, start, xs, _ = inputs
        with self.context():
            out, _, applied, _ = self.fn(
                leaves,
                _false(),
                np.int32(start),
                np.int32(count),
                np.int32(count + 1),  # no reports
                self.data,
                self.key,
                xs,
            )
        if int(applied[0]) != count:  # the same program on the same inputs
            raise RuntimeError(
                f"{_CALL}: internal error: replaying {count} good steps applied "
                f"{int(applied[0])}. Please report this with your model and data."
            )
        return out

    def _schedule(self, steps: int, dispatched: float) -> None:
        """Size the next calls from the time the last one ran: from when it was
        dispatched (after compiling) or the previous one finished, to now."""
        now = time.perf_counter()
        began = max(dispatched, self.last_collect or dispatched)
        per_step = max(now - began, 1e-9) / steps
        self.compiled.seconds_per_step = per_step
        self.per_call = self._size(per_step)
        self.last_collect = now

    def _every(self, count: int) -> int:
        """Steps between in-loop reports: ``Progress.every``, or about 10 a second
        once the speed is known, else 10 a call; more than ``count`` (none) without
        a bar."""
        if not self.in_loop:
            return count + 1
        if self.spec.every is not None:
            return self.spec.every
        known = self.compiled.seconds_per_step
        if known is None:
            return max(1, count // 10)
        return max(1, math.ceil(_REPORT_SECONDS / known))

    def _size(self, seconds_per_step: float) -> int:
        return max(1, min(self.length, int(_SECONDS_PER_CALL / seconds_per_step)))

    def _warn(self, t: int, loss: Any, loss_ok: Any, grads_ok: Any) -> None:
        warnings.warn(
            errors.nonfinite_step(t, loss, bool(loss_ok), bool(grads_ok), self.done),
            RuntimeWarning,
            stacklevel=6,  # the user's fit(...) line
        )
