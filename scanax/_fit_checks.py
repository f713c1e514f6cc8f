"""What ``scanax.fit``'s compiled loop does every ``eval_every`` steps: evaluate
the model over the whole ``eval_data`` (in eval mode) and update the early-stop
rule, keeping the best state on device.

Everything here runs inside the loop body, behind one ``lax.cond`` per step: no
host round trip, no recompile, and the same code under a population's ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import _log
from ._fit_program import trace_once
from ._stop import EarlyStop, keep_best


class StopCarry(NamedTuple):
    """The early-stop rule's state, the best state kept (an empty list when it
    is not kept), and the running sum and count of a monitored training metric
    since the last check."""

    rule: Any
    best: list
    total: jax.Array
    count: jax.Array


class Checks:
    """Every ``every`` global steps: an evaluation (``evaluate(leaves, batch,
    key, hp) -> (loss, metrics)`` over ``n`` examples in batches of
    ``batch_size``) and/or the early-stop rule ``stop``."""

    def __init__(
        self,
        every: int,
        evaluate: Callable | None,
        n: int,
        batch_size: int,
        stop: EarlyStop | None,
    ):
        self.every, self.evaluate, self.n = every, evaluate, n
        self.batch_size, self.stop = batch_size, stop
        self.train_monitor = stop is not None and not stop.monitor.startswith("val_")

    def key(self) -> tuple:
        """What the compiled program depends on (for its cache key)."""
        return (self.every, self.n, self.batch_size, self.stop)

    def init(self, leaves: list, dtype: Any = jnp.float32) -> StopCarry | None:
        """The carry before the first check, keeping ``leaves`` as the best state
        (``[]``: none kept, as a population without ``restore_best`` does)."""
        if self.stop is None:
            return None
        return StopCarry(
            self.stop.init(dtype),
            list(leaves),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def run(
        self,
        t1: Any,
        leaves: list,
        out: dict,
        ok: Any,
        eval_data: Any,
        key: Any,
        hp: Any,
        carry: StopCarry | None,
    ) -> tuple[dict, Any, StopCarry | None, Any]:
        """After global step ``t1`` (1-based): ``(val metrics, evaluated, carry,
        stop)``; ``val`` is NaN where nothing was evaluated."""
        due = t1 % self.every == 0
        val: dict = {}
        if self.evaluate is not None:
            # (traced once: the shapes for the other branch, and the evaluation)
            evaluate, shape = trace_once(self._evaluate, leaves, eval_data, key, hp)
            nan = jtu.tree_map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shape)
            val = jax.lax.cond(
                due,
                lambda: evaluate(leaves, eval_data, key, hp),
                lambda: nan,
            )
        if self.stop is None:
            return val, due, carry, jnp.array(False)
        total, count = carry.total, carry.count
        names = ["loss", *out["metrics"], *val]
        self.stop.check_monitor(names)  # (while tracing: before compiling)
        if self.train_monitor:
            value = out["metrics"].get(self.stop.monitor, out["loss"])
            total = total + jnp.asarray(value, jnp.float32)
            count = count + 1
            value = total / jnp.maximum(count, 1).astype(total.dtype)
        else:
            value = val[self.stop.monitor]

        def check():
            rule, improved, stop = self.stop.update(carry.rule, value, t1)
            improved = improved & ok  # never keep a state after a bad step
            best = keep_best(carry.best, leaves, improved) if carry.best else []
            zero = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
            return StopCarry(rule, best, *zero), stop

        def wait():
            return StopCarry(carry.rule, carry.best, total, count), jnp.array(False)

        carry, stop = jax.lax.cond(due, check, wait)
        return val, due, carry, stop

    def _evaluate(self, leaves: list, data: Any, key: Any, hp: Any) -> dict:
        """Metrics averaged over every example of ``data`` (full batches in a
        scan, then the remainder), prefixed ``val_``."""
        b = self.batch_size
        full, rest = divmod(self.n, b)

        def at(start, size):
            return jtu.tree_map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), data
            )

        def metrics(batch, j):  # batch j gets its own key
            batch_key = None if key is None else jr.fold_in(key, j)
            loss, extra = self.evaluate(leaves, batch, batch_key, hp)
            values = {"loss": loss, **extra}
            return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}

        total = None
        if full:

            def body(acc, i):
                m = jtu.tree_map(lambda v: v * b, metrics(at(i * b, b), i))
                return jtu.tree_map(jnp.add, acc, m), None

            first = jtu.tree_map(lambda v: v * b, metrics(at(0, b), 0))
            total, _ = jax.lax.scan(body, first, jnp.arange(1, full))
        if rest:
            m = jtu.tree_map(lambda v: v * rest, metrics(at(full * b, rest), full))
            total = m if total is None else jtu.tree_map(jnp.add, total, m)
        return {f"val_{k}": v / self.n for k, v in total.items()}


class Logger:
    """``log=``: the steps' metrics, reduced over windows of ``every`` steps
    (``_log.window_reduce``: means of floating metrics, last values of the others)
    and handed to the sinks at the end of each compiled call, with the
    evaluations at their steps. ``fit`` brings every step's metrics to the host
    at the end of each call anyway (for ``history``), so the windows are reduced
    there, once per call, with the same values a reduction on device gives.

    A window closes at every multiple of ``every`` (global steps: windows line up
    across calls and resumes) and at the end of a run. After a restart from a
    checkpoint, the sinks drop what they hold after the step where the restored
    history begins (this call's start, when the checkpoint was written by a call
    that started there) and are given that history again, so that each step is
    logged exactly once, whatever earlier restarts cut: a call writes the same
    rows as the uninterrupted call did.
    """

    def __init__(self, sinks: Any, every: int, members: bool = False):
        self.sinks, self.every, self.members = sinks, every, members
        self.rows: list[tuple[np.ndarray, dict]] = []  # pending train steps
        self.val: list[tuple[np.ndarray, dict]] = []  # pending evaluations

    def open(self, cut: int, history: dict | None = None) -> None:
        """Open the sinks, keeping what they hold up to step ``cut``, then give
        them ``history``'s steps after it (a run restored from a checkpoint: its
        history since this call's start)."""
        self.sinks.open(cut)
        if history is None:
            return
        axis = 1 if self.members else 0
        steps = np.asarray(history["step"])
        keep = steps > cut
        names = [k for k in history if k != "step" and not k.startswith("val_")]
        self.add(
            steps[keep], {k: np.compress(keep, history[k], axis=axis) for k in names}
        )
        if "val_step" in history:
            vsteps = np.asarray(history["val_step"])
            vkeep = vsteps > cut
            vnames = [k for k in history if k.startswith("val_") and k != "val_step"]
            self.add_val(
                vsteps[vkeep],
                {k: np.compress(vkeep, history[k], axis=axis) for k in vnames},
            )

    def add(self, steps: np.ndarray, values: dict) -> None:
        """Per-step values (``[steps, ...]``; a population's ``[members, steps,
        ...]``)."""
        if len(steps):
            self.rows.append((np.asarray(steps), self._steps_first(values)))

    def add_val(self, steps: np.ndarray, values: dict) -> None:
        if len(steps):
            self.val.append((np.asarray(steps), self._steps_first(values)))

    def _steps_first(self, values: dict) -> dict:
        if not self.members:
            return {k: np.asarray(v) for k, v in values.items()}
        return {k: np.moveaxis(np.asarray(v), 1, 0) for k, v in values.items()}

    def write(self, final: bool = False) -> None:
        """Write the windows closed so far (all of them when ``final``)."""
        if not self.rows and not self.val:
            return
        steps = np.concatenate([s for s, _ in self.rows]) if self.rows else None
        last = max(int(s[-1]) for s, _ in [*self.rows, *self.val])
        cut = last if final else last // self.every * self.every
        parts = []
        if steps is not None:
            names = list(self.rows[0][1])
            values = {k: np.concatenate([v[k] for _, v in self.rows]) for k in names}
            done = steps <= cut
            if done.any():
                parts.append(
                    _log.window_reduce(
                        steps[done], {k: v[done] for k, v in values.items()}, self.every
                    )
                )
            rest = ~done
            self.rows = (
                [(steps[rest], {k: v[rest] for k, v in values.items()})]
                if rest.any()
                else []
            )
        if self.val:
            vsteps = np.concatenate([s for s, _ in self.val])
            vnames = list(self.val[0][1])
            vvalues = {k: np.concatenate([v[k] for _, v in self.val]) for k in vnames}
            done = vsteps <= cut
            if done.any():
                parts.append((vsteps[done], {k: v[done] for k, v in vvalues.items()}))
            rest = ~done
            self.val = (
                [(vsteps[rest], {k: v[rest] for k, v in vvalues.items()})]
                if rest.any()
                else []
            )
        if parts:
            self.sinks.write(*_log.merge(*parts))
        self.sinks.flush()
