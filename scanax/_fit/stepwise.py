"""``fit(..., execution="stepwise")``: a call's chunks of steps dispatched by the
host one compiled chunk at a time (on CPU a chunk is one step: as a Python loop
of ``jax.jit`` steps runs), instead of one ``lax.while_loop`` over the chunks
(``execution="fused"``).

The programs are built from the fused loop's own pieces (``_fit_chunks.Chunks``:
``begin``, ``advance``, ``close``), so the two run the same step on the same
state: bit-identical results on CPU, every feature of the loop (a non-finite
step's stop, evaluation and the early-stop rule, accumulation, a population's
members, meshes, a rollout's feed) unchanged. Between steps the loop's state
stays on the device as a flat list of arrays, donated to the next step (on a TPU
its large leaves only: ``donated``); the host flattens nothing per step. Each
dispatch is a ``lax.while_loop`` of the fused loop's own body (one chunk) and
condition, bounded to one iteration, so the host dispatches the call's chunks
(``Plan.count``: computed from the call's steps, without reading the device), a
call that stopped early costs only its remaining (empty) loops, and XLA compiles
the chunk as the fused loop's body: bit for bit the same arithmetic, a
population's too (a ``lax.cond`` compiled a population's step differently in the
last bits).
"""

from __future__ import annotations

import math
import threading
import time
import types
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _backend
from . import memory as _memory
from .chunks import Chunks
from .program import Chunk, Out, Program, compiled

_SYNC_EVERY = 16

# On a TPU, a chunk whose loop state was donated ran its steps about twice as
# slowly as the fused loop's (a TPU v5e, the tiny MLP: 14 us a step against
# 6.8, the same HLO loop body; stepwise 1.81x fused, undonated 1.14x; leaves
# of 800 KB donated too: no slower): there only leaves of at least this size
# per device are donated, where the memory a donation saves matters.
# Elsewhere every leaf is (on CPU, undonated steps were 1.5x as slow; a GPU is
# not measured). The backend is the default one, as for the chunks' plan.
_TPU_DONATE_BYTES = 1 << 16


def donated(leaf: Any) -> bool:
    """Whether a step donates the loop state's ``leaf`` (a placed
    ``ShapeDtypeStruct``, or an array) to the next: its share on one device
    against ``_TPU_DONATE_BYTES`` on a TPU."""
    if _backend.platform() != "tpu":
        return True
    where = getattr(leaf, "sharding", None)
    shape = leaf.shape if where is None else where.shard_shape(leaf.shape)
    return math.prod(shape) * leaf.dtype.itemsize >= _TPU_DONATE_BYTES


