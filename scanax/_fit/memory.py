"""Memory a compiled call needs next to what its devices have free: how a
population decides, before it runs, to train in groups (``fit``'s automatic
``members_per_call``)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

# A call may use this share of the free memory (the rest: history copies on
# the host, fragmentation, what other code allocates meanwhile).
SHARE = 0.85


# What each compiled program needs (asking XLA takes milliseconds; a program
# lives as long as fit's cache keeps it).
_NEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_bytes(compiled: Any) -> int | None:
    """Bytes a call of ``compiled`` allocates per device beyond its arguments
    (outputs not aliased to an argument, and XLA's temporaries); None where the
    backend does not say."""
    try:
        return _NEEDS[compiled]
    except (KeyError, TypeError):
        pass
    need = _ask(compiled)
    with contextlib.suppress(TypeError):  # (not weakly referable: asked again)
        _NEEDS[compiled] = need
    return need


def _ask(compiled: Any) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without it: no estimate
        return None
    if stats is None:
        return None
    out = getattr(stats, "output_size_in_bytes", None)
    temp = getattr(stats, "temp_size_in_bytes", None)
    if out is None or temp is None:
        return None
    need = int(out) - int(getattr(stats, "alias_size_in_bytes", 0)) + int(temp)
    # The larger of the two counts what either backend says (``peak_beyond``).
    return max(need, peak_beyond(stats))


def peak_beyond(stats: Any) -> int:
    """XLA's peak memory beyond a program's arguments (0 where not reported).
    XLA:TPU reports no temporaries (0 on a v5e, 2026-12-06) but a peak that
    holds them and the arguments; XLA:CPU's peak holds arguments and outputs
    alone."""
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    return peak - int(getattr(stats, "argument_size_in_bytes", 0) or 0)


def free_bytes(devices: list) -> int | None:
    """The memory free for a call on ``devices`` (bytes, per device): the
    accelerator's allocator limit less what is in use, the smallest over the
    devices; on CPU the system's available memory shared by the devices. None
    where neither is known."""
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - no allocator statistics
            stats = None
        if stats and "bytes_limit" in stats:
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    if free:
        return min(free)
    if devices and all(d.platform == "cpu" for d in devices):
        available = _available_ram()
        return None if available is None else available // len(devices)
    return None


def _available_ram() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def members_that_fit(k: int, need: int, free: int, multiple: int = 1) -> int:
    """How many members of a call that needs ``need`` bytes for ``k`` members fit
    in ``SHARE`` of ``free`` (the need taken as proportional to the members), a
    multiple of ``multiple`` (a mesh's members axis); 0 if not even that many."""
    per_member = need / k
    fit = int(SHARE * free // per_member) if per_member > 0 else k
    return min(k, fit) // multiple * multiple


def fits(need: int, free: int) -> bool:
    return need <= SHARE * free
