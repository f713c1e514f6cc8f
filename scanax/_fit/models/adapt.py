"""Model kinds for ``scanax.fit``: NNX, optax over a pytree (Equinox), flax TrainState.

Each adapter reduces a ``(model, optimizer)`` pair to a pytree of arrays (``state``),
a fingerprint of everything else (``fingerprint()``: the same one means the same
compiled step; None when it cannot be described, and then each call traces its
program again), a pure ``step(state, batch)`` and a way back to the user's objects.
``adapt`` chooses the kind; each kind is a module (``_models_nnx``, ``_models_optax``,
``_models_trainstate``), built from what they share (``_model_step``). None of them
imports a framework the user has not already imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
from jax.sharding import PartitionSpec as P

from ... import _nnx
from ..._errors import models as errors, short_type
from . import (
    nnx as _models_nnx,
    optax as _models_optax,
    trainstate as _models_trainstate,
)
from .step import is_inexact


def _is_train_state(x: Any) -> bool:
    mod = sys.modules.get("flax.training.train_state")
    return mod is not None and isinstance(x, mod.TrainState)


def _is_gradient_transformation(x: Any) -> bool:
    optax = sys.modules.get("optax")
    return optax is not None and isinstance(x, optax.GradientTransformation)


def adapt(
    model: Any,
    optimizer: Any,
    opt_state: Any = None,
    compiled_init: bool = False,
    keep: bool = False,
) -> (
    _models_nnx.NNXAdapter
    | _models_optax.OptaxAdapter
    | _models_trainstate.TrainStateAdapter
):
    """The adapter for a ``(model, optimizer)`` pair, or a TypeError naming the fix.
    ``opt_state`` (optax pairs only) continues from an earlier optax state;
    ``compiled_init``: an optax state made with one compiled call where it can
    (``OptaxAdapter``: for fit's own run, not for a structure looked at), or
    filled on the host where it is constants, and then, with ``keep``, kept
    on the device for the next fit."""
    to_tx = getattr(optimizer, "gradient_transformation", None)
    if not _is_gradient_transformation(optimizer) and callable(to_tx):
        # optax.MultiSteps and other wrappers (MultiSteps passes extra
        # arguments such as a plateau rule's value= to the transform it wraps)
        inner = to_tx()
        optax = sys.modules["optax"]
        if isinstance(optimizer, optax.MultiSteps):
            inner = optax.GradientTransformationExtraArgs(inner.init, inner.update)
        optimizer = inner
    if opt_state is not None and not _is_gradient_transformation(optimizer):
        raise errors.opt_state_not_optax(optimizer)
    if _is_train_state(model):
        if optimizer is not None:
            raise errors.bad_pair(model, optimizer, "trainstate_with_optimizer")
        return _models_trainstate.TrainStateAdapter(model)
    if _nnx.is_node(model):
        if _models_nnx.is_optimizer(optimizer):
            return _models_nnx.NNXAdapter(model, optimizer)
        if _models_nnx.is_optimizer(model) and _nnx.is_node(optimizer):
            raise errors.bad_pair(model, optimizer, "swapped")
        raise errors.bad_pair(model, optimizer, "nnx_without_optimizer")
    if _is_gradient_transformation(optimizer):
        bad = [
            (jtu.keystr(p), short_type(x))
            for p, x in jtu.tree_flatten_with_path(model, is_leaf=_nnx.is_node)[0]
            if _nnx.is_node(x)
        ]
        if bad:
            raise errors.nnx_objects_in_optax_model(bad)
        if not any(is_inexact(x) for x in jtu.tree_leaves(model)):
            raise errors.nothing_to_train(model)
        return _models_optax.OptaxAdapter(
            model, optimizer, opt_state, compiled_init, keep
        )
    if _models_nnx.is_optimizer(optimizer):
        why = "optimizer_without_nnx"
    elif _is_gradient_transformation(model) or _models_nnx.is_optimizer(model):
        why = "swapped"  # fit(optimizer, model, ...)
    elif callable(optimizer) and (
        getattr(optimizer, "__module__", None) or ""
    ).startswith("optax"):
        why = "uncalled"  # optax.adam, not optax.adam(1e-3)
    else:
        why = "other"
    raise errors.bad_pair(model, optimizer, why)


class Flat:
    """One model as fit's loop and its features see it (``_feature.Base``):
    its adapter's state as flat leaves, a step and an evaluation on them (as
    a population's members are)."""

    members = None

    def __init__(self, adapter: Any):
        self.adapter, self.kind = adapter, adapter.kind
        self.state, self.treedef = jtu.tree_flatten(adapter.state)
        self.names = adapter.names()

    def fingerprint(self) -> Any:
        return self.adapter.fingerprint()

    def start_step(self) -> int | None:
        return self.adapter.start_step()

    def trained(self) -> list[int]:
        return self.adapter.trained()

    def trained_of(self, model: Any) -> list | None:
        return self.adapter.trained_of(model)

    def partition_specs(self) -> list | None:
        """The model's sharding annotations, one per leaf (None: none, or not
        one per leaf)."""
        tree = self.adapter.partition_specs()
        if tree is None:
            return None
        found = jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))
        return found if len(found) == len(self.state) else None

    def layer_axes(self) -> list | None:
        """Per leaf, the layer axis of a ``Stack``'s stacked leaf, else None
        (None: no leaf known as one)."""
        axes = self.adapter.layer_axes()
        return axes if axes is not None and len(axes) == len(self.state) else None

    def _tree(self, leaves: list) -> Any:
        return jtu.tree_unflatten(self.treedef, leaves)

    def step_factory(self, call_for: Callable, accumulate: int = 1) -> Callable:
        """``step(leaves, batch, key, hp)`` (``hp`` is unused); the step gets
        containers of its own (an NNX step mutates the Variables it
        merges)."""
        step = self.adapter.make_step(call_for(None), accumulate)

        def flat_step(leaves, batch, key, hp):
            new, loss, metrics, grads = step(self._tree(leaves), batch, key)
            return jtu.tree_leaves(new), loss, metrics, grads

        return flat_step

    def eval_factory(self, call_for: Callable) -> Callable:
        evaluate = self.adapter.make_eval(call_for(None))
        return lambda leaves, batch, key, hp: evaluate(self._tree(leaves), batch, key)

    def view(self, leaves: list, hp: Any, fn: Callable, *args: Any) -> Any:
        return self.adapter.make_call(fn)(self._tree(leaves), *args)

    def model_of(self, leaves: list) -> Any:
        return self.adapter.model_of(self._tree(leaves))

    def finish(self, leaves: list) -> tuple[Any, Any]:
        """The model and optimizer holding ``leaves`` (NNX: written in place)."""
        return self.adapter.finish(self._tree(leaves))
