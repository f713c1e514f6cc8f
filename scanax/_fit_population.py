"""``scanax.fit`` on a population: the compiled loop vmapped over the members.

Each member is an independent run: its own state, its own hyperparameters (the
optimizer is rebuilt from them inside the step, see ``_population``), its own
keys and, unless batches are shared, its own data order. A member whose step is
not finite stops alone: it keeps its last good state (the call is replayed up to
its good steps, as a solo ``fit`` does) and the others train on.
"""

from __future__ import annotations

import functools as ft
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import (
    _caller,
    _data,
    _feature,
    _fingerprint,
    _fit_checks,
    _fit_hooks,
    _fit_loop,
    _fit_program,
    _fit_schedule,
    _memory,
    _mesh,
    _population,
    _rollout,
)
from ._errors import population as errors

_CALL = errors.FIT


def fit_population(
    pop: _population.Population,
    setup: _fit_loop.Setup,
    shared: bool,
    members_per_call: int | None,
    eval_takes: tuple[bool, bool] | None,
) -> _fit_loop.FitResult:
    """Train every member of ``pop`` for ``setup.steps`` more steps; ``pop`` is
    updated in place. Members run ``members_per_call`` at a time (all by
    default); ``shared``: every member gets the batches of a solo run.
    ``eval_takes``: what ``setup.eval_call`` takes after ``(model, batch)``, as
    ``loss_fn``'s (``(takes_hp, takes_key)``), when it evaluates."""
    sweep = Sweep(pop, setup, shared, eval_takes)
    # members_per_call=None: all at once if the first call fits in memory, else
    # the largest groups that do; decided from the compiled call before anything
    # runs or is written. Not across processes (they would have to agree on the
    # groups) and not for iterable data (checking would take its batches).
    k, prepared = members_per_call or pop.n, None
    if (
        members_per_call is None
        and jax.process_count() == 1
        and not isinstance(setup.source, _data.IterSource)
    ):
        k, prepared = _fitting_groups(
            pop.n,
            lambda k: sweep.run(k, list(range(k))),
            setup.place,
            setup.loggers,
            setup.checkpoint_dir,
        )
    result = sweep.train(k, prepared)
    for logger in setup.loggers:
        logger.sinks.raise_pending(result)
    return result


