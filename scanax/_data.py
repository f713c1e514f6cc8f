"""Where ``scanax.fit`` gets its batches: arrays on device, or host batches.

Array data is sampled on device: step ``t`` of training uses batch ``t % per_epoch``
of epoch ``t // per_epoch``, whose order is ``epoch_order(key, epoch, n)`` (in order
when ``key`` is None). Everything is a function of the global step, so results do
not depend on how steps are grouped into calls. An incomplete last batch of each
epoch is dropped. The orders are drawn on the host, as Keras and data loaders do,
and passed to each compiled call: a shuffle inside the compiled loop (threefry
and a sort) doubled the compile time of a small model's loop.

Iterable data is consumed in order on the host, stacked ``steps_per_call`` batches at
a time and moved to the device while the previous chunk trains.
"""

from __future__ import annotations

import base64
import copy
import functools
import itertools
import json
import operator
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from . import _mesh, _rollout
from ._errors import fit as errors, rollout as rollout_errors, short_type
from ._tree import is_array


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
        sizes = [x.shape[0] if x.ndim else None for x in jtu.tree_leaves(data)]
        if None in sizes or len(set(sizes)) > 1:
            flat = jtu.tree_flatten_with_path(data)[0]
            raise errors.data_leading_axes(flat, name)
        self.n = sizes[0]
        if batch_size is None:
            raise errors.batch_size_missing(self.n)
        self.batch_size = positive_int("batch_size", batch_size)
        if self.batch_size > self.n:
            raise errors.batch_size_too_large(self.batch_size, self.n)
        self.per_epoch = self.n // self.batch_size
        self.shuffle = key is not None
        self.key = key if key is not None else unused_key()
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

    def skip(self, count: int, state: Any = None) -> None:
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


class IterSource:
    """An iterable of host batches, stacked into chunks of ``steps_per_call``
    (the same interface as ``ArraySource``)."""

    LENGTH = 100  # batches per call by default

    def __init__(self, data: Any, key: Any = None):
        try:
            self.iterator: Iterator = iter(data)
        except TypeError as err:
            raise errors.data_not_batches(data) from err
        self.key = key if key is not None else unused_key()  # per-step keys only
        # data=[x, y]: arrays meant as array data, read as a list of batches
        self.from_list = isinstance(data, list) and all(is_array(b) for b in data)
        self.consumed = 0  # batches taken from the iterator so far
        self.treedef = None
        self.types: list[tuple[tuple[int, ...], Any]] = []
        self.paths: list[str] = []
        self.impls: list[Any] = []  # per leaf: the PRNG impl of a key leaf, or None
        self.static = ("iter",)
        self.micro = 1
        # A resumable iterator (Grain's get_state/set_state, or a loader's
        # state_dict/load_state_dict): its state before each chunk was taken,
        # by the batches taken by then (the last few).
        self.resumable = _resumable(self.iterator)
        self.restart = None  # a loader's state applies to its next iterator
        if self.resumable is None:
            self.resumable = _resumable(data)
            self.restart = None if self.resumable is None else data
        self.states: dict[int, Any] | None = None  # kept with checkpoints only

    def length(self, steps: int, steps_per_call: int | None) -> int:
        """Host batches are stacked per call, so the buffers are as long as a
        call: ``steps_per_call``, else 100, or a power of two above a smaller
        ``steps`` (a few programs at most, never one per ``steps`` value)."""
        if steps_per_call is not None:
            return steps_per_call
        return min(self.LENGTH, 1 << (min(steps, self.LENGTH) - 1).bit_length())

    def sized_automatically(self, steps_per_call: int | None) -> bool:
        return False

    def use_key(self, key: Any) -> None:
        """Per-step keys from ``key`` (a restored run's saved key)."""
        self.key = key

    def check_mesh(self, mesh: Any) -> None:
        """Checked per chunk (``_mesh.put_chunk``): the batch size is the
        iterable's."""

    def arguments(self, place: Any) -> tuple[Any, Any]:
        return None, place.replicate(self.key)

    def accumulate(self, k: int) -> None:
        """Each step takes ``k`` consecutive batches (stacked on a leading axis)."""
        self.micro = k
        self.static = ("iter", k)

    def describe(self) -> dict:
        out = {"kind": "iter"}
        return {**out, "accumulate": self.micro} if self.micro > 1 else out

    def calls(self, start: int, end: int, schedule: Any, place: Any) -> Iterator:
        """``(start, end, xs)`` of each call, with its batches stacked (padded to
        ``schedule.length``) and put on the devices (for the next call, while
        the previous one trains)."""
        k = self.micro  # batches per step (accumulate)
        while start < end:
            taken = self.take(
                place.fewest(schedule.want(start, end)) * k, schedule.length * k
            )
            # Across processes: as many steps as the shortest iterable gave.
            count = place.fewest(0 if taken is None else taken[1] // k)
            if not count:
                return
            xs = taken[0]
            if k > 1:  # [length * k, ...] -> [length, k, ...]
                xs = jtu.tree_map(lambda a: a.reshape(-1, k, *a.shape[1:]), xs)
            xs = place.put_chunk(xs, 2 if k > 1 else 1)
            yield start, start + count, self.on_device(xs)
            start += count

    def sampler(self) -> IterSource:
        """The in-loop part: batch ``i`` of the call's stacked batches."""
        return _HOST_BATCHES

    def skip(self, count: int, state: Any = None) -> int:
        """Move past the batches of ``count`` steps (to resume): a resumable
        iterator is set to ``state`` (a checkpoint's ``state_at``), any other
        has them drawn and dropped; returns how many batches that was."""
        if state is not None and self.resumable is not None:
            self.resumable[1](decode_state(state))
            if self.restart is not None:  # (PyTorch's StatefulDataLoader)
                self.iterator = iter(self.restart)
            self.consumed += count * self.micro
            return count * self.micro
        skipped = sum(1 for _ in itertools.islice(self.iterator, count * self.micro))
        self.consumed += skipped
        return skipped

    def keep_states(self) -> None:
        """Keep the iterator's states for checkpoints (a resumable one's)."""
        if self.resumable is not None:
            self.states = {}

    def state_at(self, steps: int) -> Any:
        """For a checkpoint: the iterator's state after the batches of this
        call's first ``steps`` steps (batches taken ahead of the device not
        counted), encoded for the checkpoint's meta; None when it keeps none."""
        if self.resumable is None or self.states is None:
            return None
        taken = steps * self.micro
        if taken == self.consumed:
            return encode_state(self.resumable[0]())
        return self.states.get(taken)

    def take(self, count: int, length: int) -> tuple[Any, int] | None:
        """Up to ``count`` batches stacked on a new leading axis (host arrays),
        padded to ``length`` with zeros, and how many are real; None when done."""
        if self.states is not None:  # (before drawing: a checkpoint may need it)
            self.states[self.consumed] = encode_state(self.resumable[0]())
            for old in sorted(self.states)[:-3]:
                del self.states[old]
        batches = list(itertools.islice(self.iterator, count))
        if not batches:
            return None
        self.consumed += len(batches)
        columns = [
            self._leaves(b, self.consumed - len(batches) + k)
            for k, b in enumerate(batches)
        ]
        stacked = []
        for j, (shape, dtype) in enumerate(self.types):
            col = np.empty((length, *shape), dtype)
            for k, leaves in enumerate(columns):
                col[k] = leaves[j]
            if len(batches) < length:
                col[len(batches) :] = 0
            stacked.append(col)
        return jtu.tree_unflatten(self.treedef, stacked), len(batches)

    def on_device(self, xs: Any) -> Any:
        """Stacked batches on device, typed PRNG keys made keys again (they travel
        as their key data)."""
        if not any(self.impls):
            return xs
        leaves = jtu.tree_leaves(xs)
        leaves = [
            x if impl is None else jr.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, self.impls)
        ]
        return jtu.tree_unflatten(self.treedef, leaves)

    def _leaves(self, batch: Any, index: int) -> list[np.ndarray]:
        flat, treedef = jtu.tree_flatten_with_path(batch)
        impls = [jr.key_impl(x) if _is_key(x) else None for _, x in flat]
        leaves = [
            np.asarray(jr.key_data(x) if impl else x)
            for (_, x), impl in zip(flat, impls)
        ]
        for (path, x), a in zip(flat, leaves, strict=True):
            if a.dtype.kind not in "biufc":  # strings, objects: nothing JAX can carry
                raise errors.batch_leaf_not_numeric(index, jtu.keystr(path), x)
        if self.treedef is None:
            self.treedef = treedef
            self.impls = impls
            self.paths = [jtu.keystr(p) for p, _ in flat]
            self.types = [(x.shape, x.dtype) for x in leaves]
            return leaves
        if treedef != self.treedef:
            raise errors.batch_structure_changed(index, treedef, self.treedef)
        rows = [
            (
                f"batch{p}",
                f"{short_type(x)}, first batch had "
                f"{np.dtype(d).name}[{', '.join(map(str, s))}]",
            )
            for p, x, (s, d) in zip(self.paths, leaves, self.types)
            if x.shape != s or x.dtype != d
        ]
        if rows:
            raise errors.batch_shape_changed(index, rows, self.from_list)
        return leaves


