"""Metrics over a whole dataset: ``scanax.Ratio`` (a ratio of sums, not a mean
of per-batch ratios) and ``over_dataset`` (batch means weighted by their sizes, a
``Ratio``'s sums kept apart), shared by ``fit``'s in-loop evaluation and
``scanax.evaluate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
        return jtu.tree_map(jnp.add, a, b)

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
        return {k: _mean(v, n) for k, v in total.items()}


def _weighted(value: Any, size: int) -> Any:
    """A batch's part of a dataset total: a mean times the batch's size, or a
    Ratio's parts as they are (counts summed exactly as int32)."""
    if isinstance(value, Ratio):
        return Ratio(_summand(value.num), _summand(value.den))
    return jnp.asarray(value, jnp.float32) * size


def _summand(x: Any) -> Any:
    dtype = jnp.result_type(x)
    exact = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)
    return jnp.asarray(x, jnp.int32 if exact else jnp.float32)


def _divide(num: Any, den: Any) -> Any:
    """``num / den``, 0 where ``den`` is 0 (no example counted: precision with
    nothing predicted positive is 0, as scikit-learn and Keras give)."""
    return jnp.where(den == 0, 0, num / jnp.where(den == 0, 1, den)).astype(num.dtype)


def _mean(total: Any, n: int) -> Any:
    if isinstance(total, Ratio):
        num, den = (jnp.asarray(x, jnp.float32) for x in (total.num, total.den))
        return _divide(num, den)
    return total / n
