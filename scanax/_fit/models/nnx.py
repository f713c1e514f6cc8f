"""The NNX kind of ``scanax.fit``: an ``(nnx.Module, nnx.Optimizer)`` pair.

The only module of ``fit`` that touches ``flax.nnx`` (through ``sys.modules``: it
imports nothing the user has not already imported); splitting and merging NNX
objects is ``_nnx``'s.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.tree_util as jtu

from ... import _caller, _nnx
from ..._errors import evaluate as eval_errors, models as errors, short_type
from ..._errors.fit import CALL as _CALL
from . import step as _step
from .step import accumulated, evaluation, extra_args, is_inexact, split_loss


def _value(variable: Any) -> Any:
    """A Variable's value: its array, or the array its ref holds."""
    raw = variable.get_raw_value()
    return raw[...] if _nnx.is_ref(raw) else raw


class NNXAdapter:
    """``(nnx.Module, nnx.Optimizer)``: both carried as one flat list of Variable
    values, written back into the same Variables at the end."""

    kind = "nnx"

    def __init__(self, model: Any, optimizer: Any):
        self.objects = (model, optimizer)
        self.graphdef, self.variables, self.paths = _nnx.flatten([model, optimizer])
        if _nnx.holds_refs(self.variables):
            # Traced as plain Variables (a ref made inside the trace would be
            # carried out of it); written back into the refs at the end.
            plain = _nnx.without_refs([model, optimizer])
            self.graphdef = _nnx.flatten(plain)[0]
        # Variables are read and written directly: a plain one's array is
        # replaced, an array ref (`nnx.var_defaults(ref=True)`) is written in
        # place; anything else (a leaf outside a Variable) goes through
        # nnx.update at the end.
        nnx = sys.modules["flax.nnx"]
        self.writable = all(
            isinstance(v, nnx.Variable)
            and (isinstance(v.get_raw_value(), jax.Array) or _nnx.ref_of(v) is not None)
            for v in self.variables
        )
        self.state = [
            _value(v) if isinstance(v, nnx.Variable) else v for v in self.variables
        ]
        if not self.trained():
            held = collections.Counter(
                type(v).__name__
                for path, v, x in zip(self.paths, self.variables, self.state)
                if path[0] == 0 and is_inexact(x)
            )
            raise errors.wrt_chooses_nothing(getattr(optimizer, "wrt", None), held)

    def state_for_another_model(self) -> str | None:
        """Where the optimizer's state does not fit the model's parameters it
        trains (an ``nnx.Optimizer`` made for another model, or the model
        changed since): the first leaf that differs from what ``tx.init``
        gives for them, described; None when it fits (or cannot be told).
        Asked only after the step failed to trace: nothing on the normal path."""
        nnx = sys.modules["flax.nnx"]
        model, optimizer = self.objects
        tx, wrt = getattr(optimizer, "tx", None), getattr(optimizer, "wrt", None)
        if tx is None or wrt is None:
            return None
        try:
            want = jax.eval_shape(tx.init, nnx.state(model, wrt))
            have = jtu.tree_flatten_with_path(optimizer.opt_state)[0]
        except Exception:  # noqa: BLE001 - no diagnosis
            return None
        want = jtu.tree_leaves(want)
        for k, (path, x) in enumerate(have):
            w = want[k] if k < len(want) else None
            if w is None or (w.shape, w.dtype) != (x.shape, x.dtype):
                got = f"optimizer.opt_state{jtu.keystr(path)} is {short_type(x)}"
                return got + (f", the model's needs {short_type(w)}" if w else "")
        if len(want) != len(have):
            return (
                f"the model's parameters need {len(want)} state leaves, not {len(have)}"
            )
        return None

    def fingerprint(self) -> Any:
        """The graph definition as a fingerprint (``_fingerprint``): equal for
        rebuilt objects of the same structure; None when it cannot be
        described."""
        graphdef = _nnx.graphdef_fingerprint(self.graphdef)
        return None if graphdef is None else ("nnx", graphdef)

    def start_step(self) -> int:
        """The optimizer's own step count: where this call continues from."""
        return int(_value(self.objects[1].step))

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
            if path[0] == 0 and takes(path[1:], v) and is_inexact(self.state[i])
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
            out.append(_value(v))
        return out

    def partition_specs(self) -> Any:
        """The Variables' sharding annotations, one per leaf of the state."""
        variables = self.variables
        if _nnx.holds_refs(variables):  # (flax would make refs of the specs)
            variables = _nnx.flatten(_nnx.without_refs(list(self.objects)))[1]
        return sys.modules["flax.nnx"].get_partition_spec(variables)

    def layer_axes(self) -> list:
        """Per leaf of the state, the layer axis of a ``Stack``'s stacked
        Variable (their optimizer moments' too: flax copies the metadata), else
        None."""
        return [v.get_metadata().get(_nnx.LAYER_AXIS) for v in self.variables]

    def make_step(self, loss_fn: Callable, accumulate: int = 1) -> Callable:
        """``step(state, batch, key)``; with ``accumulate`` > 1, ``batch`` and
        ``key`` hold that many micro-batches (see ``accumulated``)."""
        nnx = sys.modules["flax.nnx"]
        graphdef, known = self.graphdef, self.paths
        with_model, with_extra = _update_form(self.objects[1])
        trained = self.trained()

        def check(state, batch, key):  # the loss reads the trained Variables
            def objective(values):  # (all inside the check's own trace)
                given = list(state)
                for i, v in zip(trained, values):
                    given[i] = v
                model = _nnx.unflatten(graphdef, given)[0]
                b, k = _step.first(accumulate, batch, key)
                return split_loss(_CALL, loss_fn(model, b, k))[0]

            what = "the Variables the optimizer trains (its `wrt`)"
            _step.check_reads_trained(
                objective, [state[i] for i in trained], what, nnx=True
            )

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
            given = state
            if accumulate > 1:
                state, loss, metrics, grads = accumulated(
                    one, state, batch, key, accumulate
                )
                model, optimizer = _nnx.unflatten(graphdef, state)
            else:
                model, optimizer = _nnx.unflatten(graphdef, state)
                loss, metrics, grads = grads_at(model, optimizer, batch, key)
            with _step.updating():
                extra = extra_args(optimizer.tx, loss) if with_extra else {}
                optimizer.update(*((model,) if with_model else ()), grads, **extra)
            after, values = _nnx.values([model, optimizer])
            same = after == graphdef and (
                jtu.tree_structure(values) == jtu.tree_structure(state)
            )
            if not same:  # checked while tracing: costs nothing per step
                paths = _nnx.flatten([model, optimizer])[2]
                added = [_variable_name(p) for p in paths if p not in known]
                removed = [_variable_name(p) for p in known if p not in paths]
                raise errors.state_structure_changed(added, removed)
            check(given, batch, key)
            return values, loss, metrics, grads

        return step

    def made_outside(self) -> str | None:
        """Where the model holds a part made outside the trace now running (a
        population's ``make`` returning a model it closes over, or one holding
        a pretrained submodule): ``model.enc``; None if none."""
        found = _nnx.outside([self.objects[0]])
        if not found:
            return None
        return "model" + _nnx.attribute_path(found[0][0][1:])  # (past its index)

    def make_call(self, fn: Callable) -> Callable:
        """``call(state, *args) -> fn(model, *args)`` with the model in eval mode
        (``Module.eval()``: Dropout off, BatchNorm on its running averages), on
        a copy: nothing it changes is kept."""
        graphdef = self.graphdef

        def call(state, *args):
            model, _ = _nnx.unflatten(graphdef, state)
            model.eval()
            return evaluated(model, lambda: fn(model, *args))

        return call

    def make_eval(self, loss_fn: Callable) -> Callable:
        """``evaluate(state, batch, key) -> (loss, metrics)`` in eval mode."""
        return evaluation(self.make_call(loss_fn))

    def finish(self, state: Any) -> tuple[Any, Any]:
        if self.writable:
            for var, value in zip(self.variables, state, strict=True):
                raw = var.get_raw_value()
                if _nnx.is_ref(raw):
                    _nnx.write_ref(var, raw, value)
                else:
                    var.set_raw_value(value)
        else:
            new = _nnx.unflatten(self.graphdef, state)
            objects = list(self.objects)
            _nnx.update(objects, _nnx.split(new)[1], _nnx.refs_of(objects))
        return self.objects


