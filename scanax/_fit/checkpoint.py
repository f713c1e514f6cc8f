"""Checkpoints for ``scanax.fit``: the complete training state, saved with orbax.

A checkpoint holds every array of the training state (for NNX: everything
``nnx.split((model, optimizer))`` returns, so Params, optimizer state, step counts,
RNG keys and counts, BatchNorm statistics), the shuffle key, the number of steps
done (which is also the data position: step ``t`` always uses the same batch) and
the history so far. Orbax writes each checkpoint to a temporary directory and
renames it when complete, so a process killed mid-save leaves the previous
checkpoints intact; the newest few are kept.

One orbax save at a time in a process (``_ORBAX``): orbax numbers its
operations with one process-wide counter, and a best-only store saving on its
own thread while a checkpoint's asynchronous save was still writing made the
two wait for each other's signals (a save timed out after 300 s, or the process
exited while writes were still running). A store's asynchronous save is
finished (``_finish_others``) before another store saves, and a store's
directories are created before ``save`` returns (a directory that cannot be
written fails there, not in a thread the interpreter then waits for at exit).
A failed save is raised naming the step and the newest complete checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import _caller
from .._errors import checkpoint as errors
from . import processes as _processes

_FORMAT = 1
KEEP = 3
# Held around every orbax call that writes or waits, in every thread; the
# stores with an asynchronous save still writing.
_ORBAX = threading.RLock()
_IN_FLIGHT: set = set()


def local_directory(path: str, refuse: Any) -> str:
    """``path`` absolute, with ``~`` expanded; a URL (``gs://bucket/run``) is
    ``refuse(path)``: scanax writes its index and reads its directories with
    Python's ``os``, which would take the URL for a relative path and fail
    at the first save, after training had started."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path):
        raise refuse(path)
    return os.path.abspath(os.path.expanduser(path))


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise errors.no_orbax() from err
    return ocp


def require_orbax(option: str) -> None:
    """Refuse ``option`` (``"best_dir"``) without orbax, without importing it
    (the import, a fifth of a second, is left to the thread that writes)."""
    try:
        found = importlib.util.find_spec("orbax.checkpoint") is not None
    except ImportError:
        found = False
    if not found:
        raise errors.no_orbax(option)


def is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def describe(x: Any) -> list:
    """``[shape, dtype]`` of a leaf as saved (keys are saved as their key data)."""
    if is_key(x):
        data = jr.key_data(x)
        return [list(data.shape), f"key<{jr.key_impl(x)}>"]
    return [list(x.shape), np.dtype(x.dtype).name]


def _same_kind_of_key(saved: list, given: list) -> bool:
    """Two keys' descriptions: equal, or a raw key (``jax.random.PRNGKey``) and
    a typed key of the default implementation (``jax.random.key``) with key
    data of its shape: the same bits, the same shuffle and per-step keys."""
    typed = describe(jr.key(0))
    raw = [typed[0], "uint32"]
    return saved == given or [saved, given] in ([typed, raw], [raw, typed])


def _short(desc: list) -> str:
    shape, dtype = desc
    return f"{dtype}[{', '.join(map(str, shape))}]"


class Checkpoints:
    """Save and restore ``fit``'s training state in ``directory``.

    Reading changes nothing on disk: the directory is created, and a killed
    save's temporary folders cleaned up, by the first save (so that a call
    refused before its first step leaves the directory as it was)."""

    def __init__(
        self,
        directory: Any,
        every: int,
        names: list[str],
        data: dict,
        start: int,
        keep: int | None = None,
    ):
        ocp = _ocp()
        # A best-only store (``keep=1``): saves numbered 1, 2, ... (the step in
        # each one's meta), the newest kept once it is written.
        self.keep = keep
        self.call = "scanax.fit"  # (who reads it, for messages)
        self.ocp = ocp
        self.directory = local_directory(os.fspath(directory), errors.remote_dir)
        self.every = every
        self.names = names
        self.data = data
        self.start = start  # the step this call started from
        self.reader = None
        if os.path.isdir(self.directory):
            options = ocp.CheckpointManagerOptions(
                create=False, cleanup_tmp_directories=False
            )
            with _ORBAX:
                _finish_others(self)
                self.reader = ocp.CheckpointManager(
                    self.directory, options=options, item_names=_ITEMS
                )
        self.manager = None  # the writer, made by the first save
        self.last_saved = None
        self.writing: int | None = None  # the step an asynchronous save writes
        self.failed: BaseException | None = None  # its error, seen by another
        self.data_state: Any = None  # the data iterator's, of the checkpoint restored
        self.data_skip = 0  # and the batches to draw after setting it
        self.starts = _read_index(self.directory)  # step -> its call's start

    # ------------------------------------------------------------------ save

    def _writer(self) -> Any:
        if self.manager is None:
            if self.reader is not None:
                self.reader.close()
                self.reader = None
            # A best-only store writes synchronously (on its own thread, see
            # ``_best.BestWriter``): no finalize thread of orbax's.
            options = self.ocp.CheckpointManagerOptions(
                max_to_keep=None,
                create=True,
                cleanup_tmp_directories=True,
                enable_async_checkpointing=self.keep is None,
                # (made before save returns: see the module's docstring)
                async_options=self.ocp.options.AsyncOptions(
                    create_directories_asynchronously=False
                ),
            )
            self.manager = self.ocp.CheckpointManager(
                self.directory, options=options, item_names=_ITEMS
            )
        return self.manager

    def save(
        self, step: int, leaves: list, key: Any, history: dict, data: Any = None
    ) -> None:
        """Save checkpoint ``step``; ``data``: the data iterator's state then
        (``IterSource.state_at``'s meta entries), if it keeps one. A best-only
        store saves whatever it is given (its caller knows what changed)."""
        if self.keep is None and step in (self.last_saved, 0, self.start):
            # (saved or restored already, or nothing trained: a call that ran
            # no step, an exhausted iterator's or a first step's NaN, would
            # replace the checkpoint its model came from with an empty history)
            return
        saved = [jr.key_data(x) if is_key(x) else x for x in leaves]
        # (orbax saves no zero-size array: an empty leaf is rebuilt from its
        # type on restore, an empty history entry from the meta)
        state = {"leaves": [x for x in saved if x.size], "key": _key_data(key)}
        empty = {k: describe(v) for k, v in history.items() if not np.size(v)}
        meta = {
            "format": _FORMAT,
            "step": int(step),
            "leaves": [[n, *describe(x)] for n, x in zip(self.names, leaves)],
            "data": self.data,
            "empty_history": empty,
            "key": describe(key),
            "call_start": int(self.start),
        }
        if data is not None:
            meta.update(data)
        with _ORBAX:
            self._raise_failed()
            _finish_others(self)
            try:
                self._save(int(step), state, history, empty, meta)
            except (OSError, ValueError, RuntimeError) as err:
                raise self._failure(int(step), err) from err
        self.last_saved = step

    def _save(self, step: int, state: dict, history: dict, empty: dict, meta: dict):
        ocp = self.ocp
        manager = self._writer()
        slot = step
        if self.keep is None:
            self._finish()  # (a failure: the step that failed is named)
            self._prune(manager, slot)
        else:  # a best-only store: numbered by save, the newest kept once written
            slot = max(manager.all_steps(), default=0) + 1
        self.writing = step
        manager.save(
            slot,
            # (orbax skips, silently, a step at or before the newest on disk:
            # ours replaces what a longer run wrote, see ``_prune``)
            force=True,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                history=ocp.args.StandardSave(
                    {k: v for k, v in history.items() if k not in empty}
                ),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        if self.keep is None:
            _IN_FLIGHT.add(self)
            return
        manager.wait_until_finished()  # (a kill before this leaves the older too)
        self.writing = None
        for old in sorted(manager.all_steps())[: -self.keep]:
            manager.delete(old)

    def _finish(self) -> None:
        """Wait for this store's asynchronous save (its error raised)."""
        _IN_FLIGHT.discard(self)
        if self.manager is not None and self.writing is not None:
            self.manager.wait_until_finished()
        self.writing = None

    def _raise_failed(self) -> None:
        """Raise the error of a save that another store's wait saw fail."""
        failed, self.failed = self.failed, None
        if failed is not None:
            raise failed

    def _failure(self, step: int, err: BaseException) -> OSError:
        """The error of a failed save of ``step`` (the asynchronous one still
        writing, if that one failed): which step, the newest complete one."""
        step = self.writing if self.writing is not None else step
        self.writing = None
        _IN_FLIGHT.discard(self)
        try:
            complete = [s for s in self.manager.all_steps() if s != step]
        except Exception:  # noqa: BLE001 - (the directory unreadable too)
            complete = []
        if self.keep is None:
            newest = max(complete, default=None)
        else:  # (a best-only store's numbers are its saves')
            newest = "the previous best" if complete else None
        return errors.save_failed(
            self.directory, step, err, newest, best=self.keep is not None
        )

    def _prune(self, manager: Any, step: int) -> None:
        """Before saving ``step``: delete the checkpoints that are neither among
        the newest ``KEEP`` nor the newest of the call that wrote them (each
        call's last checkpoint is kept, so that an epoch loop restarted from
        the top finds every call's end), and record ``step`` in the index.
        A checkpoint already at ``step`` (a run with other calls wrote it, or
        one this call did not restore) is replaced: the index then credits the
        checkpoint at ``step`` to the call that wrote it."""
        if step in manager.all_steps():
            manager.delete(step)
        self.starts[step] = self.start
        steps = sorted({*manager.all_steps(), step})
        keep = set(steps[-KEEP:])
        newest: dict[int, int] = {}
        for s in steps:
            if s in self.starts:
                newest[self.starts[s]] = s
        keep |= set(newest.values())
        for s in steps:
            if s not in keep and s != step:
                manager.delete(s)
                self.starts.pop(s, None)
        self.starts = {s: c for s, c in self.starts.items() if s in keep}
        if jax.process_index() == 0:
            _write_index(self.directory, self.starts)

    def close(self) -> None:
        """Wait for the last save and close (a failed save raised, named, once
        both are closed); a second call does nothing."""
        error = None
        with _ORBAX:
            try:
                self._raise_failed()
                self._finish()
            except (OSError, ValueError, RuntimeError) as err:
                error = self._failure(-1, err)
                error.__cause__ = err
            managers, self.manager = (self.manager, self.reader), None
            self.reader = None
            for manager in managers:
                if manager is not None:
                    try:
                        manager.close()
                    except Exception as err:  # noqa: BLE001 - the save's is raised
                        error = error or self._failure(-1, err)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ restore

    def _steps(self) -> list[int]:
        return [] if self.reader is None else list(self.reader.all_steps())

    def steps_after(self, end: int) -> list[int]:
        """The saved steps past ``end``, oldest first."""
        return sorted(s for s in self._steps() if s > end)

    def restore(
        self, leaves: list, key: Any, at_most: int, start: int = 0
    ) -> tuple[int, list, Any, dict] | None:
        """``(step, leaves, key, history)`` from the newest readable checkpoint
        at or before step ``at_most`` that fits ``leaves``, or None when there is
        none. An unreadable (corrupt, partial) checkpoint is skipped with a
        warning (the last one says that training starts from ``start``, the
        model as given); one from another model is an error."""
        steps = sorted((s for s in self._steps() if s <= at_most), reverse=True)
        # A call restarted (an epoch loop run again from the top) resumes from
        # its own checkpoints first: a later call's may lie within its steps
        # too when calls end early (an early stop, a NaN, an iterable's end).
        own = [s for s in steps if self.starts.get(s) == self.start and s > start]
        steps = own + [s for s in steps if s not in own]
        with _ORBAX:
            _finish_others(self)
            return self._restore(steps, leaves, key, start)

    def _restore(self, steps: list, leaves: list, key: Any, start: int) -> Any:
        for i, step in enumerate(steps):
            try:
                meta = self.reader.restore(
                    step, args=self.ocp.args.Composite(meta=self.ocp.args.JsonRestore())
                )["meta"]
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint
                self._skip(step, err, i == len(steps) - 1, start)
                continue
            self._check(step, meta, leaves, key)
            try:
                restored, new_key, history = self._read(step, meta, leaves, key)
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint
                self._skip(step, err, i == len(steps) - 1, start)
                continue
            self.data_state = meta.get("data_state")
            self.data_skip = int(meta.get("data_skip", 0))
            self.last_saved = int(meta["step"])  # (on disk: not saved again)
            return int(meta["step"]), restored, new_key, history
        return None

    def newest_meta(self) -> dict | None:
        """The meta of the newest checkpoint whose meta reads, or None."""
        ocp = self.ocp
        with _ORBAX:
            _finish_others(self)
            return self._newest_meta(ocp)

    def _newest_meta(self, ocp: Any) -> dict | None:
        for step in sorted(self._steps(), reverse=True):
            try:
                out = self.reader.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )
            except Exception:  # noqa: BLE001 - ``restore`` warns about it
                continue
            return out["meta"]
        return None

    def _read(self, step: int, meta: dict, leaves: list, key: Any) -> tuple:
        """The leaves, key and history of checkpoint ``step``."""
        ocp = self.ocp
        abstract = {
            "leaves": [_abstract(x) for x in leaves if _size(x)],
            "key": _abstract_key(key),
        }
        out = self.reader.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                history=ocp.args.StandardRestore(),
            ),
        )
        stored = iter(out["state"]["leaves"])
        restored = []
        for t in leaves:
            r = next(stored) if _size(t) else np.zeros(t.shape, _stored_dtype(t))
            restored.append(
                jr.wrap_key_data(r, impl=jr.key_impl(t)) if is_key(t) else r
            )
        new_key = _wrap_key(out["state"]["key"], key)
        history = {k: np.asarray(v) for k, v in (out["history"] or {}).items()}
        for name, (shape, dtype) in meta.get("empty_history", {}).items():
            history[name] = np.zeros(shape, dtype)
        _check_restored(step, restored, leaves, self.names)
        return restored, new_key, history

    def _skip(self, step: int, err: Exception, last: bool, start: int) -> None:
        warnings.warn(
            errors.checkpoint_unreadable(step, self.directory, err, last, start),
            RuntimeWarning,
            stacklevel=_caller.user_level(),
        )

    def _check(self, step: int, meta: dict, leaves: list, key: Any) -> None:
        best = self.keep is not None  # (its saves are numbered: the step is meta's)
        at = errors.checkpoint_at(
            meta.get("step", step) if best else step, self.directory, self.call, best
        )
        if meta.get("format") != _FORMAT:
            raise errors.checkpoint_format(at, meta.get("format"), _FORMAT)
        saved = {have[0]: have[1:] for have in meta["leaves"]}
        want = {n: list(describe(x)) for n, x in zip(self.names, leaves, strict=True)}
        only_saved = [n for n in saved if n not in want]
        only_here = [n for n in want if n not in saved]
        if only_saved or only_here:
            raise errors.checkpoint_leaves_differ(at, only_saved, only_here)
        for name, types in want.items():
            if saved[name] != types:
                raise errors.checkpoint_mismatch(
                    at, name, _short(saved[name]), _short(types)
                )
        if list(saved) != self.names:  # the same leaves in another order
            raise errors.checkpoint_mismatch(
                at, "order", ", ".join(saved), ", ".join(self.names)
            )
        if "key" in meta and not _same_kind_of_key(meta["key"], describe(key)):
            raise errors.checkpoint_key_differs(
                at, _short(meta["key"]), _short(describe(key))
            )
        if meta["data"] != self.data:
            raise errors.checkpoint_other_data(at, meta["data"], self.data)


