"""What the processes of a ``jax.distributed`` job agree on in ``scanax.fit``.

Every process runs the same ``fit`` on a mesh that spans them; what each decides
on its own host (how many steps the next call runs: timed calls, the bar's
stops, an iterable that runs out; the arguments it was called with) is agreed
through the coordination service's key-value store (``agree``), so that every
process runs the same compiled calls. Only ``mesh.Placement`` calls these, with a
mesh.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import fit as errors, short_type

# How long a process waits for the others to reach the same point of a ``fit``
# (a dead process ends the job earlier: jax.distributed's heartbeats).
AGREE_TIMEOUT_MS = 10 * 60 * 1000


def processes(mesh: Any) -> tuple[int, ...]:
    """The processes whose devices make up ``mesh`` (one in a single process)."""
    return tuple(sorted({d.process_index for d in mesh.devices.flat}))


def bar_here(mesh: Any, spec: Any) -> Any:
    """The progress bar's spec where this process shows it: on a mesh that spans
    processes only the first of them does; None elsewhere."""
    procs = processes(mesh)
    if spec is None or len(procs) == 1 or jax.process_index() == procs[0]:
        return spec
    return None


_ROUNDS: collections.defaultdict = collections.defaultdict(itertools.count)


def agree(mesh: Any, value: str) -> list[str]:
    """Every process's ``value`` (in process order), where ``mesh`` spans
    processes; ``[value]`` otherwise. Host-side only (the coordination service of
    ``jax.distributed``): nothing is dispatched to the devices, so it cannot
    interleave with a running compiled call's collectives. Every process of the
    mesh must make the same sequence of calls (``fit`` does)."""
    procs = processes(mesh)
    if len(procs) == 1:
        return [value]
    from jax._src import distributed  # the client orbax uses too

    client = distributed.global_state.client
    me = jax.process_index()
    tag = "-".join(map(str, procs))
    r = next(_ROUNDS[procs])
    client.key_value_set(f"scanax/{tag}/{r}/{me}", value)
    out = []
    for p in procs:
        if p == me:
            out.append(value)
            continue
        try:
            got = client.blocking_key_value_get(
                f"scanax/{tag}/{r}/{p}", AGREE_TIMEOUT_MS
            )
        except Exception as err:  # noqa: BLE001 - a dead or stuck process
            raise errors.process_unreachable(p, AGREE_TIMEOUT_MS // 1000) from err
        out.append(got)
    if r >= 2:  # every process has read round r - 2 once any reaches round r
        client.key_value_delete(f"scanax/{tag}/{r - 2}/{me}")
    return out


def fewest(mesh: Any, count: int) -> int:
    """The smallest ``count`` of all processes of ``mesh`` (steps of the next
    call: every process must run the same compiled calls)."""
    return min(int(v) for v in agree(mesh, str(int(count))))


def check_processes(mesh: Any, data: Any, **arguments: Any) -> None:
    """Every process of ``mesh`` called ``fit`` with the same ``arguments``
    (hyperparameters, the key) and array ``data`` of the same shapes, or an error
    naming the differences, in every process."""
    if len(processes(mesh)) == 1:
        return
    arguments = {**arguments, "data": describe_data(data)}
    mine = json.dumps({k: _plain(v) for k, v in arguments.items()}, sort_keys=True)
    everyone = [json.loads(v) for v in agree(mesh, mine)]
    first = everyone[0]
    rows = [
        (name, [seen.get(name) for seen in everyone])
        for name in first
        if any(seen.get(name) != first[name] for seen in everyone)
    ]
    if rows:
        raise errors.processes_differ(processes(mesh), rows)


def _plain(value: Any) -> Any:
    """A JSON-able description of an argument: arrays by type and shape."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):  # a key: its words
            value = jax.random.key_data(value)
            if value.is_fully_addressable:
                return np.asarray(value).ravel().tolist()
        return short_type(value)
    return type(value).__name__


def describe_data(data: Any) -> Any:
    """Array data by leaf path and type (compared across processes); an iterable
    by its type only (each process yields its own batches)."""
    if isinstance(data, list):
        return "list"
    leaves = jtu.tree_flatten_with_path(data)[0]
    if not all(hasattr(x, "shape") for _, x in leaves):
        return type(data).__name__
    return {jtu.keystr(p): short_type(x) for p, x in leaves}


def write_atomically(path: str, text: str) -> None:
    """``text`` written to ``path`` whole: a temporary file of this process
    renamed into place (removed if the write fails); those of processes
    killed between the two (kill -9) are removed after."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", newline="") as f:  # (as written: no translation)
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    remove_stale(os.path.dirname(path) or ".", os.path.basename(path) + ".tmp")


def remove_stale(directory: str, prefix: str) -> None:
    """Remove the files ``prefix`` + a process id in ``directory`` whose
    process is dead: temporary files of a process killed (kill -9) between
    writing them and renaming them into place."""
    for name in os.listdir(directory):
        pid = name[len(prefix) :]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True