class Sweep:
    """One population ``fit``: the members' keys, loss and evaluation, the
    compiled program of each group size, and the run of each group."""

    def __init__(self, pop: Any, setup: Any, shared: bool, eval_takes: Any):
        self.pop, self.setup = pop, setup
        source, key = setup.source, setup.key
        self.per_member = not shared and getattr(source, "shuffle", False)
        self.keys = jr.split(key if key is not None else _data.unused_key(), pop.n)
        features, self.feed = list(setup.features), None
        if isinstance(source, _rollout.RolloutSource):  # the feeds join the state
            self.feed = _rollout.Feeder(source, self.keys)
            features.append(self.feed)
        self.feats = feats = _feature.Features(pop, features, pop.step)
        self.call_for = _call_for(
            setup.loss_fn, setup.takes_hp, setup.takes_key, feats, pop.kind
        )
        self.checks, self.eval_arrays, self.eval_key = setup.checks, None, None
        if self.checks is not None:
            self._evaluation(setup.eval_call, eval_takes)
        self.programs: dict[int, Any] = {}  # (fingerprints take milliseconds)
        self.best = None  # best_dir=: one writer for every group
        if setup.best_dir is not None:  # the members' own leaves, first
            names = feats.names()[: feats.n]
            self.best = _fit_hooks.BestWriter(setup.best_dir, names, pop.n)

    def _evaluation(self, eval_fn: Any, eval_takes: Any) -> None:
        """Each member's evaluation (``eval_fn`` None: early stop on a
        training metric only)."""
        checks, evaluate = self.checks, None
        if eval_fn is not None:
            call_for = _call_for(eval_fn, *eval_takes, self.feats, self.pop.kind)
            evaluate = self.feats.eval_factory(call_for)
            self.eval_arrays = self.setup.place.replicate(self.setup.eval_arrays)
        self.checks = checks.bound(self.feats, evaluate)
        fingerprint = None if eval_fn is None else _fingerprint.of(eval_fn)
        self.eval_key = (
            checks.key(),
            eval_fn if fingerprint is None else fingerprint,
            eval_takes,
        )

    def program(self, k: int) -> _fit_program.Program:
        """The compiled loop of a group of ``k`` members (one per size)."""
        found = self.programs.get(k)
        if found is not None:
            return found
        pop, setup, place, feats = self.pop, self.setup, self.setup.place, self.feats
        fingerprint = pop.fingerprint()
        identity = _fit_program.identity(
            None if fingerprint is None else (fingerprint, feats.key()),
            (pop.make, feats.key()),
            setup.loss_fn,
            "population",
            setup.takes_hp,
            setup.takes_key,
            setup.source.static,
            setup.length,
            self.per_member,
            k,
            place.fingerprint(),
            self.eval_key,
        )
        sampler = setup.source.sampler()

        def build():
            lanes = Members(
                feats.step_factory(self.call_for, setup.accumulate),
                sampler,
                place,
                setup.takes_key,
                setup.accumulate,
                0 if self.per_member else None,
                place.members_axis,
                self.checks,
                None if self.feed is None else self.feed.collector,
            )
            return _fit_program.build_chunk(
                lanes, sampler, setup.length, False, _periods(self.checks, setup)
            )

        found = self.programs[k] = _fit_program.program(identity, build)
        return found

    def run(self, k: int, members: list[int]) -> _fit_loop.Run:
        """The run of ``members`` in a group of ``k`` (padded with repeats)."""
        pop, setup = self.pop, self.setup
        program = self.program(k)
        spec = setup.spec
        schedule = _fit_schedule.Schedule(
            program,
            setup.length,
            setup.source,
            setup.steps_per_call,
            setup.checkpoint_every,
            spec.every if spec is not None else None,
        )
        pad = [members[j % len(members)] for j in range(k - len(members))]
        idx = np.asarray(members + pad)
        if self.per_member:
            setup.source.for_members(self.keys[idx])
        state = self.feats.state
        if len(idx) == pop.n and (idx == np.arange(pop.n)).all():
            leaves = list(state)  # (all at once: no copy of the state)
        else:
            leaves = [x[idx] for x in state]
        kind = Group(pop, self.feats, idx, len(members), self.keys[idx])
        how = _fit_loop.How(
            pop.step, pop.step + setup.steps, spec, setup.place, False, setup.execution
        )
        best = None
        if self.best is not None:  # (Ema(on_eval=True): the average is judged, saved)
            pick = self.feats.eval_view
            best = _fit_hooks.BestSaver(self.best, pick, np.asarray(members))
        extras = _fit_loop.Extras(self.checks, self.eval_arrays, setup.loggers, best)
        return _fit_loop.Run(kind, setup.source, program, schedule, leaves, how, extras)

    def train(self, k: int, prepared: _fit_loop.Run | None) -> _fit_loop.FitResult:
        """Train the members ``k`` at a time; ``prepared``: the first group's
        run, already compiled (the memory check's)."""
        n, directory = self.pop.n, self.setup.checkpoint_dir
        groups = [list(range(g, min(g + k, n))) for g in range(0, n, k)]
        if directory is not None:
            _check_layout(directory, groups, n)
        results = []
        for members in groups:
            if prepared is not None and members[0] == 0:
                run = prepared  # (its source was last given these members)
            else:
                run = self.run(k, members)
            results.append(self._group(run, members, len(groups)))
        return self._merge(results)

    def _group(self, run: _fit_loop.Run, members: list[int], groups: int) -> Any:
        """One group's result, its padding removed."""
        directory = self.setup.checkpoint_dir
        if groups > 1:
            name = f"members_{members[0]}-{members[-1]}"
            run.kind.label = f"{_CALL} [members {members[0]}-{members[-1]}]"
            if directory is not None:
                directory = os.path.join(os.fspath(directory), name)
        if directory is not None:
            run.resume(directory, self.setup.checkpoint_every)
        try:
            out = run.go()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: all members at once keep the
            # state of the last call checked, as a single model does (with
            # groups, the population keeps its state from before the call: its
            # members would stand at different steps).
            if groups == 1 and run.kind.checked is not None:
                self._update(*run.kind.checked)
            raise
        real = len(members)
        history = {k: v if v.ndim == 1 else v[:real] for k, v in out.history.items()}
        best = None if out.best_step is None else out.best_step[:real]
        return GroupResult(
            [x[:real] for x in out.leaves],
            out.stopped[:real],
            history,
            out.applied[:real],
            out.done,
            best,
            out.execution,
        )

    def _merge(self, results: list) -> _fit_loop.FitResult:
        """The population updated with every group's result, and fit's result."""
        pop = self.pop
        if len(results) > 1:
            state = [
                jnp.concatenate(parts) for parts in zip(*(r.leaves for r in results))
            ]
            history = merge_groups([r.history for r in results])
        else:
            state, history = results[0].leaves, results[0].history
        # The clock: the steps run (an iterable may end early; every member may
        # have stopped), by the group that ran longest.
        stopped = np.concatenate([r.stopped for r in results])
        found = self._update(state, stopped, max(r.done for r in results))
        best = None
        if results[0].best_step is not None:
            best = np.concatenate([r.best_step for r in results])
        return _fit_loop.FitResult(
            _population.Members(pop, 0),
            _population.Members(pop, 1),
            history,
            np.concatenate([r.applied for r in results]),
            best,
            execution=results[-1].execution,
            **found,
        )

    def _update(self, state: list, stopped: Any, step: int) -> dict:
        """The population updated to ``state`` (its features' leaves after the
        model's; a rollout's feeds left with the Rollout); the features'
        results."""
        feats = self.feats
        self.pop.update(state[: feats.n], stopped, step)
        if self.feed is not None:
            self.feed.keep(state, feats.at_of(self.feed), step)
        return feats.results(state)


