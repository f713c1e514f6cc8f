"""``scanax.evaluate`` and ``scanax.predict``: a model in eval mode over a whole
dataset, batched on device in one compiled program.

The model's arrays go in as arguments (a copy is rebuilt inside the program, in
eval mode: the user's objects are never switched or written). Programs are kept
by fingerprint of the model's structure and the function's code, as ``fit``'s
are (``_fit_program.program``): a second call with a same-structured model or
new data of the same shapes runs the compiled program again. ``evaluate``
reduces with fit's in-loop evaluation (``_metrics.over_dataset``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .. import _caller, _eager, _fingerprint, _nnx
from .._errors import (
    evaluate as errors,
    fit as fit_errors,
    keys as key_errors,
    short_type,
)
from .._tree import as_int, is_array, not_numeric
from . import (
    keys as _keys,
    mesh as _mesh,
    metrics as _metrics,
    program as _fit_program,
    targets as _targets,
)
from .models import step as _model_step

_CALL, _PREDICT, _FIT = errors.CALL, errors.PREDICT, fit_errors.CALL
DEFAULT_BATCH = 1024  # as fit's eval_batch_size


class _Required:
    """``data``'s default, so that a call without it (``predict(model, x)``)
    gets scanax's message, not Python's."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


@_caller.positional(
    3,
    lambda extra: fit_errors.extra_positional(
        "scanax.evaluate", ("model", "eval_fn", "data"), extra, "batch_size"
    ),
)
def evaluate(
    model: Any,
    eval_fn: Callable,
    data: Any = _REQUIRED,
    *,
    batch_size: int | None = None,
    key: Any = None,
    mesh: Any = None,
) -> dict:
    """The means of ``eval_fn``'s loss and metrics over every example of ``data``,
    the model in eval mode, in one compiled program.

    Conceptually equivalent to (NNX shown)::

        model.eval()  # on a copy: the model passed in is not changed
        total, n = {}, len(data)
        for j, start in enumerate(range(0, n, batch_size)):
            batch = data[start:start + batch_size]
            loss, metrics = eval_fn(model, batch)  # or eval_fn(model, batch,
                                                   #   jax.random.fold_in(key, j))
            for name, v in {"loss": loss, **metrics}.items():
                if isinstance(v, scanax.Ratio):  # sums kept apart
                    total[name] += (v.num, v.den)
                else:  # a batch mean, weighted by the batch's size
                    total[name] += v * len(batch)
        return {name: num / den or v / n for name, v in total.items()}

    The last batch may be smaller (exactly weighted: the result is the mean
    over the dataset). Compiled once per structure: a later call with a
    same-structured model (a rebuilt one, or the same after training) and data
    of the same shapes does not trace again.

    Arguments:
        model: an ``nnx.Module`` (evaluated after ``.eval()``: Dropout off,
            BatchNorm on its running averages), an Equinox module or pytree of
            arrays (``eqx.nn.inference_mode``), a flax ``TrainState``
            (``eval_fn`` gets the state), or a ``scanax.Population`` (every
            member, in eval mode). Nothing in it is changed.
        eval_fn: ``eval_fn(model, batch)`` or ``eval_fn(model, batch, key)``
            (the key found as ``fit`` finds ``loss_fn``'s: a third parameter
            without a default, or one named ``key``, ``rng`` or ``rngs``),
            returning a scalar floating-point loss or ``(loss, metrics)`` with a
            dict of real arrays of a fixed shape, as ``fit``'s ``loss_fn``; a
            metric (or the loss) may be a ``scanax.Ratio`` of sums. A
            population's may also take the member's hyperparameters,
            ``eval_fn(model, batch, hp[, key])``.
        data: a pytree of arrays with a leading example axis.
        batch_size: examples per batch. Default: 1024 (all of them when fewer).
        key: a ``jax.random`` key, for an ``eval_fn`` taking one: batch ``j``
            gets ``jax.random.fold_in(key, j)`` (every member of a population
            the same keys). Without it, such an ``eval_fn`` gets a placeholder
            when its result does not depend on the key (a model whose Dropout
            is off in eval mode), checked by tracing it once; else it is
            refused before anything runs.
        mesh: a ``jax.sharding.Mesh`` with a ``"data"`` axis: each batch split
            over it (``batch_size`` a multiple of its size), the model
            replicated (or kept where its arrays already live on the mesh).

    Returns:
        ``{"loss": ..., **metrics}`` (the metrics by name): Python floats
        (NumPy arrays for array metrics); for a population, NumPy arrays with a
        leading member axis.

    Raises:
        TypeError: ``eval_fn`` not callable or taking other arguments, data not
            arrays, ``batch_size`` not an int, an ``eval_fn`` whose result
            depends on its key without ``key``, ``eval_fn`` not returning a
            scalar loss or real metrics, or failing on a batch of ``data`` (its
            error chained; all found while tracing, before compiling).
        ValueError: arrays in ``data`` with different leading sizes or no
            examples, a ``batch_size`` that is not positive (or not divisible
            by the mesh), a mesh without a ``"data"`` axis or with a population,
            a metric whose shape follows the batch size (a per-example value).

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> x = jnp.arange(10.0)
        >>> def eval_fn(params, batch):
        ...     err = batch * params["w"] - 2 * batch
        ...     return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}
        >>> scanax.evaluate({"w": jnp.array(1.0)}, eval_fn, x, batch_size=4)
        {'loss': 28.5, 'mae': 4.5}
    """
    if _eager.transformed():
        raise fit_errors.under_transformation(_CALL)
    if data is _REQUIRED:
        raise errors.data_missing(_CALL, "eval_fn", eval_fn)
    target = _targets.of(_CALL, model)
    _check_callable(_CALL, "eval_fn", eval_fn, target.members)
    n = _check_data(_CALL, data)
    b = _batch_size(_CALL, batch_size, n)
    if batch_size is None:  # (the default, split evenly over a mesh)
        b = _split_evenly(b, mesh)
    takes = _keys.arguments(eval_fn, _CALL, "eval_fn", target.members)
    _check_key(_CALL, key)
    place = _placement(mesh, target, b, batch_size)
    reads = _nnx.reads_itself(eval_fn, model)
    guarded_fn = guarded(eval_fn, _CALL, "eval_fn", hp=takes.hp_param, reads=reads)
    if takes.key and key is None:  # refused if the evaluation uses it
        key = unused_key(_CALL, "eval_fn", target, guarded_fn, takes, data, b)
    updates = target.updates
    identity = _fit_program.identity(
        target.identity,
        eval_fn,
        _CALL,
        takes[:2],
        updates,
        n,
        b,
        place.mesh,
    )
    call = _call(guarded_fn, *takes[:2])

    def build():
        run = target.runner(call)

        def one(leaves, hp, data, key):
            def batch_metrics(batch, batch_key):
                out = run(leaves, batch, batch_key, hp)
                if updates and isinstance(out, tuple) and len(out) == 3:
                    out = out[:2]  # (a TrainState's updates, a new eqx.nn.State)
                return _model_step.split_loss(_CALL, out, "eval_fn")

            return _metrics.over_dataset(
                batch_metrics, data, n, b, key, place.constrain_even, _CALL
            )

        return jax.vmap(one, in_axes=(0, 0, None, None)) if target.members else one

    program = _fit_program.program(identity, build)
    leaves, hp = target.leaves, target.hp
    leaves, data, key = place.put(leaves), place.put(data), place.replicate(key)
    with place.context():  # (the Auto mesh, also inside the user's jax.set_mesh)
        out = program.call(leaves, hp, data, key)
    host = place.host(out)
    names = ["loss", *(k for k in host if k != "loss")]  # (the rest by name)
    return {k: float(host[k]) if host[k].ndim == 0 else host[k] for k in names}


