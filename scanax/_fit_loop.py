"""The driver of ``scanax.fit``: what it returns (``FitResult``), the per-step
history, the call schedule and ``Run``, which runs one ``fit`` with a chunk
program from ``_fit_program``."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import (
    _caller,
    _checkpoint,
    _fit_hooks,
    _fit_schedule,
    _model_step,
    _stop,
)
from ._errors import (
    checkpoint as ckpt_errors,
    fit as errors,
    population as pop_errors,
)
from ._fit_history import History
from ._fit_program import Chunk, false

_CALL = errors.CALL
_REPORT_SECONDS = 0.1  # in-loop progress reports: about 10 a second


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
        best_step: with ``stop=EarlyStop(..., restore_best=True)``: the step
            whose state ``model`` holds (``steps`` still counts the steps
            trained); else None.
        ema: with ``fit(..., ema=decay)``: a model of the same kind (a new
            object) holding the moving average of the trained parameters (at
            ``best_step`` when the best state is restored); else None.
        execution: how the last call ran its steps, ``"fused"`` or
            ``"stepwise"`` (``fit(execution=)``; ``"auto"``'s choice).
        plateau: with ``fit(..., plateau=)``: the rule's state in the state
            returned (a ``PlateauState``; a population's: leaves ``[members]``;
            with a restored best state, that step's);
            ``fit(..., plateau_state=result.plateau)`` continues it; else None.
        loss_scale: with ``fit(..., precision="float16")``: the dynamic loss
            scale in the state returned (a ``LossScale``: the scale and the
            count of good steps since it last changed; a population's: leaves
            ``[members]``; with a restored best state, that step's);
            ``fit(..., loss_scale_state=result.loss_scale)`` continues it; else
            None.

    For a population (``scanax.population``): ``model[i]`` and ``optimizer[i]``
    are member ``i`` as ordinary objects of its kind; ``history`` arrays other
    than ``"step"`` are ``[members, steps]`` (NaN where a member did not train);
    ``steps`` is an int array, one count per member; with ``stop=`` restoring
    the best, ``best_step`` is an int array too, ``-1`` for a member with no
    best state kept (it keeps its last state); validation entries are
    ``[members, evaluations]``.
    """

    model: Any
    optimizer: Any
    history: dict[str, np.ndarray]
    steps: Any
    best_step: Any = None
    ema: Any = None
    execution: str = "fused"
    plateau: Any = None
    loss_scale: Any = None

    def plot(self, path: Any = None) -> Any:
        """Train loss (raw and smoothed) and every validation metric against the
        step, saved to ``path`` if given; returns the matplotlib figure (the
        ``plot`` extra: ``pip install scanax[plot]``)."""
        from . import _plot

        return _plot.plot(self.history, path)

    def best(self, metric: str = "loss", mode: str = "auto") -> int:
        """A population's best member: the index whose last finite value of
        ``metric`` is lowest (``mode="min"``) or highest (``"max"``); members
        with no finite value rank last. ``"auto"``: ``EarlyStop``'s rule (max for
        accuracies and similar names, min otherwise)."""
        if np.ndim(self.steps) != 1:
            raise pop_errors.best_not_population()
        names = sorted(
            k
            for k, v in self.history.items()
            if not k.endswith("step") and np.ndim(v) == 2
        )
        if metric not in names:
            raise pop_errors.best_metric(metric, names)
        values = self.history[metric]
        if mode not in ("auto", "min", "max"):
            raise pop_errors.best_mode(mode)
        if mode == "auto":
            mode = _stop.auto_mode(metric)
        values = np.asarray(values, np.float64)
        finite = np.isfinite(values)
        last = np.full(values.shape[0], np.nan)
        has = finite.any(axis=1)
        if has.any():  # (an empty history has no last value: all rank last)
            where = values.shape[1] - 1 - np.argmax(finite[:, ::-1], axis=1)
            last[has] = values[has, where[has]]
        sign = 1.0 if mode == "min" else -1.0
        return int(np.argmin(np.where(has, sign * last, np.inf)))


def best_state(
    names: list[str], best: list, last: list, keeps_last: Any, where: Any = None
) -> list:
    """The state an early stop restores: ``best``'s leaves, except the step
    counts (``_model_step.is_counter``) and what a feature keeps at the last
    step (``keeps_last(name)``: a rollout's feed), which keep ``last``'s: the
    next ``fit`` continues after the last step run with the data it would have
    had. ``where``: a population's per-member mask of the members with a best
    state (the others keep ``last``)."""
    out = []
    for name, b, x in zip(names, best, last):
        if _model_step.is_counter(name, x, where is not None) or keeps_last(name):
            out.append(x)
        elif where is None:
            out.append(b)
        else:
            out.append(
                jnp.where(where.reshape(where.shape + (1,) * (x.ndim - 1)), b, x)
            )
    return out


