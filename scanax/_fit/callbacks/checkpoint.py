"""The user's side of checkpoints: the ``Checkpoint`` feature (save every
``every`` steps, resume from the newest) and ``load_best``, which reads the best
state that ``EarlyStop(best_dir=...)`` saved. The store itself (orbax, atomic
saves, the index of calls) is ``_checkpoint``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr

from ... import _tree
from ..._errors import checkpoint as errors, fit as fit_errors
from .. import feature as _feature
from ..checkpoint import Checkpoints, is_key, local_directory, strong
from ..data import arrays as _data

BEST = {"kind": "best"}  # what a best-only store records as its data


def best_data(members: int | None) -> dict:
    """What a best-only store records as its data: ``BEST`` for one model, and
    the number of members for a population's (its leaves ``[members, ...]``,
    its history each member's best step and value, ``-1``/NaN: none)."""
    return BEST if members is None else {**BEST, "members": int(members)}


def best_key() -> Any:
    """The key a best-only store saves (the key is the run's business)."""
    return jax.random.PRNGKey(0)


def load_best(
    directory: Any, model: Any, optimizer: Any = None, *, member: Any = None
) -> tuple[Any, Any]:
    """The best state that ``fit(..., best_dir=directory)`` saved, in a model of
    the same structure: ``(model, optimizer)`` as ``fit`` takes them (NNX: the
    objects passed in, updated in place; an optax pair: the model and its optax
    state; a ``TrainState`` and None).

    Arguments:
        directory: the ``best_dir`` of a ``fit``.
        model, optimizer: a pair of the structure trained (new objects: only
            their structure is read, every array is replaced). For a
            population's ``best_dir``: one member's pair (what its ``make``
            returns).
        member: for a population's ``best_dir``, the member whose best to load
            (``-1``: the last); None for one model's.

    Returns:
        ``(model, optimizer)`` holding the best state, by ``stop=``'s monitor
        (its step is the fit's ``result.best_step`` (member ``i``'s:
        ``result.best_step[i]``) when ``stop=`` restores the best, and the best
        ``val_step`` of its history; its step counts are those of that step).

    Raises:
        FileNotFoundError: no best state in ``directory`` (or none for
            ``member``).
        ValueError: a model of another structure (the leaves that differ
            named); a ``scanax.Checkpoint`` directory, not a best state; a URL.
        TypeError: ``member=`` missing for a population's directory, or given
            for one model's.
        IndexError: ``member`` out of range.
    """
    from ..models import (
        adapt as _models,  # the model kinds (a layer of its own would be a cycle)
    )

    adapter = _models.adapt(model, optimizer)
    leaves, treedef = jax.tree_util.tree_flatten(adapter.state)
    leaves = strong(leaves)
    path = local_directory(
        os.fspath(directory),
        lambda p: errors.remote_dir(p, "directory", "scanax.load_best"),
    )
    store = Checkpoints(path, None, adapter.names(), BEST, 0, keep=1)
    store.call = "scanax.load_best"
    try:
        meta = store.newest_meta()
        if meta is not None and meta.get("data", {}).get("kind") != "best":
            raise errors.not_a_best_dir(path)
        members = None if meta is None else meta.get("data", {}).get("members")
        if members is None and member is not None and meta is not None:
            raise errors.best_not_population(path, member)
        if members is not None:
            if member is None:
                raise errors.best_member_needed(path, members)
            member = _member(member, members)
            store.data = best_data(members)
            leaves = [_stacked(x, members) for x in leaves]
        found = None
        if store.reader is not None:
            found = store.restore(leaves, best_key(), 1 << 62)
    finally:
        store.close()
    if found is None:
        raise errors.no_best_state(path)
    state = found[1]
    if members is not None:
        if int(found[3]["step"][member]) < 0:
            raise errors.best_member_none(path, member)
        state = [x[member] for x in state]
    return adapter.finish(jax.tree_util.tree_unflatten(treedef, state))


def _member(i: Any, n: int) -> int:
    """Member index ``i`` of ``n`` (negative counts from the end), checked."""
    return _tree.index_in(i, n, lambda index: errors.best_member_index(i, index, n))


def _stacked(x: Any, n: int) -> Any:
    """What a population's best-only store holds for a member's leaf ``x``:
    ``[n, ...]`` (shapes and types only, but for a key: its key data)."""
    if is_key(x):
        data = jr.key_data(x)
        stacked = jnp.zeros((n, *data.shape), data.dtype)
        return jr.wrap_key_data(stacked, impl=jr.key_impl(x))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class Checkpoint(_feature.Feature):
    """Save the training state into ``directory`` every ``every`` steps and at
    the end of each ``fit``, and resume from the newest usable checkpoint there
    (``scanax.fit(..., callbacks=[scanax.Checkpoint("runs/ckpt", every=500)])``):
    atomic, read-only until the first save, exact on resume (the data order,
    the keys and every feature's state continue); see ``docs/checkpoint.md``.

    Arguments:
        directory: a path (created if missing; not a file).
        every: steps between saves (at multiples of it); None: at the end only.

    Not part of the compiled program.

    Example:
        >>> import scanax
        >>> scanax.Checkpoint("runs/ckpt", every=500)
        Checkpoint(directory='runs/ckpt', every=500)
    """

    directory: Any
    _: dataclasses.KW_ONLY
    every: int | None = None

    def __post_init__(self) -> None:
        try:
            path = os.fspath(self.directory)
        except TypeError:
            raise fit_errors.checkpoint_dir_type(self.directory) from None
        path = local_directory(
            path, lambda p: errors.remote_dir(p, "directory", "scanax.Checkpoint")
        )
        if os.path.exists(path) and not os.path.isdir(path):
            raise fit_errors.checkpoint_dir_not_dir(path)
        if self.every is not None:
            every = _data.positive_int("every", self.every, "scanax.Checkpoint")
            object.__setattr__(self, "every", every)

    def program_key(self) -> None:
        return None
