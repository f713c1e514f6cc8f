"""Model kinds for ``scanax.fit``: NNX, optax over a pytree (Equinox), flax TrainState.

Each adapter reduces a ``(model, optimizer)`` pair to a pytree of arrays (``state``),
a hashable description of everything else (``static``: same ``static`` means the same
compiled step), a pure ``step(state, batch)`` and a way back to the user's objects.
This is the only module of ``fit`` that touches flax; it imports nothing from a
framework the user has not already imported.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _fingerprint, _nnx
from ._errors import fit as errors, short_type
from ._tree import is_array

_CALL = errors.CALL


# Prefixes of the history's entries at their own steps (evaluations, a rollout's
# collections): not a training metric's.
SPARSE_PREFIXES = ("val_", "rollout_")


def split_loss(call: str, out: Any, name: str = "loss_fn") -> tuple[Any, dict]:
    """``loss`` or ``(loss, metrics)`` from a ``loss_fn`` result, checked."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise errors.loss_tuple(call, out, name)
        loss, metrics = out
    else:
        loss, metrics = out, {}
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise errors.loss_not_scalar(call, loss, name)
    for key, leaf in metrics.items():  # flat: history has one entry per name
        reserved = key in ("loss", "step") or str(key).endswith("_step")
        # (training metrics: entries at their own steps have these prefixes)
        if reserved or (name == "loss_fn" and str(key).startswith(SPARSE_PREFIXES)):
            raise errors.metric_name_reserved(call, key)
        if not hasattr(leaf, "shape"):
            raise errors.metric_not_array(call, jtu.keystr((jtu.DictKey(key),)), leaf)
    return loss, metrics


def accumulated(one: Callable, state: Any, batches: Any, keys: Any, k: int) -> tuple:
    """``k`` micro-batches (``batches``/``keys`` stacked on a leading axis) of
    ``one(state, batch, key) -> (state, loss, metrics, grads)``: the state
    threaded through (BatchNorm statistics, RNG counts), the gradients averaged
    as ``optax.MultiSteps`` does (``acc + (g - acc) / (j + 1)``, so that
    ``accumulate=k`` equals it), the loss and floating metrics averaged (other
    metrics: the last value). ``k == 1``: ``one`` itself."""
    if k == 1:
        return one(state, batches, keys)

    def at(tree, j):
        return jtu.tree_map(lambda x: x[j], tree)

    state, loss, metrics, grads = one(state, at(batches, 0), at(keys, 0))

    def body(carry, j):
        state, acc, total, sums = carry
        state, loss, metrics, grads = one(state, at(batches, j), at(keys, j))
        acc = jtu.tree_map(
            lambda a, g: a + (g - a) / (j + 1).astype(a.dtype), acc, grads
        )
        sums = {n: _add(s, v) for (n, s), v in zip(sums.items(), metrics.values())}
        return (state, acc, total + loss, sums), None

    (state, grads, total, sums), _ = jax.lax.scan(
        body, (state, grads, loss, dict(metrics)), jnp.arange(1, k)
    )
    metrics = {n: (v / k if _averaged(v) else v) for n, v in sums.items()}
    return state, total / k, metrics, grads


def _averaged(v: Any) -> bool:
    """A floating array metric (averaged over micro-batches); a ``Ratio``'s
    sums (any pytree that is not an array) are summed, others keep the last."""
    return isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.inexact)


def _add(total: Any, v: Any) -> Any:
    if not isinstance(v, jax.Array):  # a Ratio: its numerator and denominator
        return jtu.tree_map(jnp.add, total, v)
    return total + v if _averaged(v) else v


def extra_args(tx: Any, loss: Any) -> dict:
    """What ``tx.update`` gets besides ``(updates, state, params)``: ``value=``
    the step's loss (with accumulation, the micro-batches' mean) for an
    ``optax.GradientTransformationExtraArgs`` (``optax.contrib.reduce_on_plateau``,
    ``optax.polyak_sgd``; ``optax.chain`` passes it on to those of its parts that
    take extra arguments), nothing for a plain ``optax.GradientTransformation``.
    Decided while tracing: a plain transform's step does not change."""
    optax = sys.modules.get("optax")
    if optax is not None and isinstance(tx, optax.GradientTransformationExtraArgs):
        return {"value": loss}
    return {}


