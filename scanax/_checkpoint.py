"""Checkpoints for ``scanax.fit``: the complete training state, saved with orbax.

A checkpoint holds every array of the training state (for NNX: everything
``nnx.split((model, optimizer))`` returns, so Params, optimizer state, step counts,
RNG keys and counts, BatchNorm statistics), the shuffle key, the number of steps
done (which is also the data position: step ``t`` always uses the same batch) and
the history so far. Orbax writes each checkpoint to a temporary directory and
renames it when complete, so a process killed mid-save leaves the previous
checkpoints intact; the newest few are kept.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._errors import fit as errors

_FORMAT = 1
KEEP = 3


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise errors.no_orbax() from err
    return ocp


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def describe(x: Any) -> list:
    """``[shape, dtype]`` of a leaf as saved (keys are saved as their key data)."""
    if _is_key(x):
        data = jr.key_data(x)
        return [list(data.shape), f"key<{jr.key_impl(x)}>"]
    return [list(x.shape), np.dtype(x.dtype).name]


def _short(desc: list) -> str:
    shape, dtype = desc
    return f"{dtype}[{', '.join(map(str, shape))}]"


class Checkpoints:
    """Save and restore ``fit``'s training state in ``directory``."""

    def __init__(self, directory: Any, every: int, names: list[str], data: dict):
        ocp = _ocp()
        self.ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        self.names = names
        self.data = data
        options = ocp.CheckpointManagerOptions(
            max_to_keep=KEEP, create=True, cleanup_tmp_directories=True
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "history", "meta")
        )
        self.last_saved = None

    # ------------------------------------------------------------------ save

    def save(self, step: int, leaves: list, key: Any, history: dict) -> None:
        if step == self.last_saved or step == 0:
            return
        saved = [jr.key_data(x) if _is_key(x) else x for x in leaves]
        state = {"leaves": saved, "key": _key_data(key)}
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "leaves": [[n, *describe(x)] for n, x in zip(self.names, leaves)],
            "data": self.data,
        }
        ocp = self.ocp
        self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                history=ocp.args.StandardSave(history),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        self.last_saved = step

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ------------------------------------------------------------------ restore

    def steps_after(self, end: int) -> list[int]:
        """The saved steps past ``end``, oldest first."""
        return sorted(s for s in self.manager.all_steps() if s > end)

    def restore(
        self, leaves: list, key: Any, at_most: int
    ) -> tuple[int, list, Any, dict] | None:
        """``(step, leaves, key, history)`` from the newest readable checkpoint
        at or before step ``at_most`` that fits ``leaves``, or None when there is
        none. An unreadable (corrupt, partial) checkpoint is skipped with a
        warning; one from another model is an error."""
        ocp = self.ocp
        steps = [s for s in self.manager.all_steps() if s <= at_most]
        for step in sorted(steps, reverse=True):
            try:
                meta = self.manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )["meta"]
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint
                self._skip(step, err)
                continue
            self._check(step, meta, leaves)
            abstract = {
                "leaves": [_abstract(x) for x in leaves],
                "key": _abstract_key(key),
            }
            try:
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract),
                        history=ocp.args.StandardRestore(),
                    ),
                )
                restored = [
                    jr.wrap_key_data(r, impl=jr.key_impl(t)) if _is_key(t) else r
                    for r, t in zip(out["state"]["leaves"], leaves)
                ]
                new_key = _wrap_key(out["state"]["key"], key)
                history = {k: np.asarray(v) for k, v in out["history"].items()}
                _check_restored(step, restored, leaves, self.names)
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint
                self._skip(step, err)
                continue
            return int(meta["step"]), restored, new_key, history
        return None

    def _skip(self, step: int, err: Exception) -> None:
        warnings.warn(
            errors.checkpoint_unreadable(step, self.directory, err),
            RuntimeWarning,
            stacklevel=5,
        )

    def _check(self, step: int, meta: dict, leaves: list) -> None:
        if meta.get("format") != _FORMAT:
            raise errors.checkpoint_format(
                step, self.directory, meta.get("format"), _FORMAT
            )
        saved = {have[0]: have[1:] for have in meta["leaves"]}
        want = {n: list(describe(x)) for n, x in zip(self.names, leaves, strict=True)}
        only_saved = [n for n in saved if n not in want]
        only_here = [n for n in want if n not in saved]
        if only_saved or only_here:
            raise errors.checkpoint_leaves_differ(
                step, self.directory, only_saved, only_here
            )
        for name, types in want.items():
            if saved[name] != types:
                raise errors.checkpoint_mismatch(
                    step, self.directory, name, _short(saved[name]), _short(types)
                )
        if list(saved) != self.names:  # the same leaves in another order
            raise errors.checkpoint_mismatch(
                step, self.directory, "order", ", ".join(saved), ", ".join(self.names)
            )
        if meta["data"] != self.data:
            raise errors.checkpoint_other_data(
                step, self.directory, meta["data"], self.data
            )


def _key_data(key: Any) -> Any:
    return jr.key_data(key) if _is_key(key) else key


def _wrap_key(data: Any, template: Any) -> Any:
    if _is_key(template):
        return jr.wrap_key_data(data, impl=jr.key_impl(template))
    return jnp.asarray(data, template.dtype)


def _abstract(x: Any) -> Any:
    if _is_key(x):
        x = jr.key_data(x)
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _abstract_key(key: Any) -> Any:
    return _abstract(key)


def _check_restored(step: int, restored: list, leaves: list, names: list) -> None:
    """Orbax must give back the exact types (it drops ``weak_type``: we never use
    weak types in the state, so a restored carry has the type of a fresh one)."""
    for name, r, t in zip(names, restored, leaves):
        if r.shape != t.shape or r.dtype != t.dtype:
            raise errors.restored_type(step, name, r, t)