def _fitting_groups(
    n: int, first_run: Callable, place: Any, loggers: tuple, directory: Any
) -> tuple[int, Any]:
    """The members per call: all ``n`` if the first call of all fits in the
    devices' free memory, else the largest groups that do (a warning says so);
    a ``MemoryError`` where groups cannot follow or nothing fits. Returned with
    the first group's run, compiled and checked."""
    multiple = place.members_multiple
    k, first = n, None
    while True:
        try:
            run = first_run(k)
            check_memory(run)
            break
        except TooBig as big:
            # (numbers only: the exception's traceback holds the run's arrays)
            first = first or (big.need, big.free)
            fit = _memory.members_that_fit(k, big.need, big.free, multiple)
            fit = min(fit, k - multiple)  # (a need not quite proportional)
            reason = "log" if loggers else None
            if reason is None and directory is not None:
                reason = "checkpoint"
            if fit < 1 or reason is not None:
                raise errors.population_too_big(
                    n, k, big.need, big.free, _memory.SHARE, max(fit, 0), reason
                ) from None
            k = fit
    if k < n:
        warnings.warn(
            errors.population_in_groups(n, n, k, *first, _memory.SHARE),
            RuntimeWarning,
            stacklevel=_caller.user_level(),
        )
    return k, run


def _check_layout(directory: Any, groups: list[list[int]], n: int) -> None:
    """A checkpoint directory holding checkpoints written with other groups than
    ``groups`` is refused: they would be silently ignored (each group keeps its
    own subdirectory). Groups not started yet, or started and never saved (a
    run interrupted early), are no conflict."""
    path = os.fspath(directory)
    if not os.path.isdir(path):
        return
    entries = os.listdir(path)
    found = sorted(e for e in entries if e.startswith("members_") and _saved(path, e))
    whole = any(e.isdigit() for e in entries)
    want = {f"members_{g[0]}-{g[-1]}" for g in groups}
    if found if len(groups) == 1 else whole or set(found) - want:
        raise errors.checkpoint_groups_differ(path, found, whole, len(groups[0]), n)