class NNXAdapter:
    """``(nnx.Module, nnx.Optimizer)``: both carried as one flat list of Variable
    values, written back into the same Variables at the end."""

    kind = "nnx"

    def __init__(self, model: Any, optimizer: Any):
        self.objects = (model, optimizer)
        self.graphdef, self.variables, self.paths = _nnx.flatten([model, optimizer])
        # Plain Variables are read and written directly; anything else (a leaf
        # outside a Variable, an array ref) goes through nnx.update at the end.
        nnx = sys.modules["flax.nnx"]
        self.writable = all(
            isinstance(v, nnx.Variable) and isinstance(v.get_raw_value(), jax.Array)
            for v in self.variables
        )
        self.state = [
            v.get_raw_value() if isinstance(v, nnx.Variable) else v
            for v in self.variables
        ]
        self.static = ("nnx", self.graphdef)

    def fingerprint(self) -> Any:
        """``static`` as a fingerprint (``_fingerprint``): equal for rebuilt
        objects of the same structure; None when it cannot be described."""
        graphdef = _nnx.graphdef_fingerprint(self.graphdef)
        return None if graphdef is None else ("nnx", graphdef)

    def start_step(self) -> int:
        """The optimizer's own step count: where this call continues from."""
        return int(self.objects[1].step.get_raw_value())

    def names(self) -> list[str]:
        """``model['l1']['kernel']`` for each leaf of the state."""
        out = []
        for path, _ in jtu.tree_flatten_with_path(self.state)[0]:
            out.append(_variable_name(self.paths[path[0].idx]) + jtu.keystr(path[1:]))
        return out

    def trained(self) -> list[int]:
        """The positions in ``state`` of the trained parameters: the model's
        floating Variables the optimizer's ``wrt`` filter takes."""
        nnx = sys.modules["flax.nnx"]
        takes = nnx.filterlib.to_predicate(self.objects[1].wrt)
        return [
            i
            for i, (path, v) in enumerate(zip(self.paths, self.variables))
            if path[0] == 0 and takes(path[1:], v) and _is_inexact(self.state[i])
        ]

    def model_of(self, state: Any) -> Any:
        """A new model holding ``state`` (the objects passed in unchanged)."""
        return _nnx.unflatten(self.graphdef, state)[0]

    def trained_of(self, model: Any) -> list | None:
        """The trained parameters of another model of this structure (None if
        it is not one)."""
        try:
            _, variables, paths = _nnx.flatten([model])
        except Exception:
            return None
        values = dict(zip(paths, variables))
        out = []
        for i in self.trained():
            v = values.get(self.paths[i])
            if v is None:
                return None
            out.append(v.get_raw_value())
        return out

    def partition_specs(self) -> Any:
        """The Variables' sharding annotations, one per leaf of the state."""
        return sys.modules["flax.nnx"].get_partition_spec(self.variables)

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        """``step(state, batch, key)``; with ``accumulate`` > 1, ``batch`` and
        ``key`` hold that many micro-batches (see ``accumulated``)."""
        nnx = sys.modules["flax.nnx"]
        graphdef, known = self.graphdef, self.paths

        def grads_at(model, optimizer, batch, key):
            grad_fn = nnx.value_and_grad(
                lambda m, b: split_loss(_CALL, loss_fn(m, b, key)),
                argnums=nnx.DiffState(0, optimizer.wrt),
                has_aux=True,
            )
            (loss, metrics), grads = grad_fn(model, batch)
            return loss, metrics, grads

        def one(state, batch, key):  # a micro-batch, on the state as values
            model, optimizer = _nnx.unflatten(graphdef, state)
            loss, metrics, grads = grads_at(model, optimizer, batch, key)
            return _nnx.values([model, optimizer])[1], loss, metrics, grads

        def step(state, batch, key):
            if accumulate > 1:
                state, loss, metrics, grads = accumulated(
                    one, state, batch, key, accumulate
                )
                model, optimizer = _nnx.unflatten(graphdef, state)
            else:
                model, optimizer = _nnx.unflatten(graphdef, state)
                loss, metrics, grads = grads_at(model, optimizer, batch, key)
            optimizer.update(model, grads, **extra_args(optimizer.tx, loss))
            after, values = _nnx.values([model, optimizer])
            same = after == graphdef and (
                jtu.tree_structure(values) == jtu.tree_structure(state)
            )
            if not same:  # checked while tracing: costs nothing per step
                paths = _nnx.flatten([model, optimizer])[2]
                added = [_variable_name(p) for p in paths if p not in known]
                removed = [_variable_name(p) for p in known if p not in paths]
                raise errors.state_structure_changed(added, removed)
            return values, loss, metrics, grads

        return step

    def make_call(self, fn: Callable) -> Callable:
        """``call(state, *args) -> fn(model, *args)`` with the model in eval mode
        (``Module.eval()``: Dropout off, BatchNorm on its running averages), on
        a copy: nothing it changes is kept."""
        graphdef = self.graphdef

        def call(state, *args):
            model, _ = _nnx.unflatten(graphdef, state)
            model.eval()
            return fn(model, *args)

        return call

    def make_eval(self, loss_fn: Callable) -> Callable:
        """``evaluate(state, batch, key) -> (loss, metrics)`` in eval mode."""
        return _evaluation(self.make_call(loss_fn))

    def finish(self, state: Any) -> tuple[Any, Any]:
        if self.writable:
            for var, value in zip(self.variables, state, strict=True):
                var.set_raw_value(value)
        else:
            new = _nnx.unflatten(self.graphdef, state)
            _nnx.update(list(self.objects), _nnx.split(new)[1])
        return self.objects


