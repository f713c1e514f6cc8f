"""Where ``scanax.fit`` gets its batches: arrays on device, or host batches.

Array data is sampled on device: step ``t`` of training uses batch ``t % per_epoch``
of epoch ``t // per_epoch``, whose order is ``epoch_order(key, epoch, n)`` (in order
when ``key`` is None). Everything is a function of the global step, so results do
not depend on how steps are grouped into calls. An incomplete last batch of each
epoch is dropped. The orders are drawn on the host, as Keras and data loaders do,
and passed to each compiled call: a shuffle inside the compiled loop (threefry
and a sort) doubled the compile time of a small model's loop.

Iterable data (``_iterables``) is consumed in order on the host.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ..._errors import fit as errors, rollout as rollout_errors
from ..._tree import as_int, is_array, not_numeric
from .. import mesh as _mesh
from . import iterables as _iterables, rollout as _rollout


def is_array_data(data: Any) -> bool:
    """True when ``data`` is a (non-empty) pytree of arrays rather than an iterable."""
    if isinstance(data, Iterator):
        return False
    leaves = jtu.tree_leaves(data)
    return bool(leaves) and all(is_array(x) for x in leaves)


class ArraySource:
    """A pytree of arrays with a leading example axis, sampled on device.

    What ``fit`` asks of a source: the compiled ``length`` of a call, whether
    calls are ``sized_automatically``, the ``arguments`` the compiled loop takes
    (placed on devices), the ``calls`` to make, a ``sampler`` for inside the loop
    (``first``/``advance``/``batch``), a ``describe`` for checkpoints and ``skip``
    to resume.
    """

    # Steps per compiled call: the history buffers' length, so that one program
    # runs any number of steps.
    LENGTH = 1000

    def __init__(self, data: Any, batch_size: Any, key: Any, name: str = "data"):
        bad = not_numeric(data)
        if bad:
            raise errors.data_not_numeric(bad, name)
        sizes = [x.shape[0] if x.ndim else None for x in jtu.tree_leaves(data)]
        if None in sizes or len(set(sizes)) > 1:
            flat = jtu.tree_flatten_with_path(data)[0]
            raise errors.data_leading_axes(flat, name)
        self.n = sizes[0]
        if self.n == 0:
            raise errors.data_empty(name, data)
        if batch_size is None:
            raise errors.batch_size_missing(self.n)
        self.batch_size = positive_int("batch_size", batch_size)
        if self.batch_size > self.n:
            raise errors.batch_size_too_large(self.batch_size, self.n)
        self.per_epoch = self.n // self.batch_size
        self.shuffle = key is not None
        self.key = key if key is not None else _iterables.unused_key()
        self.seed = _seed(key) if self.shuffle else None
        self._orders: dict[tuple, np.ndarray] = {}  # (seed, epoch) -> the order
        self.members: list | None = None  # per-member seeds (a population)
        self.micro = 1  # batches per optimizer step (``accumulate``)
        self.data = data
        self.static = ("array", self.n, self.batch_size, self.shuffle)

    def length(self, steps: int, steps_per_call: int | None) -> int:
        return max(self.LENGTH, steps_per_call or 0)

    def use_key(self, key: Any) -> None:
        """Shuffle with ``key`` from now on (a restored run's saved key)."""
        if self.shuffle:
            self.key, self.seed, self._orders = key, _seed(key), {}

    def sized_automatically(self, steps_per_call: int | None) -> bool:
        """Calls sized by their speed (no ``steps_per_call`` given), in one
        process: the processes of a ``jax.distributed`` job must run the same
        steps per call, and each one's measured speed is its own."""
        return steps_per_call is None and jax.process_count() == 1

    def check_mesh(self, mesh: Any) -> None:
        _mesh.check_batch(mesh, self.batch_size, "batch_size")

    def arguments(self, place: Any) -> tuple[Any, Any]:
        """``(data, key)`` for the compiled loop, on the devices (``place``: a
        ``_mesh.Placement``)."""
        return place.put(self.data), place.replicate(self.key)

    def accumulate(self, k: int) -> None:
        """Step ``t`` takes the ``k`` batches of data steps ``t*k ... t*k+k-1``
        (stacked on a leading axis), as ``k`` steps of ``optax.MultiSteps`` would."""
        if k * self.batch_size > self.n:
            raise errors.accumulate_too_large(k, self.batch_size, self.n)
        self.micro = k
        self.static = (*self.static[:4], k)

    def steps_for(self, epochs: int) -> int:
        """The optimizer steps of ``epochs`` passes over the data."""
        batches = epochs * self.per_epoch
        if batches % self.micro:
            raise errors.epochs_accumulate(epochs, self.per_epoch, self.micro)
        return batches // self.micro

    def epoch_of(self, steps: np.ndarray) -> np.ndarray:
        """The epoch (from 1) each global step (1-based) took its batches from
        (with ``accumulate``: its first micro-batch's)."""
        steps = np.asarray(steps, np.int64)
        return (steps - 1) * self.micro // self.per_epoch + 1

    def describe(self) -> dict:
        """What a checkpoint records of the data (a resume must see the same)."""
        out = {
            "kind": "array",
            "n": self.n,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }
        if self.micro > 1:
            out["accumulate"] = self.micro
        return out

    def rewind(self, steps: int) -> bool:
        """(nothing to set back: step ``t``'s batch is found from ``t``)"""
        return False

    def past(self, steps: int) -> int:
        """(nothing read ahead)"""
        return 0

    def skip(self, count: int, state: Any = None, then: int = 0) -> None:
        """Nothing to skip: step ``t``'s batch is a function of ``t``."""

    def keep_states(self) -> None:
        """(nothing to keep: step ``t``'s batch is a function of ``t``)"""

    def state_at(self, steps: int) -> None:
        """(nothing to save)"""

    def calls(self, start: int, end: int, schedule: Any, place: Any) -> Iterator:
        """``(start, end, xs)`` of each call (``schedule.want(start, end)`` steps):
        the batches are drawn inside, ``xs`` holds the example orders (shuffled
        data) of the epochs the call may reach."""
        while start < end:
            count = place.fewest(schedule.want(start, end))  # across processes
            orders = None
            if self.shuffle:
                k = self.micro
                orders = self._placed(start * k, schedule.length * k, count * k, place)
            yield start, start + count, orders
            start += count

    def _placed(self, start: int, length: int, count: int, place: Any) -> Any:
        """``orders`` on the devices; the last one placed is kept (small ones
        only): the short calls of an epoch loop ask for the same rows again."""
        first = start // self.per_epoch
        last = (start + count - 1) // self.per_epoch
        seeds = self.seed if self.members is None else self.members
        key = (repr(seeds), first, last, length, self.n, self.per_epoch, place.mesh)
        found = _PLACED.get(key)
        if found is not None:
            return found
        orders = self.orders(start, length, count)
        placed = place.replicate(orders)
        _PLACED.clear()
        if orders.nbytes <= _PLACED_BYTES:
            _PLACED[key] = placed
        return placed

    def for_members(self, keys: Any) -> None:
        """Draw one order per member (a population's members, each shuffled as a
        solo ``fit`` with its key would be): ``xs`` gets a leading member axis."""
        # (one transfer for all members: a key's words each cost a dispatch)
        self.members = [[int(v) for v in row.ravel()] for row in _words(keys)]
        self._orders = {}

    def orders(self, start: int, length: int, count: int | None = None) -> np.ndarray:
        """``[epochs, n]``: row ``j`` is the order of epoch ``start // per_epoch +
        j``, for every epoch a call of ``length`` steps from ``start`` can reach
        (a fixed number of rows: one compiled program); ``[members, epochs, n]``
        after ``for_members``. With ``count`` (the steps the call runs), rows past
        the epochs those steps reach repeat the last one (never read)."""
        first = start // self.per_epoch
        rows = length // self.per_epoch + 2
        last = first + rows - 1
        if count is not None:
            last = min(last, (start + count - 1) // self.per_epoch)
        epochs = [min(e, last) for e in range(first, first + rows)]
        if self.members is None:
            out = np.stack([self.order(self.seed, e) for e in epochs])
        else:
            out = np.stack(
                [np.stack([self.order(s, e) for e in epochs]) for s in self.members]
            )
        for old in [k for k in self._orders if k[1] < first]:
            del self._orders[old]
        return out

    def order(self, seed: list[int], epoch: int) -> np.ndarray:
        found = self._orders.get((tuple(seed), epoch))
        if found is None:
            found = self._orders[tuple(seed), epoch] = epoch_order(seed, epoch, self.n)
        return found

    def sampler(self) -> ArraySource:
        """This source without its arrays (the compiled loop gets them as
        arguments; a cached loop must not keep a dataset alive)."""
        clone = copy.copy(self)
        clone.data = clone.key = None
        return clone

    # -- on device, inside the compiled chunk: functions of the global step only --

    def first(self, key: Any, t: Any) -> Any:
        """The sampler's state: the epoch the call starts in (row 0 of ``xs``)."""
        return t * self.micro // self.per_epoch

    def advance(self, first: Any, key: Any, t: Any) -> Any:
        return first

    def batch(self, first: Any, data: Any, xs: Any, t: Any, i: Any) -> Any:
        if self.micro > 1:  # the micro-batches of data steps t*k ... t*k+k-1
            steps = t * self.micro + jnp.arange(self.micro, dtype=jnp.int32)
            return jax.vmap(lambda m: self._batch(first, data, xs, m))(steps)
        return self._batch(first, data, xs, t)

    def _batch(self, first: Any, data: Any, xs: Any, t: Any) -> Any:
        start = (t % self.per_epoch) * self.batch_size
        if self.shuffle:
            row = t // self.per_epoch - first
            idx = jax.lax.dynamic_slice(xs, (row, start), (1, self.batch_size))[0]
            return jtu.tree_map(lambda x: jnp.take(x, idx, axis=0), data)
        return jtu.tree_map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, start, self.batch_size), data
        )


