"""The steps of one compiled call of ``scanax.fit`` (``Chunks``): chunks of a
static length inside one loop over chunks, the work that need not run every step
at their boundaries, and how one model's steps advance (``Solo``; a population's
members: ``_fit_members.Members``). How the steps are grouped into chunks, and
how long a chunk is: ``_fit_plan``."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu

from .. import _progress
from .._errors import fit as errors
from .._once import branch_free, once_if
from .plan import Plan, chunk_length, chunked
from .program import (
    Chunk,
    Out,
    Report,
    finite,
    intact,
    marked,
    outputs,
    step_key,
    trace_once,
)

_CALL = errors.CALL


class Lanes(abc.ABC):
    """How a call's steps advance the state: one model (``Solo``) or a
    population's members side by side (``_fit_population.Members``). The loop
    around them (``Chunks``) is the same: chunks of steps (a ``lax.scan`` with
    a static trip count), with the work that need not happen every step at
    the chunk boundaries (``before``: a rollout's collection; ``after``:
    evaluation, the early-stop and plateau rules)."""

    @abc.abstractmethod
    def begin(self, c: Chunk) -> tuple[Any, Any]:
        """``(env, lane)``: values fixed for the call (computed once, outside
        the loop) and the lanes' own carry."""

    @abc.abstractmethod
    def step(
        self, c: Chunk, env: Any, carry: tuple, perm: Any, t: Any, i: Any, active: Any
    ):
        """One step, branch-free: ``(leaves, stopped, extra, lane)`` after it,
        and its outputs for the buffers. ``carry`` is ``(leaves, stopped,
        extra, lane)``; ``active`` (a traced bool, or None: always) says
        whether the step is one of the call's: a step past a chunk's end runs
        and changes nothing (a select per leaf)."""

    def before(self, c: Chunk, env: Any, carry: tuple, t: Any) -> tuple:
        """At the boundary before global step ``t`` (a chunk's first): the
        carry and what the buffers record at that step's row (a rollout's
        collection, when one is due). Default: nothing."""
        return carry, {}

    def after(self, c: Chunk, env: Any, carry: tuple, t1: Any) -> tuple:
        """At the boundary after global step ``t1 - 1`` (a chunk's last): the
        carry and what the buffers record at that step's row (an evaluation
        and the rules, when one is due). Default: nothing."""
        return carry, {}

    @abc.abstractmethod
    def running(self, c: Chunk, i: Any, stopped: Any, extra: Any, lane: Any) -> Any:
        """Whether the loop runs another chunk from step ``i`` of the call."""

    @abc.abstractmethod
    def finish(self, c: Chunk, i: Any, carry: tuple, bufs: Any) -> Out:
        """The call's outputs after ``i`` steps ran."""


def masked(active: Any, new: list, old: list) -> list:
    """``new`` where the step is ``active``, else ``old`` (a select per leaf;
    ``active`` None: ``new``)."""
    if active is None:
        return new
    return [jnp.where(active, n, o) for n, o in zip(new, old)]


