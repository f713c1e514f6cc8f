"""Where a warning points: the user's line, the first frame outside scanax and
the libraries it calls while it runs (JAX tracing, Flax, Equinox, Optax, Orbax),
found when the warning is raised instead of counted by hand; and whether a
user's function takes the arguments scanax will call it with."""

from __future__ import annotations

import inspect
import sys
from typing import Any

# Modules (by their __name__'s first part) whose frames a warning passes over.
_LIBRARIES = frozenset(
    {"scanax", "jax", "jaxlib", "flax", "equinox", "optax", "orbax", "contextlib"}
)


def user_level() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by this
    function's caller, point at the first frame outside scanax and the
    libraries above (``<frozen ...>`` import frames too)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _library(frame):
        frame, level = frame.f_back, level + 1
    return level


def _library(frame) -> bool:
    name = frame.f_globals.get("__name__") or ""
    return name.partition(".")[0] in _LIBRARIES or frame.f_code.co_filename.startswith(
        "<frozen"
    )


def signature_if_not_taking(fn: Any, n: int) -> str | None:
    """``fn``'s signature if it cannot be called with ``n`` positional
    arguments, else None (also where its signature cannot be read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (a builtin or a C function: not read)
        return None
    try:
        signature.bind(*range(n))
    except TypeError:
        return str(signature)
    return None
