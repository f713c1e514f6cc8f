"""Metrics over a whole dataset: ``scanax.Ratio`` (a ratio of sums, not a mean
of per-batch ratios) and ``over_dataset`` (batch means weighted by their sizes, a
``Ratio``'s sums kept apart), shared by ``fit``'s in-loop evaluation and
``scanax.evaluate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._errors import evaluate as evaluate_errors
from .models import step as _model_step
from .program import trace_once


@jtu.register_pytree_node_class
class Ratio:
    """A metric that is a ratio of sums over the whole dataset: ``sum(num) /
    sum(den)``, not a mean of per-batch ratios.

    Return it among the metrics of an ``eval_fn`` (or as its loss) for
    ``scanax.evaluate`` and ``scanax.fit``'s in-loop evaluation: across
    batches, ``num`` and ``den`` are summed separately and the metric is their
    quotient, so precision, recall, F1 or a per-token loss are the dataset's
    own values however the data is batched. Sum over the batch's examples
    yourself; an array ``num``/``den`` (per class, say) gives an array metric.

    Conceptually equivalent to (0 where the denominator sums to 0)::

        value = sum(r.num for r in batch_ratios) / sum(r.den for r in batch_ratios)

    Wherever else it is read as an array (a training metric of ``loss_fn``
    in ``fit``'s history, ``jnp.asarray``, ``np.asarray``), a Ratio is its
    value ``num / den``.

    Arguments:
        num, den: real arrays or numbers (bool, integer or floating) whose
            shapes broadcast together, e.g. counts; anything else (a complex
            value, a string) is refused with a ``TypeError``, shapes that do
            not broadcast with a ``ValueError``.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> tp, fp, fn = jnp.array(3), jnp.array(1), jnp.array(2)
        >>> precision = scanax.Ratio(tp, tp + fp)
        >>> float(precision.value), precision.shape
        (0.75, ())
    """

    __slots__ = ("num", "den")

    def __init__(self, num: Any, den: Any):
        for part, value in (("num", num), ("den", den)):
            if not _model_step.is_real_number(value):
                raise evaluate_errors.ratio_part(part, value)
        try:
            jnp.broadcast_shapes(jnp.shape(num), jnp.shape(den))
        except ValueError:
            raise evaluate_errors.ratio_shapes(num, den) from None
        self.num, self.den = num, den

    def tree_flatten(self) -> tuple[tuple, None]:
        return (self.num, self.den), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> Ratio:
        # (not checked: JAX rebuilds pytrees with placeholders as leaves)
        out = object.__new__(cls)
        out.num, out.den = children
        return out

    @property
    def shape(self) -> tuple:
        return tuple(jnp.broadcast_shapes(jnp.shape(self.num), jnp.shape(self.den)))

    @property
    def dtype(self) -> Any:
        """The value's dtype: floating (counts give the default float)."""
        types = [jnp.result_type(x) for x in (self.num, self.den)]
        floats = [t for t in types if jnp.issubdtype(t, jnp.inexact)]
        if not floats:
            return jnp.result_type(float)
        return max(floats, key=lambda t: jnp.dtype(t).itemsize)

    @property
    def value(self) -> Any:
        """``num / den`` (a JAX array; 0 where ``den`` is 0)."""
        dtype = self.dtype
        return _divide(jnp.asarray(self.num, dtype), jnp.asarray(self.den, dtype))

    def __jax_array__(self) -> Any:
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        own = np.dtype(self.dtype)
        num, den = np.asarray(self.num, own), np.asarray(self.den, own)
        value = np.where(den == 0, 0, num / np.where(den == 0, 1, den)).astype(own)
        return np.asarray(value, dtype or own)

    def __repr__(self) -> str:
        return f"scanax.Ratio(num={self.num!r}, den={self.den!r})"


def over_dataset(
    metrics: Callable,
    data: Any,
    n: int,
    batch_size: int,
    key: Any = None,
    place: Callable | None = None,
    call: str = "scanax.fit",
) -> dict:
    """``{"loss": ..., **metrics}`` over every example of ``data`` (``n`` of them,
        a leading axis on every leaf), in batches of ``batch_size``: full batches in
        a scan, then the remainder. ``metrics(batch, batch_key) -> (loss, metrics)``
        gives a batch's means (batch ``j``'s key: ``fold_in(key, j)``, None without
        ``key``); each is weighted by its batch's size, so that the result is the
        mean over the examples, and a :class:`Ratio`'s ``num`` and ``den`` are
        summed separately. ``place``: applied to each batch (a sharding constraint);
    ``call``: who evaluates (for messages).

        Conceptually equivalent to::

            total = {}
            for j, start in enumerate(range(0, n, batch_size)):
                batch = data[start:start + batch_size]
                loss, extra = metrics(batch, fold_in(key, j))
                for name, v in {"loss": loss, **extra}.items():
                    total[name] += (v.num, v.den) if ratio else v * len(batch)
            return {name: num / den if ratio else v / n for name, v in total.items()}
    """
    b = batch_size
    full, rest = divmod(n, b)

    def at(start, size):
        batch = jtu.tree_map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start, size), data
        )
        return batch if place is None else place(batch)

    def sums(batch, j, size):
        batch_key = None if key is None else jr.fold_in(key, j)
        loss, extra = metrics(batch, batch_key)
        values = {"loss": loss, **extra}
        return {k: _weighted(v, size) for k, v in values.items()}

    def add(a, b):
        return jtu.tree_map(_add, a, b, is_leaf=lambda x: isinstance(x, _Count))

    with jax.named_scope("scanax.evaluate"):
        total = None
        if full:
            # (traced once: the carry's shapes, and the scan's batch)
            one, shapes = trace_once(lambda i: sums(at(i * b, b), i, b), jnp.int32(0))
            zero = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(acc, i):
                return add(acc, one(i)), None

            total, _ = jax.lax.scan(body, zero, jnp.arange(full, dtype=jnp.int32))
        if rest:
            last = sums(at(full * b, rest), full, rest)
            if total is not None:  # (a metric's shape must not depend on b)
                _model_step.same_shapes(call, "eval_fn", total, last, (b, rest))
            total = last if total is None else add(total, last)
        if not (full and rest):  # (one batch size seen: look at another)
            size = b if full else rest
            _per_example(call, lambda x: sums(x, 0, 2 * size), data, place, total, size)
        return {k: _mean(v, n) for k, v in total.items()}


