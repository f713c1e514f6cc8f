"""What ``scanax.fit``'s compiled loop does every ``eval_every`` steps: evaluate
the model over the whole ``eval_data`` (in eval mode), update the early-stop
rule, keeping the best state on device, and the plateau rule, whose state is
part of the training state (``_plateau``). The evaluation's reduction over a
dataset (``over_dataset``: batch means weighted by their sizes, a ``Ratio``'s
sums kept apart) is shared with ``scanax.evaluate``.

Everything here runs inside the compiled loop: the running sums after every step
(branch-free), the checks at the chunk boundaries where one is due, behind one
``once_if`` per chunk; no recompile, and the same code under a population's
``vmap``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _caller
from .._errors import fit as errors, plateau as _plateau_errors, stop as _stop_errors
from . import scalars as _scalars
from .callbacks import plateau as _plateau
from .callbacks.early_stop import EarlyStop, keep_best, kept_init
from .callbacks.plateau import Plateau, PlateauCarry
from .metrics import Ratio, over_dataset


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

    Its parts run where the compiled loop puts them (``_fit_chunks.Chunks``):
    ``accumulate`` after every step (branch-free: the running sums of a
    monitored training metric), ``collected`` at a rollout's collections (a
    monitored rollout metric's), and ``work`` at the chunk boundaries where a
    check is ``due``, behind one ``_once.once_if`` (the evaluation, then the
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

    def warn_unreached(self, start: int, steps: int) -> None:
        """Warn where a run's first call (from step 0) ends before its first
        check (``every`` > ``steps``): no evaluation, no rule checked, which
        history and the result would show only as absent. Not for a call that
        continues a run (an epoch loop's later calls reach the check in
        their turn)."""
        if start != 0 or self.every <= steps:
            return
        rules = [r for r in (self.early, self.plateau) if r is not None]
        message = errors.checks_unreached(
            self.every, steps, self.evaluate is not None, rules
        )
        warnings.warn(message, UserWarning, stacklevel=_caller.user_level())

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
            kept_init(self.early, dtype),
            list(leaves),
            _scalars.constant(0, jnp.float32),
            _scalars.constant(0, jnp.int32),
        )

    def _rules(self) -> list:
        return [r for r in (self.early, self.plateau) if r is not None]

    def _one_number(self, monitor: str, value: Any, per: str) -> None:
        """Refuse, while tracing, a monitored training (``per`` "step") or
        rollout ("collection") metric that is not a scalar: the rules sum it
        into a scalar carry."""
        if jnp.ndim(value) != 0:
            rule = self.early if self.early and self.early.monitor == monitor else None
            errors = _stop_errors if rule is not None else _plateau_errors
            raise errors.monitor_not_scalar(monitor, value, per)

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
            self._one_number(monitor, value, "step")
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
            self._one_number(monitor, names[monitor], "collection")
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
