"""``scanax.fit`` of one model: its run (``fit_model``: the state laid out,
placed, its program built or found, trained) and its kind (``Model``: what
``_fit_loop.Run`` trains for it, and what that changes on the host)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _caller, _fingerprint
from .._errors import fit as errors
from . import (
    checkpoint as _checkpoint,
    chunks as _fit_chunks,
    engine as _fit_loop,
    feature as _feature,
    hooks as _fit_hooks,
    plan as _fit_plan,
    program as _fit_program,
    schedule as _fit_schedule,
)
from .callbacks import best as _best
from .data import rollout as _rollout
from .engine import Read
from .models import adapt as _models, step as _model_step
from .program import Carry, Chunk, Report, false
from .result import FitResult, best_state

_CALL = errors.CALL


def fit_model(adapter: Any, opt_state: Any, setup: Any) -> FitResult:
    """One model's run: its state laid out (the model's, then its features'),
    placed, its program built (or found), then trained from its optimizer's
    step."""
    start = adapter.start_step()
    if start is None:
        if opt_state is not None:
            warnings.warn(
                errors.no_step_count(), RuntimeWarning, stacklevel=_caller.user_level()
            )
        start = 0
    place, source, spec = setup.place, setup.source, setup.spec
    base = _models.Flat(adapter)
    features, feed = list(setup.features), None
    if isinstance(source, _rollout.RolloutSource):  # the feed joins the state
        feed = _rollout.Feeder(source)
        features.append(feed)
    feats = _feature.Features(base, features, start)
    leaves = _checkpoint.strong(feats.state)
    place.check_unplaced(feats.names(), leaves, pop=False)
    leaves, shardings = place.state(feats, leaves, setup.shard)
    # In-loop bar reports only where calls are not sized to a quarter second:
    # host batches, or a steps_per_call of the user's.
    ticks = spec is not None and place.local
    ticks = ticks and not source.sized_automatically(setup.steps_per_call)
    eval_arrays = place.replicate(setup.eval_arrays)
    checks = _with_eval(setup.checks, feats)
    bar_every = spec.every if spec is not None and not ticks else None
    cuts = _fit_schedule.cuts(setup)
    program = _model_program(feats, checks, setup, shardings, ticks, feed, cuts)
    schedule = _fit_schedule.Schedule(
        program,
        setup.length,
        source,
        setup.steps_per_call,
        setup.checkpoint_every,
        bar_every,
    )
    how = _fit_loop.How(start, start + setup.steps, spec, place, ticks, setup.execution)
    best = None
    if setup.best_dir is not None:  # the model's own leaves, first in the state
        writer = _best.BestWriter(setup.best_dir, feats.names()[: feats.n], None)
        # (Ema(on_eval=True): the best judged on the average, saved as such)
        best = _best.BestSaver(writer, feats.eval_view)
    extras = _fit_loop.Extras(checks, eval_arrays, setup.loggers, best)
    kind = Model(base, feats, place)
    run = _fit_loop.Run(kind, source, program, schedule, leaves, how, extras)
    if setup.checkpoint_dir is not None:
        run.resume(setup.checkpoint_dir, setup.checkpoint_every)
    try:
        result = run.go()
    except BaseException as err:
        if run.done == start and isinstance(err, (TypeError, ValueError)):
            found = getattr(adapter, "state_for_another_model", lambda: None)()
            if found is not None:  # (failed tracing: nothing ran)
                raise errors.optimizer_for_another_model(found) from err
        # (NNX objects keep the last checked state in place: the feed with it)
        if feed is not None and kind.finished is not None and base.kind == "nnx":
            feed.keep(kind.finished, feats.at_of(feed), run.done)
        # (the NNX objects, an Equinox or TrainState ``fit_result``, hold
        # run.done: a resumable iterator given again continues there)
        rewound = source.rewind(run.done - start)
        if isinstance(err, KeyboardInterrupt) or run.done != start:
            read = (rewound, source.past(run.done - start), run.done)
            if base.kind == "nnx":
                # (a checkpoint restored, no call of it read: the objects are
                # as given, and the same call resumes from it)
                held = run.done if kind.finished is not None else start
                _note(err, held, start, start + setup.steps, *read)
            _attach(err, kind, run, base.kind == "nnx", read)
        raise
    if feed is not None:  # the Rollout continues from the state handed back
        feed.keep(kind.finished, feats.at_of(feed), run.done)
    if checks is not None:  # (after the run: a refused one warns of nothing)
        checks.warn_unreached(start, setup.steps)
    for logger in setup.loggers:
        logger.sinks.raise_pending(result)
    return result


def _attach(err: BaseException, kind: Model, run: Any, nnx: bool, read: tuple) -> None:
    """Ctrl-C, or an error after steps ran: the result of the last checked
    state (``kind.partial``; None for an NNX run that checked none) as the
    exception's ``fit_result``, said in a note (Equinox and TrainState results
    are new objects, not otherwise returned), with what became of the batches
    read ahead (``read``: as ``_note``'s) for them.
    Never in the way of the run's own error: a result that cannot be made is
    not attached."""
    try:
        result = kind.partial(run, nnx)
        err.fit_result = result
    except Exception:  # noqa: BLE001 - the run's own error goes on as it is
        return
    if result is not None and hasattr(err, "add_note"):  # (Python 3.11+)
        name = type(err).__name__
        err.add_note(errors.fit_result_attached(result.steps, nnx, name, *read))


def _note(err: BaseException, done: int, start: int, end: int, *read: Any) -> None:
    """Ctrl-C on an NNX fit, or an error after steps ran (a failed save, the
    data): which step the objects hold, the ``steps=`` that ends the run, and
    what became of the batches read ahead."""
    how = "stopped by this error"
    if isinstance(err, KeyboardInterrupt):
        how = "interrupted"
    note = errors.interrupted_nnx(done, start, end, *read, how=how)
    if hasattr(err, "add_note"):  # (Python 3.11+)
        err.add_note(note)
    else:
        warnings.warn(note, RuntimeWarning, stacklevel=_caller.user_level())


def _model_program(
    feats: Any,
    checks: Any,
    setup: Any,
    shardings: Any,
    ticks: bool,
    feed: Any,
    cuts: tuple,
) -> Any:
    """One model's chunk program, from the cache when an earlier ``fit`` had
    the same structure."""
    base, loss_fn, takes_key = feats.base, setup.loss_fn, setup.takes_key
    plain = loss_fn if takes_key else (lambda model, batch, key: loss_fn(model, batch))
    call = feats.wrap_loss(plain, base.kind)
    fingerprint = base.fingerprint()
    identity = _fit_program.identity(
        None if fingerprint is None else (fingerprint, feats.key()),
        loss_fn,
        None if checks is None else checks.key(),
        _fingerprint.key(setup.eval_call),
        takes_key,
        # (by fingerprint: a re-defined model class has a new treedef, the same
        # program)
        _fingerprint.key(base.treedef),
        setup.source.static,
        setup.length,
        shardings,
        ticks,
        cuts,
    )
    sampler = setup.source.sampler()  # no data, no iterator: what the loop needs

    def build():
        lanes = _fit_chunks.Solo(
            feats.step_factory(lambda hp: call, setup.accumulate),
            sampler,
            setup.place,
            shardings,
            takes_key,
            checks,
            setup.accumulate,
            feats.base.trained(),
            None if feed is None else feed.collector,
        )
        periods = (
            None if checks is None else checks.every,
            None if feed is None else feed.rollout.period,
        )
        return _fit_chunks.build_chunk(
            lanes, sampler, setup.length, ticks, periods, cuts
        )

    return _fit_program.program(identity, build)


def _with_eval(checks: Any, feats: Any) -> Any:
    """``checks`` with its evaluation on one model's flat leaves (in eval mode,
    in the precision computed in)."""
    if checks is None:
        return None
    evaluate = None
    if checks.evaluate is not None:
        call = feats.wrap_loss(checks.evaluate, feats.base.kind)
        evaluate = feats.eval_factory(lambda hp: call)
    return checks.bound(feats, evaluate)


class _Differs(Exception):
    """A replay of a bad call did not reproduce its run."""


class Model:
    """What ``Run`` trains for one model: its state as flat leaves (the
    model's, ``base``: a ``_models.Flat``, then its features', ``feats``). A
    non-finite step stops the run: the call's good steps are recomputed and
    the run ends with the last good state (see ``_fit_chunks.Chunks``)."""

    members = None
    hp = None
    label = _CALL

    def __init__(self, base: Any, feats: Any, place: Any):
        self.base, self.feats, self.place = base, feats, place
        self.handed = None  # the (model, optimizer) given the last state early
        self.first: list | None = None  # the state training started from
        self.finished: list | None = None  # the state last handed back
        self.results: dict = {}  # the features' results of that state

    def init(self, run: Any, carry: Carry, key: Any) -> tuple[Carry, Any]:
        if run.checks is not None:
            carry = carry._replace(extra=run.checks.init(carry.leaves))
        return carry, key

    def begin(self, run: Any) -> None:
        self.first = run.good

    def names(self, run: Any) -> list[str]:
        """The names of the checkpointed leaves."""
        names = self.feats.names()
        if run.extra is None:
            return names
        rule = [f"stop.rule.{f}" for f in run.extra.rule._fields]
        return [
            *names,
            *rule,
            *(f"stop.best.{n}" for n in names),
            "stop.total",
            "stop.count",
        ]

    def describe(self, run: Any) -> dict:
        """What a checkpoint records of the run's inputs (a resume must see the
        same): the data."""
        return run.source.describe()

    def saved(self, run: Any, carry: Carry) -> list:
        """What a checkpoint holds: the state's leaves (and, with an early stop,
        the rule's state and the best state kept)."""
        if carry.extra is None:
            return list(carry.leaves)
        return [*carry.leaves, *jtu.tree_leaves(carry.extra)]

    def load(self, run: Any, saved: list) -> Carry:
        n, extra = len(run.leaves), run.extra
        if extra is not None:
            extra = jtu.tree_unflatten(jtu.tree_structure(extra), saved[n:])
        return Carry(list(saved[:n]), run.stopped, extra)

    def use_key(self, run: Any, key: Any) -> Any:
        """Continue with ``key`` (a checkpoint's): the shuffle and the per-step
        keys both come from it."""
        run.source.use_key(key)
        return key

    def restored(self, run: Any, history: dict) -> None:
        """(nothing to count: the history holds one model's steps)"""

    def stopped_by_rule(self, run: Any) -> bool:
        """Whether the early-stop rule has said stop (a restored checkpoint of
        a call that stopped early): nothing is left to train."""
        if run.extra is None:
            return False
        return bool(jax.device_get(run.extra.rule.stopped))

    def count(self, run: Any, steps: int) -> tuple[Any, int]:
        return np.int32(steps), run.every(steps)

    def compile(self, run: Any, args: Chunk, mode: str) -> Any:
        return run.execution.executable(args, mode)

    def collect(self, run, start, end, out, args, report, ys, dispatched) -> Read:
        count, early = int(report.applied), bool(report.ended)
        run.schedule.ran(end - start, dispatched)
        leaves, extra, redone = out.leaves, out.extra, None
        halted = run.halted or early  # (early: the rule said stop, a clean end)
        bad = not bool(report.intact) or (not early and start + count < end)
        if run.halted:  # (dispatched before the run halted: it ran nothing)
            leaves, extra = run.good, run.state.extra
        elif bad:
            halted = True
            count, good, found = self._first_bad(run, args, report)
            leaves, extra = good.leaves, good.extra
            redone = Carry(leaves, good.stopped, extra)
            done = run.done + count - run.start
            if found:
                held = count == 0 and not self._finite(leaves)
                loss = ys["loss"][count]
                message = errors.nonfinite_step(
                    start + count, loss, done, run.restoring, held
                )
                run.warn(message)
            else:
                run.warn(errors.replay_differs(start, done))
        recorded = run.history.add(start, ys, count, count)
        postfix = {}  # (only what a bar shows)
        if count and run.spec is not None:
            postfix["loss"] = f"{float(ys['loss'][count - 1]):.4g}"
            for name, values in run.history.val.items():  # the last evaluation
                if name != "val_step" and values and len(values[-1]):
                    postfix[name] = f"{float(np.ravel(values[-1][-1])[0]):.4g}"
        complete = not halted and start + count == end
        state = Carry(leaves, out.stopped, extra)
        call = _fit_hooks.Collected(start, end, complete, state, recorded, postfix)
        return Read(count, halted, redone, call)

    def _finite(self, leaves: list) -> bool:
        """Whether every trained parameter in ``leaves`` is finite (tested on
        the host, once, when a call's first step was bad)."""
        return _model_step.finite_on_host(leaves[j] for j in self.base.trained())

    def _first_bad(self, run: Any, args: Chunk, report: Report) -> tuple:
        """``(b, out, found)`` of a call that hit a bad step: its first bad
        step's place in the call, and the call's output after the ``b`` good
        steps before it (the same program on the same inputs, replayed for
        ``b`` steps: bit-identical). A step whose own test stopped the loop
        (``report.applied``) is the bad one when the parameters are intact at
        the call's end; else a bad step marked them (``_fit_program.marked``):
        the last replay that leaves them intact is found by bisection, trying
        the steps just before a loss that stopped the loop first (a marked
        parameter makes the next step's loss NaN). A replay that does not
        reproduce the run (steps that are not deterministic) ends the search
        at the call's start, the last state known good (``found`` False)."""
        applied, stopped = int(report.applied), bool(report.stopped)
        outs: dict[int, Any] = {}  # steps replayed: the output, where good
        tried: set[int] = set()
        marks = _fit_plan.chunked()  # (else the program does not test them)

        def good(c: int) -> bool:
            if c in tried:
                return c in outs
            tried.add(c)
            out = self._replay(run, args, c)
            got = Report.read(jax.device_get(out.report))
            expected = min(c, applied) if stopped else c
            if int(got.applied) != expected:
                raise _Differs
            # (the parameters tested on the host only for a replay that counts)
            if c == expected and got.intact and (marks or self._intact(args, out)):
                outs[c] = out
            return c in outs

        try:
            if bool(report.intact):
                if good(applied):
                    return applied, outs[applied], True
                if marks:  # (the run's parameters were intact, the replay's not)
                    raise _Differs
                # On CPU: an update made a parameter non-finite from finite
                # gradients, and a later loss stopped the loop: found as a
                # marked parameter is, by the parameters.
            # Each replay runs from the call's start: about log2 of its steps.
            lo, hi, tries = 0, applied + 1 if stopped else applied, 0
            while hi - lo > 1:
                c = hi - 1 if stopped and tries < 2 else (lo + hi) // 2
                tries += 1
                lo, hi = (c, hi) if good(c) else (lo, c)
            if lo not in outs:  # (0: the call's input, never replayed)
                good(lo)
            return lo, outs[lo], True
        except _Differs:  # (no step: the call's input, as it came in)
            good(0)
            return 0, outs[0], False

    def _intact(self, args: Chunk, out: Any) -> bool:
        """Whether no trained parameter element finite at the call's start is
        non-finite in ``out`` (on the host, once per replay of a bad call: the
        program tests it off CPU only, where gradients mark parameters)."""
        trained = self.base.trained()
        before = [args.leaves[j] for j in trained]
        return bool(_fit_program.intact(before, [out.leaves[j] for j in trained]))

    def _replay(self, run: Any, args: Chunk, count: int) -> Any:
        """The call of ``args`` replayed for its first ``count`` steps."""
        again = args._replace(
            stopped=false(), count=np.int32(count), every=np.int32(count + 1)
        )  # count + 1: no reports
        return run.call(again)

    def hand_over(self, run: Any) -> None:
        """Give the objects the state while the last call runs (an NNX update
        then overlaps it); a bad step found after replaces it. (Not when the
        best state kept by the early stop replaces it anyway.)"""
        self.handed = None if run.restoring else self.finish(run.leaves)

    def interrupted(self, run: Any) -> None:
        """Interrupted or failed: NNX objects keep the last checked state."""
        if self.handed is not None or run.good is not self.first:
            self.finish(run.good)

    def best_step(self, run: Any) -> int | None:
        """The step of the best state kept by the early stop (to restore)."""
        if not run.restoring:
            return None
        step = int(jax.device_get(run.extra.rule.best_step))
        return step if step >= 0 else None

    def result(self, run: Any) -> FitResult:
        best = self.best_step(run)
        if best is not None:  # EarlyStop(restore_best=True): the best state
            names = self.names(run)
            kept = best_state(names, run.extra.best, run.leaves, self.feats.keeps_last)
            model, optimizer = self.finish(kept)
        elif self.handed is None or run.halted:
            model, optimizer = self.finish(run.leaves)
        else:
            model, optimizer = self.handed  # (already holding the last state)
        steps = run.done - run.start
        history = run.history.result()
        return FitResult(
            model,
            optimizer,
            history,
            steps,
            best,
            execution=run.execution.mode,
            **self.results,
        )

    def partial(self, run: Any, nnx: bool) -> FitResult | None:
        """An interrupted run's result: the last state checked and handed back
        (``interrupted``), the history of its steps (the rows of the calls
        checked). None checked: an Equinox or TrainState run's starting state
        (a checkpoint's when one was restored); None for NNX, whose objects
        are as given."""
        if self.finished is None and nnx:
            return None
        leaves = self.finished if self.finished is not None else self.first
        model, optimizer = self.finish(leaves)  # (NNX: what the objects hold)
        done = run.done  # (of ``leaves``: the last call checked, or the start)
        history = run.history.result()
        return FitResult(
            model,
            optimizer,
            history,
            done - run.start,
            execution=run.execution.mode,
            **self.results,
        )

    def finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place),
        and the features' results of that state."""
        back = self.place.hand_back(leaves)  # (on the user's mesh)
        self.finished, self.results = leaves, self.feats.results(back)
        return self.base.finish(back[: self.feats.n])
