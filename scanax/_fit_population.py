"""``scanax.fit`` on a population: the compiled loop vmapped over the members.

Each member is an independent run: its own state, its own hyperparameters (the
optimizer is rebuilt from them inside the step, see ``_population``), its own
keys and, unless batches are shared, its own data order. A member whose step is
not finite stops alone: it keeps its last good state (the call is replayed up to
its good steps, as a solo ``fit`` does) and the others train on.
"""

from __future__ import annotations

import contextlib
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

from . import _data, _fit_loop, _mesh, _population, _progress
from ._errors import population as errors

_CALL = errors.FIT


def fit_population(
    pop: _population.Population,
    loss_fn: Callable,
    source: Any,
    key: Any,
    takes: tuple[bool, bool],
    length: int,
    shared: bool,
    members_per_call: int | None,
    how: tuple,
    logger: Any = None,
) -> _fit_loop.FitResult:
    """Train every member of ``pop`` for ``steps`` more steps; ``pop`` is updated
    in place. Members run ``members_per_call`` at a time (all by default)."""
    steps, steps_per_call, spec, mesh, checkpoint_dir, checkpoint_every = how
    takes_hp, takes_key, accumulate = takes
    n = pop.n
    k = members_per_call or n
    per_member = not shared and getattr(source, "shuffle", False)
    keys = jr.split(key if key is not None else _data.unused_key(), n)

    def call_for(hp):
        if takes_hp and takes_key:
            return lambda model, batch, key: loss_fn(model, batch, hp, key)
        if takes_hp:
            return lambda model, batch, key: loss_fn(model, batch, hp)
        if takes_key:
            return lambda model, batch, key: loss_fn(model, batch, key)
        return lambda model, batch, key: loss_fn(model, batch)

    identity = _fit_loop.identity(
        pop.fingerprint(),
        pop.make,
        loss_fn,
        "population",
        takes_hp,
        takes_key,
        source.static,
        length,
        per_member,
        k,
        None if mesh is None else (mesh.shape_tuple, mesh.device_ids.tobytes()),
    )
    sampler = source.sampler()
    xs_axis = 0 if per_member else None

    batch_mesh = mesh if mesh is not None and _mesh.has_data_axis(mesh) else None

    def build():
        return build_chunk(
            pop.step_factory(call_for, accumulate),
            sampler,
            length,
            batch_mesh,
            takes_key,
            accumulate,
            xs_axis,
            None if mesh is None else _mesh.MEMBERS,
        )

    program = _fit_loop.program(identity, build)
    bar_every = spec.every if spec is not None else None
    schedule = _fit_loop.Schedule(
        program, length, source, steps_per_call, checkpoint_every, bar_every
    )
    groups = [list(range(g, min(g + k, n))) for g in range(0, n, k)]
    states, stopped, histories, applied = [], [], [], []
    for members in groups:
        padded = members + [members[j % len(members)] for j in range(k - len(members))]
        idx = np.asarray(padded)
        if per_member:
            source.for_members(keys[idx])
        directory = checkpoint_dir
        if directory is not None and len(groups) > 1:
            directory = os.path.join(
                os.fspath(checkpoint_dir), f"members_{members[0]}-{members[-1]}"
            )
        run = PopRun(pop, idx, len(members), keys[idx], source, program, schedule, how)
        run.logger = logger
        if len(groups) > 1:
            run.label = f"{_CALL} [members {members[0]}-{members[-1]}]"
        if directory is not None:
            run.resume(directory, checkpoint_every)
        leaves, stop, history, count, done = run.go()
        real = len(members)
        states.append([x[:real] for x in leaves])
        stopped.append(stop[:real])
        histories.append(
            {name: v if v.ndim == 1 else v[:real] for name, v in history.items()}
        )
        applied.append(count[:real])
    state = (
        [jnp.concatenate(parts) for parts in zip(*states)]
        if len(groups) > 1
        else states[0]
    )
    # The clock: the steps run (an iterable may end early).
    pop.update(state, np.concatenate(stopped), done)
    history = histories[0]
    if len(groups) > 1:
        history = {
            name: v if v.ndim == 1 else np.concatenate([h[name] for h in histories])
            for name, v in histories[0].items()
        }
    result = _fit_loop.FitResult(
        _population.Members(pop, 0),
        _population.Members(pop, 1),
        history,
        np.concatenate(applied),
    )
    if logger is not None:
        logger.sinks.raise_pending(result)
    return result