def _saved(path: str, entry: str) -> bool:
    """Whether the group directory ``entry`` holds a checkpoint (a step)."""
    sub = os.path.join(path, entry)
    return os.path.isdir(sub) and any(e.isdigit() for e in os.listdir(sub))


class TooBig(Exception):
    """A population's compiled call needs more memory than its devices have free
    (raised before it runs: nothing has changed)."""

    def __init__(self, need: int, free: int):
        super().__init__(need, free)
        self.need, self.free = need, free


def _call_for(
    fn: Callable, takes_hp: bool, takes_key: bool, feats: Any, kind: str
) -> Callable:
    """``call_for(hp)``: ``fn`` as ``call(model, batch, key)`` for a member with
    hyperparameters ``hp`` (computing in the features' precision, if one is
    given: ``feats.wrap_loss``)."""

    def plain(hp):
        if takes_hp and takes_key:
            return lambda model, batch, key: fn(model, batch, hp, key)
        if takes_hp:
            return lambda model, batch, key: fn(model, batch, hp)
        if takes_key:
            return lambda model, batch, key: fn(model, batch, key)
        return lambda model, batch, key: fn(model, batch)

    return lambda hp: feats.wrap_loss(plain(hp), kind)


def _periods(checks: Any, setup: Any) -> tuple[int, ...]:
    """The in-loop events' periods (a chunk boundary at each multiple):
    evaluation every, a rollout's collection."""
    out = []
    if checks is not None:
        out.append(checks.every)
    if isinstance(setup.source, _rollout.RolloutSource):
        out.append(setup.source.rollout.period)
    return tuple(out)


def merge_groups(histories: list[dict]) -> dict:
    """The histories of ``members_per_call`` groups as one: member rows stacked,
    on the union of their steps (a group whose members all stopped early ends
    sooner; NaN where a group has no entry)."""
    steps = ft.reduce(np.union1d, [h["step"] for h in histories])
    out = {"step": steps}
    for prefix in ("val_", "rollout_"):  # entries at their own steps
        if prefix + "step" in histories[0]:
            out[prefix + "step"] = ft.reduce(
                np.union1d, [h[prefix + "step"] for h in histories]
            )

    def steps_of(name: str) -> str:
        return next(
            (p + "step" for p in ("val_", "rollout_") if name.startswith(p)), "step"
        )

    for name, first in histories[0].items():
        if first.ndim == 1:
            continue
        axis = out[steps_of(name)]
        rows = []
        for h in histories:
            own = h[steps_of(name)]
            v = h[name]
            row = np.full((v.shape[0], len(axis), *v.shape[2:]), np.nan, v.dtype)
            row[:, np.searchsorted(axis, own)] = v
            rows.append(row)
        out[name] = np.concatenate(rows)
    return out