# Whether the model is called by Rollout's ``collect`` (``collecting``), for
# the warning of ``evaluated``.
_COLLECTING: contextvars.ContextVar = contextvars.ContextVar(
    "collecting", default=False
)


@contextlib.contextmanager
def collecting() -> Iterator[None]:
    """Calls of the model in eval mode in this block are Rollout's ``collect``."""
    token = _COLLECTING.set(True)
    try:
        yield
    finally:
        _COLLECTING.reset(token)


def evaluated(model: Any, run: Callable, call: str | None = None) -> Any:
    """``run()`` (an evaluation of ``model``, a copy in eval mode), warning
    when it moves the model's own RNG streams: every batch (every collection)
    is evaluated on the same copy, so its draws repeat (a warning: a stream
    forked for a Dropout in eval mode moves and draws nothing)."""
    out, drawn = _nnx.unseeded_draws(model, run)
    if drawn:
        message = (
            eval_errors.own_rngs_drawn_in_collect(drawn)
            if _COLLECTING.get()
            else eval_errors.own_rngs_drawn(call, drawn)
        )
        warnings.warn(message, RuntimeWarning, stacklevel=_caller.user_level())
    return out


def _update_form(optimizer: Any) -> tuple[bool, bool]:
    """How ``optimizer.update`` is called: with the model first (``nnx.Optimizer``;
    not ``nnx.ModelAndOptimizer``, which holds it), and with the transform's
    extra arguments (``value=``) only where it takes them (a subclass's
    ``update(self, model, grads)`` does not)."""
    try:
        params = inspect.signature(optimizer.update).parameters.values()
    except (TypeError, ValueError):
        return True, True
    kinds = [p.kind for p in params]
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    with_model = (
        sum(k in positional for k in kinds) >= 2
        or inspect.Parameter.VAR_POSITIONAL in kinds
    )
    with_extra = inspect.Parameter.VAR_KEYWORD in kinds or any(
        p.name == "value" for p in params
    )
    return with_model, with_extra


def _variable_name(path: tuple) -> str:
    """``model['l1']['kernel']`` from a joint ``_nnx.flatten`` path."""
    head, *rest = path
    return ("model", "optimizer")[head] + "".join(f"[{k!r}]" for k in rest)


def is_optimizer(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Optimizer)
