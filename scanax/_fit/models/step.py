"""What every model kind of ``scanax.fit`` builds its step from.

The checked ``loss_fn`` result (``split_loss``: ``loss`` or ``(loss, metrics)``),
the eval step on a kind's ``make_call`` (``evaluation``), micro-batch averaging
(``accumulated``), the extra arguments of an optax transform's update
(``extra_args``), which leaves are trained (``is_inexact``) and which leaves of a
training state are step counts (``is_counter``). The kinds themselves are in
``_models_nnx``, ``_models_optax`` and ``_models_trainstate``; ``_models.adapt``
chooses one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..._errors import evaluate as evaluate_errors, models as errors
from ..._errors.fit import CALL as _CALL
from ..._tree import is_array
from .. import keys as _keys

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
    if (
        name == "loss_fn"
        and not isinstance(loss, jax.Array)
        and hasattr(loss, "__jax_array__")
    ):
        # a scanax.Ratio trained on: its value num / den (an evaluation keeps
        # its sums apart, ``eval_fn``'s)
        loss = loss.__jax_array__()
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise errors.loss_not_scalar(call, loss, name)
    for key in metrics:  # flat: history has one entry per name
        if not isinstance(key, str):
            raise errors.metric_name_type(call, key, name)
        reserved = key in ("loss", "step") or str(key).endswith("_step")
        # (training metrics: entries at their own steps have these prefixes)
        if reserved or (name == "loss_fn" and str(key).startswith(SPARSE_PREFIXES)):
            raise errors.metric_name_reserved(call, key)
    return loss, check_metrics(call, metrics, name)


def check_metrics(call: str, metrics: dict, name: str) -> dict:
    """The one rule of every metric (``loss_fn``'s, an evaluation's, a
    ``Rollout``'s ``collect``'s), checked when it is first traced: a real
    array (bool, integer or floating; a Python number becomes one) or a
    ``Ratio`` of them, of any fixed shape; complex values, strings and other
    objects are refused, naming the metric. Returns ``metrics`` with Python
    numbers as arrays."""
    out = {}
    for key, leaf in metrics.items():
        if not isinstance(key, str):
            raise errors.metric_name_type(call, key, name)
        path = jtu.keystr((jtu.DictKey(key),))
        if isinstance(leaf, (bool, int, float)):
            leaf = jnp.asarray(leaf)
        dtype = getattr(leaf, "dtype", None)
        if not hasattr(leaf, "shape") or dtype is None:
            if isinstance(leaf, complex):
                raise errors.metric_complex(call, path, leaf, name)
            raise errors.metric_not_array(call, path, leaf, name)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise errors.metric_complex(call, path, leaf, name)
        if not is_real_dtype(dtype):
            raise errors.metric_not_real(call, path, leaf, name)
        out[key] = leaf
    return out


def same_shapes(
    call: str, name: str, first: dict, last: dict, sizes: tuple[int, int]
) -> None:
    """Refuse metrics (``{name: value}`` of two batches of ``sizes``) whose
    shapes differ: a per-example value, which no dataset mean can hold."""
    rows = []
    for key, a in first.items():
        sa = [jnp.shape(x) for x in jtu.tree_leaves(a)]
        sb = [jnp.shape(x) for x in jtu.tree_leaves(last[key])]
        if sa != sb:
            path = jtu.keystr((jtu.DictKey(key),))
            rows.append((path, _shapes(a), _shapes(last[key])))
    if rows:
        raise evaluate_errors.metric_shape_varies(call, name, rows, sizes)


def _shapes(value: Any) -> str:
    return " / ".join(str(list(jnp.shape(x))) for x in jtu.tree_leaves(value))


def is_real_number(value: Any) -> bool:
    """A Python bool/int/float, or an array (or NumPy scalar) of a real
    dtype: what a metric, or a ``Ratio``'s ``num`` and ``den``, may be."""
    if isinstance(value, (bool, int, float)):
        return True
    dtype = getattr(value, "dtype", None)
    return hasattr(value, "shape") and dtype is not None and is_real_dtype(dtype)


