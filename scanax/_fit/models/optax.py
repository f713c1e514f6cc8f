"""The optax kind of ``scanax.fit``: a pytree of parameters (an Equinox module, a
dict...) and an optax transform.

Also the optax state's step counts: the one it keeps (Adam's ``count``,
schedules...) or, for a transform that keeps none, fit's own (``_counter``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import jax.tree_util as jtu

from ... import _fingerprint
from ..._errors import models as errors, short_type
from ..._errors.fit import CALL as _CALL
from ..._tree import is_array
from . import optax_init as _inits, step as _step
from .eqx_state import Held
from .step import accumulated, evaluation, extra_args, is_inexact, split_loss


class OptaxAdapter:
    """A pytree of parameters (an Equinox module, a dict...) and an optax transform.

    As in Equinox, the floating-point arrays are trained, other arrays are carried
    unchanged and every other leaf is static. The optax state is ``tx.init`` of the
    model with ``None`` at every leaf that is not trained (``eqx.filter(model,
    eqx.is_inexact_array)``).
    """

    kind = "optax"

    def __init__(
        self,
        model: Any,
        tx: Any,
        opt_state: Any = None,
        compiled_init: bool = False,
        keep: bool = False,
    ):
        flat, treedef = jtu.tree_flatten_with_path(model)
        leaves = [x for _, x in flat]
        self.paths = [p for p, _ in flat]
        # (an eqx.nn.State's arrays are carried, not trained: ``eqx_state``)
        self.held = Held(model)
        held = frozenset(self.held.positions)
        train = tuple(
            i for i, x in enumerate(leaves) if is_inexact(x) and i not in held
        )
        other = tuple(
            i
            for i, x in enumerate(leaves)
            if is_array(x) and (i in held or not is_inexact(x))
        )
        self.held_at = tuple(j for j, i in enumerate(other) if i in held)
        dynamic = set(train) | set(other)
        template = [None if i in dynamic else x for i, x in enumerate(leaves)]
        self.layout = _Layout(treedef, template, train, other)
        self.train, self.other = train, other
        params = [leaves[i] for i in train]
        others = [leaves[i] for i in other]
        filtered = self.layout.filtered(params)
        # The transform's fingerprint, walked once: the program's key and the
        # compiled init's (``fingerprint``, ``optax_init.made_state``).
        self.tx_key = _fingerprint.of(tx)
        # The state fit makes: ``tx.init``, in one compiled call for the
        # run's own state (``compiled_init``: ``optax_init.made_state``), eager
        # for a structure looked at (a population's member, a checkpoint's
        # layout: its arrays are replaced, and a compile per member's learning
        # rate would cost more than it saves); for a given ``opt_state``, what
        # it must look like (no arrays made).
        made = opt_state is None
        if not made:
            fresh = _inits.init_shapes(tx, self.tx_key, filtered)
        elif compiled_init:
            fresh = _inits.made_state(tx, self.tx_key, filtered, keep)
        else:
            fresh = tx.init(filtered)
        # A state that keeps no step count of its own (plain SGD, MultiSteps)
        # gets fit's: ``tx`` is trained as ``optax.chain(tx, counter)``, whose
        # state is that of ``optax.chain(tx, optax.scale_by_schedule(lambda
        # step: 1.0))``, so that the next call continues where this one stopped.
        self.counted = not _keeps_count(fresh)
        self.given_uncounted = False  # an opt_state given without fit's count
        if self.counted:
            self.tx = sys.modules["optax"].chain(tx, _counter())
            if not made and _same_structure(opt_state, fresh):
                self.given_uncounted = True
                opt_state = (opt_state, _counter().init(None))
            # (a chain's state is the tuple of its parts' states)
            fresh = (fresh, _counter().init(None))
        else:
            self.tx = tx
        self.made = made
        # (the arrays of a state fit made: a kept state of constants may be
        # among them, which no user gets: ``optax_init.owned``)
        self.started = {id(x) for x in jtu.tree_leaves(fresh)} if made else set()
        if opt_state is not None:
            _check_opt_state(opt_state, fresh)
            fresh = opt_state
        self.state = {"params": params, "other": others, "opt_state": fresh}
        statics = tuple((i, x) for i, x in enumerate(template) if i not in dynamic)
        self._layout_key = ("optax", treedef, train, other, statics, self.counted)

    def fingerprint(self) -> Any:
        rest = _fingerprint.of(self._layout_key)  # (tx's: ``tx_key``, walked once)
        return None if rest is None or self.tx_key is None else (rest, self.tx_key)

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

    def layer_axes(self) -> None:
        """(no leaf known as a ``Stack``'s stacked one)"""
        return None

    def start_step(self) -> int | None:
        """The step count kept in the optax state (``count`` of Adam, schedules,
        ``inject_hyperparams``...; fit's own count for a state that keeps none):
        where this call continues from. None for an ``opt_state`` given without
        fit's count (a state made by ``tx.init``, not by ``fit``)."""
        if self.made:
            # Every count of a state ``tx.init`` makes starts at 0 (optax's
            # do: ``tests/test_fit_continue.py``): no read, which would wait
            # for the init's device work before the program is dispatched.
            return 0
        if self.counted:
            state = self.state["opt_state"]
            return None if self.given_uncounted else int(state[1].count)
        return _step_count(self.state["opt_state"])

    def names(self) -> list[str]:
        flat = jtu.tree_flatten_with_path(self.state)[0]
        return [_optax_name(self, path) for path, _ in flat]

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        tx, layout = self.tx, self.layout  # no arrays: the step is cached
        held, at = self.held, self.held_at

        def objective_at(carried, b, k):
            def objective(q):
                out = loss_fn(layout.model(q, carried), b, k)
                out, new = held.threaded(out, carried, at)
                loss, metrics = split_loss(_CALL, out)
                return loss, (metrics, new)

            return objective

        def step(state, batch, key):
            params = state["params"]

            def one(carried, b, k):
                (loss, (metrics, new)), grads = jax.value_and_grad(
                    objective_at(carried, b, k), has_aux=True
                )(params)
                return new, loss, metrics, grads

            others, loss, metrics, grads = accumulated(
                one, state["other"], batch, key, accumulate
            )

            def loss_of(q):  # (all inside the check's own trace)
                b, k = _step.first(accumulate, batch, key)
                return objective_at(state["other"], b, k)(q)[0]

            what = "the model's floating-point arrays"
            _step.check_reads_trained(loss_of, params, what)
            with _step.updating():
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
        """``evaluate(state, batch, key) -> (loss, metrics)`` in inference mode
        (a new eqx.nn.State returned is dropped)."""
        held = self.held
        return evaluation(self.make_call(lambda *a: held.dropped(loss_fn(*a))))

    def finish(self, state: Any) -> tuple[Any, Any]:
        model = self.layout.model(state["params"], state["other"])
        opt_state = state["opt_state"]
        if self.made:  # (the state fit made, given back if no step changed it)
            opt_state = _inits.owned(opt_state, self.started)
        return model, opt_state


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