class Solo(Lanes):
    """One model: a step stops the loop when its loss is not finite (it is
    applied, and the rest of its chunk runs on; the host recomputes the call's
    good steps, see ``Chunks``). Off CPU (``marks``) its gradients are not
    tested each step: a non-finite one marks the parameter it trains
    (``_fit_program.marked``: NaN there), and the call's end reports whether
    its parameters are ``intact`` (a bad call stops the next one, already
    dispatched); the host then replays the call to find the first bad step.
    On CPU every step tests its gradients too: XLA:CPU compiles that test
    into the loop's fusions nearly free (about 1% of a small MLP's first
    call), where the parameters' test after the loop took 10-20%.
    ``trained``: the parameters' positions among the leaves. With ``checks``
    (``_fit_checks.Checks``), the monitored training metrics are summed each
    step, and at the boundaries where one is due: evaluation, the early-stop
    rule (which may end the loop) and the plateau rule. ``collector``: a
    rollout's (``_rollout.Collector``), whose collections run at the
    boundaries before their steps, or None."""

    def __init__(
        self,
        step,
        sampler,
        place,
        shardings,
        takes_key,
        checks,
        accumulate,
        trained,
        collector=None,
    ):
        self.fn, self.sampler, self.place = step, sampler, place
        # the guard: marks and one test per call off CPU, else a test per step
        self.trained, self.marks = trained, chunked()
        self.shardings, self.takes_key = shardings, takes_key
        self.checks, self.accumulate = checks, accumulate
        self.collector = collector

    def begin(self, c: Chunk) -> tuple[Any, Any]:
        root = jr.split(c.key)[1] if self.takes_key else None
        # the early-stop rule said stop; the steps run
        return root, (jnp.array(False), jnp.int32(0))

    def step(self, c, env, carry, perm, t, i, active):
        leaves, stopped, extra, (early, ran) = carry
        batch = self.sampler.batch(perm, c.data, c.xs, t, i)
        batch = self.place.constrain_batch(batch, 1 if self.accumulate > 1 else 0)
        key_t = step_key(env, t, self.accumulate) if self.takes_key else None
        new, loss, metrics, grads = self.fn(leaves, batch, key_t, c.hp)
        new, tested = marked(new, self.trained, grads) if self.marks else (new, grads)
        loss_ok, grads_ok = finite(loss, tested)
        out = outputs(loss, metrics)
        ok = loss_ok & grads_ok
        if self.checks is not None:
            take = ok if active is None else ok & active
            new, extra = self.checks.accumulate(new, out, take, extra)
        if active is None:  # (one step per chunk: the loop stops after a bad one)
            return (new, ~ok, extra, (early, ran + 1)), out
        # The steps after a bad one run (the host redoes the call's good steps):
        # only a step past the chunk's cut is masked.
        ran_now = active & ~stopped
        leaves = masked(active, new, leaves)
        stopped = stopped | (ran_now & ~ok)
        return (leaves, stopped, extra, (early, ran + ran_now.astype(ran.dtype))), out

    def before(self, c, env, carry, t):
        if self.collector is None:
            return carry, {}
        leaves, stopped, extra, lane = carry
        leaves, due, metrics = self.collector.before(leaves, t, c.hp)
        if self.checks is not None:  # (a monitored rollout metric's sums)
            leaves, extra = self.checks.collected(leaves, metrics, due, extra)
        carry = (leaves, stopped, extra, lane)
        return carry, {"collected": due, "rollout": metrics}

    def after(self, c, env, carry, t1):
        if self.checks is None:
            return carry, {}
        leaves, stopped, extra, (early, ran) = carry
        # (fit's key, or a placeholder: an eval_fn may take a key when
        # loss_fn does not)
        eval_key = jr.fold_in(jr.split(c.key)[0], t1 - 1)
        args = (leaves, c.aux["eval"], eval_key, c.hp, extra)
        due = self.checks.due(t1) & ~stopped  # (a bad step: the host redoes it)
        checked = when(due, lambda *a: self.checks.work(t1, *a), args)
        carry = (checked.leaves, stopped, checked.carry, (checked.stop, ran))
        return carry, {"val": checked.val, "evaluated": due}

    def running(self, c, i, stopped, extra, lane):
        return (i < c.count) & ~stopped & ~lane[0]

    def finish(self, c, i, carry, bufs):
        leaves, stopped, extra, (early, ran) = carry
        applied = jnp.where(stopped & ~c.stopped, ran - 1, ran)
        kept = jnp.array(True)  # (on CPU every step tests its gradients)
        if self.marks:
            kept = intact(
                [c.leaves[j] for j in self.trained], [leaves[j] for j in self.trained]
            )
        if self.shardings is not None:  # the state keeps its placement
            leaves = _placed(leaves, self.shardings)
            best = getattr(extra, "best", None)
            if best and len(best) == len(self.shardings):
                # (and so does an early stop's copy of it: a leaf the model
                # does not annotate would leave the call split as XLA chose,
                # and the next call, compiled for the first's, refuse it)
                extra = extra._replace(best=_placed(best, self.shardings))
        report = Report(applied, ran, stopped, early, kept).packed()
        # A stop by the rule, or marked parameters, also stop the next call
        # (already dispatched).
        return Out(leaves, stopped | early | ~kept, report, bufs, extra)