_ITEMS = ("state", "history", "meta")
_INDEX = "scanax-calls.json"  # step -> the step its call started from


def _read_index(directory: str) -> dict[int, int]:
    try:
        with open(os.path.join(directory, _INDEX)) as f:
            return {int(k): int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}


def _write_index(directory: str, starts: dict[int, int]) -> None:
    """Written whole, atomically (``_processes.write_atomically``)."""
    text = json.dumps({str(k): v for k, v in sorted(starts.items())})
    _processes.write_atomically(os.path.join(directory, _INDEX), text)


def _finish_others(store: Checkpoints) -> None:
    """Finish every other store's asynchronous save (``_ORBAX`` held): one
    orbax save at a time. A failure is kept for its own store to raise."""
    for other in list(_IN_FLIGHT):
        if other is store:
            continue
        try:
            other._finish()
        except (OSError, ValueError, RuntimeError) as err:
            other.failed = other._failure(-1, err)
            other.failed.__cause__ = err


def _size(x: Any) -> int:
    """The number of stored elements of a leaf (a key's: its key data's)."""
    return int(np.prod(jr.key_data(x).shape if is_key(x) else x.shape))


def _stored_dtype(x: Any) -> Any:
    return jr.key_data(x).dtype if is_key(x) else x.dtype


