"""``scanax.Rollout``: data generated on device by the model being trained (an
environment's rollouts, a simulator, synthetic data), as ``fit``'s ``data``.

The generator's state (the *feed*: the user's carry, the batch last collected,
its minibatch orders and a key) is part of the training state the compiled loop
carries: a feature (``Feeder``, ``_feature``) adds its leaves, for one model
and a population's members alike. So everything the loop does to the state it
does to the feed: the last good state after a non-finite step, checkpoints and
their exact resume, a population's per-member selects. Between ``fit`` calls
the feed stays with the ``Rollout`` object (``Rollout.state``), so that the next
call continues it.

Collections happen at the global steps that are multiples of ``epochs *
minibatches``, at the boundary before them (the compiled loop cuts its chunks
there: one ``once_if``, a ``lax.cond`` or a loop of at most one trip, per
chunk, run only at those steps, the same for a population's members). Step
``t`` trains on minibatch ``t % minibatches`` of epoch ``(t // minibatches) %
epochs`` of the batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu

from ... import _caller, _fingerprint
from ..._errors import rollout as errors
from ..._once import once_if
from ..._tree import is_array, is_arraylike
from .. import feature as _feature
from ..models import nnx as _models_nnx, step as _model_step

_FOLD = 2  # fit's key: split(key)[0] evaluations, [1] steps, fold_in(key, 2) here


class Rollout:
    """Batches made on device, inside ``fit``'s compiled loop, by the model
    being trained: ``fit(model, optimizer, loss_fn, scanax.Rollout(collect,
    init, epochs=4, minibatches=4), steps=..., key=key)``.

    Conceptually equivalent to (PPO's update epochs and minibatches)::

        init_key, rkey = jax.random.split(jax.random.fold_in(key, 2))
        carry = init(init_key)
        for t in range(start, start + steps):
            if t % (epochs * minibatches) == 0:
                rkey, collect_key, shuffle_key = jax.random.split(rkey, 3)
                batch, carry, metrics = collect(eval_mode(model), carry, collect_key)
                history.append(t + 1, metrics)  # "rollout_step", "rollout_<name>"
                orders = [jax.random.permutation(
                    jax.random.fold_in(shuffle_key, e), n) for e in range(epochs)]
            j = t % (epochs * minibatches)
            idx = orders[j // minibatches][j % minibatches * size:][:size]
            train_step(model, tree_map(lambda x: x[idx], batch))

    Arguments:
        collect: ``collect(model, carry, key) -> (batch, carry)`` or ``(batch,
            carry, metrics)``: a pytree of arrays with a leading example axis
            ``n`` (divisible by ``minibatches``), the new carry (the same
            structure, shapes and dtypes as ``init``'s), and a dict of scalars
            recorded once per collection. It runs inside the compiled loop
            with the model in eval mode (as ``eval_fn``); no gradient flows
            through it.
        init: ``init(key) -> carry``: the generator's first state (an
            environment's, a simulator's); a population's members get one
            each, from their own keys.
        epochs: passes over each collected batch.
        minibatches: optimizer steps per pass, each on ``n // minibatches``
            examples in a fresh order (``1``: the whole batch, in order).

    ``Rollout.state`` holds the feed after the last ``fit`` it fed (None
    before): the next ``fit`` with this object continues it, so ten calls give
    what one call of ten times the steps gives. ``reset()`` starts over from
    ``init``. Checkpoints hold the feed too. A ``fit`` that fails or is
    interrupted leaves it as it was, except for NNX models, which keep the
    last checked state in place: the feed stays with them. A model that starts
    between collection steps (trained before, or with another period) gets a
    collection of its own before its first step; its metrics are not recorded.
    """

    def __init__(
        self,
        collect: Callable,
        init: Callable,
        *,
        epochs: int = 1,
        minibatches: int = 1,
    ):
        for name, fn, arity in (("collect", collect, 3), ("init", init, 1)):
            if not callable(fn):
                raise errors.not_callable(name, fn)
            if _caller.cannot_bind(fn, *range(arity)) is not None:
                raise errors.arity(name, fn, arity)
        self.collect, self.init = collect, init
        self.epochs = _positive("epochs", epochs)
        self.minibatches = _positive("minibatches", minibatches)
        self.state: Any = None  # the feed after the last fit (a population's: stacked)
        self.members: int | None = None  # the population size the state is for
        self.step: int | None = None  # the global step the state was left at

    @property
    def period(self) -> int:
        """Optimizer steps per collection."""
        return self.epochs * self.minibatches

    def reset(self) -> None:
        """Start the next ``fit`` from ``init`` again."""
        self.state, self.members, self.step = None, None, None

    def __repr__(self) -> str:
        name = getattr(self.collect, "__name__", type(self.collect).__name__)
        return (
            f"scanax.Rollout({name}, epochs={self.epochs}, "
            f"minibatches={self.minibatches})"
        )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise errors.positive(name, value)
    return value


class Feed(NamedTuple):
    """A rollout's state inside the training state."""

    carry: Any  # the user's carry
    batch: Any  # the batch last collected
    orders: Any  # int32[epochs, n]: each epoch's example order
    key: Any  # the key of the next collection


# ---------------------------------------------------------------------------- source


class RolloutSource:
    """``fit``'s data source for a ``Rollout`` (the protocol of
    ``_data.ArraySource``): nothing to sample, the step makes its batch."""

    LENGTH = 1000  # as array data: calls sized automatically, one program

    def __init__(self, rollout: Rollout, key: Any):
        if key is None:
            raise errors.without_key()
        self.rollout, self.key = rollout, key
        ids = (_fingerprint.key(rollout.collect), _fingerprint.key(rollout.init))
        self.static = ("rollout", *ids, rollout.epochs, rollout.minibatches)

    def length(self, steps: int, steps_per_call: int | None) -> int:
        return max(self.LENGTH, steps_per_call or 0)

    def use_key(self, key: Any) -> None:
        """(the feed carries its own key, restored with it)"""

    def sized_automatically(self, steps_per_call: int | None) -> bool:
        return steps_per_call is None

    def check_mesh(self, mesh: Any) -> None:
        raise errors.option("mesh")

    def arguments(self, place: Any) -> tuple[Any, Any]:
        return None, self.key

    def accumulate(self, k: int) -> None:
        raise errors.option("accumulate")

    def describe(self) -> dict:
        r = self.rollout
        return {"kind": "rollout", "epochs": r.epochs, "minibatches": r.minibatches}

    def rewind(self, steps: int) -> bool:
        """(nothing to set back: step ``t``'s batch is found from ``t``)"""
        return False

    def past(self, steps: int) -> int:
        """(nothing read ahead)"""
        return 0

    def skip(self, count: int, state: Any = None, then: int = 0) -> None:
        """(the feed is restored with the state)"""

    def keep_states(self) -> None:
        """(the feed is saved with the state)"""

    def state_at(self, steps: int) -> None:
        """(the feed is saved with the state)"""

    def calls(self, start: int, end: int, schedule: Any, place: Any) -> Iterator:
        while start < end:
            count = place.fewest(schedule.want(start, end))
            yield start, start + count, None
            start += count

    def sampler(self) -> RolloutSource:
        return self

    def first(self, key: Any, t: Any) -> None:
        return None

    def advance(self, state: Any, key: Any, t: Any) -> None:
        return None

    def batch(self, state: Any, data: Any, xs: Any, t: Any, i: Any) -> Any:
        return t  # (the fed step makes the batch of step t)


# ---------------------------------------------------------------------------- the step


class Collector:
    """One rollout's collection and minibatches, for one model (or member):
    ``view(model_leaves, hp, *args)`` calls a function of the model in eval
    mode; ``inner`` is the plain step on the model's leaves."""

    def __init__(self, rollout: Rollout, view: Callable, n: int):
        self.rollout, self.view, self.n = rollout, view, n
        self.metric_names: list[str] = []
        self.metric_shapes: dict = {}
        self.feed_def: Any = None

    def collect(self, model: list, carry: Any, key: Any, hp: Any) -> tuple:
        """``(batch, carry, metrics)``, checked."""
        with _models_nnx.collecting():  # (named in the warning of its own RNGs)
            out = self.view(model, hp, self.rollout.collect, carry, key)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise errors.output(out)
        batch, new, metrics = (*out, {}) if len(out) == 2 else out
        if not isinstance(metrics, dict):
            raise errors.metrics(metrics)
        _check_carry(carry, new)
        flat = jtu.tree_flatten_with_path(batch)[0]
        for path, x in flat:
            if not is_array(x) or not jnp.ndim(x):
                raise errors.batch_leaf(jtu.keystr(path), x)
        leaves = [x for _, x in flat]
        if not leaves:
            raise errors.batch(batch)
        sizes = {x.shape[0] for x in leaves}
        if len(sizes) > 1 or next(iter(sizes)) % self.rollout.minibatches:
            raise errors.batch_sizes(batch, self.rollout.minibatches)
        if sizes == {0}:
            raise errors.batch_empty(batch)
        for name in metrics:
            if (
                not isinstance(name, str)
                or name.startswith("rollout_")
                or (name == "step" or name.endswith("_step"))
            ):
                raise errors.metric_name(name)
        metrics = _model_step.check_metrics(errors.CALL, metrics, "collect")
        metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
        return batch, new, metrics

    def fresh(self, model: list, carry: Any, key: Any, hp: Any) -> tuple[Feed, dict]:
        """A new collection: the feed after it, and its metrics."""
        key, collect_key, shuffle_key = jr.split(key, 3)
        batch, carry, metrics = self.collect(model, carry, collect_key, hp)
        n = jtu.tree_leaves(batch)[0].shape[0]
        if self.rollout.minibatches == 1:  # the whole batch: no order
            orders = jnp.zeros((self.rollout.epochs, 0), jnp.int32)
        else:
            orders = jnp.stack(
                [
                    jr.permutation(jr.fold_in(shuffle_key, e), n).astype(jnp.int32)
                    for e in range(self.rollout.epochs)
                ]
            )
        return Feed(carry, batch, orders, key), metrics

    def first(self, model: list, key: Any, hp: Any, start: int) -> Feed:
        """The feed before step ``start`` (traced): ``init``'s carry, and a
        collection unless ``start`` is a collection step (where the loop
        collects first)."""
        init_key, key = jr.split(jr.fold_in(key, _FOLD))
        carry = self.rollout.init(init_key)
        for path, x in jtu.tree_flatten_with_path(carry)[0]:
            if not is_arraylike(x):
                raise errors.init_leaf(jtu.keystr(path), x)
        if start % self.rollout.period:
            return self.fresh(model, carry, key, hp)[0]
        feed, _ = jax.eval_shape(lambda: self.fresh(model, carry, key, hp))
        zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), feed)
        return zeros._replace(carry=carry, key=key)

    def shapes(self, model: list, feed: Feed, hp: Any) -> None:
        """Learn the metrics' names (traced)."""
        _, metrics = jax.eval_shape(lambda: self.fresh(model, feed.carry, feed.key, hp))
        self.metric_names = sorted(metrics)
        self.metric_shapes = {k: v.shape for k, v in metrics.items()}

    def step(self, inner: Callable) -> Callable:
        """``step(leaves, t, key, hp)`` on the model's and the feed's leaves
        (``inner``: the step on the model's leaves): minibatch ``t`` of the
        batch last collected (``before``), branch-free."""
        n, rollout = self.n, self.rollout
        period, m = rollout.period, rollout.minibatches

        def step(leaves, t, key, hp):
            model = leaves[:n]
            feed = jtu.tree_unflatten(self.feed_def, leaves[n:])
            batch = feed.batch
            if m > 1:
                j = t % period
                size = jtu.tree_leaves(batch)[0].shape[0] // m
                order = feed.orders[j // m]
                idx = jax.lax.dynamic_slice_in_dim(order, (j % m) * size, size)
                batch = jtu.tree_map(lambda x: jnp.take(x, idx, axis=0), batch)
            new, loss, step_metrics, grads = inner(model, batch, key, hp)
            return [*new, *leaves[n:]], loss, step_metrics, grads

        return step

    def due(self, t: Any) -> Any:
        """Whether global step ``t`` collects first."""
        return t % self.rollout.period == 0

    def collect_into(self, leaves: list, hp: Any) -> tuple[list, dict]:
        """A new collection into one model's (member's) state: its leaves
        with the new feed, and the collection's metrics."""
        model = leaves[: self.n]
        feed = jtu.tree_unflatten(self.feed_def, leaves[self.n :])
        feed, metrics = self.fresh(model, feed.carry, feed.key, hp)
        return [*model, *jtu.tree_leaves(feed)], metrics

    def nan_metrics(self, members: tuple = ()) -> dict:
        """The metrics where no collection is due: NaN (``members``: a
        population's member axis first)."""
        shapes = self.metric_shapes
        return {
            k: jnp.full((*members, *shapes[k]), jnp.nan, jnp.float32)
            for k in self.metric_names
        }

    def before(self, leaves: list, t: Any, hp: Any) -> tuple[list, Any, dict]:
        """One model's boundary before global step ``t``: a collection behind
        ``once_if`` where one is due; ``(leaves, collected, metrics)``."""
        due = self.due(t)
        leaves, metrics = once_if(
            due,
            self.collect_into,
            lambda leaves, hp: (list(leaves), self.nan_metrics()),
            leaves,
            hp,
        )
        return leaves, due, metrics

    def names(self, prefix: str = "rollout") -> list[str]:
        """The checkpoint names of the feed's leaves."""
        feed = jtu.tree_unflatten(self.feed_def, [0] * self.feed_def.num_leaves)
        return [prefix + jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(feed)[0]]


def is_feed(name: str) -> bool:
    """Whether a leaf of the training state (by its checkpoint name) is a
    rollout's feed."""
    return name.startswith(("rollout.", "members.rollout."))


def _check_carry(old: Any, new: Any) -> None:
    """``collect``'s carry must keep ``init``'s structure, shapes and dtypes."""
    old_flat, old_def = jtu.tree_flatten_with_path(old)
    new_flat, new_def = jtu.tree_flatten_with_path(new)
    if old_def != new_def:
        raise errors.carry_structure(old_def, new_def)
    for (path, a), (_, b) in zip(old_flat, new_flat):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise errors.carry_leaf(jtu.keystr(path), a, b)


# ---------------------------------------------------------------------------- feeds


# ``init``'s programs (the first feed, compiled), by what they depend on: a new
# Rollout of the same functions for a model of the same structure reuses one.
_FIRSTS: dict = {}


def _first_program(
    identity: Any, source: Any, first: Any, start: int, model: list, keys: Any
) -> Any:
    run = first if keys is None else jax.vmap(first)
    if identity is None or not _fingerprint.cacheable(source.static):
        return jax.jit(run)  # (no fingerprint: compiled for this fit only)
    types = tuple(_avals(model))
    cache = (identity, source.static, start % source.rollout.period == 0, types,
             None if keys is None else (len(keys), _avals(keys)[0]))  # fmt: skip
    try:
        found = _FIRSTS.get(cache)
    except TypeError:  # an unhashable part
        return jax.jit(run)
    if found is None:
        found = _FIRSTS[cache] = jax.jit(run)
        while len(_FIRSTS) > 16:
            _FIRSTS.pop(next(iter(_FIRSTS)))
    return found


def start_feed(
    source: RolloutSource,
    collector: Collector,
    model: list,
    hp: Any,
    start: int,
    keys: Any = None,
    identity: Any = None,
) -> Any:
    """The feed the run starts with: the one the ``Rollout`` kept from its last
    ``fit`` (checked to fit this model), else a new one from ``init``; a
    population's (``keys``: the members' keys) with a member axis.
    ``identity``: the model's fingerprint (its first feed's program is cached
    by it)."""
    rollout, members = source.rollout, None if keys is None else len(keys)

    def first(model, key, hp):
        return collector.first(model, key, hp, start)

    one_model, one_key, one_hp = _one(model, keys, source.key, hp)
    if rollout.state is None:
        feed = _first_program(identity, source, first, start, model, keys)(
            model, source.key if keys is None else keys, hp
        )
    else:
        if rollout.members != members:
            raise errors.members(rollout.members, members)
        if rollout.step is not None and rollout.step != start:
            warnings.warn(
                errors.state_elsewhere(rollout.step, start),
                RuntimeWarning,
                stacklevel=_caller.user_level(),
            )
        feed = rollout.state
        fresh = jax.eval_shape(first, one_model, one_key, one_hp)
        drop = 0 if keys is None else 1  # (a population's member axis)
        found = [(s[drop:], d) for s, d in _avals(feed)]
        if jtu.tree_structure(feed) != jtu.tree_structure(fresh) or found != _avals(
            fresh
        ):
            kept, now = _avals(feed.key)[0][1], _avals(fresh.key)[0][1]
            raise errors.state_changed(None if kept == now else (kept, now))

    def learn(model, feed, hp):
        collector.shapes(model, feed, hp)
        return jnp.zeros(())

    one_feed = feed if keys is None else jtu.tree_map(lambda x: x[0], feed)
    jax.eval_shape(learn, one_model, one_feed, one_hp)
    collector.feed_def = jtu.tree_structure(feed)
    return feed


def _one(model: list, keys: Any, key: Any, hp: Any) -> tuple:
    """One member's arguments (the first's), or the model's own."""
    if keys is None:
        return model, key, hp
    first = lambda tree: jtu.tree_map(lambda x: x[0], tree)  # noqa: E731
    return first(model), keys[0], first(hp)


def _avals(tree: Any) -> list:
    return [(jnp.shape(x), jnp.result_type(x)) for x in jtu.tree_leaves(tree)]


class Feeder(_feature.Feature):
    """A ``Rollout``'s state in the training state, as a feature of one run
    (``_feature``): its leaves (``Feed``: the user's carry, the batch last
    collected, its orders, a key) follow the model's and the other
    features', for one model and each member of a population alike; each
    step trains on its minibatch of the batch (``Collector.step``), a
    collection runs at the boundary before a collection step
    (``Collector.before``). An early stop that restores the best state keeps
    the feed as it was last (the next ``fit`` continues the environments);
    ``keep`` leaves it with the ``Rollout`` for the next ``fit``. ``keys``: a
    population's members' (each gets its own environments), None for one
    model."""

    phase: ClassVar[int] = 40

    def __init__(self, source: RolloutSource, keys: Any = None):
        self.source, self.rollout, self.keys = source, source.rollout, keys
        self.collector: Collector | None = None
        self.members: int | None = None

    def program_key(self) -> Any:
        return ("rollout", self.collector.feed_def)

    def init_leaves(self, base: Any, start: int, before: list) -> list:
        n = len(base.state)

        def view(model, hp, fn, *args):
            return base.view(model[:n], hp, fn, *args)

        self.collector = Collector(self.rollout, view, len(before))
        self.members = base.members
        hp = None if base.members is None else base.hp()
        feed = start_feed(
            self.source, self.collector, list(before), hp, start, self.keys,
            identity=base.fingerprint(),
        )  # fmt: skip
        return jtu.tree_leaves(feed)

    def leaf_names(self, base: Any) -> list[str]:
        return self.collector.names()

    def wrap_step(self, make: Callable, base: Any, names: list[str]) -> Callable:
        collector = self.collector

        def wrapped(call_for: Callable) -> Callable:
            return collector.step(make(call_for))

        return wrapped

    def keeps_last(self, name: str) -> bool:
        return is_feed(name)

    def keep(self, leaves: list, at: int, step: int) -> None:
        """Leave the feed in ``leaves`` (from ``at``) with the ``Rollout``, at
        global ``step``: the next ``fit`` continues it."""
        feed = jtu.tree_unflatten(self.collector.feed_def, list(leaves[at:]))
        rollout = self.rollout
        rollout.state, rollout.members, rollout.step = feed, self.members, step