def _per_example(
    call: str, sums: Callable, data: Any, place: Callable | None, total: dict, size: int
) -> None:
    """Refuse a metric whose shape follows the batch size when every batch had
    ``size`` examples: the function's shapes at twice that size (found by
    ``jax.eval_shape``: nothing is added to the program, no callback of it runs)
    must be the same. Only a metric that is not a scalar can follow it; a
    function that cannot take another batch size (a reshape to its own) has
    nothing to compare."""
    if all(jnp.ndim(x) == 0 for x in jtu.tree_leaves(total)):
        return
    batch = jtu.tree_map(
        lambda x: jax.ShapeDtypeStruct((2 * size, *x.shape[1:]), x.dtype), data
    )
    try:
        again = jax.eval_shape(lambda b: sums(b if place is None else place(b)), batch)
    except Exception:  # noqa: BLE001
        return
    _model_step.same_shapes(call, "eval_fn", total, again, (size, 2 * size))


def _weighted(value: Any, size: int) -> Any:
    """A batch's part of a dataset total: a mean times the batch's size, or a
    Ratio's parts as they are (integer counts summed exactly)."""
    if isinstance(value, Ratio):
        return Ratio.tree_unflatten(None, (_summand(value.num), _summand(value.den)))
    return jnp.asarray(value, _float(value)) * size


class _Count(NamedTuple):
    """An int32 count summed exactly past int32's range, ``hi * 2**16 + lo``
    with ``0 <= lo < 2**16`` (to 2**47: a per-token loss's token count over
    more than 2**31 tokens, which an int32 sum wraps round)."""

    hi: Any
    lo: Any


def _summand(x: Any) -> Any:
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(x, _float(x))
    if dtype.itemsize == 8:  # (int64 under jax_enable_x64: exact as it is)
        return jnp.asarray(x)
    x = jnp.asarray(x, jnp.int32)
    return _Count(x >> 16, x & 0xFFFF)


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, _Count):
        lo = a.lo + b.lo
        return _Count(a.hi + b.hi + (lo >> 16), lo & 0xFFFF)
    return a + b


def _float(x: Any) -> Any:
    """What a metric is summed in: float32, or float64 for a float64 value
    (under jax_enable_x64)."""
    dtype = jnp.result_type(x)
    wide = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 8
    return jnp.float64 if wide else jnp.float32


def _as(x: Any, dtype: Any) -> Any:
    if isinstance(x, _Count):
        return x.hi.astype(dtype) * 65536 + x.lo.astype(dtype)
    return jnp.asarray(x, dtype)


def _divide(num: Any, den: Any) -> Any:
    """``num / den``, 0 where ``den`` is 0 (no example counted: precision with
    nothing predicted positive is 0, as scikit-learn and Keras give)."""
    return jnp.where(den == 0, 0, num / jnp.where(den == 0, 1, den)).astype(num.dtype)


def _mean(total: Any, n: int) -> Any:
    if isinstance(total, Ratio):
        parts = [x.hi if isinstance(x, _Count) else x for x in (total.num, total.den)]
        floats = [_float(x) for x in parts if jnp.issubdtype(x.dtype, jnp.inexact)]
        dtype = max(floats, key=lambda t: jnp.dtype(t).itemsize, default=None)
        dtype = dtype or jnp.result_type(float)
        return _divide(_as(total.num, dtype), _as(total.den, dtype))
    return total / n