def build_chunk(
    step: Callable,
    source: Any,
    length: int,
    mesh: Any,
    takes_key: bool,
    accumulate: int,
    xs_axis: int | None,
    members: str | None,
) -> Callable:
    """``chunk(leaves, stopped, start, count, every, data, keys, xs, hp, aux)`` of
    a population: one ``lax.while_loop`` over the steps whose body is the
    members' step under ``vmap``. A member takes step ``i`` while ``i <
    count[m]`` and it has not stopped; a non-finite step is not applied (a
    select per state leaf) and stops that member alone. The loop itself is not
    vmapped: a vmapped loop with a per-member condition would select every
    carried buffer at every step.

    Returns ``(leaves, stopped, (applied, early), bufs, None)``: per member, the
    steps applied; per-step outputs ``[length, members, ...]``.
    """

    def one(leaves, key, xs, hp, perm, data, t, i):
        batch = source.batch(perm, data, xs, t, i)
        if mesh is not None:
            batch = _mesh.batch_constraint(mesh, batch, 1 if accumulate > 1 else 0)
        key_t = None
        if takes_key:
            key_t = _fit_loop.step_key(jr.split(key)[1], t, accumulate)
        new, loss, metrics, grads = step(leaves, batch, key_t, hp)
        loss_ok, grads_ok = _fit_loop.finite(loss, grads)
        return new, {"loss": loss, "metrics": metrics}, loss_ok & grads_ok

    axes = (0, 0, xs_axis, 0, None, None, None, None)
    members_step = jax.vmap(one, in_axes=axes, spmd_axis_name=members)

    def chunk(leaves, stopped, start, count, every, data, keys, xs, hp, aux):
        with jax.named_scope(_CALL):
            perm = source.first(None, start)
            out_type = jax.eval_shape(
                members_step, leaves, keys, xs, hp, perm, data, start, 0
            )[1]
            bufs = jtu.tree_map(
                lambda s: jnp.zeros((length, *s.shape), s.dtype), out_type
            )
            applied = jnp.zeros(stopped.shape, jnp.int32)

            def cond(carry):
                i, _, stopped, _, _, _ = carry
                return (i < jnp.max(count)) & ~jnp.all(stopped)

            def body(carry):
                i, leaves, stopped, perm, bufs, applied = carry
                t = start + i
                perm = source.advance(perm, None, t)
                new, out, ok = members_step(leaves, keys, xs, hp, perm, data, t, i)
                active = (i < count) & ~stopped
                take = active & ok
                leaves = [
                    jnp.where(take.reshape(take.shape + (1,) * (x.ndim - 1)), n, x)
                    for n, x in zip(new, leaves)
                ]
                bufs = jtu.tree_map(
                    lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, i, 0),
                    bufs,
                    out,
                )
                stopped = stopped | (active & ~ok)
                return i + 1, leaves, stopped, perm, bufs, applied + take

            init = (jnp.int32(0), leaves, stopped, perm, bufs, applied)
            _, leaves, stopped, _, bufs, applied = jax.lax.while_loop(cond, body, init)
            return leaves, stopped, (applied, jnp.array(False)), bufs, None

    return chunk


