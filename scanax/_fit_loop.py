"""The driver of ``scanax.fit``: what it returns (``FitResult``), the per-step
history, the call schedule and ``Run``, which runs one ``fit`` with a chunk
program from ``_fit_program``."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _caller, _checkpoint, _models, _progress, _stop
from ._errors import fit as errors, population as pop_errors
from ._fit_program import Chunk, false

_CALL = errors.CALL
# The wall time that the automatic schedule aims each call at (array data: calls
# grow from 8 steps to this, up to the source's compiled length).
_SECONDS_PER_CALL = 0.25
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
        where = values.shape[1] - 1 - np.argmax(finite[:, ::-1], axis=1)
        last[has] = values[has, where[has]]
        sign = 1.0 if mode == "min" else -1.0
        return int(np.argmin(np.where(has, sign * last, np.inf)))


def best_state(names: list[str], best: list, last: list, where: Any = None) -> list:
    """The state an early stop restores: ``best``'s leaves, except the step
    counts (``_models.is_counter``), which keep ``last``'s: the next ``fit``
    continues after the last step run. ``where``: a population's per-member
    mask of the members with a best state (the others keep ``last``)."""
    out = []
    for name, b, x in zip(names, best, last):
        if _models.is_counter(name, x, where is not None):
            out.append(x)
        elif where is None:
            out.append(b)
        else:
            out.append(
                jnp.where(where.reshape(where.shape + (1,) * (x.ndim - 1)), b, x)
            )
    return out


# ---------------------------------------------------------------------------- history


class History:
    """Per-step values of one ``fit`` call, with their global step numbers.

    A population's (``members=k``): ``[members, steps]`` arrays (NaN where a
    member did not train) and ``[members, evaluations]`` evaluations (NaN
    where a member did not evaluate); the step numbers are shared."""

    def __init__(self, members: int | None = None):
        self.members = members
        self.axis = 0 if members is None else 1  # the steps' axis of a value
        self.arrays: dict[str, list[np.ndarray]] = {"step": [], "loss": []}
        self.val: dict[str, list[np.ndarray]] = {}  # "val_step" and "val_<name>"
        self.count = 0  # steps recorded
        self.warned = False

    def _axis(self, name: str) -> int:
        return 0 if name.endswith("step") else self.axis

    def restore(self, saved: dict[str, np.ndarray], after: int, step: int) -> None:
        """The history of a checkpoint at ``step``, from step ``after + 1`` on (a
        checkpoint of an older format has no step numbers: they are counted back)."""
        saved = dict(saved)
        val = {k: saved.pop(k) for k in list(saved) if k.startswith("val_")}
        if "val_step" in val:
            keep_val = np.asarray(val["val_step"]) > after
            self.val = {
                k: [np.compress(keep_val, v, axis=self._axis(k))]
                for k, v in val.items()
            }
        n = len(saved.get("loss", ()))
        steps = saved.pop("step", np.arange(step - n + 1, step + 1, dtype=np.int64))
        keep = np.asarray(steps) > after
        self.arrays = {"step": [np.asarray(steps)[keep]]}
        self.arrays.update(
            {k: [np.compress(keep, v, axis=self.axis)] for k, v in saved.items()}
        )
        self.arrays.setdefault("loss", [])
        self.count = int(keep.sum())

    def add(self, first: int, ys: dict, applied: Any, ran: int) -> tuple:
        """``ran`` steps from global step ``first`` (0-based; recorded 1-based,
        as the optimizer's step count after each), of which ``applied`` (per
        member) were applied: a member's others are NaN. Returns what it
        recorded, for the logger: ``(steps, values, val_steps, val_values)``."""
        values = {"loss": ys["loss"], **ys["metrics"]}
        if self.members is None:
            values = {k: np.asarray(v)[:ran] for k, v in values.items()}
        else:
            mask = np.arange(ran)[None, :] >= np.asarray(applied)[:, None]
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
        steps = np.arange(first + 1, first + ran + 1)
        self.arrays["step"].append(steps)
        for name, value in values.items():
            self.arrays[name].append(value)
        self.count += ran
        if "val" not in ys:
            return steps, values, steps[:0], {}
        # evaluations: one entry each, at their steps (a population: where any
        # member evaluated, NaN for the others)
        evaluated = np.asarray(ys["evaluated"])
        if self.members is None:
            idx = np.flatnonzero(evaluated[:ran])
            val = {k: np.asarray(v)[idx] for k, v in ys["val"].items()}
        else:
            evaluated = evaluated[:, :ran]
            idx = np.flatnonzero(evaluated.any(axis=0))
            val = {
                k: np.where(evaluated[:, idx], np.asarray(v)[:, idx], np.nan)
                for k, v in ys["val"].items()
            }
        self.val.setdefault("val_step", []).append(first + 1 + idx)
        for name, value in val.items():
            self.val.setdefault(name, []).append(value)
        return steps, values, first + 1 + idx, val

    def _nan(self, count: int) -> np.ndarray:
        """NaN for ``count`` steps (and every member)."""
        if self.members is None:
            return np.full(count, np.nan, np.float32)
        return np.full((self.members, count), np.nan)

    def _align(self, metrics: dict, count: int) -> None:
        """Metric names differ from those of the history so far (a checkpoint of a
        ``loss_fn`` returning other metrics): NaN where a metric has no value, so
        that every history array keeps one entry per step."""
        known = set(self.arrays) - {"loss", "step"}
        new, gone = sorted(set(metrics) - known), sorted(known - set(metrics))
        if self.count and not self.warned:
            self.warned = True
            warnings.warn(
                errors.metrics_changed(self.count, new, gone),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        for name in new:  # (one model: a float32 start, as it always had)
            first = self.count or self.members is None
            self.arrays[name] = [self._nan(self.count)] if first else []
        for name in gone:
            self.arrays[name].append(self._nan(count))

    def result(self) -> dict[str, np.ndarray]:
        def empty(name: str) -> np.ndarray:
            if name.endswith("step"):
                return np.zeros((0,), np.int64)
            return np.zeros((0,) if self.members is None else (self.members, 0))

        out = {}
        for name, parts in {**self.arrays, **self.val}.items():
            if parts:
                out[name] = np.concatenate(parts, axis=self._axis(name))
            else:
                out[name] = empty(name).astype(
                    np.int64 if name.endswith("step") else np.float32
                )
        return out


# ---------------------------------------------------------------------------- driver


class Schedule:
    """How many steps each call runs: ``steps_per_call`` if given, else sized from
    the speed of the last call to take about ``_SECONDS_PER_CALL`` (8 steps first,
    to time them, when nothing is known yet); calls also end on checkpoint steps
    and on multiples of the progress bar's ``every``."""

    def __init__(
        self, program, length, source, steps_per_call, checkpoint_every, bar_every
    ):
        self.program, self.length = program, length
        self.auto = auto = source.sized_automatically(steps_per_call)
        self.stops = [e for e in (checkpoint_every, bar_every) if e]
        known = program.seconds_per_step
        if not auto:
            self.per_call = min(length, steps_per_call or length)
        elif known is None:
            self.per_call = min(length, 8)
        else:
            self.per_call = self._size(known)
        self.last = None

    def want(self, start: int, end: int) -> int:
        want = min(self.per_call, end - start)
        for every in self.stops:
            want = min(want, every - start % every)
        return want

    @property
    def timing(self) -> bool:
        """Whether the next call must be timed before more are dispatched."""
        return self.auto and self.program.seconds_per_step is None

    def ran(self, steps: int, dispatched: float) -> None:
        """Size the next calls from the time the last one ran: from when it was
        dispatched (after compiling) or the previous one finished, to now."""
        if not self.auto:
            return
        now = time.perf_counter()
        began = max(dispatched, self.last or dispatched)
        per_step = max(now - began, 1e-9) / steps
        self.program.seconds_per_step = per_step
        self.per_call = self._size(per_step)
        self.last = now

    def _size(self, seconds_per_step: float) -> int:
        return max(1, min(self.length, int(_SECONDS_PER_CALL / seconds_per_step)))


