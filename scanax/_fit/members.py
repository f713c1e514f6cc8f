"""A population's members in ``scanax.fit``: their lanes in the compiled loop
(``Members``: the step of every member under ``vmap``, a stopped member a
select) and their kind on the host (``Group``: what ``_fit_loop.Run`` trains
for a group of members, and what that changes)."""

from __future__ import annotations

import functools as ft
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import population as errors
from .._once import once_if
from . import (
    checks as _fit_checks,
    chunks as _fit_chunks,
    hooks as _fit_hooks,
    mesh as _mesh,
    program as _fit_program,
)
from .engine import Read
from .models import population as _population, step as _model_step
from .program import Carry
from .result import best_state

_CALL = errors.FIT


class Members(_fit_chunks.Lanes):
    """A population's members side by side: their step under ``vmap`` in one
    loop. A member takes step ``i`` while ``i < count[m]`` and it has not
    stopped; a non-finite step is not applied (a select per state leaf) and
    stops that member alone. The loop itself is not vmapped: a vmapped loop
    with a per-member condition would select every carried buffer at every
    step.

    With ``checks`` (``_fit_checks.Checks``): after each step, every member's
    running sums of its monitored training metric; at the chunk boundaries
    where a check is due, every member's evaluation, early-stop and plateau
    rules (``checks.work`` under ``vmap``, behind one ``once_if``: the
    evaluation is due at the same steps for all), their carry with a leading
    member axis. A member whose rule says stop stops (its ``rule.stopped``);
    a member that no longer trains (stopped, or a non-finite step) leaves its
    carry as it was and records no evaluation (``evaluated`` is per member).
    ``collector``: a rollout's (``_rollout.Collector``), whose collections
    run at the boundaries before their steps, for the members that train.

    The report holds, per member, the steps applied, the stopped members and
    those stopped by their rule, and the steps the loop ran (fewer than
    ``max(count)`` when every member stopped); per-step outputs are
    ``[length, members, ...]``. On a mesh, the report and the outputs are
    replicated: every process reads them.
    """

    def __init__(
        self,
        step,
        sampler,
        place,
        takes_key,
        accumulate,
        xs_axis,
        members,
        checks,
        collector=None,
    ):
        self.place, self.checks, self.collector = place, checks, collector
        self.members = members

        def one(leaves, key, xs, hp, perm, data, t, i):
            batch = sampler.batch(perm, data, xs, t, i)
            batch = place.constrain_batch(batch, 1 if accumulate > 1 else 0)
            key_t = None
            if takes_key:
                key_t = _fit_program.step_key(jr.split(key)[1], t, accumulate)
            new, loss, metrics, grads = step(leaves, batch, key_t, hp)
            loss_ok, grads_ok = _fit_program.finite(loss, grads)
            return new, _fit_program.outputs(loss, metrics), loss_ok & grads_ok

        axes = (0, 0, xs_axis, 0, None, None, None, None)
        self.members_step = jax.vmap(one, in_axes=axes, spmd_axis_name=members)

    def begin(self, c):
        # (the steps applied, per member; the steps the loop ran)
        return None, (jnp.zeros(c.stopped.shape, jnp.int32), jnp.int32(0))

    def _training(self, c, i, stopped, extra):
        """The members that take step ``i`` of the call (unless not finite)."""
        return (i < c.count) & ~stopped & ~_ended(extra)

    def step(self, c, env, carry, perm, t, i, active):
        leaves, stopped, extra, (applied, ran) = carry
        new, out, ok = self.members_step(leaves, c.key, c.xs, c.hp, perm, c.data, t, i)
        training = self._training(c, i, stopped, extra)
        if active is not None:
            training = training & active
        take = training & ok
        if self.checks is not None:
            new, extra = self._vmap(self.checks.accumulate, (0, 0, 0, 0))(
                new, out, take, extra
            )
        leaves = [_where(take, n, x) for n, x in zip(new, leaves)]
        applied = applied + take.astype(applied.dtype)
        ran = jnp.where(jnp.any(training), i + 1, ran)
        return (leaves, stopped | (training & ~ok), extra, (applied, ran)), out

    def _vmap(self, fn, in_axes, out_axes=0):
        return jax.vmap(
            fn, in_axes=in_axes, out_axes=out_axes, spmd_axis_name=self.members
        )

    def before(self, c, env, carry, t):
        if self.collector is None:
            return carry, {}
        leaves, stopped, extra, lane = carry
        i = t - c.start
        training = self._training(c, i, stopped, extra)
        collector, checks = self.collector, self.checks
        due = collector.due(t)
        collect = self._vmap(collector.collect_into, (0, 0))
        kept = (list(leaves), collector.nan_metrics(stopped.shape))
        new, metrics = once_if(
            due, collect, lambda leaves, hp: kept, leaves, c.hp
        )  # (a member that no longer trains keeps its feed)
        got = due & training
        leaves = [_where(got, n, x) for n, x in zip(new, leaves)]
        if checks is not None:
            leaves, extra = self._vmap(checks.collected, (0, 0, 0, 0))(
                leaves, metrics, got, extra
            )
        return (leaves, stopped, extra, lane), {"collected": got, "rollout": metrics}

    def after(self, c, env, carry, t1):
        if self.checks is None:
            return carry, {}
        leaves, stopped, extra, lane = carry
        checks = self.checks
        # the members that took the chunk's last step (``t1 - 1``)
        took = self._training(c, t1 - 1 - c.start, stopped, extra)

        def work(leaves, eval_data, key, hp, extra):
            def one(leaves, key, hp, extra):
                # the solo run's evaluation key: fit's key (the member's), then
                # the step
                eval_key = jr.fold_in(jr.split(key)[0], t1 - 1)
                return checks.work(t1, leaves, eval_data, eval_key, hp, extra)

            out_axes = _fit_checks.Checked(0, 0, 0, 0)
            return self._vmap(one, (0, 0, 0, 0), out_axes)(leaves, key, hp, extra)

        due = checks.due(t1)
        args = (leaves, c.aux["eval"], c.key, c.hp, extra)
        checked = _fit_chunks.when(due & jnp.any(took), work, args)
        keep = ft.partial(_where, took)  # (the rest: as they were)
        leaves = [keep(n, x) for n, x in zip(checked.leaves, leaves)]
        if extra is not None:
            extra = checked.carry._replace(
                rule=jtu.tree_map(keep, checked.carry.rule, extra.rule),
                best=[keep(n, x) for n, x in zip(checked.carry.best, extra.best)],
                total=keep(checked.carry.total, extra.total),
                count=keep(checked.carry.count, extra.count),
            )
        return (leaves, stopped, extra, lane), {
            "val": checked.val,
            "evaluated": due & took,
        }

    def running(self, c, i, stopped, extra, lane):
        return (i < jnp.max(c.count)) & ~jnp.all(stopped | _ended(extra))

    def finish(self, c, i, carry, bufs):
        leaves, stopped, extra, (applied, ran) = carry
        report = _fit_program.Report(applied, ran, stopped, _ended(extra)).packed()
        # What the host reads after the call, readable by every process (members
        # split over processes' devices gathered); the carry keeps its placement.
        (report, bufs), (leaves, stopped, extra) = self.place.readable(
            (report, bufs), (leaves, stopped, extra)
        )
        return _fit_program.Out(leaves, stopped, report, bufs, extra)