def _placed(leaves: list, shardings: Any) -> list:
    return [jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, shardings)]


class Chunks:
    """A call's steps, as ``lanes`` take them: one body for the two ways a call
    runs. ``fused(*Chunk)``: up to ``count`` steps from global step ``start``
    in one ``lax.while_loop`` over chunks (``execution="fused"``);
    ``begin``/``advance``/``close``: the same chunks as programs of their own,
    dispatched one chunk at a time by the host (``execution="stepwise"``,
    ``_fit_stepwise``). Both return ``Out``.

    A chunk is ``plan.k`` steps in a ``lax.scan`` (a static trip count: on a
    GPU, a ``while_loop`` copies its predicate to the host at every
    iteration, a scan of known length does not) over a window of the global
    step grid, whose steps up to ``plan.end(...)`` are the call's: a chunk is
    cut at the call's end and at every in-loop event, and the steps past its
    cut run masked (a
    select per state leaf: they change nothing). Only the loop over chunks
    is dynamic: the number of steps per call varies (the automatic schedule,
    the last call, a NaN, an early stop) without recompiling. At the
    boundaries, each event's work runs where it is due (``_once.once_if``,
    ``Lanes.before``/``after``): nothing branches per step. With chunks
    (``plan.k`` > 1) that is a loop of at most one trip, so that the program
    holds no conditional (on a TPU one moves a small state out of on-chip
    memory); with one step per chunk, a ``lax.cond`` (a loop that carries the
    state each step is the slower there). ``plan.k`` is
    decided when the step is first traced (``chunk_length``: 1 on CPU,
    where a loop iteration costs no round trip and the masks would).

    With ``ticks`` (a bar, and calls not sized automatically: host batches or
    a ``steps_per_call``), a chunk that reaches a multiple of ``every``
    reports to the host at its end (``_progress.tick_newest``), so the bar
    moves during long calls. Automatically sized calls (array data) take
    about a quarter second each, so the bar moves between them: their
    program has no host callback, is the same with and without a bar, and
    can be stored in JAX's persistent compilation cache.

    Per-step outputs go to ``length + k - 1``-long buffers (a chunk writes all
    its ``k`` rows; rows past the call's steps are never read), the
    boundaries' to theirs at their step's row. One model's non-finite step is
    applied and the loop stops after its chunk; the host then recomputes the
    good steps of that call from the call's input (the same program on the
    same inputs: bit-identical).

    The loop's state is ``(i, carry, perm, bufs)``: steps taken, the lanes'
    carry ``(leaves, stopped, extra, lane)``, the sampler's order and the
    buffers.
    """

    def __init__(
        self,
        lanes: Lanes,
        sampler: Any,
        length: int,
        ticks: bool,
        periods: tuple[int, ...] = (),
        cuts: tuple[int, ...] = (),
    ):
        self.lanes, self.sampler = lanes, sampler
        self.length, self.ticks, self.periods = length, ticks, periods
        self.cuts = cuts
        self.plan: Plan | None = None  # (decided when the step is first traced)

    def __call__(self, *args: Any) -> Out:
        return self.fused(*args)

    def fused(self, *args: Any) -> Out:
        c = Chunk(*args)
        with jax.named_scope(_CALL):
            env, loop, parts = self._open(c)
            i, carry, _, bufs = self._loop(c, env, parts, loop)
            return self.lanes.finish(c, i, carry, self._merged(bufs))

    def begin(self, c: Chunk) -> tuple[Any, tuple]:
        """``(env, loop)`` before the first chunk."""
        with jax.named_scope(_CALL):
            env, loop, _ = self._open(c)
            return env, loop

    def advance(self, c: Chunk, env: Any, loop: tuple) -> tuple:
        """The loop's state after its next chunk, or as it is when the loop
        would have ended: the fused loop bounded to one iteration (the host
        dispatches ``plan.count(...)`` of them without reading the device, and
        XLA compiles the chunk as the fused loop's body). ``c.leaves`` is
        unused (None)."""
        with jax.named_scope(_CALL):
            i, carry, perm, _ = loop
            parts = self._traced(c, env, carry, perm)
            return self._loop(c, env, parts, loop, until=i + 1)

    def close(self, c: Chunk, loop: tuple) -> Out:
        """The call's outputs after the loop ``loop``."""
        with jax.named_scope(_CALL):
            i, carry, _, bufs = loop
            return self.lanes.finish(c, i, carry, self._merged(bufs))

    def _loop(self, c, env, parts, loop, until=None) -> tuple:
        """The loop over chunks while the lanes run (and, ``until``, before
        step ``until``: the stepwise call's one chunk)."""

        def more(loop: tuple) -> Any:
            running = self.running(c, loop)
            return running if until is None else running & (loop[0] < until)

        def body(loop: tuple) -> tuple:
            return self._chunk(c, env, parts, loop)

        return jax.lax.while_loop(more, body, loop)

    def _traced(self, c: Chunk, env: Any, carry: tuple, perm: Any) -> tuple:
        """The step and the boundaries' work, each traced once (their
        outputs' shapes size the buffers); the plan, decided at the first."""
        lanes = self.lanes
        masks = chunked()  # (on CPU, k is 1: no masks)

        def one(carry, perm, t, i, active):
            return lanes.step(c, env, carry, perm, t, i, active if masks else None)

        step, shapes = trace_once(one, carry, perm, c.start, jnp.int32(0), True)
        if self.plan is None:
            k = chunk_length(step.jaxpr, self.periods + self.cuts) if masks else 1
            self.plan = Plan(k, self.periods)
        with self._boundaries():
            before = trace_once(
                lambda carry, t: lanes.before(c, env, carry, t), carry, c.start
            )
            after = trace_once(
                lambda carry, t: lanes.after(c, env, carry, t), carry, c.start + 1
            )
        return step, shapes[1], before, after

    def _boundaries(self) -> Any:
        """How the boundaries' work is traced (``_once.once_if``): with chunks
        (``plan.k`` > 1) in loops of at most one trip, so that the program
        holds no conditional; one step per chunk, behind ``lax.cond``."""
        return branch_free(self.plan.k > 1)

    def _open(self, c: Chunk) -> tuple[Any, tuple, tuple]:
        perm = self.sampler.first(c.key, c.start)
        extra = None if c.aux is None else c.aux["stop"]
        env, lane = self.lanes.begin(c)
        carry = (c.leaves, c.stopped, extra, lane)
        parts = self._traced(c, env, carry, perm)
        _, out, (_, before), (_, after) = parts
        rows = self.length + 2 * (self.plan.k - 1)  # (a window either side)
        n = self.length
        bufs = (
            jtu.tree_map(lambda s: jnp.zeros((rows, *s.shape), s.dtype), out),
            jtu.tree_map(lambda s: _empty((n, *s.shape), s.dtype), before[1]),
            jtu.tree_map(lambda s: _empty((n, *s.shape), s.dtype), after[1]),
        )
        return env, (jnp.int32(0), carry, perm, bufs), parts

    def _merged(self, bufs: tuple) -> dict:
        return _merged(bufs, self.plan.k, self.length)

    def running(self, c: Chunk, loop: tuple) -> Any:
        i, (_, stopped, extra, lane), _, _ = loop
        return self.lanes.running(c, i, stopped, extra, lane)

    def _chunk(self, c: Chunk, env: Any, parts: tuple, loop: tuple) -> tuple:
        step, _, (before, _), (after, _) = parts
        k = self.plan.k
        i, carry, perm, (bufs, pre_bufs, post_bufs) = loop
        t0 = c.start + i
        base = t0 - t0 % k  # (the chunk's window on the global grid)
        every = c.every if self.ticks else None
        end = self.plan.end(t0, c.start + jnp.max(c.count), every)
        carry, pre = before(carry, t0)
        pre_bufs = _write(pre_bufs, pre, i)

        def one(state, j):
            carry, perm = state
            t = base + j
            perm = self.sampler.advance(perm, c.key, t)
            carry, out = step(carry, perm, t, t - c.start, (t >= t0) & (t < end))
            return (carry, perm), out

        (carry, perm), ys = jax.lax.scan(
            one, (carry, perm), jnp.arange(k, dtype=jnp.int32)
        )
        row = base - c.start + k - 1  # (the buffers start k - 1 rows early)
        if k > 1:  # (a window cut by an event is visited again: keep its rows)
            t = base + jnp.arange(k, dtype=jnp.int32)
            ours = (t >= t0) & (t < end)

            def kept(b, y):
                old = jax.lax.dynamic_slice_in_dim(b, row, k)
                return jnp.where(ours.reshape((k,) + (1,) * (y.ndim - 1)), y, old)

            ys = jtu.tree_map(kept, bufs, ys)
        bufs = jtu.tree_map(
            lambda b, y: jax.lax.dynamic_update_slice_in_dim(b, y, row, 0), bufs, ys
        )
        carry, post = after(carry, end)
        post_bufs = _write(post_bufs, post, end - 1 - c.start)
        if self.ticks:
            last = jax.lax.dynamic_index_in_dim(
                ys["loss"], end - 1 - base, keepdims=False
            )
            with self._boundaries():
                _progress.tick_newest(end % c.every == 0, end, last)
        return end - c.start, carry, perm, (bufs, pre_bufs, post_bufs)