def _evaluation(call: Callable) -> Callable:
    """``evaluate(state, batch, key) -> (loss, metrics)`` from a ``make_call``."""

    def evaluate(state, batch, key):
        return split_loss(_CALL, call(state, batch, key), "eval_fn")

    return evaluate


def _variable_name(path: tuple) -> str:
    """``model['l1']['kernel']`` from a joint ``_nnx.flatten`` path."""
    head, *rest = path
    return ("model", "optimizer")[head] + "".join(f"[{k!r}]" for k in rest)


class OptaxAdapter:
    """A pytree of parameters (an Equinox module, a dict...) and an optax transform.

    As in Equinox, the floating-point arrays are trained, other arrays are carried
    unchanged and every other leaf is static. The optax state is ``tx.init`` of the
    model with ``None`` at every leaf that is not trained (``eqx.filter(model,
    eqx.is_inexact_array)``).
    """

    kind = "optax"

    def __init__(self, model: Any, tx: Any, opt_state: Any = None):
        flat, treedef = jtu.tree_flatten_with_path(model)
        leaves = [x for _, x in flat]
        self.paths = [p for p, _ in flat]
        train = tuple(i for i, x in enumerate(leaves) if _is_inexact(x))
        other = tuple(
            i for i, x in enumerate(leaves) if is_array(x) and not _is_inexact(x)
        )
        dynamic = set(train) | set(other)
        template = [None if i in dynamic else x for i, x in enumerate(leaves)]
        self.layout = _Layout(treedef, template, train, other)
        self.train, self.other = train, other
        params = [leaves[i] for i in train]
        others = [leaves[i] for i in other]
        fresh = tx.init(self.layout.filtered(params))
        # A state that keeps no step count of its own (plain SGD, MultiSteps)
        # gets fit's: ``tx`` is trained as ``optax.chain(tx, counter)``, whose
        # state is that of ``optax.chain(tx, optax.scale_by_schedule(lambda
        # step: 1.0))``, so that the next call continues where this one stopped.
        self.counted = not _keeps_count(fresh)
        self.given_uncounted = False  # an opt_state given without fit's count
        if self.counted:
            self.tx = sys.modules["optax"].chain(tx, _counter())
            if opt_state is not None and _same_structure(opt_state, fresh):
                self.given_uncounted = True
                opt_state = (opt_state, _counter().init(None))
            fresh = self.tx.init(self.layout.filtered(params))
        else:
            self.tx = tx
        if opt_state is not None:
            _check_opt_state(opt_state, fresh)
            fresh = opt_state
        self.state = {"params": params, "other": others, "opt_state": fresh}
        statics = tuple((i, x) for i, x in enumerate(template) if i not in dynamic)
        self.static = ("optax", treedef, train, other, statics, tx, self.counted)

    def fingerprint(self) -> Any:
        return _fingerprint.of(self.static)

    def trained(self) -> list[int]:
        """The positions of the trained parameters in ``state``'s leaves."""
        flat = jtu.tree_flatten_with_path(self.state)[0]
        return [i for i, (path, _) in enumerate(flat) if path[0].key == "params"]

    def model_of(self, state: Any) -> Any:
        return self.layout.model(state["params"], state["other"])

    def trained_of(self, model: Any) -> list | None:
        leaves, treedef = jtu.tree_flatten(model)
        if treedef != self.layout.treedef:
            return None
        return [leaves[i] for i in self.train]

    def partition_specs(self) -> None:
        """No sharding annotations: the state is replicated on a mesh."""
        return None

    def start_step(self) -> int | None:
        """The step count kept in the optax state (``count`` of Adam, schedules,
        ``inject_hyperparams``...; fit's own count for a state that keeps none):
        where this call continues from. None for an ``opt_state`` given without
        fit's count (a state made by ``tx.init``, not by ``fit``)."""
        if self.counted:
            state = self.state["opt_state"]
            return None if self.given_uncounted else int(state[1].count)
        return _step_count(self.state["opt_state"])

    def names(self) -> list[str]:
        flat = jtu.tree_flatten_with_path(self.state)[0]
        return [_optax_name(self, path) for path, _ in flat]

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        tx, layout = self.tx, self.layout  # no arrays: the step is cached

        def step(state, batch, key):
            params, others = state["params"], state["other"]

            def one(p, b, k):
                def objective(q):
                    return split_loss(_CALL, loss_fn(layout.model(q, others), b, k))

                (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(p)
                return p, loss, metrics, grads

            _, loss, metrics, grads = accumulated(one, params, batch, key, accumulate)
            updates, opt_state = tx.update(
                layout.filtered(grads),
                state["opt_state"],
                layout.filtered(params),
                **extra_args(tx, loss),
            )
            flat = jtu.tree_leaves(updates)
            new = [(p + u).astype(p.dtype) for p, u in zip(params, flat)]
            out = {"params": new, "other": others, "opt_state": opt_state}
            return out, loss, metrics, grads

        return step

    def make_call(self, fn: Callable) -> Callable:
        """``call(state, *args) -> fn(model, *args)``; an Equinox model in
        inference mode (``eqx.nn.inference_mode``: Dropout off, BatchNorm on its
        running averages)."""
        layout = self.layout

        def call(state, *args):
            model = layout.model(state["params"], state["other"])
            eqx = sys.modules.get("equinox")
            if eqx is not None:
                model = eqx.nn.inference_mode(model)
            return fn(model, *args)

        return call

    def make_eval(self, loss_fn: Callable) -> Callable:
        """``evaluate(state, batch, key) -> (loss, metrics)`` in inference mode."""
        return _evaluation(self.make_call(loss_fn))

    def finish(self, state: Any) -> tuple[Any, Any]:
        model = self.layout.model(state["params"], state["other"])
        return model, state["opt_state"]


class _Layout:
    """Where the trained and carried arrays go in a model's leaves; the static
    leaves (and ``None`` in the array slots)."""

    def __init__(self, treedef: Any, template: list, train: tuple, other: tuple):
        self.treedef, self.template = treedef, template
        self.train, self.other = train, other

    def filtered(self, params: list[Any]) -> Any:
        """The model with ``params`` in the trained slots and None elsewhere."""
        leaves: list[Any] = [None] * len(self.template)
        for i, p in zip(self.train, params):
            leaves[i] = p
        return jtu.tree_unflatten(self.treedef, leaves)

    def model(self, params: list[Any], others: list[Any]) -> Any:
        leaves = list(self.template)
        for i, p in zip(self.train, params):
            leaves[i] = p
        for i, a in zip(self.other, others):
            leaves[i] = a
        return jtu.tree_unflatten(self.treedef, leaves)


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
            if getattr(path[0], "name", None) == "params" and _is_inexact(x)
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

        def one(state, batch, key):
            def objective(params):
                out = loss_fn(state.replace(params=params), batch, key)
                updates: dict = {}
                if isinstance(out, tuple) and len(out) == 3:
                    *out, updates = out
                    out = tuple(out)
                loss, metrics = split_loss(_CALL, out)
                return loss, (metrics, updates)

            (loss, (metrics, updates)), grads = jax.value_and_grad(
                objective, has_aux=True
            )(state.params)
            if updates:
                state = state.replace(**_check_updates(state, updates))
            elif _has_arrays(getattr(state, "batch_stats", None)):
                warnings.warn(errors.batch_stats_not_updated(), stacklevel=2)
            return state, loss, metrics, grads

        def step(state, batch, key):
            after, loss, metrics, grads = accumulated(
                one, state, batch, key, accumulate
            )
            # (apply_gradients changes step, params and opt_state only: the same
            # as applying the updates after it)
            extra = extra_args(after.tx, loss)
            if not extra:
                return after.apply_gradients(grads=grads), loss, metrics, grads
            # apply_gradients calls tx.update without extra arguments: it runs on
            # the transform with them bound, then the state gets its own back
            # (a subclass's apply_gradients and OVERWRITE_WITH_GRADIENT still hold)
            tx = after.tx
            bound = tx._replace(update=ft.partial(tx.update, **extra))
            new = after.replace(tx=bound).apply_gradients(grads=grads)
            return new.replace(tx=tx), loss, metrics, grads

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

        return _evaluation(dropped)

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


def _check_opt_state(given: Any, fresh: Any) -> None:
    """``given`` must look like ``tx.init(params)``: same structure, shapes, dtypes."""

    def describe(tree):
        return [
            (jtu.keystr(p), short_type(x))
            for p, x in jtu.tree_flatten_with_path(tree)[0]
        ]

    want, got = describe(fresh), describe(given)
    if jtu.tree_structure(given) != jtu.tree_structure(fresh):
        have, need = {p for p, _ in got}, {p for p, _ in want}
        extra = [p for p, _ in got if p not in need]
        missing = [p for p, _ in want if p not in have]
        if extra:
            detail = f"opt_state{extra[0]} is not in tx.init(params)"
        elif missing:
            detail = f"opt_state{missing[0]} is missing"
        else:
            detail = "the same leaves, but other static fields (e.g. layer sizes)"
    else:
        bad = [(p, g, w) for (p, g), (_, w) in zip(got, want) if g != w]
        if not bad:
            return
        path, g, w = bad[0]
        detail = f"opt_state{path} is {g}, expected {w}"
    raise errors.opt_state_mismatch(detail)


# optax states whose counters are not the number of steps applied
_CYCLING_STATES = ("ApplyEvery", "MultiStepsState")
# optax states with a ``count`` that is no step count, passed over (the plateau
# rule counts the losses of its current window)
_OTHER_COUNTS = ("ReduceLROnPlateauState",)


def _step_counts(opt_state: Any) -> list | None:
    """The step counts an optax state keeps (scalar ``count`` fields; read
    by structure alone, so the state may be traced), or None when one of its
    states cycles (``optax.apply_every``, ``optax.MultiSteps``). The plateau
    rule's ``count`` (the losses of its window) is no step count."""
    counts = []
    for node in _state_nodes(opt_state):
        name = type(node).__name__
        if name in _CYCLING_STATES:
            return None
        count = getattr(node, "count", None)
        if getattr(count, "shape", None) == () and name not in _OTHER_COUNTS:
            counts.append(count)
    return counts


def _step_count(opt_state: Any) -> int | None:
    """The step count an optax state keeps, or None when it keeps none (plain
    SGD), when its counts disagree, or when one cycles."""
    values = {int(c) for c in _step_counts(opt_state) or ()}
    return values.pop() if len(values) == 1 else None


def _keeps_count(opt_state: Any) -> bool:
    """Whether an optax state keeps a step count (no value is read)."""
    return bool(_step_counts(opt_state))


def _counter() -> Any:
    """An optax transform that only counts its updates (the state and count
    of ``optax.scale_by_schedule``, the updates unchanged)."""
    optax = sys.modules["optax"]

    def init(params: Any) -> Any:
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates: Any, state: Any, params: Any = None) -> tuple:
        return updates, optax.ScaleByScheduleState(
            count=optax.safe_increment(state.count)
        )

    return optax.GradientTransformation(init, update)