def _ended(extra: Any) -> Any:
    """Members stopped by their early-stop rule."""
    if extra is None:
        return jnp.array(False)
    return extra.rule.stopped


def _where(take: Any, new: Any, old: Any) -> Any:
    """``new`` for the members where ``take``, else ``old`` (a member axis first)."""
    return jnp.where(take.reshape(take.shape + (1,) * (new.ndim - 1)), new, old)


class GroupResult(NamedTuple):
    """What a group's run gives ``fit_population`` (``Group.result``)."""

    leaves: list  # the members' state (the best kept where stop= restores it)
    stopped: np.ndarray  # per member: stopped by a non-finite step
    history: dict
    applied: np.ndarray  # per member: the steps applied
    done: int  # the steps run (the group's clock)
    best_step: np.ndarray | None
    execution: str = "fused"  # how its last call ran


class Group:
    """What ``_fit_loop.Run`` trains for a group of a population's members
    (``idx``; the first ``real`` are members, the rest padding to the group's
    size): their state with a member axis, their hyperparameters and keys. A
    member whose step is not finite stops alone (the loop keeps its last good
    state); the run ends when every member has stopped."""

    def __init__(self, pop: Any, feats: Any, idx: np.ndarray, real: int, keys: Any):
        self.pop, self.feats, self.idx, self.real = pop, feats, idx, real
        self.keys = keys
        self.members = len(idx)
        self.hp = {name: v[idx] for name, v in pop.hp().items()}
        self.mask = np.asarray(pop.stopped)[idx]  # stopped members, on the host
        self.applied = np.zeros(self.members, np.int64)
        self.checked = None  # (state, stopped, step) after the last call read
        self.label = _CALL

    def init(self, run: Any, carry: Carry, key: Any) -> tuple[Carry, Any]:
        leaves, stopped, extra = carry.leaves, jnp.asarray(self.mask), None
        checks = run.checks
        if checks is not None and checks.stop is not None:
            # (else no copy of the state; best_dir= saves it)
            keep = checks.stop.restore_best or run.extras.best is not None
            extra = jax.vmap(lambda x: checks.init(x if keep else []))(leaves)
        # population parallelism: members split over devices (on a mesh)
        leaves, key, self.hp, stopped, extra = run.place.by_member(
            (leaves, self.keys, self.hp, stopped, extra)
        )
        return Carry(leaves, stopped, extra), key

    def begin(self, run: Any) -> None:
        """(``fit_population`` keeps the state of the last call read)"""

    def shared_shuffle(self, run: Any) -> bool:
        """Shared batches of shuffled array data: their order comes from fit's
        key, not the members' (which the checkpoint's key slot holds), so the
        checkpoint keeps it too."""
        source = run.source
        return getattr(source, "shuffle", False) and source.members is None

    def names(self, run: Any) -> list[str]:
        own = self.feats.names()
        names = [f"members.{name}" for name in own] + ["members.stopped"]
        if run.extra is not None:
            rule = [f"members.stop.rule.{f}" for f in run.extra.rule._fields]
            best = [f"members.stop.best.{n}" for n in own if run.extra.best]
            names += [*rule, *best, "members.stop.total", "members.stop.count"]
        return [*names, "shuffle_key"] if self.shared_shuffle(run) else names

    def describe(self, run: Any) -> dict:
        """The data and the members' hyperparameters: a sweep re-run with other
        values in the same directory is refused, not silently restored."""
        values = {k: [float(x) for x in np.asarray(v)] for k, v in self.hp.items()}
        return {**run.source.describe(), "hyperparameters": values}

    def saved(self, run: Any, carry: Carry) -> list:
        shuffle = [run.source.key] if self.shared_shuffle(run) else []
        return [*carry.leaves, carry.stopped, *jtu.tree_leaves(carry.extra), *shuffle]

    def load(self, run: Any, saved: list) -> Carry:
        n, extra = len(run.leaves), run.extra
        stopped = saved[n]
        self.mask = _mesh.host_value(stopped)
        rest = list(saved[n + 1 :])
        if self.shared_shuffle(run):  # the saved shuffle (use_key: the members')
            run.source.use_key(rest.pop())
        if extra is not None:
            extra = jtu.tree_unflatten(jtu.tree_structure(extra), rest)
        return Carry(list(saved[:n]), stopped, extra)

    def use_key(self, run: Any, key: Any) -> Any:
        """Continue with the members' ``key`` (a checkpoint's): their shuffles
        too, when each member has its own data order."""
        if getattr(run.source, "members", None) is not None:
            run.source.for_members(key)
        return key

    def restored(self, run: Any, history: dict) -> None:
        """The steps each member had applied (its finite losses)."""
        self.applied += np.isfinite(history["loss"]).sum(axis=1)

    def _finite(self, leaves: list, m: int) -> bool:
        """Whether every trained parameter of member ``m`` (its place in this
        call's group) is finite."""
        trained = self.pop.trained()
        return _model_step.finite_on_host(leaves[j][m] for j in trained)

    def stopped_by_rule(self, run: Any) -> bool:
        """(members stop one by one, inside the loop)"""
        return False

    def count(self, run: Any, steps: int) -> tuple[Any, int]:
        """Every member takes the steps (the loop skips stopped members); no
        in-loop reports."""
        return np.full(self.members, steps, np.int32), steps + 1

    def compile(self, run: Any, args: Any, mode: str) -> Any:
        try:
            return run.execution.executable(args, mode)
        except _population.PYTHON_VALUE_ERRORS as err:  # while tracing the step
            raise errors.hp_used_as_python_value(list(self.hp), err) from err

    def collect(self, run, start, end, out, args, report, ys, dispatched) -> Read:
        ys = jtu.tree_map(lambda v: np.moveaxis(v, 0, 1), ys)  # [members, steps]
        counts = np.asarray(report.applied).astype(np.int64)
        ran = int(report.ran)  # (fewer than asked: every member stopped)
        run.schedule.ran(max(ran, 1), dispatched)
        bad = np.asarray(report.stopped) & ~self.mask  # stopped in this call
        if bad.any():  # (their bad step was not applied)
            self.mask = self.mask | bad
            rows = [m for m in np.flatnonzero(bad) if m < self.real]
            group = [int(m) for m in self.idx[: self.real]]
            group = group if len(group) < self.pop.n else None
            # (a member's last applied update may have made its parameters
            # non-finite, only its next loss showing it: tested on the host,
            # only for the members that stopped)
            held = [int(self.idx[m]) for m in rows if not self._finite(out.leaves, m)]
            run.warn(
                errors.nonfinite_members(
                    [int(self.idx[m]) for m in rows],
                    [start + int(counts[m]) + 1 for m in rows],
                    self.pop.n,
                    int((~self.mask[: self.real]).sum()),
                    group,
                    held,
                )
            )
        recorded = run.history.add(start, ys, counts, ran)
        self.applied += counts
        # (a call dispatched after every member stopped ran none)
        self.checked = (out.leaves, self.mask, run.done + ran)  # (one assignment)
        training = ~self.mask
        if out.extra is not None:
            training &= ~np.asarray(report.ended)
        postfix = {}  # (only what a bar shows)
        last = ys["loss"][:, ran - 1][training] if ran else ys["loss"][:0, 0]
        if last.size and run.spec is not None:
            postfix = {
                "best": f"{np.nanmin(last):.4g}",
                "median": f"{np.nanmedian(last):.4g}",
            }
        state = Carry(out.leaves, out.stopped, out.extra)
        complete = ran == end - start
        call = _fit_hooks.Collected(start, end, complete, state, recorded, postfix)
        return Read(ran, not training.any(), None, call)

    def hand_over(self, run: Any) -> None:
        """(the population is updated once, by ``fit_population``)"""

    def interrupted(self, run: Any) -> None:
        """(``fit_population`` keeps the last checked state, ``checked``)"""

    def best_steps(self, run: Any) -> np.ndarray | None:
        """Per member, the step of the best state kept by ``stop=`` (``-1``:
        none, the member keeps its last state); None when nothing is restored."""
        if not run.restoring:
            return None
        return _mesh.host_value(run.extra.rule.best_step).astype(np.int64)

    def result(self, run: Any) -> GroupResult:
        leaves, best = run.leaves, self.best_steps(run)
        if best is not None:  # each member with a kept state gets it back
            names, kept = self.feats.names(), jnp.asarray(best >= 0)
            keeps_last = self.feats.keeps_last
            leaves = best_state(names, run.extra.best, leaves, keeps_last, kept)
        history = run.history.result()
        return GroupResult(
            leaves,
            self.mask,
            history,
            self.applied,
            run.done,
            best,
            run.execution.mode,
        )
