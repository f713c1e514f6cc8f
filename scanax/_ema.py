"""``fit(..., ema=decay)``: an exponential moving average of the trained
parameters, kept in the compiled loop as part of the training state.

A wrapper of the model's adapter (``_models``) adds the average's leaves after
the state's, so that everything the loop does to the state it does to the
average too: the last good state after a non-finite step (a step that is not
applied does not update it), checkpoints and their exact resume, an early
stop's best state.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _model_step, _population
from ._errors import fit as errors


def check_decay(ema: Any) -> float | None:
    """``ema=`` checked: None, or a decay in ``[0, 1)`` (any real number, a
    NumPy or JAX scalar too)."""
    if ema is None:
        return None
    dtype = getattr(ema, "dtype", None)  # a NumPy or JAX scalar
    scalar = dtype is not None and np.ndim(ema) == 0 and dtype.kind in "iuf"
    if isinstance(ema, bool) or not (isinstance(ema, numbers.Real) or scalar):
        raise errors.ema_type(ema)
    try:
        ema = float(ema)
    except (TypeError, ValueError):
        raise errors.ema_type(ema) from None
    if not 0.0 <= float(ema) < 1.0:
        raise errors.ema_value(ema)
    return float(ema)


class Options(NamedTuple):
    """``fit``'s ``ema=``, ``ema_eval=`` and ``ema_state=``, checked."""

    decay: float
    on_eval: bool  # ``ema_eval``: evaluations (and their rules) see the average
    start: Any = None  # ``ema_state``: an earlier call's ``result.ema``, or None


class EmaAdapter(_model_step.Wrapper):
    """A model's adapter whose state is ``(model state, average)``: after each
    step ``e = decay * e + (1 - decay) * p`` for every trained parameter
    ``p`` (computed in its own dtype). With ``on_eval``, evaluations (and what
    ``stop=`` monitors of them) use the averaged parameters."""

    def __init__(self, adapter: Any, decay: float, on_eval: bool, start: Any = None):
        super().__init__(
            adapter, ("ema", decay, on_eval), self._averaged if on_eval else None
        )
        self.decay, self.on_eval = decay, on_eval
        leaves, self.inner_def = jtu.tree_flatten(adapter.state)
        self.where = adapter.trained()
        average = [leaves[i] for i in self.where]
        if start is not None:  # ema_state=: continue an earlier fit's average
            given = adapter.trained_of(start)
            if given is None or [(jnp.shape(a), jnp.result_type(a)) for a in given] != [
                (jnp.shape(a), jnp.result_type(a)) for a in average
            ]:
                raise errors.ema_state_mismatch()
            average = [jnp.asarray(a) for a in given]
        self.state = (adapter.state, average)
        self.static = ("ema", adapter.static, decay, on_eval)

    def names(self) -> list[str]:
        inner = self.adapter.names()
        return [*inner, *(f"ema.{inner[i]}" for i in self.where)]

    def partition_specs(self) -> Any:
        """The model's annotations, the average's those of its parameters."""
        found = self.inner_specs(self.inner_def.num_leaves)
        return None if found is None else [*found, *(found[i] for i in self.where)]

    def averaged_leaves(self, leaves: list) -> list:
        """The model's own leaves, the average in place of the parameters, from
        this adapter's flat state (more leaves may follow: a rollout's)."""
        n = self.inner_def.num_leaves
        out = list(leaves[:n])
        for j, i in enumerate(self.where):
            out[i] = leaves[n + j]
        return out

    def _averaged(self, state: Any) -> Any:
        """The model's state with the average in place of the parameters."""
        leaves = jtu.tree_leaves(state[0])
        for i, e in zip(self.where, state[1]):
            leaves[i] = e
        return jtu.tree_unflatten(self.inner_def, leaves)

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        inner, where, decay = (
            self.adapter.make_step(loss_fn, accumulate),
            self.where,
            self.decay,
        )

        def step(state, batch, key):
            new, loss, metrics, grads = inner(state[0], batch, key)
            leaves = jtu.tree_leaves(new)
            average = _update(decay, state[1], [leaves[i] for i in where])
            return (new, average), loss, metrics, grads

        return step

    def finish(self, state: Any) -> tuple[Any, Any]:
        self.ema = self.adapter.model_of(self._averaged(state))
        return self.adapter.finish(state[0])


def _update(decay: float, average: list, params: list) -> list:
    return [
        (decay * e + (1.0 - decay) * p.astype(e.dtype)).astype(e.dtype)
        for e, p in zip(average, params)
    ]


class EmaPopulation(_population.Wrapped):
    """A population (``_population.Population``) whose members' state holds
    their averages too (after the model's leaves), for one ``fit``."""

    def __init__(self, pop: Any, decay: float, on_eval: bool, start: Any = None):
        where = pop.adapter(0).trained()
        average = [pop.state[i] for i in where]
        if start is not None:  # ema_state=: an earlier population fit's result.ema
            given = getattr(start, "leaves", None)
            same = given is not None and [
                (jnp.shape(a), jnp.result_type(a)) for a in given
            ] == [(jnp.shape(a), jnp.result_type(a)) for a in average]
            if not same:
                raise errors.ema_state_mismatch()
            average = list(given)
        names = [f"ema.{pop.names[i]}" for i in where]
        view = self._averaged if on_eval else None
        super().__init__(pop, ("ema", decay, on_eval), average, names, view)
        self.decay, self.on_eval, self.where = decay, on_eval, where

    def step_factory(self, call_for: Callable, accumulate: int = 1) -> Callable:
        inner, n, where = (
            self.pop.step_factory(call_for, accumulate),
            self.n_model,
            self.where,
        )

        def step(leaves, batch, key, hp):
            new, loss, metrics, grads = inner(leaves[:n], batch, key, hp)
            average = _update(self.decay, leaves[n:], [new[i] for i in where])
            return [*new, *average], loss, metrics, grads

        return step

    def _averaged(self, leaves: list) -> list:
        out = list(leaves[: self.n_model])
        for i, e in zip(self.where, leaves[self.n_model :]):
            out[i] = e
        return out

    def result(self) -> EmaMembers:
        return EmaMembers(self.pop, self.where, self.own)


class EmaMembers(Sequence):
    """``result.ema`` of a population ``fit``: member ``i``'s averaged model
    (``[i]``), as an ordinary object of its kind; ``leaves``: the averages
    (what ``ema_state=`` continues from)."""

    def __init__(self, pop: Any, where: list[int], leaves: list):
        self._pop, self._where, self.leaves = pop, where, leaves

    def __len__(self) -> int:
        return self._pop.n

    def __getitem__(self, i: Any) -> Any:
        i = _population.member_index(i, len(self))
        leaves = [x[i] for x in self._pop.state]
        for j, e in zip(self._where, self.leaves):
            leaves[j] = e[i]
        return self._pop.model_of(i, leaves)