# The shuffled orders last placed on device (see ``ArraySource._placed``).
_PLACED: dict = {}
_PLACED_BYTES = 16 << 20


def epoch_order(seed: Any, epoch: int, n: int) -> np.ndarray:
    """The example order of ``epoch`` for shuffled array data: a permutation of
    ``range(n)`` drawn by NumPy from ``fit``'s key and the epoch number
    (``seed`` is ``_seed(key)``)."""
    rng = np.random.default_rng([*seed, int(epoch)])
    return rng.permutation(n).astype(np.int32)


def _seed(key: Any) -> list[int]:
    """The words of a JAX key (typed, or a legacy ``uint32[2]``), as a NumPy seed."""
    return [int(v) for v in _words(key).ravel()]


def _words(keys: Any) -> np.ndarray:
    """The words of JAX keys (typed, or legacy ``uint32[..., 2]``) on the host."""
    return np.asarray(jr.key_data(keys) if _is_key(keys) else keys)


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def check_key(key: Any, population: bool = False) -> None:
    """Refuse a ``key`` that ``jax.random`` would not take as one key: a typed
    key of shape ``()`` or a raw ``uint32`` key of the default implementation's
    shape (``jax.random.PRNGKey``)."""
    if key is None:
        return
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if np.shape(key) == ():
            return
    elif (
        isinstance(key, (jax.Array, np.ndarray))
        and dtype == np.uint32
        and np.shape(key) == _raw_key_shape()
    ):
        return
    raise errors.key_type(key, population)


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw key of JAX's default PRNG implementation."""
    return jax.eval_shape(lambda: jr.key_data(jr.key(0))).shape