class PopHistory(_fit_loop.History):
    """Per-step values of every member: ``[members, steps]`` arrays (NaN where a
    member did not train), and the global step numbers."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def add_members(self, first: int, ys: dict, counts: np.ndarray, ran: int) -> None:
        """``ran`` steps from global step ``first``; member ``m`` applied
        ``counts[m]`` of them (the rest is NaN)."""
        mask = np.arange(ran)[None, :] >= counts[:, None]
        values = {"loss": ys["loss"], **ys["metrics"]}
        for name, v in values.items():
            v = np.asarray(v)[:, :ran]
            if not np.issubdtype(v.dtype, np.floating):
                v = v.astype(np.float64)
            values[name] = np.where(
                mask.reshape(mask.shape + (1,) * (v.ndim - 2)), np.nan, v
            )
        metrics = {k: v for k, v in values.items() if k != "loss"}
        if set(metrics) != set(self.arrays) - {"loss", "step"}:
            self._align(metrics, ran)
        self.arrays["step"].append(np.arange(first + 1, first + ran + 1))
        for name, v in values.items():
            self.arrays[name].append(v)
        self.count += ran

    def _align(self, metrics: dict, count: int) -> None:
        known = set(self.arrays) - {"loss", "step"}
        for name in sorted(set(metrics) - known):
            self.arrays[name] = (
                [np.full((self.k, self.count), np.nan)] if self.count else []
            )
        for name in sorted(known - set(metrics)):
            self.arrays[name].append(np.full((self.k, count), np.nan))

    def restore(self, saved: dict, after: int, step: int) -> None:
        saved = dict(saved)
        steps = np.asarray(saved.pop("step"))
        keep = steps > after
        self.arrays = {"step": [steps[keep]]}
        self.arrays.update({k: [np.asarray(v)[:, keep]] for k, v in saved.items()})
        self.count = int(keep.sum())

    def result(self) -> dict[str, np.ndarray]:
        out = {
            "step": np.zeros((0,), np.int64),
            "loss": np.zeros((self.k, 0), np.float32),
        }
        for name, parts in self.arrays.items():
            if parts:
                out[name] = np.concatenate(parts, axis=-1)
        return out


class PopRun(_fit_loop.Run):
    """One group of members through one ``fit`` call: every call is collected
    before the next (a member that stops is replayed to its last good step)."""

    def __init__(self, pop, idx, real, keys, source, program, schedule, how):
        steps, _, spec, mesh, _, _ = how
        leaves = [x[idx] for x in pop.state]
        run_how = (pop.step, pop.step + steps, spec, mesh, False)
        super().__init__(None, source, program, None, leaves, schedule, run_how)
        self.pop, self.k, self.idx, self.real = pop, len(idx), idx, real
        self.key = keys
        self.hp = {name: v[idx] for name, v in pop.hp().items()}
        self.mask = np.asarray(pop.stopped)[idx]
        self.stopped = jnp.asarray(self.mask)
        if mesh is not None:  # population parallelism: members split over devices
            self.leaves, self.key, self.hp, self.stopped = _mesh.by_member(
                mesh, (self.leaves, self.key, self.hp, self.stopped)
            )
        self.applied = np.zeros(self.k, np.int64)
        self.history = PopHistory(self.k)
        self.label = _CALL

    def _call(self, *args, **kwargs):
        try:
            return super()._call(*args, **kwargs)
        except _population.PYTHON_VALUE_ERRORS as err:  # while tracing the step
            raise errors.hp_used_as_python_value(list(self.hp), err) from err

    def resume(self, directory: Any, every: int | None) -> None:
        super().resume(directory, every)
        if self.done > self.start:  # restored: the steps each member had applied
            loss = self.history.result()["loss"]
            self.applied += np.isfinite(loss).sum(axis=1)

    def _describe(self) -> dict:
        """The data and the members' hyperparameters: a sweep re-run with other
        values in the same directory is refused, not silently restored."""
        values = {k: [float(x) for x in np.asarray(v)] for k, v in self.hp.items()}
        return {**self.source.describe(), "hyperparameters": values}

    def _names(self) -> list[str]:
        return [f"members.{name}" for name in self.pop.names] + ["members.stopped"]

    def _saved(self, leaves: list, extra: Any = None) -> list:
        return [*leaves, self.stopped]

    def _load(self, saved: list) -> None:
        *self.leaves, self.stopped = saved
        self.mask = np.asarray(self.stopped)

    def go(self) -> tuple:
        if self.logger is not None and self.done == self.start:
            self.logger.resume(self.start)  # (a restored run resumed it already)
        bar = None
        shown: Any = contextlib.nullcontext()
        if self.spec is not None:
            bar = _progress.open_bar(
                self.spec,
                self.end,
                _CALL,
                desc=self.label,
                unit="step",
                initial=self.done,
            )
            shown = _progress.showing(bar)
        try:
            with shown:
                self._loop(bar)
            if self.ckpt is not None:
                self.ckpt.save(
                    self.done,
                    self._saved(self.leaves),
                    self.key,
                    self.history.result(),
                )
            if self.logger is not None:
                self.logger.write(final=True)
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
            if self.logger is not None:
                self.logger.sinks.close()
        return self.leaves, self.mask, self.history.result(), self.applied, self.done

    def _loop(self, bar: Any) -> None:
        calls = self.source.calls(self.done, self.end, self.schedule, self.mesh)
        for start, end, xs in calls:
            ran = end - start
            count = np.full(self.k, ran, np.int32)
            leaves, stopped, applied, ys, _ = self._call(
                self.leaves, self.stopped, start, count, ran + 1, xs
            )
            dispatched = time.perf_counter()
            applied, ys, now = jax.device_get((applied, ys, stopped))
            ys = jtu.tree_map(lambda v: np.moveaxis(v, 0, 1), ys)  # [members, steps]
            counts = np.asarray(applied[0]).astype(np.int64)
            self.schedule.ran(ran, dispatched)
            bad = np.asarray(now) & ~self.mask  # stopped in this call
            if bad.any():  # (their bad step was not applied)
                self.mask = self.mask | bad
                rows = [m for m in np.flatnonzero(bad) if m < self.real]
                warnings.warn(
                    errors.nonfinite_members(
                        [int(self.idx[m]) for m in rows],
                        [start + int(counts[m]) + 1 for m in rows],
                        self.pop.n,
                    ),
                    RuntimeWarning,
                    stacklevel=5,
                )
            self.history.add_members(start, ys, counts, ran)
            if self.logger is not None:
                h = {k: v[-1] for k, v in self.history.arrays.items()}
                self.logger.add(h.pop("step"), h)
                self.logger.write()
            self.leaves, self.stopped = leaves, stopped
            self.applied += counts
            self.done = end
            if bar is not None:
                bar.update(end - bar.n)
                last = ys["loss"][:, ran - 1][~self.mask]
                if last.size:
                    bar.set_postfix(
                        best=f"{np.nanmin(last):.4g}",
                        median=f"{np.nanmedian(last):.4g}",
                    )
            if self.ckpt is not None and self.ckpt.every and end % self.ckpt.every == 0:
                self.ckpt.save(
                    end, self._saved(self.leaves), self.key, self.history.result()
                )
            if self.mask.all():
                break
