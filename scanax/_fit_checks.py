"""What ``scanax.fit``'s compiled loop does every ``eval_every`` steps: evaluate
the model over the whole ``eval_data`` (in eval mode), update the early-stop
rule, keeping the best state on device, and the plateau rule, whose state is
part of the training state (``_plateau``). The evaluation's reduction over a
dataset (``over_dataset``: batch means weighted by their sizes, a ``Ratio``'s
sums kept apart) is shared with ``scanax.evaluate``.

Everything here runs inside the compiled loop: the running sums after every step
(branch-free), the checks at the chunk boundaries where one is due, behind one
``lax.cond`` per chunk; no recompile, and the same code under a population's
``vmap``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import _log, _model_step, _plateau
from ._errors import evaluate as evaluate_errors
from ._fit_program import trace_once
from ._plateau import Plateau, PlateauCarry
from ._stop import EarlyStop, keep_best


class StopCarry(NamedTuple):
    """The early-stop rule's state, the best state kept (an empty list when it
    is not kept), and the running sum and count of a monitored training metric
    since the last check."""

    rule: Any
    best: list
    total: jax.Array
    count: jax.Array


@dataclasses.dataclass(frozen=True)
class Rules:
    """The rules checked at each evaluation besides it: an early stop and a
    plateau rule (``Checks``'s ``stop`` when there is a plateau rule). ``at``:
    where the plateau rule's carry (``_plateau.PlateauCarry``) starts in the
    training state's flat leaves."""

    stop: EarlyStop | None
    plateau: Plateau | None = None
    at: int = 0

    @property
    def restore_best(self) -> bool:
        """Whether the early stop restores the best state it keeps."""
        return self.stop is not None and self.stop.restore_best


class Checked(NamedTuple):
    """What a check gives back (``Checks.work``)."""

    leaves: list  # the training state, the plateau rule's carry updated
    val: dict  # the evaluation's metrics
    carry: StopCarry | None  # the early-stop carry
    stop: Any  # the early-stop rule says stop


class Checks:
    """Every ``every`` global steps: an evaluation (``evaluate(leaves, batch,
    key, hp) -> (loss, metrics)`` over ``n`` examples in batches of
    ``batch_size``) and/or the rules ``stop``: an ``EarlyStop``, or ``Rules``
    (a ``Plateau``, and an ``EarlyStop`` or not). ``stop`` is kept as given:
    what a ``Checks`` rebuilt with another ``evaluate`` is given again.

    Its parts run where the compiled loop puts them (``_fit_program.Chunks``):
    ``accumulate`` after every step (branch-free: the running sums of a
    monitored training metric), ``collected`` at a rollout's collections (a
    monitored rollout metric's), and ``work`` at the chunk boundaries where a
    check is ``due``, behind one ``lax.cond`` (the evaluation, then the
    rules)."""

    def __init__(
        self,
        every: int,
        evaluate: Callable | None,
        n: int,
        batch_size: int,
        stop: EarlyStop | Rules | None,
    ):
        self.every, self.evaluate, self.n = every, evaluate, n
        self.batch_size, self.stop = batch_size, stop
        rules = stop if isinstance(stop, Rules) else Rules(stop)
        self.early, self.plateau, self.at = rules.stop, rules.plateau, rules.at
        # the names a monitor may have, learnt while the step and the
        # collections are traced (``check_monitor`` at the first check)
        self.names: dict[str, list[str]] = {"train": [], "rollout": []}

    def key(self) -> tuple:
        """What the compiled program depends on (for its cache key)."""
        return (self.every, self.n, self.batch_size, self.stop)

    def bound(self, feats: Any, evaluate: Callable | None) -> Checks:
        """These checks for one run's state (``feats``, a
        ``_feature.Features``): the plateau rule's carry where the state holds
        it, the evaluation ``evaluate(leaves, batch, key, hp)`` (or none)."""
        rules = self.stop if isinstance(self.stop, Rules) else Rules(self.stop)
        if rules.plateau is not None:
            rules = Rules(rules.stop, rules.plateau, feats.at_of(rules.plateau))
        else:
            rules = self.stop
        return Checks(self.every, evaluate, self.n, self.batch_size, rules)

    def init(self, leaves: list, dtype: Any = jnp.float32) -> StopCarry | None:
        """The early-stop carry before the first check, keeping ``leaves`` as the
        best state (``[]``: none kept, as a population without ``restore_best``
        does); None without an early stop (the plateau rule's carry is in the
        training state)."""
        if self.early is None:
            return None
        return StopCarry(
            self.early.init(dtype),
            list(leaves),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def _rules(self) -> list:
        return [r for r in (self.early, self.plateau) if r is not None]

    def accumulate(
        self, leaves: list, out: dict, take: Any, carry: StopCarry | None
    ) -> tuple[list, StopCarry | None]:
        """After a step (``take``: it was applied, or a traced bool): each
        rule's running sum and count of its monitored training metric (a
        training metric is checked by its mean since the last check)."""
        self.names["train"] = ["loss", *out["metrics"]]

        def add(monitor: str, total: Any, count: Any) -> tuple:
            if monitor.startswith(_SPARSE):
                return total, count
            value = out["metrics"].get(monitor, out["loss"])
            if isinstance(value, Ratio):  # (a step's value: its num / den)
                value = value.value
            added = total + jnp.asarray(value, jnp.float32)
            return jnp.where(take, added, total), jnp.where(take, count + 1, count)

        if self.early is not None:
            carry = carry._replace(
                **dict(
                    zip(
                        ("total", "count"),
                        add(self.early.monitor, carry.total, carry.count),
                    )
                )
            )
        if self.plateau is not None:
            held = _plateau.read(leaves, self.at)
            total, seen = add(self.plateau.monitor, held.total, held.seen)
            leaves = _plateau.write(
                leaves, self.at, held._replace(total=total, seen=seen)
            )
        return leaves, carry

    def collected(
        self, leaves: list, rollout: dict, got: Any, carry: StopCarry | None
    ) -> tuple[list, StopCarry | None]:
        """At a rollout's collection (``got``: one was made): each rule's
        running sum and count of its monitored rollout metric. A NaN value
        counts as no collection: what a ``collect`` reports when nothing
        happened (an episode's return where no episode ended)."""
        names = {f"rollout_{k}": v for k, v in rollout.items()}
        self.names["rollout"] = list(names)

        def add(monitor: str, total: Any, count: Any) -> tuple:
            if monitor not in names:
                return total, count
            took = got & ~jnp.isnan(names[monitor])
            value = jnp.where(took, names[monitor], 0.0)
            return total + value.astype(jnp.float32), count + took.astype(count.dtype)

        if self.early is not None:
            total, count = add(self.early.monitor, carry.total, carry.count)
            carry = carry._replace(total=total, count=count)
        if self.plateau is not None:
            held = _plateau.read(leaves, self.at)
            total, seen = add(self.plateau.monitor, held.total, held.seen)
            leaves = _plateau.write(
                leaves, self.at, held._replace(total=total, seen=seen)
            )
        return leaves, carry

    def due(self, t1: Any) -> Any:
        """Whether a check is due after global step ``t1`` (1-based)."""
        return t1 % self.every == 0

    def work(
        self,
        t1: Any,
        leaves: list,
        eval_data: Any,
        key: Any,
        hp: Any,
        carry: StopCarry | None,
    ) -> Checked:
        """The check due after global step ``t1`` (1-based): the evaluation,
        then the rules (branch-free: run where one is due)."""
        val: dict = {}
        if self.evaluate is not None:
            val = self._evaluate(leaves, eval_data, key, hp)
        stop = jnp.array(False)
        if self.early is None and self.plateau is None:
            return Checked(leaves, val, carry, stop)
        names = [*self.names["train"], *val, *self.names["rollout"]]
        for rule in self._rules():
            rule.check_monitor(names)  # (while tracing: before compiling)
        if self.early is not None:
            carry, stop = self._early_stop(t1, leaves, val, carry)
        if self.plateau is not None:
            leaves = self._reduce(leaves, val)
        return Checked(leaves, val, carry, stop)

    def _monitored(self, monitor: str, val: dict, total, count) -> tuple:
        """``(value, check)``: the value of ``monitor`` that a rule checks, and
        whether it checks it now: a training or rollout metric by its mean
        since the last check (none since, for a rollout's: no check, the rule
        waits for one), an evaluation metric as evaluated."""
        if monitor.startswith("val_"):
            return val[monitor], jnp.array(True)
        value = total / jnp.maximum(count, 1).astype(total.dtype)
        if monitor.startswith("rollout_"):
            return value, count > 0
        return value, jnp.array(True)

    def _early_stop(self, t1, leaves, val, carry) -> tuple:
        """The early-stop carry after a check, and whether to stop."""
        value, check = self._monitored(
            self.early.monitor, val, carry.total, carry.count
        )
        rule, improved, stop = self.early.update(carry.rule, value, t1)
        improved = improved & check
        best = keep_best(carry.best, leaves, improved) if carry.best else []
        zero = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        checked = StopCarry(rule, best, *zero)
        new = jtu.tree_map(
            lambda n, o: jnp.where(check, n, o),
            checked._replace(best=[]),
            carry._replace(best=[]),
        )
        return new._replace(best=best), stop & check

    def _reduce(self, leaves, val) -> list:
        """The training state with the plateau rule's carry after a check."""
        held = _plateau.read(leaves, self.at)
        value, check = self._monitored(self.plateau.monitor, val, held.total, held.seen)
        rule, _ = self.plateau.update(held.rule, value)
        new = PlateauCarry(rule, jnp.zeros_like(held.total), jnp.zeros_like(held.seen))
        new = jtu.tree_map(lambda n, o: jnp.where(check, n, o), new, held)
        return _plateau.write(leaves, self.at, new)

    def _evaluate(self, leaves: list, data: Any, key: Any, hp: Any) -> dict:
        """Metrics over every example of ``data`` (``over_dataset``), prefixed
        ``val_``."""

        def batch_metrics(batch, batch_key):
            return self.evaluate(leaves, batch, batch_key, hp)

        found = over_dataset(batch_metrics, data, self.n, self.batch_size, key)
        return {f"val_{k}": v for k, v in found.items()}


# Monitors that are not a training metric: an evaluation's, a rollout's.
_SPARSE = ("val_", "rollout_")


@jtu.register_pytree_node_class
class Ratio:
    """A metric that is a ratio of sums over the whole dataset: ``sum(num) /
    sum(den)``, not a mean of per-batch ratios.

    Return it among the metrics of an ``eval_fn`` (or as its loss) for
    ``scanax.evaluate`` and ``scanax.fit``'s in-loop evaluation: across
    batches, ``num`` and ``den`` are summed separately and the metric is their
    quotient, so precision, recall, F1 or a per-token loss are the dataset's
    own values however the data is batched. Sum over the batch's examples
    yourself; an array ``num``/``den`` (per class, say) gives an array metric.

    Conceptually equivalent to (0 where the denominator sums to 0)::

        value = sum(r.num for r in batch_ratios) / sum(r.den for r in batch_ratios)

    Wherever else it is read as an array (a training metric of ``loss_fn``
    in ``fit``'s history, ``jnp.asarray``, ``np.asarray``), a Ratio is its
    value ``num / den``.

    Arguments:
        num, den: real arrays or numbers (bool, integer or floating) whose
            shapes broadcast together, e.g. counts; anything else (a complex
            value, a string) is refused with a ``TypeError``, shapes that do
            not broadcast with a ``ValueError``.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> tp, fp, fn = jnp.array(3), jnp.array(1), jnp.array(2)
        >>> precision = scanax.Ratio(tp, tp + fp)
        >>> float(precision.value), precision.shape
        (0.75, ())
    """

    __slots__ = ("num", "den")

    def __init__(self, num: Any, den: Any):
        for part, value in (("num", num), ("den", den)):
            if not _model_step.is_real_number(value):
                raise evaluate_errors.ratio_part(part, value)
        try:
            jnp.broadcast_shapes(jnp.shape(num), jnp.shape(den))
        except ValueError:
            raise evaluate_errors.ratio_shapes(num, den) from None
        self.num, self.den = num, den

    def tree_flatten(self) -> tuple[tuple, None]:
        return (self.num, self.den), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> Ratio:
        # (not checked: JAX rebuilds pytrees with placeholders as leaves)
        out = object.__new__(cls)
        out.num, out.den = children
        return out

    @property
    def shape(self) -> tuple:
        return tuple(jnp.broadcast_shapes(jnp.shape(self.num), jnp.shape(self.den)))

    @property
    def dtype(self) -> Any:
        """The value's dtype: floating (counts give the default float)."""
        types = [jnp.result_type(x) for x in (self.num, self.den)]
        floats = [t for t in types if jnp.issubdtype(t, jnp.inexact)]
        if not floats:
            return jnp.result_type(float)
        return max(floats, key=lambda t: jnp.dtype(t).itemsize)

    @property
    def value(self) -> Any:
        """``num / den`` (a JAX array; 0 where ``den`` is 0)."""
        dtype = self.dtype
        return _divide(jnp.asarray(self.num, dtype), jnp.asarray(self.den, dtype))

    def __jax_array__(self) -> Any:
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        own = np.dtype(self.dtype)
        num, den = np.asarray(self.num, own), np.asarray(self.den, own)
        value = np.where(den == 0, 0, num / np.where(den == 0, 1, den)).astype(own)
        return np.asarray(value, dtype or own)

    def __repr__(self) -> str:
        return f"scanax.Ratio(num={self.num!r}, den={self.den!r})"


def over_dataset(
    metrics: Callable,
    data: Any,
    n: int,
    batch_size: int,
    key: Any = None,
    place: Callable | None = None,
    call: str = "scanax.fit",
) -> dict:
    """``{"loss": ..., **metrics}`` over every example of ``data`` (``n`` of them,
        a leading axis on every leaf), in batches of ``batch_size``: full batches in
        a scan, then the remainder. ``metrics(batch, batch_key) -> (loss, metrics)``
        gives a batch's means (batch ``j``'s key: ``fold_in(key, j)``, None without
        ``key``); each is weighted by its batch's size, so that the result is the
        mean over the examples, and a :class:`Ratio`'s ``num`` and ``den`` are
        summed separately. ``place``: applied to each batch (a sharding constraint);
    ``call``: who evaluates (for messages).

        Conceptually equivalent to::

            total = {}
            for j, start in enumerate(range(0, n, batch_size)):
                batch = data[start:start + batch_size]
                loss, extra = metrics(batch, fold_in(key, j))
                for name, v in {"loss": loss, **extra}.items():
                    total[name] += (v.num, v.den) if ratio else v * len(batch)
            return {name: num / den if ratio else v / n for name, v in total.items()}
    """
    b = batch_size
    full, rest = divmod(n, b)

    def at(start, size):
        batch = jtu.tree_map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), data
        )
        return batch if place is None else place(batch)

    def sums(batch, j, size):
        batch_key = None if key is None else jr.fold_in(key, j)
        loss, extra = metrics(batch, batch_key)
        values = {"loss": loss, **extra}
        return {k: _weighted(v, size) for k, v in values.items()}

    def add(a, b):
        return jtu.tree_map(jnp.add, a, b)

    with jax.named_scope("scanax.evaluate"):
        total = None
        if full:
            # (traced once: the carry's shapes, and the scan's batch)
            one, shapes = trace_once(lambda i: sums(at(i * b, b), i, b), jnp.int32(0))
            zero = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(acc, i):
                return add(acc, one(i)), None

            total, _ = jax.lax.scan(body, zero, jnp.arange(full, dtype=jnp.int32))
        if rest:
            last = sums(at(full * b, rest), full, rest)
            if total is not None:  # (a metric's shape must not depend on b)
                _model_step.same_shapes(call, "eval_fn", total, last, (b, rest))
            total = last if total is None else add(total, last)
        return {k: _mean(v, n) for k, v in total.items()}