def _resumable(obj: Any) -> tuple[Any, Any] | None:
    """``(get_state, set_state)`` of an iterator or loader that has them
    (Grain's names, or PyTorch's ``state_dict``/``load_state_dict``)."""
    for get, put in (("get_state", "set_state"), ("state_dict", "load_state_dict")):
        if callable(getattr(obj, get, None)) and callable(getattr(obj, put, None)):
            return getattr(obj, get), getattr(obj, put)
    return None


def encode_state(state: Any) -> dict:
    """An iterator's state as the checkpoint's meta (JSON) holds it: bytes, or
    anything ``json`` writes and reads back equal."""
    if isinstance(state, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(state)).decode()}
    try:
        text = json.dumps(state)
    except (TypeError, ValueError) as err:
        raise errors.iterator_state_type(state) from err
    if json.loads(text) != state:
        raise errors.iterator_state_type(state)
    return {"json": state}


def decode_state(saved: dict) -> Any:
    if "bytes" in saved:
        return base64.b64decode(saved["bytes"])
    return saved["json"]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


class _HostBatches:
    """Inside the loop: batch ``i`` of the stacked host batches ``xs``."""

    def first(self, key: Any, t: Any) -> None:
        return None

    def advance(self, state: Any, key: Any, t: Any) -> None:
        return None

    def batch(self, state: Any, data: Any, xs: Any, t: Any, i: Any) -> Any:
        return jtu.tree_map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), xs
        )


_HOST_BATCHES = _HostBatches()


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


@functools.cache
def unused_key() -> Any:
    """A placeholder key argument when nothing is shuffled (made once)."""
    return jr.key(0)


def positive_int(name: str, value: Any) -> int:
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if value > 0:
                return value
            raise errors.not_positive(name, value)
    raise errors.not_int(name, value)


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
            raise errors.data_leaf_not_array(jtu.keystr(path), leaf)
    if isinstance(data, list) or not is_array_data(data):
        if batch_size is not None:
            raise errors.batch_size_with_iterable(data)
        return IterSource(data, key)
    return ArraySource(data, batch_size, key)