def is_real_dtype(dtype: Any) -> bool:
    """A bool, integer or floating dtype (not complex, strings or keys)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # (a key's dtype)
        return False
    return dtype.kind in "biuf" or jnp.issubdtype(dtype, jnp.floating)


def evaluation(call: Callable) -> Callable:
    """``evaluate(state, batch, key) -> (loss, metrics)`` from a ``make_call``."""

    def evaluate(state, batch, key):
        return split_loss(_CALL, call(state, batch, key), "eval_fn")

    return evaluate


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


def first(k: int, *trees: Any) -> tuple:
    """The first of ``accumulated``'s ``k`` stacked micro-batches (and keys):
    ``trees`` as they are when ``k`` is 1."""
    if k == 1:
        return trees
    return tuple(jtu.tree_map(lambda x: x[0], tree) for tree in trees)


def _averaged(v: Any) -> bool:
    """A floating array metric (averaged over micro-batches); a ``Ratio``'s
    sums (any pytree that is not an array) are summed, others keep the last."""
    return isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.inexact)


def _add(total: Any, v: Any) -> Any:
    if not isinstance(v, jax.Array):  # a Ratio: its numerator and denominator
        return jtu.tree_map(jnp.add, total, v)
    return total + v if _averaged(v) else v


@contextlib.contextmanager
def updating() -> Any:
    """Around an optimizer's update: optax's TypeError for an argument fit does
    not pass (a line search's ``grad=`` and ``value_fn=``) as fit's own, naming
    the fix; any other error as it is."""
    try:
        yield
    except TypeError as err:
        if "missing" in str(err) and "value_fn" in str(err):
            raise errors.update_needs_more(err) from err
        raise


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


def finite_on_host(arrays: Any) -> bool:
    """Whether every floating array of ``arrays`` is finite, read to the host
    (for a stop's message: never per step)."""
    for x in arrays:
        x = np.asarray(jax.device_get(x))
        if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all():
            return False
    return True


def is_inexact(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


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


def check_reads_trained(
    objective: Callable, trained: list, what: str, nnx: bool = False
) -> None:
    """Raise, while tracing, when the loss ``objective(trained)`` cannot depend
    on any array of ``trained``: its gradient is zero, and training would change
    nothing (a loss reading a model other than the one it is passed: from a
    closure, a ``functools.partial``, ``self.model``; one under
    ``stop_gradient``; an NNX ``wrt`` choosing Variables the loss does not
    read). Found on the loss's jaxpr (one more trace of the loss per compile:
    nothing is added to the program), as ``keys.uses_key`` finds a key's use:
    conservatively (an operation with an input that depends passes it to all
    its outputs); a program with effects other than callbacks' (a state's) is
    taken to depend. ``what``: the trained arrays, as the message names them;
    ``nnx``: the message names ``wrt``."""
    if not trained:
        return
    jaxpr = jax.make_jaxpr(objective)(trained).jaxpr
    if any(type(e).__name__ not in _CALLBACK_EFFECTS for e in jaxpr.effects):
        return
    marks = [True] * len(jaxpr.invars)  # (its inputs: the trained arrays)
    if not _keys.depends(jaxpr, marks, cut=("stop_gradient",))[0]:
        cut = _keys.depends(jaxpr, marks)[0]  # (a stop_gradient cut it off)
        raise errors.loss_reads_no_parameter(_CALL, what, cut, nnx)


# The effects of callbacks (``jax.debug.print``/``callback``, ``io_callback``),
# by their classes' names: a program with any other effect (a state's reads and
# writes) is not walked. (A name JAX changes is one more effect not walked.)
_CALLBACK_EFFECTS = {"DebugEffect", "OrderedDebugEffect", "IOEffect", "OrderedIOEffect"}