class Run:
    """One ``fit`` call: dispatch chunks, keep one in flight, collect history."""

    def __init__(
        self, adapter, source, program, treedef, leaves, schedule, how, extras=None
    ):
        self.adapter, self.source, self.program = adapter, source, program
        self.treedef, self.leaves, self.schedule = treedef, leaves, schedule
        self.start, self.end, self.spec, self.mesh, self.ticks = how
        # evaluation/early stop (``_fit_checks.Checks``), eval data, log=
        self.checks, self.eval_data, self.logger = extras or (None, None, None)
        self.extra = None if self.checks is None else self.checks.init(leaves)
        self.done = self.start  # the global step reached
        self.fn = None  # the compiled chunk, for this call's argument signature
        self.ckpt = None
        self.stopped = false()
        self.history = History()
        self.halted = False
        self.bar = None
        self.good = leaves  # the last state checked to be finite
        self.data, self.key = source.arguments(self.mesh)
        self.hp = None  # a population's hyperparameters
        # What the log sinks keep (rows up to this step) and the restored history
        # they are given again after it (``Logger.open``).
        self.replay: tuple[int, dict | None] = (self.start, None)
        self.chunks: Any = None  # the calls to make, and the first (``prepare``)
        self.nxt: Any = None

    def context(self) -> Any:
        """The mesh as context while tracing: NNX Variables with sharding
        annotations need one when the step merges them."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    def resume(self, directory: Any, every: int | None) -> None:
        """Continue from the newest usable checkpoint in ``directory`` that lies
        between this call's start and end (see ``docs/checkpoint.md``)."""
        self.ckpt = _checkpoint.Checkpoints(
            directory, every, self._names(), self._describe(), self.start
        )
        past = self.ckpt.steps_after(self.end)
        found = self.ckpt.restore(
            self._saved(self.leaves, self.extra),
            self.key,
            at_most=self.end,
            start=self.start,
        )
        if past and found is None:  # nothing to resume but a longer run
            raise errors.checkpoint_past_end(
                self.ckpt.directory, past, self.start, self.end
            )
        if past and (found is None or found[0] < self.end):
            warnings.warn(
                errors.checkpoint_saves_dropped(self.ckpt.directory, past, self.end),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        if found is None or found[0] <= self.start:
            return
        step, saved, key, history = found
        self._load(saved)
        self.use_key(key)
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
        if step == self.end:
            warnings.warn(
                errors.checkpoint_at_end(self.ckpt.directory, step),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        elif self.stopped_by_rule():  # the call ended there, by its early stop
            self.halted = True
            warnings.warn(
                errors.checkpoint_stopped(self.ckpt.directory, step),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        self.source.skip(step - self.start)  # the batches those steps used

    def use_key(self, key: Any) -> None:
        """Continue with ``key`` (a checkpoint's): the shuffle and the per-step
        keys both come from it."""
        self.key = key
        self.source.use_key(key)

    def prepare(self) -> None:
        """The first call's batches, and its program compiled: every refusal
        found while tracing ``loss_fn``/``eval_fn`` comes here, before any file,
        sink, model or optimizer changes."""
        self.chunks = self.source.calls(self.done, self.end, self.schedule, self.mesh)
        self.nxt = None if self.halted else next(self.chunks, None)
        if self.nxt is not None:
            with self.context():
                self._compiled(self._args(*self._at(*self.nxt)))

    def open_logs(self) -> None:
        """Open the log sinks after the last refusal, before the first step."""
        if self.logger is not None:
            self.logger.open(*self.replay)

    def _at(self, start: int, end: int, xs: Any) -> tuple:
        """``_call``'s arguments for the steps ``start`` to ``end``."""
        count = end - start
        return (
            self.leaves,
            self.stopped,
            start,
            count,
            self._every(count),
            xs,
            self.extra,
        )

    def _describe(self) -> dict:
        """What a checkpoint records of the run's inputs (a resume must see the
        same): the data."""
        return self.source.describe()

    def _names(self) -> list[str]:
        """The names of the checkpointed leaves."""
        names = self.adapter.names()
        if self.extra is None:
            return names
        rule = [f"stop.rule.{f}" for f in self.extra.rule._fields]
        return [
            *names,
            *rule,
            *(f"stop.best.{n}" for n in names),
            "stop.total",
            "stop.count",
        ]

    def _saved(self, leaves: list, extra: Any = None) -> list:
        """What a checkpoint holds: the state's leaves (and, with ``stop=``, the
        rule's state and the best state kept)."""
        if extra is None:
            return list(leaves)
        return [*leaves, *jtu.tree_leaves(extra)]

    def _load(self, saved: list) -> None:
        n = len(self.leaves)
        self.leaves = list(saved[:n])
        if self.extra is not None:
            treedef = jtu.tree_structure(self.extra)
            self.extra = jtu.tree_unflatten(treedef, saved[n:])

    def go(self) -> FitResult:
        self.prepare()
        self.open_logs()
        shown: Any = contextlib.nullcontext()
        if self.spec is not None:
            self.bar = _progress.open_bar(
                self.spec,
                self.end,
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

    def _args(self, leaves, stopped, start, count, every, xs, extra=None) -> Chunk:
        """The compiled chunk's arguments for a call."""
        aux = None
        if self.checks is not None:
            aux = {"eval": self.eval_data, "stop": extra}
        return Chunk(
            leaves,
            stopped,
            np.int32(start),
            np.int32(count),
            np.int32(every),
            self.data,
            self.key,
            xs,
            self.hp,
            aux,
        )

    def _call(self, *args, **kwargs):
        args = self._args(*args, **kwargs)
        with self.context():
            return self._compiled(args)(*args)

    def _compiled(self, args: tuple) -> Any:
        """The compiled chunk, compiled for the first call's ``args``."""
        if self.fn is None:
            self.fn = self.program.executable(args)
        return self.fn

    def _go(self) -> FitResult:
        pending = None
        first = self.leaves
        handed = False  # the model may hold a state not yet checked
        try:
            chunks, nxt = self.chunks, self.nxt
            while nxt is not None:
                start, end, xs = nxt
                inputs = (self.leaves, start, xs, self.extra)
                self.leaves, self.stopped, applied, ys, self.extra = self._call(
                    self.leaves,
                    self.stopped,
                    start,
                    end - start,
                    self._every(end - start),
                    xs,
                    self.extra,
                )
                # Compiling happens in the call above, running after it returns.
                inputs = (*inputs, time.perf_counter())
                if pending is not None:
                    self._collect(*pending)
                pending = (start, end, applied, ys, self.leaves, inputs, self.extra)
                if self.schedule.timing:
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
                # (not when the best state kept by stop= replaces it anyway)
                handed = not self.restoring
                if handed:
                    model, optimizer = self._finish(self.leaves)
                self._collect(*pending)
            if self.ckpt is not None:
                self.ckpt.save(
                    self.done,
                    self._saved(self.leaves, self.extra),
                    self.key,
                    self.history.result(),
                )
            if self.logger is not None:
                self.logger.write(final=True)
        except BaseException:
            # Interrupted or failed: NNX objects keep the last checked state.
            if handed or self.good is not first:
                self._finish(self.good)
            raise
        finally:
            if self.ckpt is not None:
                self.ckpt.close()
            if self.logger is not None:
                self.logger.sinks.close()
        best = self.best_step()
        if best is not None:  # stop=EarlyStop(restore_best=True): the best state
            model, optimizer = self._finish(
                best_state(self._names(), self.extra.best, self.leaves)
            )
        elif not handed or self.halted:
            model, optimizer = self._finish(self.leaves)
        result = FitResult(
            model, optimizer, self.history.result(), self.done - self.start, best
        )
        if self.logger is not None:
            self.logger.sinks.raise_pending(result)
        return result

    def stopped_by_rule(self) -> bool:
        """Whether the early-stop rule has said stop (a restored checkpoint of
        a call that stopped early): nothing is left to train. A population's
        members stop one by one, inside the loop."""
        if self.extra is None or self.hp is not None:
            return False
        return bool(jax.device_get(self.extra.rule.stopped))

    @property
    def restoring(self) -> bool:
        """Whether ``stop=`` restores the best state it keeps."""
        stop = None if self.checks is None else self.checks.stop
        return stop is not None and stop.restore_best

    def best_step(self) -> int | None:
        """The step of the best state kept by ``stop=`` (to restore), if any."""
        if not self.restoring:
            return None
        step = int(jax.device_get(self.extra.rule.best_step))
        return step if step >= 0 else None

    def _finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place)."""
        return self.adapter.finish(jtu.tree_unflatten(self.treedef, leaves))

    def _collect(
        self,
        start: int,
        end: int,
        applied: Any,
        ys: Any,
        leaves: list,
        inputs: tuple,
        extra: Any = None,
    ) -> None:
        report, ys = jax.device_get((applied, ys))
        count, early = int(report.applied), bool(report.ended)
        loss_ok, grads_ok = report.loss_ok, report.grads_ok
        self.schedule.ran(end - start, inputs[-1])
        steps, values, val_steps, val = self.history.add(start, ys, count, count)
        if self.logger is not None:
            self.logger.add(steps, values)
            self.logger.add_val(val_steps, val)
        self.done += count
        # In-loop reports of the next call may have moved the bar ahead already: it
        # never moves back (go() sets the final count).
        if self.bar is not None and count and self.done > self.bar.n:
            self.bar.update(self.done - self.bar.n)
            shown = {"loss": f"{float(ys['loss'][count - 1]):.4g}"}
            for name, values in self.history.val.items():  # the last evaluation
                if name != "val_step" and values and len(values[-1]):
                    shown[name] = f"{float(np.ravel(values[-1][-1])[0]):.4g}"
            self.bar.set_postfix(shown)
        if early and not self.halted:  # stop= said stop: a clean end
            self.halted = True
        elif not self.halted and start + count < end:
            self.halted = True
            self.leaves, self.extra = self._redo(inputs, count)
            self._warn(start + count, ys["loss"][count], loss_ok, grads_ok)
        self.good = self.leaves if self.halted else leaves
        if (
            not self.halted
            and self.ckpt is not None
            and self.ckpt.every
            and start + count == end
            and end % self.ckpt.every == 0
        ):
            self.ckpt.save(
                end, self._saved(leaves, extra), self.key, self.history.result()
            )
        if self.logger is not None:
            self.logger.write()

    def _redo(self, inputs: tuple, count: int) -> list:
        """The state after the ``count`` good steps of a call that hit a bad one."""
        leaves, start, xs, extra, _ = inputs
        out, _, applied, _, extra = self._call(
            leaves, false(), start, count, count + 1, xs, extra
        )  # count + 1: no reports
        if int(applied.applied) != count:  # the same program on the same inputs
            raise RuntimeError(
                f"{_CALL}: internal error: replaying {count} good steps applied "
                f"{int(applied.applied)}. Please report this with your model and data."
            )
        return out, extra

    def _every(self, count: int) -> int:
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

    def _warn(self, t: int, loss: Any, loss_ok: Any, grads_ok: Any) -> None:
        warnings.warn(
            errors.nonfinite_step(
                t, loss, bool(loss_ok), bool(grads_ok), self.done - self.start
            ),
            RuntimeWarning,
            stacklevel=_caller.user_level(),
        )