@_caller.positional(
    3,
    lambda extra: fit_errors.extra_positional(
        "scanax.predict", ("model", "fn", "data"), extra, "batch_size"
    ),
)
def predict(
    model: Any,
    fn: Callable,
    data: Any = _REQUIRED,
    *,
    batch_size: int | None = None,
    key: Any = None,
):
    """``fn(model, batch)`` over every example of ``data``, the model in eval
    mode, the batches' outputs concatenated in order, in one compiled program.

    Conceptually equivalent to (NNX shown)::

        model.eval()  # on a copy: the model passed in is not changed
        outs = [fn(model, data[start:start + batch_size])  # or fn(model, batch,
                for start in range(0, len(data), batch_size)]  #   fold_in(key, j))
        return jax.tree.map(lambda *o: jnp.concatenate(o), *outs)

    Every batch has ``batch_size`` examples: the last one is the data's last
    ``batch_size`` examples (overlapping the one before), of which the rows
    not yet predicted are kept, so that no other batch shape is compiled.

    Arguments:
        model: as for ``scanax.evaluate`` (a ``scanax.Population``: every
            member's outputs, with a leading member axis).
        fn: ``fn(model, batch)`` returning a pytree of arrays with a leading
            batch axis (one row per example), or ``fn(model, batch, key)``:
            the key is found as ``scanax.evaluate`` finds ``eval_fn``'s (a
            population's ``fn`` may take the member's hyperparameters third,
            as its ``eval_fn`` may).
        data: a pytree of arrays with a leading example axis.
        batch_size: examples per batch. Default: 1024 (all of them when fewer).
        key: for an ``fn`` taking a key, as ``scanax.evaluate``'s (without
            it, refused only when the outputs depend on the key).

    Returns:
        ``fn``'s pytree with each leaf ``[n, ...]`` over the ``n`` examples (a
        population's ``[members, n, ...]``), as JAX arrays.

    Raises:
        TypeError: ``fn`` not callable or taking other arguments, data not
            arrays, ``batch_size`` not an int, an output without the batch axis.
        ValueError: arrays in ``data`` with different leading sizes or no
            examples, a ``batch_size`` that is not positive.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> params = {"w": jnp.array(3.0)}
        >>> out = scanax.predict(params, lambda p, x: x * p["w"], jnp.arange(5.0),
        ...                      batch_size=2)
        >>> out.tolist()
        [0.0, 3.0, 6.0, 9.0, 12.0]
    """
    if data is _REQUIRED:
        raise errors.data_missing(_PREDICT, "fn", fn)
    target = _targets.of(_PREDICT, model)
    _check_callable(_PREDICT, "fn", fn, target.members)
    n = _check_data(_PREDICT, data)
    b = _batch_size(_PREDICT, batch_size, n)
    takes = _keys.arguments(fn, _PREDICT, "fn", target.members)
    _check_key(_PREDICT, key)
    reads = _nnx.reads_itself(fn, model)
    guarded_fn = guarded(fn, _PREDICT, "fn", hp=takes.hp_param, reads=reads)
    if takes.key and key is None:  # refused if the outputs depend on it
        key = unused_key(_PREDICT, "fn", target, guarded_fn, takes, data, b)
    identity = _fit_program.identity(target.identity, fn, _PREDICT, n, b, takes[:2])
    call = _call(guarded_fn, *takes[:2])

    def build():
        run = target.runner(call)

        def one(leaves, hp, data, key):
            def rows(batch, j):
                return run(
                    leaves, batch, None if key is None else jr.fold_in(key, j), hp
                )

            return _batched(rows, data, n, b)

        return jax.vmap(one, in_axes=(0, 0, None, None)) if target.members else one

    program = _fit_program.program(identity, build)
    return program.call(target.leaves, target.hp, data, key)