# ---------------------------------------------------------------------------- driver


class Setup(NamedTuple):
    """What ``fit``'s arguments come to, checked (``_fit.fit``): the inputs of
    one model's run or of a population's."""

    steps: int
    loss_fn: Any
    takes_hp: bool  # loss_fn takes a member's hyperparameters (a population)
    takes_key: bool  # loss_fn takes a per-step key
    key: Any  # fit's key, or None
    source: Any  # ``_data.ArraySource`` or ``_data.IterSource``
    accumulate: int
    steps_per_call: int | None
    length: int  # the compiled call's buffers
    checkpoint_dir: Any
    checkpoint_every: int | None
    place: Any  # ``_mesh.Placement``: the default device, or a mesh
    shard: str | None
    spec: Any  # the progress bar's ``_progress.Progress``, or None
    checks: Any  # ``_fit_checks.Checks`` (evaluation, early stop), or None
    eval_arrays: Any
    eval_call: Any  # eval_fn (or loss_fn) as given, with evaluation
    loggers: tuple  # ``_fit_checks.Logger`` per window length of the sinks
    features: tuple  # the features with state or step parts (``_feature``)
    best_dir: Any  # ``best_dir=``, or None
    execution: str = "auto"  # ``execution=``: "auto", "fused" or "stepwise"


class How(NamedTuple):
    """Where a run starts and ends, and how it shows and places its work."""

    start: int  # the global step it starts from
    end: int  # the global step it ends at, unless something stops it
    spec: Any  # the bar's ``_progress.Progress``, or None
    place: Any  # ``_mesh.Placement``
    ticks: bool  # in-loop bar reports
    execution: str = "fused"  # ``fit(execution=)``: "auto", "fused", "stepwise"


class Extras(NamedTuple):
    """A run's evaluation, early stop, logs and best-only store."""

    checks: Any  # ``_fit_checks.Checks``, or None
    eval_data: Any  # the eval arrays, on the devices
    loggers: tuple  # ``_fit_checks.Logger``s
    best: Any = None  # ``_fit_hooks.BestSaver`` (``best_dir=``), or None


class Kind(Protocol):
    """What a ``Run`` trains, and what that changes on the host: one model
    (``Model``) or a group of a population's members (``_fit_population.Group``).
    ``members``: the group's size (None: one model); ``hp``: the members'
    hyperparameters (None); ``label``: the bar's description."""

    members: int | None
    hp: Any
    label: str

    def init(self, run: Run) -> None:
        """Set the run's early-stop carry and stopped flag (and placements)."""

    def names(self, run: Run) -> list[str]:
        """The names of the checkpointed leaves."""

    def describe(self, run: Run) -> dict:
        """What a checkpoint records of the run's inputs (a resume must match)."""

    def saved(self, run: Run, leaves: list, stopped: Any, extra: Any) -> list:
        """What a checkpoint holds of that state."""

    def load(self, run: Run, saved: list) -> None:
        """Set the run's state from a checkpoint's ``saved``."""

    def use_key(self, run: Run, key: Any) -> None:
        """Continue with a checkpoint's key (the shuffle too)."""

    def restored(self, run: Run, history: dict) -> None:
        """Count what a restored history holds."""

    def stopped_by_rule(self, run: Run) -> bool:
        """Whether a restored early stop leaves nothing to train."""

    def count(self, run: Run, steps: int) -> tuple[Any, int]:
        """A call's ``count`` and ``every`` arguments for ``steps`` steps."""

    def compile(self, run: Run, args: Chunk, mode: str) -> Any:
        """The executable for ``args`` in ``mode`` (errors named for this
        kind)."""

    def collect(self, run, start, end, out, args, report, ys, dispatched) -> Any:
        """Read one call: the run's step count, history, stop and last good
        state updated; the ``_fit_hooks.Collected`` call for the hooks."""

    def hand_over(self, run: Run) -> None:
        """Before the last call is read (while it runs)."""

    def interrupted(self, run: Run) -> None:
        """After an error or an interrupt."""

    def result(self, run: Run) -> Any:
        """What the run gives back."""


