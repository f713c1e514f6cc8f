"""Where scanax meets its user's code: where a warning points (the user's
line, the first frame outside scanax and the libraries it calls while it runs:
JAX tracing, Flax, Equinox, Optax, Orbax, found when the warning is raised
instead of counted by hand), whether a user's function takes the arguments
scanax will call it with, and whether its error may be about its input."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax

from . import _nnx

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


def positional(count: int, refuse: Callable[[tuple], Exception]) -> Callable:
    """A decorator for a public function taking ``count`` positional arguments:
    a call with more raises ``refuse(the extra ones)`` instead of Python's bare
    count; its signature (``inspect.signature``, the API reference) stays the
    function's own."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > count:
                raise refuse(args[count:])
            return fn(*args, **kwargs)

        return call

    return wrap


def cannot_bind(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """``(fn's signature, why)`` where ``fn`` cannot be called with these
    arguments; None where it can, or where its signature cannot be read (a
    builtin: called as it is)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        return str(signature), str(err)
    return None


def about_the_input(err: Exception) -> bool:
    """Whether an error a user's function raised while it was traced may come
    from the input scanax gave it (so the call raises it again naming that
    input, the original chained): not JAX's own about tracing, not scanax's,
    not NNX's refusal of a Variable from another trace."""
    text = str(err.args[0]) if err.args else ""
    if isinstance(err, (jax.errors.JAXTypeError, jax.errors.JAXIndexError)):
        return False
    return not text.startswith("scanax") and not _nnx.is_trace_level_error(err)