def _batched(fn: Callable, data: Any, n: int, b: int) -> Any:
    """``fn(batch, j)`` over ``data`` in batches of ``b`` (the last: the last
    ``b`` examples), the outputs' new rows concatenated."""
    count = -(-n // b)
    tail = n - (count - 1) * b  # rows of the last batch not predicted before

    def body(_, j):
        start = jnp.minimum(j * b, n - b)
        batch = jtu.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, b), data)
        out = fn(batch, j)
        for path, leaf in jtu.tree_flatten_with_path(out)[0]:
            if not is_array(leaf) or leaf.ndim < 1 or leaf.shape[0] != b:
                raise errors.output_not_batched(jtu.keystr(path), leaf, b)
        return None, out

    def rows(y):
        head = y[: count - 1].reshape(((count - 1) * b, *y.shape[2:]))
        return jnp.concatenate([head, y[count - 1, b - tail :]])

    with jax.named_scope(_PREDICT):
        _, ys = jax.lax.scan(body, None, jnp.arange(count))
        return jtu.tree_map(rows, ys)


# ---------------------------------------------------------------------- arguments


def _check_callable(call: str, name: str, fn: Any, population: bool) -> None:
    if not callable(fn):
        raise errors.fn_not_callable(call, name, fn, population)


def batches(data: Any, b: int) -> Any:
    """What a batch of ``b`` examples of ``data`` is (shapes and dtypes)."""
    return jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct((b, *x.shape[1:]), x.dtype), data
    )


