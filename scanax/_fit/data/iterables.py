"""Host batches for ``scanax.fit``: an iterable (a list of batches, a
generator, a data loader) consumed in order, stacked ``steps_per_call`` batches
at a time and moved to the device while the previous chunk trains. An iterator
with ``get_state``/``set_state`` (Grain) or ``state_dict``/``load_state_dict``
(PyTorch) resumes from a checkpoint exactly; others are skipped forward."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ... import _caller
from ..._errors import fit as errors, short_type
from ..._tree import is_array


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def unused_key() -> Any:
    """A placeholder key argument when nothing is shuffled (made once)."""
    return jr.key(0)


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
        self.short = False  # an incomplete last batch was met: the data's end
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
        # A resumable iterator's states before the last chunks, by the batches
        # taken by then: for checkpoints (``state_at``) and to set it back to
        # the step a run stopped at (``rewind``).
        self.states: dict[int, Any] = {}
        self.saved = False  # (checkpoints keep them: each one checked as taken)

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
        first = True
        while start < end:
            taken = self.take(
                place.fewest(schedule.want(start, end)) * k, schedule.length * k
            )
            # Across processes: as many steps as the shortest iterable gave.
            count = place.fewest(0 if taken is None else taken[1] // k)
            if taken is not None and taken[1] % k:  # (the data's end)
                warnings.warn(
                    errors.micro_batches_left(taken[1] % k, k),
                    RuntimeWarning,
                    stacklevel=_caller.user_level(),
                )
            if not count:
                # (no step at all, nothing read before: an iterator used up by
                # a call before; not after a short batch, or a resume at the end)
                if first and not self.short and not self.consumed:
                    warnings.warn(
                        errors.data_gave_no_batch(end - start),
                        RuntimeWarning,
                        stacklevel=_caller.user_level(),
                    )
                return
            first = False
            xs = taken[0]
            if k > 1:  # [length * k, ...] -> [length, k, ...]
                xs = jtu.tree_map(lambda a: a.reshape(-1, k, *a.shape[1:]), xs)
            xs = place.put_chunk(xs, 2 if k > 1 else 1)
            yield start, start + count, self.on_device(xs)
            start += count

    def sampler(self) -> IterSource:
        """The in-loop part: batch ``i`` of the call's stacked batches."""
        return _HOST_BATCHES

    def skip(self, count: int, state: Any = None, then: int = 0) -> int:
        """Move past the batches of ``count`` steps (to resume): a resumable
        iterator is set to ``state`` (a checkpoint's ``state_at``), then
        ``then`` more batches drawn and dropped; any other has them all drawn
        and dropped; returns how many batches that was."""
        if state is not None and self.resumable is not None:
            self.resumable[1](decode_state(state))
            if self.restart is not None:  # (PyTorch's StatefulDataLoader)
                self.iterator = iter(self.restart)
            for _ in itertools.islice(self.iterator, then):
                pass
            self.consumed += count * self.micro
            return count * self.micro
        skipped = sum(1 for _ in itertools.islice(self.iterator, count * self.micro))
        self.consumed += skipped
        return skipped

    def rewind(self, steps: int) -> bool:
        """After an interrupted or failed run: a resumable iterator set back
        to just after the batches of this call's first ``steps`` steps (those
        read ahead for a call that did not train, and those drawn by a read
        that failed midway, are given again by the same iterator); whether it
        was. Any failure leaves it as it is (the run's own error goes on)."""
        taken = steps * self.micro
        before = [n for n in self.states if n <= taken]
        if self.resumable is None or not before:
            return False
        at = max(before)
        try:
            self.resumable[1](self.states[at])
            if self.restart is not None:  # (PyTorch's StatefulDataLoader)
                self.iterator = iter(self.restart)
            for _ in itertools.islice(self.iterator, taken - at):
                pass
        except Exception:  # noqa: BLE001 - (not set back: the caller says so)
            return False
        self.consumed = taken
        return True

    def past(self, steps: int) -> int:
        """The batches taken past this call's first ``steps`` steps (read
        ahead for a call that did not train)."""
        return max(0, self.consumed - steps * self.micro)

    def keep_states(self) -> None:
        """Keep the iterator's states for checkpoints (a resumable one's):
        each is checked as it is taken, so that one a checkpoint cannot hold
        is refused before the first step."""
        self.saved = self.resumable is not None

    def state_at(self, steps: int) -> dict | None:
        """For a checkpoint's meta: the iterator's state after the batches of
        this call's first ``steps`` steps (batches taken ahead of the device
        not counted), encoded: ``{"data_state": ...}``, or the state before
        the chunk that step is in and the batches to draw after it
        (``"data_skip"``: a step inside a chunk, where a non-finite step
        stopped the call); None when it keeps none."""
        if not self.saved:
            return None
        taken = steps * self.micro
        if taken in self.states:  # (kept before the read from there: one that
            # failed midway has moved the iterator on)
            return {"data_state": encode_state(self.states[taken])}
        if taken == self.consumed:
            return {"data_state": encode_state(self.resumable[0]())}
        before = [n for n in self.states if n <= taken]
        if not before:
            return None
        at = max(before)
        found = {"data_state": encode_state(self.states[at])}
        return {**found, "data_skip": taken - at} if taken > at else found

    def take(self, count: int, length: int) -> tuple[Any, int] | None:
        """Up to ``count`` batches stacked on a new leading axis (host arrays),
        padded to ``length`` with zeros, and how many are real; None when done."""
        if self.resumable is not None:  # (before drawing: see rewind, state_at)
            self.states[self.consumed] = state = self.resumable[0]()
            if self.saved:  # (one a checkpoint cannot hold: refused now)
                encode_state(state)
            for old in sorted(self.states)[:-3]:
                del self.states[old]
        batches = [] if self.short else list(itertools.islice(self.iterator, count))
        columns = []
        for k, b in enumerate(batches):
            try:
                columns.append(self._leaves(b, self.consumed + k))
            except _Short as short:  # (an incomplete last batch: the data's end)
                warnings.warn(
                    errors.short_batch_ends(self.consumed + k, *short.args),
                    RuntimeWarning,
                    stacklevel=_caller.user_level(),
                )
                self.short, batches = True, batches[:k]
                break
        if not batches:
            return None
        self.consumed += len(batches)
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
        if rows and not self.from_list:
            sizes = {x.shape[:1] for x in leaves}
            if len(sizes) == 1 and all(
                x.ndim and x.dtype == d and x.shape[1:] == s[1:] and x.shape[0] < s[0]
                for x, (s, d) in zip(leaves, self.types)
            ):  # fewer examples, nothing else changed
                raise _Short(leaves[0].shape[0], self.types[0][0][0])
        if rows:
            raise errors.batch_shape_changed(index, rows, self.from_list)
        return leaves


class _Short(Exception):
    """A batch like the first but with fewer examples: ``(n, first's n)``."""


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