def _weighted(value: Any, size: int) -> Any:
    """A batch's part of a dataset total: a mean times the batch's size, or a
    Ratio's parts as they are (counts summed exactly as int32)."""
    if isinstance(value, Ratio):
        return Ratio(_summand(value.num), _summand(value.den))
    return jnp.asarray(value, jnp.float32) * size


def _summand(x: Any) -> Any:
    dtype = jnp.result_type(x)
    exact = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)
    return jnp.asarray(x, jnp.int32 if exact else jnp.float32)


def _divide(num: Any, den: Any) -> Any:
    """``num / den``, 0 where ``den`` is 0 (no example counted: precision with
    nothing predicted positive is 0, as scikit-learn and Keras give)."""
    return jnp.where(den == 0, 0, num / jnp.where(den == 0, 1, den)).astype(num.dtype)


def _mean(total: Any, n: int) -> Any:
    if isinstance(total, Ratio):
        num, den = (jnp.asarray(x, jnp.float32) for x in (total.num, total.den))
        return _divide(num, den)
    return total / n


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
        sparse = ("val_", "rollout_")  # (entries at their own steps)
        names = [k for k in history if k != "step" and not k.startswith(sparse)]
        self.add(
            steps[keep], {k: np.compress(keep, history[k], axis=axis) for k in names}
        )
        for prefix in sparse:
            if prefix + "step" in history:
                vsteps = np.asarray(history[prefix + "step"])
                vkeep = vsteps > cut
                vnames = [
                    k for k in history if k.startswith(prefix) and k != prefix + "step"
                ]
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
        pending = []
        for names in dict.fromkeys(tuple(v) for _, v in self.val):
            # (each kind of entry apart: evaluations, a rollout's collections)
            group = [(s, v) for s, v in self.val if tuple(v) == names]
            vsteps = np.concatenate([s for s, _ in group])
            vvalues = {k: np.concatenate([v[k] for _, v in group]) for k in names}
            done = vsteps <= cut
            if done.any():
                parts.append((vsteps[done], {k: v[done] for k, v in vvalues.items()}))
            rest = ~done
            if rest.any():
                pending.append((vsteps[rest], {k: v[rest] for k, v in vvalues.items()}))
        self.val = pending
        if parts:
            self.sinks.write(*_log.merge(*parts))
        self.sinks.flush()
