"""What ``scanax.evaluate``, ``scanax.predict`` and fit's evaluation run a
function on: a model (NNX, Equinox, a ``TrainState``, any pytree) or a
population, as its arrays and a ``runner`` that rebuilds it in eval mode inside
the compiled program (the user's objects are never switched or written)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _fingerprint, _nnx
from .._errors import evaluate as errors
from .._tree import is_array
from .models import nnx as _models_nnx, population as _population
from .models.eqx_state import Held


class Target(NamedTuple):
    """What is evaluated: its arrays (``leaves``; a population's with a member
    axis, and its hyperparameters ``hp``), what the compiled program depends on
    (``identity``, a fingerprint, or None: traced again at every call), and
    ``runner(call) -> run(leaves, batch, key, hp)``: ``call(model, batch, key,
    hp)`` on the model rebuilt from ``leaves`` in eval mode, its result as it
    is. ``runner`` closes over no array: programs are cached. ``updates``: a
    ``loss_fn`` may return a third element (a TrainState's updates, an
    Equinox model's new ``eqx.nn.State``), which an evaluation drops."""

    leaves: list
    hp: Any
    identity: Any
    runner: Callable
    members: bool
    updates: bool


def of(call: str, model: Any) -> Target:
    """What ``call`` (``scanax.evaluate``, ``predict`` or fit's evaluation)
    evaluates for ``model``: an NNX module, a population, or a pytree."""
    if _population.is_population(model):
        return _population_target(model)
    if _nnx.is_node(model) or _nnx.contains_node(model):
        if _models_nnx.is_optimizer(model):
            raise errors.optimizer_as_model(call)
        return _nnx_target(call, model)
    return _tree_target(call, model)


def _nnx_target(name: str, model: Any) -> Target:
    """An NNX module, or a dict, list or tuple holding some: every module in
    it in eval mode."""
    graphdef, leaves = _nnx.values([model])

    def runner(call):
        def run(leaves, batch, key, hp):
            (copy,) = _nnx.unflatten(graphdef, leaves)
            _nnx.eval_mode(copy)
            copy = _equinox_inference(copy)  # (an Equinox part of a container)
            return _models_nnx.evaluated(copy, lambda: call(copy, batch, key, hp), name)

        return run

    found = _nnx.graphdef_fingerprint(graphdef)
    identity = None if found is None else ("nnx", found)
    return Target(leaves, None, identity, runner, False, False)


def _tree_target(call: str, model: Any) -> Target:
    """An Equinox module, a TrainState or any pytree: its arrays are the
    program's arguments, every other leaf is static."""
    flat, treedef = jtu.tree_flatten(model)
    dynamic = [i for i, x in enumerate(flat) if is_array(x)]
    if not dynamic:
        raise errors.model_type(call, model)
    template = [None if is_array(x) else x for x in flat]
    statics = tuple((i, x) for i, x in enumerate(template) if i not in set(dynamic))
    updates = _is_train_state(model) or bool(Held(model))

    def runner(fn):
        def run(leaves, batch, key, hp):
            full = list(template)
            for i, x in zip(dynamic, leaves):
                full[i] = x
            rebuilt = jtu.tree_unflatten(treedef, full)
            eqx = sys.modules.get("equinox")
            if eqx is not None:
                rebuilt = eqx.nn.inference_mode(rebuilt)
            return fn(rebuilt, batch, key, hp)

        return run

    static = ("tree", treedef, tuple(dynamic), statics)
    identity = _fingerprint.of(static)
    leaves = [flat[i] for i in dynamic]
    return Target(leaves, None, identity, runner, False, updates)


def _population_target(pop: Any) -> Target:
    """Each member rebuilt by the population's own eval (``eval_factory``: its
    kind's eval mode); ``call``'s result is passed out around the split into
    ``(loss, metrics)`` that the fit loop's evaluation makes."""

    def runner(call):
        def run(leaves, batch, key, hp):
            box = []

            def inner(model, batch, key):
                box.append(call(model, batch, key, hp))
                return jnp.zeros(()), {}

            pop.eval_factory(lambda hp: inner)(leaves, batch, key, hp)
            return box[0]

        return run

    identity = pop.fingerprint()
    return Target(
        list(pop.state),
        pop.hp(),
        identity,
        runner,
        True,
        pop.updates(),
    )


def _equinox_inference(tree: Any) -> Any:
    """``eqx.nn.inference_mode`` on each Equinox module in ``tree``, the NNX
    nodes in it left as they are (the same objects)."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return tree
    return jtu.tree_map(
        lambda x: eqx.nn.inference_mode(x) if isinstance(x, eqx.Module) else x,
        tree,
        is_leaf=lambda x: isinstance(x, eqx.Module) or _nnx.is_node(x),
    )


def _is_train_state(x: Any) -> bool:
    mod = sys.modules.get("flax.training.train_state")
    return mod is not None and isinstance(x, mod.TrainState)
