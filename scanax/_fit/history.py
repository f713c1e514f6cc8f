"""The history of one ``scanax.fit`` run: per-step values with their global
step numbers and the evaluations at theirs, for one model or a population's
members (a member axis first), restored from a checkpoint and read back as
``FitResult.history``."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import _caller
from .._errors import fit as errors

# Entries recorded at some steps only, as (buffer, its flag, history prefix):
# evaluations after step t (0-based) and a rollout's collections before it, both
# at step number t + 1 (``val_step``, ``rollout_step``), as the step's own entries:
# the collection that step ``t + 1`` was the first to train on.
SPARSE = (("val", "evaluated", "val_"), ("rollout", "collected", "rollout_"))
# Who returns a group's metrics, and what a group's entry is (``_align``'s warning).
_GROUPS = {
    "": ("`loss_fn`", "steps", "step"),
    "val_": ("the evaluation", "evaluations", "evaluation"),
    "rollout_": ("`collect`", "collections", "collection"),
}


class History:
    """Per-step values of one ``fit`` call, with their global step numbers.

    A population's (``members=k``): ``[members, steps]`` arrays (NaN where a
    member did not train) and ``[members, evaluations]`` evaluations (NaN
    where a member did not evaluate); the step numbers are shared."""

    def __init__(self, members: int | None = None):
        self.members = members
        self.axis = 0 if members is None else 1  # the steps' axis of a value
        self.arrays: dict[str, list[np.ndarray]] = {"step": [], "loss": []}
        # "val_step", "val_<name>", "rollout_step", "rollout_<name>"
        self.val: dict[str, list[np.ndarray]] = {}
        self.count = 0  # steps recorded
        self.warned: set[str] = set()  # the groups whose metric change was told

    def _axis(self, name: str) -> int:
        return 0 if name.endswith("step") else self.axis

    def restore(self, saved: dict[str, np.ndarray], after: int, step: int) -> None:
        """The history of a checkpoint at ``step``, from step ``after + 1`` on (a
        checkpoint of an older format has no step numbers: they are counted back)."""
        saved = dict(saved)
        self.val = {}
        for _, _, prefix in SPARSE:
            group = {k: saved.pop(k) for k in list(saved) if k.startswith(prefix)}
            if prefix + "step" in group:
                keep = np.asarray(group[prefix + "step"]) > after
                self.val.update(
                    {
                        k: [np.compress(keep, v, axis=self._axis(k))]
                        for k, v in group.items()
                    }
                )
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
        recorded, for the logger: ``(steps, values, sparse)``, ``sparse`` a
        list of ``(steps, values)``: the evaluations, the collections."""
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
        known = set(self.arrays) - {"loss", "step"}
        self._align(self.arrays, known, metrics, self.count, ran, "")
        steps = np.arange(first + 1, first + ran + 1)
        self.arrays["step"].append(steps)
        for name, value in values.items():
            self.arrays[name].append(value)
        self.count += ran
        sparse = []
        for entry, flag, prefix in SPARSE:
            if entry in ys:
                sparse.append(self._sparse(first, ys, ran, entry, flag, prefix))
        return steps, values, sparse

    def _sparse(self, first, ys, ran, entry, flag, prefix) -> tuple:
        """Entries recorded at some steps only: one each where ``ys[flag]``, at
        their steps (a population: where any member has one, NaN for the
        others)."""
        done = np.asarray(ys[flag])
        named = {
            k if k.startswith(prefix) else prefix + k: v for k, v in ys[entry].items()
        }
        if self.members is None:
            idx = np.flatnonzero(done[:ran])
            values = {k: np.asarray(v)[idx] for k, v in named.items()}
        else:
            done = done[:, :ran]
            idx = np.flatnonzero(done.any(axis=0))
            values = {
                k: _masked(done[:, idx], np.asarray(v)[:, idx])
                for k, v in named.items()
            }
        steps = first + 1 + idx
        known = {k for k in self.val if k.startswith(prefix)} - {prefix + "step"}
        done = sum(len(s) for s in self.val.get(prefix + "step", []))
        self._align(self.val, known, values, done, len(idx), prefix)
        self.val.setdefault(prefix + "step", []).append(steps)
        for name, value in values.items():
            self.val.setdefault(name, []).append(value)
        return steps, values

    def _nan(self, count: int, shape: tuple = ()) -> np.ndarray:
        """NaN for ``count`` steps (and every member) of a metric of ``shape``."""
        if self.members is None:
            return np.full((count, *shape), np.nan, np.float32)
        return np.full((self.members, count, *shape), np.nan, np.float32)

    def _align(
        self, store: dict, known: set, values: dict, done: int, count: int, group: str
    ) -> None:
        """Metric names differ from those recorded so far (a checkpoint of a
        ``loss_fn``, ``collect`` or evaluation returning other metrics): NaN
        where a metric has no value, so that every array of ``store`` keeps one
        entry per step (``group`` ""), collection ("rollout_") or evaluation
        ("val_"); ``done`` entries so far, ``count`` now. Told once per group."""
        if set(values) == known:
            return
        new, gone = sorted(set(values) - known), sorted(known - set(values))
        if done and group not in self.warned:
            self.warned.add(group)
            warnings.warn(
                errors.metrics_changed(done, new, gone, *_GROUPS[group]),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        # (a metric from the first entry on keeps its dtype: an int or bool
        # training metric of one model stays one; it was float64, joined to an
        # empty float32 start)
        start = bool(done)
        axis = self.axis + 1  # (a metric's own shape after the steps' axis)
        for name in new:
            shape = np.shape(values[name])[axis:]
            store[name] = [self._nan(done, shape)] if start else []
        for name in gone:
            shape = np.shape(store[name][-1])[axis:] if store[name] else ()
            store[name].append(self._nan(count, shape))

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


def _masked(done: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``v`` (``[members, entries, ...]``) where ``done`` (``[members,
    entries]``), NaN elsewhere."""
    return np.where(done.reshape(done.shape + (1,) * (v.ndim - 2)), v, np.nan)