_COUNTER_NAMES = ("['step']", ".step", "['count']", ".count")


def is_counter(name: str, leaf: Any, members: bool = False) -> bool:
    """Whether a leaf of the training state (by its checkpoint name) is a step
    count: an optimizer's ``step``, a TrainState's ``step``, an optax state's
    ``count`` (Adam's bias correction, schedules, fit's own count). Restoring an
    early stop's best state keeps these at the last step run. ``members``: the
    leaf has a population's member axis first."""
    dtype = getattr(leaf, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.integer)
        and np.ndim(leaf) == int(members)
        and name.endswith(_COUNTER_NAMES)
    )


def _same_structure(a: Any, b: Any) -> bool:
    return jtu.tree_structure(a) == jtu.tree_structure(b)


def _state_nodes(tree: Any) -> list:
    """The named tuples (optax states) inside an optax state, outermost first."""
    out: list = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            out.append(node)
            stack.extend(getattr(node, f) for f in node._fields)
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return out


def _optax_name(adapter: OptaxAdapter, path: tuple) -> str:
    """``model[1].weight`` for a trained or carried leaf, ``opt_state...`` else."""
    part = path[0].key
    if part in ("params", "other"):
        index = (adapter.train if part == "params" else adapter.other)[path[1].idx]
        model_path = adapter.paths[index]
        return "model" + jtu.keystr(model_path)
    return "opt_state" + jtu.keystr(path[1:])