class Run:
    """One ``fit`` run of one model or of one group of a population's members
    (``kind``: ``Model``, or ``_fit_population.Group``): dispatch the compiled
    calls, keep one in flight while the host reads the one before, and hand
    each to the hooks (``_fit_hooks``: bar, checkpoints, logs)."""

    def __init__(self, kind: Kind, source, program, schedule, leaves, how, extras):
        self.kind, self.source, self.program = kind, source, program
        self.schedule, self.leaves = schedule, leaves
        self.start, self.end, self.spec = how.start, how.end, how.spec
        self.place, self.ticks = how.place, how.ticks
        # fused or stepwise calls, and auto's choice (``_fit_schedule.Execution``)
        self.execution = _fit_schedule.Execution(program, how.execution)
        # evaluation/early stop (``_fit_checks.Checks``), eval data, log=
        self.checks, self.eval_data, self.loggers, self.best = extras
        self.data, self.key = source.arguments(self.place)
        self.extra = None  # the early-stop carry
        self.stopped = false()
        kind.init(self)
        self.done = self.start  # the global step reached
        self.history = History(kind.members)
        self.good = self.leaves  # the last state checked
        self.halted = False
        self.fns: dict = {}  # the compiled chunk, by execution (this signature)
        self.collected_at: float | None = None  # when the last call was read
        self.ckpt = None
        # What the log sinks keep (rows up to this step) and the restored history
        # they are given again after it (``Logger.open``).
        self.replay: tuple[int, dict | None] = (self.start, None)
        self.chunks: Any = None  # the calls to make, and the first (``prepare``)
        self.nxt: Any = None

    def context(self) -> Any:
        """The mesh as context while tracing (``_mesh.Placement.context``)."""
        return self.place.context()

    # ------------------------------------------------------------ resume

    def resume(self, directory: Any, every: int | None) -> None:
        """Continue from the newest usable checkpoint in ``directory`` that lies
        between this call's start and end (see ``docs/checkpoint.md``)."""
        self.source.keep_states()  # (a resumable iterator's, for the saves)
        names = self.kind.names(self)
        describe = self.kind.describe(self)
        self.ckpt = _checkpoint.Checkpoints(
            directory, every, names, describe, self.start
        )
        past = self.ckpt.steps_after(self.end)
        found = self.ckpt.restore(
            self.kind.saved(self, self.leaves, self.stopped, self.extra),
            self.key,
            at_most=self.end,
            start=self.start,
        )
        if past and found is None:  # nothing to resume but a longer run
            raise ckpt_errors.checkpoint_past_end(
                self.ckpt.directory, past, self.start, self.end
            )
        if past and (found is None or found[0] < self.end):
            self.warn(
                ckpt_errors.checkpoint_saves_dropped(
                    self.ckpt.directory, past, self.end
                )
            )
        if found is None or found[0] <= self.start:
            return
        step, saved, key, history = found
        self.kind.load(self, saved)
        self.kind.use_key(self, key)
        self.ckpt.last_saved = step
        self.history.restore(history, self.start, step)
        restored = self.history.result()
        # The sinks keep their rows up to where the restored history begins and
        # are given that history again: a resume never deletes a row it does not
        # write again (an earlier restart may have cut them).
        steps = restored["step"]
        self.replay = (int(steps[0]) - 1 if len(steps) else step, restored)
        self.done = step
        self.good = self.leaves
        self.kind.restored(self, restored)
        if step == self.end:
            self.warn(ckpt_errors.checkpoint_at_end(self.ckpt.directory, step))
        elif self.kind.stopped_by_rule(self):  # the call ended there, by its rule
            self.halted = True
            self.warn(ckpt_errors.checkpoint_stopped(self.ckpt.directory, step))
        # the batches those steps used (a resumable iterator: set to its state)
        self.source.skip(step - self.start, self.ckpt.data_state)

    # ------------------------------------------------------------ run

    def prepare(self) -> None:
        """The first call's batches, and its program compiled: every refusal
        found while tracing ``loss_fn``/``eval_fn`` comes here, before any file,
        sink, model or optimizer changes."""
        self.chunks = self.source.calls(self.done, self.end, self.schedule, self.place)
        self.nxt = None if self.halted else next(self.chunks, None)
        if self.nxt is not None:
            began = time.perf_counter()
            with self.context():
                self.compiled(self.args(*self.nxt))
            self.execution.compiled(time.perf_counter() - began)

    def hooks(self) -> list:
        """The host-side features of this run, in the order they are called."""
        out: list = []
        if self.spec is not None:
            out.append(_fit_hooks.Bar(self.spec, self.kind.label))
        if self.ckpt is not None:
            out.append(_fit_hooks.Saver(self.ckpt))
        out += [_fit_hooks.Logs(logger) for logger in self.loggers]
        if self.best is not None:
            out.append(self.best)
        return out

    def go(self) -> Any:
        """Train, then the kind's result (``Model``: a ``FitResult``)."""
        hooks, started = self.hooks(), []
        self.first = self.good
        try:
            self.prepare()
            for hook in hooks:
                hook.start(self)
                started.append(hook)
            self._loop(hooks)
            for hook in hooks:
                hook.end(self)
        except BaseException:
            self.kind.interrupted(self)
            raise
        finally:
            for hook in reversed(started):
                hook.close(self)
            if self.ckpt is not None:
                self.ckpt.close()
            self.execution.close()
        return self.kind.result(self)

    def args(self, start: int, end: int, xs: Any) -> Chunk:
        """The compiled chunk's arguments for the steps ``start`` to ``end``."""
        count, every = self.kind.count(self, end - start)
        aux = None
        if self.checks is not None:
            aux = {"eval": self.eval_data, "stop": self.extra}
        return Chunk(
            self.leaves,
            self.stopped,
            np.int32(start),
            count,
            np.int32(every),
            self.data,
            self.key,
            xs,
            self.kind.hp,
            aux,
        )

    def call(self, args: Chunk, mode: str | None = None) -> Any:
        """The call of ``args``, executed in ``mode`` (default: the run's)."""
        with self.context():
            return self.compiled(args, mode)(*args)

    def compiled(self, args: tuple, mode: str | None = None) -> Any:
        """The compiled chunk in ``mode``, compiled for the first call's
        ``args``."""
        mode = mode or self.execution.mode
        fn = self.fns.get(mode)
        if fn is None:
            fn = self.fns[mode] = self.kind.compile(self, args, mode)
        return fn

    def _loop(self, hooks: list) -> None:
        pending = None
        chunks, nxt = self.chunks, self.nxt
        while nxt is not None:
            start, end, xs = nxt
            args = self.args(start, end, xs)
            mode = self.execution.next_mode(self, args)
            trial = mode != self.execution.mode  # auto's timed stepwise call
            if trial and pending is not None:  # (timed alone: nothing overlaps it)
                self._collect(hooks, *pending)
                pending = None
                if self.halted:  # (a stop in the call before: nothing to time)
                    break
            with self.context():
                fn = self.compiled(args, mode)
                began = time.perf_counter()
                out = fn(*args)
            self.leaves, self.stopped, self.extra = out.leaves, out.stopped, out.extra
            # Compiling happens in the call above, running after it returns.
            dispatched = time.perf_counter()
            if pending is not None:
                self._collect(hooks, *pending)
            pending = (start, end, out, args, dispatched, began, mode)
            if self.schedule.timing or trial:
                # Time the first call before sizing the next ones (and auto's
                # trial before choosing).
                self._collect(hooks, *pending)
                pending = None
            if self.halted:
                break
            # The next chunk (host batches: stacked and put on device) is
            # prepared while this one trains.
            nxt = next(chunks, None)
        if pending is not None:
            self.kind.hand_over(self)  # (while the last call runs)
            self._collect(hooks, *pending)

    def _collect(self, hooks, start, end, out, args, dispatched, began, mode):
        report, ys = jax.device_get((out.report, out.bufs))
        # The call's time, from when it was dispatched or the one before it was
        # read (calls overlap), to now: auto's measurement.
        now = time.perf_counter()
        since = began if self.collected_at is None else max(began, self.collected_at)
        self.collected_at = now
        self.execution.ran(mode, int(np.max(report.ran)), now - since)
        call = self.kind.collect(self, start, end, out, args, report, ys, dispatched)
        for hook in hooks:
            hook.after_call(self, call)

    def warn(self, message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller.user_level())

    @property
    def restoring(self) -> bool:
        """Whether ``stop=`` restores the best state it keeps."""
        stop = None if self.checks is None else self.checks.stop
        return stop is not None and stop.restore_best

    def every(self, count: int) -> int:
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