def describe(batch: Any) -> str:
    """``tuple: [0] float32[4, 3], [1] int32[4]`` for a batch's leaves; ``an
    array: float32[4, 3]`` for a batch that is one."""
    if isinstance(batch, jax.Array):  # (a tracer while traced: not its type's name)
        return f"an array: {short_type(batch)}"
    leaves = jtu.tree_flatten_with_path(batch)[0]
    parts = ", ".join(
        f"{jtu.keystr(p) or '(the batch)'} {short_type(x)}" for p, x in leaves
    )
    return f"{type(batch).__name__}: {parts}"


@dataclasses.dataclass(frozen=True)
class Guarded:
    """``fn`` (a user's evaluation or prediction function, called as
    ``fn(model, batch, ...)`` with batches of the argument ``data``), whose
    errors while it is traced are raised again naming the call, the function
    and what the batch is, the original chained: data of another structure or
    feature shape than ``fn`` reads fails inside ``fn``, before anything runs.
    A fingerprint of ``fn`` is one of this (its fields), so compiled programs
    are still found by it."""

    fn: Callable
    call: str
    name: str
    data: str  # the data's argument name
    hp: str | None = None  # the parameter a population member's hp go to
    reads: str | None = None  # the name it reads the trained NNX model by
    owned: tuple = ()  # metric names the call records itself ("epoch")

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    def __call__(self, *args: Any) -> Any:
        try:
            out = self.fn(*args)
        except Exception as err:
            if self.reads is not None and _nnx.is_trace_level_error(err):
                # (the model read from outside, written while traced: flax's
                # TraceContextError, from a BatchNorm's statistics)
                if self.call == _FIT and self.data == "data":  # (training)
                    raise fit_errors.loss_fn_wrote_the_model(self.reads) from err
                raise errors.fn_read_the_model(
                    self.call, self.name, self.reads
                ) from err
            if not isinstance(
                err, (TypeError, ValueError, KeyError, IndexError, AttributeError)
            ):
                raise
            if len(args) < 2 or not _caller.about_the_input(err):
                raise
            raise errors.fn_failed(
                self.call, self.name, self.data, describe(args[1]), err, self.hp
            ) from err
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            for name in self.owned:
                if name in out[1]:
                    raise fit_errors.metric_name_owned(self.name, name)
        return out


def guarded(
    fn: Callable,
    call: str,
    name: str,
    data: str = "data",
    hp: str | None = None,
    reads: str | None = None,
    owned: tuple = (),
) -> Guarded:
    """``fn`` as a ``Guarded`` (``data``: the name of the argument whose
    batches it is given; ``hp``: the parameter that gets a population member's
    hyperparameters, named in its messages; ``reads``: the name by which it
    reads the NNX model being trained from outside, named if that fails;
    ``owned``: metric names the call records itself, refused in its result)."""
    return Guarded(fn, call, name, data, hp, reads, owned)


# Whether an evaluation uses the key it takes, by what is evaluated and the
# function (``unused_key``): traced once per program.
_USES: dict = {}


