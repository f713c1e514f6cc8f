"""The protocol of ``scanax.fit``'s features, and how one run composes them.

A feature (``scanax.Ema``, ``scanax.Plateau``, ``scanax.Precision``, a Rollout's
feed...) is an object that validates itself when made (the user's: a frozen
dataclass). It declares the parts it has, each where it runs:

- **its state**: leaves after the model's, the same for one model and for each
  member of a population (``leaf_names``; ``init_member``: one member's, pure,
  vmapped over a population's members; or ``state=`` continued from an earlier
  call: ``given_leaves``);
- **every step**, branch-free: what it does to the loss (``wrap_loss``) and to
  the step on one member's flat leaves (``wrap_step``), and what evaluations see
  of the state (``eval_view``);
- **at the chunk boundaries**: ``before`` a step (a rollout's collection); the
  rules checked at evaluations are ``_fit_checks``'s;
- **on the host**: what it gives the result (``result``, under its ``field``),
  and which of its leaves an early stop keeps at the last step
  (``keeps_last``).

The engine (``Features``) orders the parts by each feature's ``phase``, never
by the order the user listed them in: the state is the model's leaves, then
each feature's by phase; the step is the model's, wrapped by each feature from
the lowest phase out. A single model and a population run the same parts; the
model side (``Base``) is ``_models.Flat`` for one model, the population itself
for many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import jax
from jax.sharding import PartitionSpec as P


class Base(Protocol):
    """What features see of the model: one model (``_models.Flat``) or a
    population (``_population.Population``), as flat leaves of one member
    (stacked on a member axis for a population)."""

    kind: str  # "nnx", "optax" or "trainstate"
    members: int | None  # a population's size, None for one model
    state: list  # the model's leaves
    names: list[str]  # their checkpoint names

    def trained(self) -> list[int]:
        """The positions of the trained parameters among the leaves."""

    def step_factory(self, call_for: Callable, accumulate: int = 1) -> Callable:
        """``step(leaves, batch, key, hp) -> (leaves, loss, metrics, grads)`` of
        one member; ``call_for(hp)`` is its loss as ``call(model, batch,
        key)``."""

    def eval_factory(self, call_for: Callable) -> Callable:
        """``evaluate(leaves, batch, key, hp) -> (loss, metrics)`` in eval
        mode."""

    def view(self, leaves: list, hp: Any, fn: Callable, *args: Any) -> Any:
        """``fn(model, *args)`` on one member's leaves in eval mode."""


class Feature:
    """A training feature of ``scanax.fit``, given in ``fit(...,
    callbacks=[...])``. Every part is optional; the defaults do nothing.
    ``phase``: where its state and step part stand among the others (lower:
    nearer the model); ``field``: the ``FitResult`` attribute of its
    ``result``."""

    phase: ClassVar[int] = 0
    field: ClassVar[str | None] = None

    def program_key(self) -> Any:
        """Its part of the compiled program's identity (a frozen dataclass:
        itself, whose fields compare; continued state does not)."""
        return self

    # ---------------------------------------------------------------- state

    def leaf_names(self, base: Base) -> list[str]:
        """The checkpoint names of its leaves (none: no state)."""
        return []

    def init_leaves(self, base: Base, start: int, before: list) -> list:
        """Its leaves at the start of a run from global step ``start`` (after
        the state's leaves ``before`` them): the continued state if given,
        else ``init_member`` of each member."""
        given = self.given_leaves(base)
        if given is not None:
            return given
        one = lambda model: self.init_member(base, model)  # noqa: E731
        if base.members is None:
            return list(one(list(base.state)))
        return list(jax.vmap(one)(list(base.state)))

    def init_member(self, base: Base, model: list) -> list:
        """One member's leaves before its first step, from its model leaves
        (pure: vmapped over a population's members)."""
        return []

    def given_leaves(self, base: Base) -> list | None:
        """``state=``'s leaves, checked against this model (a population's:
        a member axis first), or None."""
        return None

    def leaf_specs(self, specs: list, base: Base) -> list:
        """Its leaves' sharding annotations (the model's: ``specs``):
        replicated."""
        return [P() for _ in self.leaf_names(base)]

    # ---------------------------------------------------------------- every step

    def wrap_loss(self, call: Callable, kind: str) -> Callable:
        """The loss ``call(model, batch, key)`` the step differentiates."""
        return call

    def wrap_step(self, make: Callable, base: Base, names: list[str]) -> Callable:
        """``make(call_for) -> step`` of the model and the features below it,
        wrapped: the wrapped step gets the flat leaves up to its own (which
        start at ``at = len(names)``; ``names``: the checkpoint names of those
        before) and gives ``make``'s step ``leaves[:at]``."""
        return make

    def eval_view(self, leaves: list, base: Base, at: int) -> list:
        """What evaluations see of one member's state (default: as it is)."""
        return leaves

    # ---------------------------------------------------------------- boundaries

    def before(self, leaves: list, t: Any, hp: Any) -> tuple | None:
        """At the boundary before global step ``t``: ``(leaves, due,
        metrics)`` of one member (None: nothing happens there)."""
        return None

    # ---------------------------------------------------------------- host

    def keeps_last(self, name: str) -> bool:
        """Whether an early stop that restores the best state keeps this leaf
        at the last step run instead (by its checkpoint name)."""
        return False

    def result(self, base: Base, leaves: list, at: int) -> Any:
        """What ``FitResult.<field>`` holds, from the state after the run (a
        population's: stacked; its own leaves start at ``at``)."""
        return None


