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
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import _caller, _fingerprint
from .._errors import population as errors
from . import (
    chunks as _fit_chunks,
    engine as _fit_loop,
    feature as _feature,
    members as _fit_members,
    memory as _memory,
    program as _fit_program,
    schedule as _fit_schedule,
)
from .callbacks import best as _best
from .data import iterables as _iterables, rollout as _rollout
from .models import population as _population
from .result import FitResult

_CALL = errors.FIT


def fit_population(
    pop: _population.Population,
    setup: _fit_loop.Setup,
    shared: bool,
    members_per_call: int | None,
    eval_takes: tuple[bool, bool] | None,
) -> FitResult:
    """Train every member of ``pop`` for ``setup.steps`` more steps; ``pop`` is
    updated in place. Members run ``members_per_call`` at a time (all by
    default); ``shared``: every member gets the batches of a solo run.
    ``eval_takes``: what ``setup.eval_call`` takes after ``(model, batch)``, as
    ``loss_fn``'s (``(takes_hp, takes_key)``), when it evaluates."""
    start = pop.step  # (the run's first call from 0: ``warn_unreached``)
    if np.all(pop.stopped):
        warnings.warn(
            errors.every_member_stopped(pop.n),
            RuntimeWarning,
            stacklevel=_caller.user_level(),
        )
    sweep = Sweep(pop, setup, shared, eval_takes)
    # members_per_call=None: all at once if the first call fits in memory, else
    # the largest groups that do; decided from the compiled call before anything
    # runs or is written. Not across processes (they would have to agree on the
    # groups) and not for iterable data (checking would take its batches).
    k, prepared = members_per_call or pop.n, None
    if (
        members_per_call is None
        and jax.process_count() == 1
        and not isinstance(setup.source, _iterables.IterSource)
    ):
        k, prepared = _fitting_groups(
            pop.n,
            lambda k: sweep.run(k, list(range(k))),
            setup.place,
            setup.loggers,
            setup.checkpoint_dir,
        )
    result = sweep.train(k, prepared)
    if setup.checks is not None:  # (after the run: a refused one warns of nothing)
        setup.checks.warn_unreached(start, setup.steps)
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
        self.keys = jr.split(key if key is not None else _iterables.unused_key(), pop.n)
        features, self.feed = list(setup.features), None
        if isinstance(source, _rollout.RolloutSource):  # the feeds join the state
            self.feed = _rollout.Feeder(source, self.keys)
            features.append(self.feed)
        self.feats = feats = _feature.Features(pop, features, pop.step)
        # the members' own leaves (a feature's state is placed with theirs)
        n = feats.n
        setup.place.check_unplaced(feats.names()[:n], list(feats.state)[:n], pop=True)
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
            self.best = _best.BestWriter(setup.best_dir, names, pop.n)

    def _evaluation(self, eval_fn: Any, eval_takes: Any) -> None:
        """Each member's evaluation (``eval_fn`` None: early stop on a
        training metric only)."""
        checks, evaluate = self.checks, None
        if eval_fn is not None:
            call_for = _call_for(eval_fn, *eval_takes, self.feats, self.pop.kind)
            evaluate = self.feats.eval_factory(call_for)
            self.eval_arrays = self.setup.place.replicate(self.setup.eval_arrays)
        self.checks = checks.bound(self.feats, evaluate)
        self.eval_key = (checks.key(), _fingerprint.key(eval_fn), eval_takes)

    def program(self, k: int) -> _fit_program.Program:
        """The compiled loop of a group of ``k`` members (one per size)."""
        found = self.programs.get(k)
        if found is not None:
            return found
        pop, setup, place, feats = self.pop, self.setup, self.setup.place, self.feats
        fingerprint = pop.fingerprint()
        cuts = _fit_schedule.cuts(setup)
        identity = _fit_program.identity(
            None if fingerprint is None else (fingerprint, feats.key()),
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
            cuts,
        )
        sampler = setup.source.sampler()

        def build():
            lanes = _fit_members.Members(
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
            periods = _periods(self.checks, setup)
            return _fit_chunks.build_chunk(
                lanes, sampler, setup.length, False, periods, cuts
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
        kind = _fit_members.Group(pop, self.feats, idx, len(members), self.keys[idx])
        how = _fit_loop.How(
            pop.step, pop.step + setup.steps, spec, setup.place, False, setup.execution
        )
        best = None
        if self.best is not None:  # (Ema(on_eval=True): the average is judged, saved)
            pick = self.feats.eval_view
            best = _best.BestSaver(self.best, pick, np.asarray(members))
        extras = _fit_loop.Extras(self.checks, self.eval_arrays, setup.loggers, best)
        return _fit_loop.Run(kind, setup.source, program, schedule, leaves, how, extras)

    def train(self, k: int, prepared: _fit_loop.Run | None) -> FitResult:
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
        return _fit_members.GroupResult(
            [x[:real] for x in out.leaves],
            out.stopped[:real],
            history,
            out.applied[:real],
            out.done,
            best,
            out.execution,
        )

    def _merge(self, results: list) -> FitResult:
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
        return FitResult(
            _population.Members(pop, 0, made := {}),
            _population.Members(pop, 1, made),
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