def build_chunk(
    lanes: Lanes, sampler: Any, length: int, ticks: bool, periods=(), cuts=()
) -> Chunks:
    """The steps of a call as ``lanes`` take them (``Chunks``); ``periods``:
    the in-loop events' (evaluation every, a rollout's collection); ``cuts``:
    where the host ends calls (``host_cuts``)."""
    return Chunks(lanes, sampler, length, ticks, tuple(p for p in periods if p), cuts)


def when(due: Any, work: Callable, args: tuple) -> Any:
    """``work(*args)`` (a check: a ``Checked``-like record of ``leaves``,
    ``val``, ``carry``, ``stop``) where it is ``due`` (``once_if``), else the
    state as it is, NaN metrics and no stop. ``work`` is traced once (its
    output's shapes make the other branch)."""
    run, shape = trace_once(work, *args)

    def skip(*args: Any) -> Any:
        nan = jtu.tree_map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shape.val)
        stop = jnp.zeros(shape.stop.shape, bool)
        return shape._replace(leaves=list(args[0]), val=nan, carry=args[-1], stop=stop)

    return once_if(due, run, skip, *args)


def _merged(bufs: tuple, k: int, length: int) -> dict:
    """The buffers of the steps (from the call's first step's row: ``k - 1``
    rows after theirs start) and of the boundaries, as one record, ``length``
    rows each (``{"loss", "metrics"}``, and ``"val"``, ``"evaluated"``,
    ``"collected"``, ``"rollout"`` where those events run)."""
    steps, before, after = bufs
    steps = jtu.tree_map(lambda b: b[k - 1 : k - 1 + length], steps)
    return {**steps, **before, **after}


def _empty(shape: tuple, dtype: Any) -> Any:
    """A boundary buffer before any write: NaN (floats), False, 0."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.full(shape, jnp.nan, dtype)
    return jnp.zeros(shape, dtype)


def _write(bufs: Any, values: Any, row: Any) -> Any:
    """``values`` (one row) into ``bufs`` at ``row``."""
    return jtu.tree_map(
        lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, row, 0), bufs, values
    )