class Features:
    """The features of one run, composed by phase over its model (``base``):
    the state's layout (the model's leaves, then each feature's), the step and
    the evaluation on one member's flat leaves, the results."""

    def __init__(self, base: Base, features: Sequence[Feature], start: int):
        self.base = base
        self.items = sorted(features, key=lambda f: f.phase)
        self.n = len(base.state)  # the model's leaves
        self.at: list[int] = []
        self.own: list[list] = []
        at = self.n
        for f in self.items:
            leaves = f.init_leaves(base, start, self.state)
            self.at.append(at)
            self.own.append(leaves)
            at += len(leaves)

    @property
    def state(self) -> list:
        return [*self.base.state, *(x for own in self.own for x in own)]

    def names(self) -> list[str]:
        own = [n for f in self.items for n in f.leaf_names(self.base)]
        return [*self.base.names, *own]

    def key(self) -> tuple:
        """The features' part of the compiled program's identity."""
        return tuple((type(f).__name__, f.program_key()) for f in self.items)

    def partition_specs(self) -> list | None:
        """The state's sharding annotations, one per leaf, or None (the model
        has none)."""
        specs = self.base.partition_specs()
        if specs is None:
            return None
        out = list(specs)
        for f in self.items:
            out += f.leaf_specs(specs, self.base)
        return out

    def layer_axes(self) -> list | None:
        """Per leaf of the state, a ``Stack``'s layer axis (``shard="fsdp"``
        leaves it whole), else None; None: none known. A feature's leaves
        mirror the model's as their annotations do (``leaf_specs``)."""
        axes = self.base.layer_axes()
        if axes is None:
            return None
        out = list(axes)
        for f in self.items:
            out += [
                a if isinstance(a, int) else None for a in f.leaf_specs(axes, self.base)
            ]
        return out

    def wrap_loss(self, call: Callable, kind: str) -> Callable:
        for f in self.items:
            call = f.wrap_loss(call, kind)
        return call

    def step_factory(self, call_for: Callable, accumulate: int = 1) -> Callable:
        """One member's step on the whole flat state: the model's, wrapped by
        each feature from the lowest phase out (a feature's step gets the
        leaves up to its own, and gives the inner step those before them)."""
        base = self.base

        def make(call_for: Callable) -> Callable:
            return base.step_factory(call_for, accumulate)

        names = self.names()
        for f, at in zip(self.items, self.at):
            make = f.wrap_step(make, base, names[:at])
        return make(call_for)

    def eval_factory(self, call_for: Callable) -> Callable:
        evaluate, view = self.base.eval_factory(call_for), self.eval_view
        return lambda leaves, batch, key, hp: evaluate(view(leaves), batch, key, hp)

    def eval_view(self, leaves: list) -> list:
        """The model's leaves evaluations see (an average in place of the
        parameters, with ``Ema(on_eval=True)``)."""
        for f, at in zip(self.items, self.at):
            leaves = f.eval_view(leaves, self.base, at)
        return list(leaves[: self.n])

    def view(self, leaves: list, hp: Any, fn: Callable, *args: Any) -> Any:
        return self.base.view(leaves[: self.n], hp, fn, *args)

    def keeps_last(self, name: str) -> bool:
        return any(f.keeps_last(name) for f in self.items)

    def results(self, leaves: list) -> dict:
        """``{field: value}`` of the features with a result, from the run's
        final state (a population's: stacked)."""
        return {
            f.field: f.result(self.base, list(leaves), at)
            for f, at in zip(self.items, self.at)
            if f.field is not None
        }

    def at_of(self, feature: Feature) -> int:
        """Where ``feature``'s leaves start in the state."""
        return self.at[next(i for i, f in enumerate(self.items) if f is feature)]

    def find(self, kind: type) -> Any:
        """The feature of class ``kind`` (None: not given)."""
        return next((f for f in self.items if isinstance(f, kind)), None)