class Model:
    """What ``Run`` trains for one model: its state as flat leaves (the
    model's, ``base``: a ``_models.Flat``, then its features', ``feats``). A
    non-finite step stops the run: the call's good steps are recomputed and
    the run ends with the last good state (see ``_fit_program.Chunks``)."""

    members = None
    hp = None
    label = _CALL

    def __init__(self, base: Any, feats: Any):
        self.base, self.feats = base, feats
        self.handed = None  # the (model, optimizer) given the last state early
        self.finished: list | None = None  # the state last handed back
        self.results: dict = {}  # the features' results of that state

    def init(self, run: Run) -> None:
        if run.checks is not None:
            run.extra = run.checks.init(run.leaves)

    def names(self, run: Run) -> list[str]:
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

    def describe(self, run: Run) -> dict:
        """What a checkpoint records of the run's inputs (a resume must see the
        same): the data."""
        return run.source.describe()

    def saved(self, run: Run, leaves: list, stopped: Any, extra: Any) -> list:
        """What a checkpoint holds: the state's leaves (and, with ``stop=``, the
        rule's state and the best state kept)."""
        if extra is None:
            return list(leaves)
        return [*leaves, *jtu.tree_leaves(extra)]

    def load(self, run: Run, saved: list) -> None:
        n = len(run.leaves)
        run.leaves = list(saved[:n])
        if run.extra is not None:
            treedef = jtu.tree_structure(run.extra)
            run.extra = jtu.tree_unflatten(treedef, saved[n:])

    def use_key(self, run: Run, key: Any) -> None:
        """Continue with ``key`` (a checkpoint's): the shuffle and the per-step
        keys both come from it."""
        run.key = key
        run.source.use_key(key)

    def restored(self, run: Run, history: dict) -> None:
        """(nothing to count: the history holds one model's steps)"""

    def stopped_by_rule(self, run: Run) -> bool:
        """Whether the early-stop rule has said stop (a restored checkpoint of
        a call that stopped early): nothing is left to train."""
        if run.extra is None:
            return False
        return bool(jax.device_get(run.extra.rule.stopped))

    def count(self, run: Run, steps: int) -> tuple[Any, int]:
        return np.int32(steps), run.every(steps)

    def compile(self, run: Run, args: Chunk, mode: str) -> Any:
        return run.execution.executable(args, mode)

    def collect(self, run, start, end, out, args, report, ys, dispatched):
        count, early = int(report.applied), bool(report.ended)
        run.schedule.ran(end - start, dispatched)
        recorded = run.history.add(start, ys, count, count)
        run.done += count  # (a call dispatched after a stop ran no step)
        leaves, extra = out.leaves, out.extra
        if early and not run.halted:  # stop= said stop: a clean end
            run.halted = True
        elif not run.halted and start + count < end:
            run.halted = True
            run.leaves, run.extra = leaves, extra = self._redo(run, args, count)
            run.warn(
                errors.nonfinite_step(
                    start + count,
                    ys["loss"][count],
                    bool(report.loss_ok),
                    bool(report.grads_ok),
                    run.done - run.start,
                )
            )
        run.good = leaves
        postfix = {}  # (only what a bar shows)
        if count and run.spec is not None:
            postfix["loss"] = f"{float(ys['loss'][count - 1]):.4g}"
            for name, values in run.history.val.items():  # the last evaluation
                if name != "val_step" and values and len(values[-1]):
                    postfix[name] = f"{float(np.ravel(values[-1][-1])[0]):.4g}"
        complete = not run.halted and start + count == end
        state = (leaves, out.stopped, extra)
        return _fit_hooks.Collected(start, end, complete, state, recorded, postfix)

    def _redo(self, run: Run, args: Chunk, count: int) -> tuple:
        """The state after the ``count`` good steps of a call that hit a bad one
        (the same program on the same inputs: bit-identical)."""
        again = args._replace(
            stopped=false(), count=np.int32(count), every=np.int32(count + 1)
        )  # count + 1: no reports
        out = run.call(again)
        if int(out.report.applied) != count:
            raise RuntimeError(
                f"{_CALL}: internal error: replaying {count} good steps applied "
                f"{int(out.report.applied)}. Please report this with your model "
                "and data."
            )
        return out.leaves, out.extra

    def hand_over(self, run: Run) -> None:
        """Give the objects the state while the last call runs (an NNX update
        then overlaps it); a bad step found after replaces it. (Not when the
        best state kept by stop= replaces it anyway.)"""
        self.handed = None if run.restoring else self.finish(run.leaves)

    def interrupted(self, run: Run) -> None:
        """Interrupted or failed: NNX objects keep the last checked state."""
        if self.handed is not None or run.good is not run.first:
            self.finish(run.good)

    def best_step(self, run: Run) -> int | None:
        """The step of the best state kept by ``stop=`` (to restore), if any."""
        if not run.restoring:
            return None
        step = int(jax.device_get(run.extra.rule.best_step))
        return step if step >= 0 else None

    def result(self, run: Run) -> FitResult:
        best = self.best_step(run)
        if best is not None:  # stop=EarlyStop(restore_best=True): the best state
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

    def finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place),
        and the features' results of that state."""
        self.finished, self.results = leaves, self.feats.results(leaves)
        return self.base.finish(leaves[: self.feats.n])