def positive_int(name: str, value: Any, call: str = errors.CALL) -> int:
    count = as_int(value)
    if count is None:
        raise errors.not_int(name, value, call)
    if count < 1:
        raise errors.not_positive(name, count, call)
    return count


def _outer_list(data: Any, path: tuple) -> tuple[tuple, list] | None:
    """The outermost Python list on ``path`` into ``data`` (its path, the
    list), or None."""
    node = data
    for i, key in enumerate(path):
        if isinstance(node, list):
            return path[:i], node
        if isinstance(key, jtu.DictKey):
            node = node[key.key]
        elif isinstance(key, jtu.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jtu.GetAttrKey):
            node = getattr(node, key.name)
        else:
            return None
    return None


def make_source(data: Any, batch_size: Any, key: Any) -> Any:
    """Array data: a pytree of arrays that is not a list (lists, iterators and
    other iterables are sequences of batches); a ``scanax.Rollout``."""
    if isinstance(data, _rollout.Rollout):
        if batch_size is not None:
            raise rollout_errors.batch_size_given(batch_size)
        return _rollout.RolloutSource(data, key)
    if isinstance(data, (dict, tuple)) and not is_array_data(data):
        # Arrays next to something else: meant as array data, not as an iterable
        # (iterating a dict would give its keys).
        flat = jtu.tree_flatten_with_path(data)[0]
        if any(is_array(x) for _, x in flat):
            path, leaf = next((p, x) for p, x in flat if not is_array(x))
            outer = _outer_list(data, path)  # (an array's values as a list?)
            if outer is not None:
                raise errors.data_list_not_array(jtu.keystr(outer[0]), len(outer[1]))
            raise errors.data_leaf_not_array(jtu.keystr(path), leaf)
    if isinstance(data, list) or not is_array_data(data):
        if batch_size is not None:
            raise errors.batch_size_with_iterable(data)
        return _iterables.IterSource(data, key)
    return ArraySource(data, batch_size, key)