def _key_data(key: Any) -> Any:
    return jr.key_data(key) if is_key(key) else key


def _wrap_key(data: Any, template: Any) -> Any:
    if is_key(template):
        return jr.wrap_key_data(data, impl=jr.key_impl(template))
    return jnp.asarray(data, template.dtype)


def _abstract(x: Any) -> Any:
    if is_key(x):
        x = jr.key_data(x)
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _abstract_key(key: Any) -> Any:
    return _abstract(key)


def _check_restored(step: int, restored: list, leaves: list, names: list) -> None:
    """Orbax must give back the exact types (it drops ``weak_type``: we never use
    weak types in the state, so a restored carry has the type of a fresh one)."""
    for name, r, t in zip(names, restored, leaves):
        if r.shape != t.shape or r.dtype != t.dtype:
            raise errors.restored_type(step, name, r, t)


def strong(leaves: list) -> list:
    """The state as the loop carries it: JAX arrays in JAX's default dtypes (a
    float64 NumPy array is float32 unless x64 is on; a Python int is int32), with
    weak types dropped (a carry must keep its type; restored checkpoints lose them).
    Checkpoints are written and checked in these types. A host value (a
    ``TrainState``'s first ``step``) is typed on the host and put in one
    transfer (not a transfer and a conversion), a fresh array each call: a
    state fit gives back may be donated by the user's code."""
    out = []
    for x in leaves:
        if hasattr(x, "__jax_array__") and not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        elif not isinstance(x, jax.Array):
            host = np.asarray(x)
            x = jax.device_put(host.astype(jax.dtypes.canonicalize_dtype(host.dtype)))
        # (a JAX array already strong as it is: no ``jnp.asarray``, ~10 us each)
        out.append(jnp.asarray(x, x.dtype) if getattr(x, "weak_type", False) else x)
    return out
