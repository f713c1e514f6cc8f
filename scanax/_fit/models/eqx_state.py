"""An Equinox model's ``eqx.nn.State`` in ``scanax.fit``'s optax kind.

A model made by ``eqx.nn.make_with_state`` comes with a State (BatchNorm's
running statistics, SpectralNorm's vectors): floating-point arrays that are no
parameters. fit carries them untrained, and ``loss_fn`` gives the new State
back as a third element, ``(loss, metrics, state)``, which replaces it after
the step (with ``accumulate``, after each micro-batch): the way a TrainState's
``batch_stats`` come back (``trainstate.py``), and what a hand-written
Equinox loop threads.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ... import _caller
from ..._errors import models as errors


def is_state(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.nn.State)


class Held:
    """Where a model's one State lies in its leaves (``positions``; empty for
    a model without one), and what a new State must look like."""

    def __init__(self, model: Any):
        self.positions: tuple[int, ...] = ()
        self.path = ""
        self.found = False  # (a State may hold no arrays: no stateful layer)
        if "equinox" not in sys.modules:
            return
        nodes = jtu.tree_flatten_with_path(model, is_leaf=is_state)[0]
        found, i = [], 0
        for path, node in nodes:
            n = len(jtu.tree_leaves(node)) if is_state(node) else 1
            if is_state(node):
                found.append((jtu.keystr(path), range(i, i + n), node))
            i += n
        if len(found) > 1:
            raise errors.states_many([p for p, _, _ in found])
        if found:
            self.found = True
            self.path, positions, state = found[0]
            self.positions = tuple(positions)
            self.treedef = jtu.tree_structure(state)
            self.avals = [
                (jnp.shape(x), jnp.result_type(x)) for x in jtu.tree_leaves(state)
            ]

    def __bool__(self) -> bool:
        return self.found

    def threaded(self, out: Any, others: list, where: tuple[int, ...]) -> tuple:
        """``loss_fn``'s result without its State, and ``others`` (the carried
        arrays) with the new State's at ``where`` (their places in ``others``).
        Checked: a third element only for a model with a State, and one built
        like it."""
        if not (isinstance(out, tuple) and len(out) == 3):
            if self and isinstance(out, tuple) and any(map(is_state, out)):
                raise errors.state_without_metrics(self.path, out)
            if self:
                self._warn(errors.state_not_returned(self.path))
            return out, others
        if not self:
            raise errors.third_without_state(out[2])
        *out, state = out
        if not isinstance(out[1], dict):
            raise errors.state_metrics_type(self.path, out[1])
        if not is_state(state):
            raise errors.state_not_a_state(self.path, state)
        leaves = jtu.tree_leaves(state)
        got = [(jnp.shape(x), jnp.result_type(x)) for x in leaves]
        if jtu.tree_structure(state) != self.treedef or got != self.avals:
            raise errors.state_changed(self.path, self.avals, got)
        # (the State the step was given, returned as it was, or one it did
        # not compute: the model's call gave back a new one that is dropped)
        given = [others[j] for j in where]
        unchanged = all(a is b for a, b in zip(leaves, given))
        computed = any(isinstance(x, jax.core.Tracer) for x in leaves)
        if leaves and (unchanged or not computed):
            self._warn(errors.state_not_returned(self.path, given_back=True))
        others = list(others)
        for j, x in zip(where, leaves):
            others[j] = x
        return tuple(out), others

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, UserWarning, stacklevel=_caller.user_level())

    def dropped(self, out: Any) -> Any:
        """An evaluation's result without the new State (inference mode: it
        is the State as trained)."""
        if self and isinstance(out, tuple) and len(out) == 3:
            return out[:2]
        return out