class Members(_fit_program.Lanes):
    """A population's members side by side: their step under ``vmap`` in one
    loop. A member takes step ``i`` while ``i < count[m]`` and it has not
    stopped; a non-finite step is not applied (a select per state leaf) and
    stops that member alone. The loop itself is not vmapped: a vmapped loop
    with a per-member condition would select every carried buffer at every
    step.

    With ``checks`` (``_fit_checks.Checks``): after each step, every member's
    running sums of its monitored training metric; at the chunk boundaries
    where a check is due, every member's evaluation, early-stop and plateau
    rules (``checks.work`` under ``vmap``, behind one ``lax.cond``: the
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
        new, metrics = jax.lax.cond(
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
        checked = _fit_program.when(due & jnp.any(took), work, args)
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
        report = _fit_program.Report(applied, ran, stopped, _ended(extra))
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

    def init(self, run: Any) -> None:
        run.key = self.keys
        run.stopped = jnp.asarray(self.mask)
        if run.checks is not None and run.checks.stop is not None:
            # (else no copy of the state; best_dir= saves it)
            keep = run.checks.stop.restore_best or run.best is not None
            run.extra = jax.vmap(lambda x: run.checks.init(x if keep else []))(
                run.leaves
            )
        # population parallelism: members split over devices (on a mesh)
        run.leaves, run.key, self.hp, run.stopped, run.extra = run.place.by_member(
            (run.leaves, run.key, self.hp, run.stopped, run.extra)
        )

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

    def saved(self, run: Any, leaves: list, stopped: Any, extra: Any) -> list:
        shuffle = [run.source.key] if self.shared_shuffle(run) else []
        return [*leaves, stopped, *jtu.tree_leaves(extra), *shuffle]

    def load(self, run: Any, saved: list) -> None:
        n = len(run.leaves)
        run.leaves, run.stopped = list(saved[:n]), saved[n]
        self.mask = _mesh.host_value(run.stopped)
        rest = list(saved[n + 1 :])
        if self.shared_shuffle(run):  # the saved shuffle (use_key: the members')
            run.source.use_key(rest.pop())
        if run.extra is not None:
            run.extra = jtu.tree_unflatten(jtu.tree_structure(run.extra), rest)

    def use_key(self, run: Any, key: Any) -> None:
        """Continue with the members' ``key`` (a checkpoint's): their shuffles
        too, when each member has its own data order."""
        run.key = key
        if getattr(run.source, "members", None) is not None:
            run.source.for_members(key)

    def restored(self, run: Any, history: dict) -> None:
        """The steps each member had applied (its finite losses)."""
        self.applied += np.isfinite(history["loss"]).sum(axis=1)

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

    def collect(self, run, start, end, out, args, report, ys, dispatched):
        ys = jtu.tree_map(lambda v: np.moveaxis(v, 0, 1), ys)  # [members, steps]
        counts = np.asarray(report.applied).astype(np.int64)
        ran = int(report.ran)  # (fewer than asked: every member stopped)
        run.schedule.ran(max(ran, 1), dispatched)
        bad = np.asarray(report.stopped) & ~self.mask  # stopped in this call
        if bad.any():  # (their bad step was not applied)
            self.mask = self.mask | bad
            rows = [m for m in np.flatnonzero(bad) if m < self.real]
            run.warn(
                errors.nonfinite_members(
                    [int(self.idx[m]) for m in rows],
                    [start + int(counts[m]) + 1 for m in rows],
                    self.pop.n,
                    int((~self.mask[: self.real]).sum()),
                )
            )
        recorded = run.history.add(start, ys, counts, ran)
        self.applied += counts
        run.done += ran  # (a call dispatched after every member stopped ran none)
        run.good = out.leaves
        self.checked = (out.leaves, self.mask, run.done)  # (one assignment)
        training = ~self.mask
        if out.extra is not None:
            training &= ~np.asarray(report.ended)
        if not training.any():
            run.halted = True
        postfix = {}  # (only what a bar shows)
        last = ys["loss"][:, ran - 1][training] if ran else ys["loss"][:0, 0]
        if last.size and run.spec is not None:
            postfix = {
                "best": f"{np.nanmin(last):.4g}",
                "median": f"{np.nanmedian(last):.4g}",
            }
        state = (out.leaves, out.stopped, out.extra)
        return _fit_hooks.Collected(
            start, end, ran == end - start, state, recorded, postfix
        )

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
            leaves = _fit_loop.best_state(
                names, run.extra.best, leaves, keeps_last, kept
            )
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


def check_memory(run: Any) -> None:
    """Compile a group's first call and raise ``TooBig`` if it would not fit in
    the devices' free memory, before anything runs or is written (array data:
    drawing its call's orders changes nothing)."""
    first = next(run.source.calls(run.done, run.end, run.schedule, run.place))
    with run.context():
        need = _memory.call_bytes(run.compiled(run.args(*first)))
    if need is None:
        return
    free = _memory.free_bytes(run.place.devices(run.leaves[0]))
    if free is not None and not _memory.fits(need, free):
        raise TooBig(need, free)