def unused_key(
    call: str,
    name: str,
    target: _targets.Target,
    fn: Callable,
    takes: Any,
    data: Any,
    b: int,
) -> Any:
    """The key to pass a function that takes one (``takes``) when none was
    given: a placeholder if what it returns in eval mode does not depend on
    it (traced on one batch of ``data``); else a named refusal, before
    anything runs."""
    found = None
    try:
        model = target.identity or _fingerprint.UNKNOWN
        parts = (model, _fingerprint.key(fn), takes, b, call)
        cache_key = parts if _fingerprint.cacheable(parts) else None
        found = None if cache_key is None else _USES.get(cache_key)
    except TypeError:  # (unhashable: trace it)
        cache_key = None
    if found is None:
        run = target.runner(_call(fn, *takes[:2]))
        if target.members:
            run = jax.vmap(run, in_axes=(0, None, None, 0))
        key = jax.ShapeDtypeStruct((), jr.key(0).dtype)
        args = (target.leaves, batches(data, b), key, target.hp)
        found = _keys.uses_key(run, args, 2)
        if cache_key is not None:
            _USES[cache_key] = found
    if found:
        raise key_errors.key_used(call, name, takes.param, call == "scanax.fit")
    return jr.key(0)


def fit_eval_key(model: Any, fn: Callable, population: bool, data: Any, b: int) -> None:
    """``scanax.fit``'s evaluation by ``fn`` (``eval_fn``, or ``loss_fn``),
    when fit has no key: refused, naming ``key=``, if ``fn`` takes a key and
    its result in eval mode depends on it (fit passes a placeholder)."""
    takes = _keys.arguments(fn, "scanax.fit", "eval_fn", population)
    if takes.key:
        target = _targets.of("scanax.fit", model)
        unused_key("scanax.fit", "eval_fn", target, fn, takes, data, b)


def _call(fn: Callable, takes_hp: bool, takes_key: bool) -> Callable:
    """``fn`` as ``call(model, batch, key, hp)``."""
    if takes_hp and takes_key:
        return lambda model, batch, key, hp: fn(model, batch, hp, key)
    if takes_hp:
        return lambda model, batch, key, hp: fn(model, batch, hp)
    if takes_key:
        return lambda model, batch, key, hp: fn(model, batch, key)
    return lambda model, batch, key, hp: fn(model, batch)


def _check_data(call: str, data: Any) -> int:
    """The number of examples of array data, checked."""
    leaves = jtu.tree_leaves(data)
    if isinstance(data, list) or not leaves or not all(is_array(x) for x in leaves):
        raise errors.data_not_arrays(call, data)
    bad = not_numeric(data)
    if bad:
        raise fit_errors.data_not_numeric(bad, call=call)
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if None in sizes or len(sizes) > 1:
        raise errors.data_leading_axes(call, jtu.tree_flatten_with_path(data)[0])
    n = sizes.pop()
    if n == 0:
        raise errors.data_empty(call, data)
    return n


def _batch_size(call: str, value: Any, n: int) -> int:
    if value is None:
        return max(min(DEFAULT_BATCH, n), 1)
    size = as_int(value)
    if size is None:
        raise errors.batch_size_type(call, value)
    if size < 1:
        raise errors.batch_size_not_positive(call, size)
    return max(min(size, n), 1)


def _check_key(call: str, key: Any) -> None:
    if key is None:
        return
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if np.shape(key) == ():
            return
    elif is_array(key) and dtype == np.uint32 and np.shape(key) == (2,):
        return
    raise errors.key_type(call, key)


def _split_evenly(b: int, mesh: Any) -> int:
    """The default batch size ``b`` rounded down to a multiple of ``mesh``'s
    ``"data"`` axis, where there is one (the rest is a last, smaller batch)."""
    if isinstance(mesh, jax.sharding.Mesh) and _mesh.has_data_axis(mesh):
        size = _mesh.data_size(mesh)
        return b - b % size if b >= size else b
    return b


def _placement(
    mesh: Any, target: _targets.Target, b: int, given: Any
) -> _mesh.Placement:
    """Where the evaluation runs: the default device, or ``mesh`` (checked; its
    axes ``Auto``, as ``fit`` uses it) with each batch split over ``"data"``."""
    if mesh is None:
        return _mesh.Placement()
    if not isinstance(mesh, jax.sharding.Mesh):
        raise errors.mesh_type(_CALL, mesh)
    if target.members:
        raise errors.mesh_with_population(_CALL)
    if not _mesh.has_data_axis(mesh):
        raise errors.mesh_axis(_CALL, mesh)
    size = _mesh.data_size(mesh)
    if b % size:
        raise errors.batch_not_divisible(_CALL, b, size, given)
    return _mesh.Placement(_mesh.auto(mesh))