class Stepwise:
    """The programs of one argument signature: ``begin`` (the loop's state
    before the first step), ``step`` (one chunk, donating the state: ``donated``) and
    ``close`` (the call's ``Out``); called like the fused executable. Built in
    two parts: tracing and lowering, with ``begin`` compiled to learn the
    state's placement (``__init__``, on the caller's thread: it runs the user's
    ``loss_fn``), then compiling the step and ``close``
    (``compile``, which may run on another thread while the fused loop
    trains)."""

    def __init__(self, chunks: Chunks, args: Chunk, signature: tuple):
        self.chunks, self.signature = chunks, signature
        c = Chunk(*args)
        begin = jax.jit(chunks.begin).trace(c).lower()
        self._begin = self._compiled(begin, "begin")
        # The state's shapes and placements as ``begin`` gives them (without
        # running it: that would copy the whole state once more).
        env, loop = jtu.tree_map(
            lambda s, where: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=where, weak_type=s.weak_type
            ),
            jax.eval_shape(chunks.begin, c),
            self._begin.output_shardings,
        )
        fixed_leaves, self.fixed_tree = jtu.tree_flatten(self._fixed(c))
        env_leaves, self.env_tree = jtu.tree_flatten(env)
        loop_leaves, self.loop_tree = jtu.tree_flatten(loop)
        self.n_fixed, self.n_env = len(fixed_leaves), len(env_leaves)
        n_in = self.n_fixed + self.n_env
        donate = tuple(n_in + j for j, x in enumerate(loop_leaves) if donated(x))
        # The state comes out placed as it went in (a population's per-member
        # counts and buffers are replicated on a members mesh; left to XLA,
        # they come out split and the next step refuses them).
        placed = [x.sharding for x in loop_leaves]
        step = jax.jit(self._flat_step, donate_argnums=donate, out_shardings=placed)
        # On several devices, the host waits for a step every ``sync`` steps:
        # XLA:CPU aborts collectives when thousands of steps are in flight.
        devices = {d for x in loop_leaves for d in x.sharding.device_set}
        self.sync = _SYNC_EVERY if len(devices) > 1 else 0
        self.lowered = (
            step.trace(*fixed_leaves, *env_leaves, *loop_leaves).lower(),
            jax.jit(chunks.close).trace(c, loop).lower(),
        )
        self._step = self._close = self.placement = None
        self.lock = threading.Lock()

    def compile(self) -> Stepwise:
        with self.lock:  # (auto's thread and a run of the same program)
            if self._step is None:
                step, close = (
                    self._compiled(lowered, role)
                    for lowered, role in zip(self.lowered, ("step", "close"))
                )
                # where the call's host values go, once per call (not per step)
                self.placement = step.input_shardings[0][: self.n_fixed]
                self._step, self._close, self.lowered = step, close, None
        return self

    def _compiled(self, lowered: Any, role: str) -> Any:
        """One of the programs compiled, or as an earlier ``fit`` compiled the
        same (a function traced again: ``_fit_program.identity``)."""
        return compiled(lowered, (role, self.signature), time.perf_counter())[0]

    def memory_analysis(self) -> Any:
        """A call's need beyond its arguments (``_memory``): ``begin``'s copy
        of the state and buffers, and the step's temporaries (the state is
        donated from step to step; on a TPU its small leaves are not, and the
        step's peak holds their copies)."""
        step = self.compile()._step.memory_analysis()
        begin = self._begin.memory_analysis()
        if step is None or begin is None:
            return None
        return types.SimpleNamespace(
            output_size_in_bytes=begin.output_size_in_bytes,
            alias_size_in_bytes=0,
            temp_size_in_bytes=max(begin.temp_size_in_bytes, step.temp_size_in_bytes),
            argument_size_in_bytes=0,
            peak_memory_in_bytes=max(
                _memory.peak_beyond(begin), _memory.peak_beyond(step)
            ),
        )

    @staticmethod
    def _fixed(c: Chunk) -> Chunk:
        """What a step reads of the call's arguments (not the state it started
        from, nor the early-stop carry: the loop's state holds both)."""
        aux = None if c.aux is None else {**c.aux, "stop": None}
        return c._replace(leaves=None, aux=aux)

    def _flat_step(self, *flat: Any) -> list:
        a, b = self.n_fixed, self.n_fixed + self.n_env
        c = jtu.tree_unflatten(self.fixed_tree, flat[:a])
        env = jtu.tree_unflatten(self.env_tree, flat[a:b])
        loop = jtu.tree_unflatten(self.loop_tree, flat[b:])
        return jtu.tree_leaves(self.chunks.advance(c, env, loop))

    def __call__(self, *args: Any) -> Out:
        c = Chunk(*args)
        env, loop = self._begin(c)
        fixed = [
            x if isinstance(x, jax.Array) else jax.device_put(x, where)
            for x, where in zip(jtu.tree_leaves(self._fixed(c)), self.placement)
        ] + jtu.tree_leaves(env)
        state = jtu.tree_leaves(loop)
        step, sync = self._step, self.sync
        every = int(c.every) if self.chunks.ticks else None
        chunks = self.chunks.plan.count(int(c.start), int(np.max(c.count)), every)
        for k in range(chunks):
            state = step(*fixed, *state)
            if sync and k % sync == sync - 1:
                state[0].block_until_ready()
        return self._close(c, jtu.tree_unflatten(self.loop_tree, state))


def lowered(program: Program, args: Chunk) -> Stepwise:
    """``program``'s stepwise programs for arguments like ``args``, traced and
    lowered (compiled if they were before); kept on the program."""
    signature = program.signature(args)
    found = program.stepwise.get(signature)
    if found is None:
        found = program.stepwise[signature] = Stepwise(program.chunks, args, signature)
    return found


def executable(program: Program, args: Chunk) -> Stepwise:
    """``program``'s compiled stepwise programs for arguments like ``args``."""
    return lowered(program, args).compile()
