"""The TrainState kind of ``scanax.fit``: a flax ``TrainState``, trained by its
own ``apply_gradients``."""

from __future__ import annotations

import dataclasses
import functools as ft
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ... import _fingerprint
from ..._errors import models as errors
from ..._errors.fit import CALL as _CALL
from ..._tree import is_array
from . import step as _step
from .step import accumulated, evaluation, extra_args, is_inexact, split_loss


class TrainStateAdapter:
    """A flax ``TrainState``: ``loss_fn(state, batch)``, then ``apply_gradients``."""

    kind = "trainstate"

    def __init__(self, state: Any):
        self.state = state
        self.static = ("trainstate", jtu.tree_structure(state))

    def fingerprint(self) -> Any:
        return _fingerprint.of(self.static)

    def trained(self) -> list[int]:
        """The positions of the floating ``params`` in the state's leaves."""
        flat = jtu.tree_flatten_with_path(self.state)[0]
        return [
            i
            for i, (path, x) in enumerate(flat)
            if getattr(path[0], "name", None) == "params" and is_inexact(x)
        ]

    def model_of(self, state: Any) -> Any:
        return state

    def trained_of(self, model: Any) -> list | None:
        leaves, treedef = jtu.tree_flatten(model)
        if treedef != jtu.tree_structure(self.state):
            return None
        return [leaves[i] for i in self.trained()]

    def partition_specs(self) -> None:
        """No sharding annotations: the state is replicated on a mesh."""
        return None

    def layer_axes(self) -> None:
        """(no leaf known as a ``Stack``'s stacked one)"""
        return None

    def start_step(self) -> int:
        """The state's own ``step``: where this call continues from."""
        return int(self.state.step)

    def names(self) -> list[str]:
        flat = jtu.tree_flatten_with_path(self.state)[0]
        return ["state" + jtu.keystr(path) for path, _ in flat]

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        """``loss_fn`` may return ``(loss, metrics, updates)``: ``updates`` replaces
        fields of the state (a linen model's new ``batch_stats``, from
        ``apply_fn(..., mutable=["batch_stats"])``); then ``apply_gradients``.
        With ``accumulate`` > 1, the micro-batches' gradients are averaged
        (``accumulated``), the updates threaded through them."""

        updated: set = set()  # the fields loss_fn returns, found while tracing

        def objective_at(state, batch, key):
            def objective(params):
                out = loss_fn(state.replace(params=params), batch, key)
                updates: dict = {}
                if isinstance(out, tuple) and len(out) == 3:
                    *out, updates = out
                    out = tuple(out)
                loss, metrics = split_loss(_CALL, out)
                return loss, (metrics, updates)

            return objective

        def one(state, batch, key):
            (loss, (metrics, updates)), grads = jax.value_and_grad(
                objective_at(state, batch, key), has_aux=True
            )(state.params)
            if updates:
                updates = _check_updates(state, updates)
                updated.update(updates)
                state = state.replace(**updates)
            elif _has_arrays(getattr(state, "batch_stats", None)):
                warnings.warn(errors.batch_stats_not_updated(), stacklevel=2)
            return state, loss, metrics, grads

        def step(state, batch, key):
            after, loss, metrics, grads = accumulated(
                one, state, batch, key, accumulate
            )
            # apply_gradients on the state as it was, the updates after it (as
            # flax's examples pass them: a subclass's apply_gradients reading
            # batch_stats sees the step's old ones)
            extra = extra_args(state.tx, loss)
            # apply_gradients calls tx.update without extra arguments: with
            # some, it runs on the transform with them bound, then the state
            # gets its own back (a subclass's apply_gradients and
            # OVERWRITE_WITH_GRADIENT still hold)
            tx = state.tx
            bound = tx._replace(update=ft.partial(tx.update, **extra)) if extra else tx
            with _step.updating():
                new = state.replace(tx=bound).apply_gradients(grads=grads)
            new = new.replace(tx=tx, **{f: getattr(after, f) for f in updated})

            def loss_of(params):  # (all inside the check's own trace)
                b, k = _step.first(accumulate, batch, key)
                return objective_at(state, b, k)(params)[0]

            what = "the TrainState's `params`"
            _step.check_reads_trained(loss_of, state.params, what)
            return new, loss, metrics, grads

        return step

    def make_call(self, fn: Callable) -> Callable:
        """``call(state, *args) -> fn(state, *args)``: the state as it is
        (deterministic evaluation is ``fn``'s to choose)."""
        return fn

    def make_eval(self, loss_fn: Callable) -> Callable:
        """``evaluate(state, batch, key) -> (loss, metrics)``: ``loss_fn`` on the
        state as it is (a ``(loss, metrics, updates)`` result's updates are
        dropped)."""

        def dropped(state, batch, key):
            out = loss_fn(state, batch, key)
            return out[:2] if isinstance(out, tuple) and len(out) == 3 else out

        return evaluation(dropped)

    def finish(self, state: Any) -> tuple[Any, Any]:
        return state, None


_OWN_FIELDS = ("step", "apply_fn", "params", "tx", "opt_state")


def _has_arrays(tree: Any) -> bool:
    return any(is_array(x) for x in jtu.tree_leaves(tree))


def _check_updates(state: Any, updates: Any) -> dict:
    """``updates`` (from ``loss_fn``) checked against the state's own fields."""
    fields = [f.name for f in dataclasses.fields(state) if f.name not in _OWN_FIELDS]
    if not isinstance(updates, dict):
        raise errors.trainstate_updates_type(updates, fields)
    for name, value in updates.items():
        if name not in fields:
            raise errors.trainstate_updates_field(name, fields)
        old = getattr(state, name)
        if jtu.tree_structure(value) != jtu.tree_structure(old) or any(
            jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b)
            for a, b in zip(jtu.tree_leaves(value), jtu.tree_leaves(old), strict=True)
        ):
            raise errors.trainstate_updates_changed(name, old, value)
    return updates