def _is_inexact(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _is_train_state(x: Any) -> bool:
    mod = sys.modules.get("flax.training.train_state")
    return mod is not None and isinstance(x, mod.TrainState)


def _is_gradient_transformation(x: Any) -> bool:
    optax = sys.modules.get("optax")
    return optax is not None and isinstance(x, optax.GradientTransformation)


def _is_nnx_optimizer(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Optimizer)


def adapt(
    model: Any, optimizer: Any, opt_state: Any = None
) -> NNXAdapter | OptaxAdapter | TrainStateAdapter:
    """The adapter for a ``(model, optimizer)`` pair, or a TypeError naming the fix.
    ``opt_state`` (optax pairs only) continues from an earlier optax state."""
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
        return TrainStateAdapter(model)
    if _nnx.is_node(model):
        if _is_nnx_optimizer(optimizer):
            return NNXAdapter(model, optimizer)
        raise errors.bad_pair(model, optimizer, "nnx_without_optimizer")
    if _is_gradient_transformation(optimizer):
        bad = [
            (jtu.keystr(p), short_type(x))
            for p, x in jtu.tree_flatten_with_path(model, is_leaf=_nnx.is_node)[0]
            if _nnx.is_node(x)
        ]
        if bad:
            raise errors.nnx_objects_in_optax_model(bad)
        if not any(_is_inexact(x) for x in jtu.tree_leaves(model)):
            raise errors.nothing_to_train(model)
        return OptaxAdapter(model, optimizer, opt_state)
    why = "optimizer_without_nnx" if _is_nnx_optimizer(optimizer) else "other"
    raise errors.bad_pair(model, optimizer, why)
