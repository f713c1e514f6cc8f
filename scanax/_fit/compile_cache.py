"""Compiled programs kept on disk between processes: JAX's persistent compilation
cache, switched on for a directory of the user's choice.

Nothing is home-made: this sets JAX's own options (``jax_compilation_cache_dir``
and, while it still has JAX's default, the minimum compile time worth storing),
so every ``jax.jit`` program of the process is cached, not only scanax's. It never
overrides a cache directory the user already chose, never writes outside the
directory it reports, and never makes a run fail: a directory that cannot be
written gets one warning and the run goes on without a cache.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import jax

from .. import _caller
from .._errors import fit as errors

ENV = "SCANAX_COMPILE_CACHE"
# Programs that compiled faster than this are not stored (JAX's default is 1 s,
# which would skip fit's loop on small models).
MIN_COMPILE_SECONDS = 0.2
_JAX_DEFAULT_MIN_SECONDS = 1.0
_env_checked = False


def default_directory() -> str:
    """``$XDG_CACHE_HOME/scanax/jax``, else ``~/.cache/scanax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "scanax", "jax")


def compile_cache(directory: Any = None) -> str | None:
    """Keep compiled programs on disk, so that the next process running the same
    programs (a re-run script, the next seed of a sweep run as its own process)
    loads them instead of compiling.

    This switches on JAX's persistent compilation cache for the whole process
    (every ``jax.jit`` program, not only scanax's). Setting the environment
    variable ``SCANAX_COMPILE_CACHE`` does the same at the first ``scanax.fit``:
    ``1`` for the default directory, a path for that one, ``0`` (or nothing) for
    no cache.

    Arguments:
        directory: where to keep the programs. Default: ``$XDG_CACHE_HOME/scanax/
            jax`` (``~/.cache/scanax/jax``).

    Returns:
        The directory in use: the one JAX was already given if the user set
        ``jax_compilation_cache_dir`` before (it is never overridden), else
        ``directory``; None, with a warning, if it cannot be written.

    Programs with host callbacks (a progress bar updated from inside a loop,
    ``jax.debug.print``) are never stored: that is JAX's rule. ``scanax.fit`` on
    array data keeps its loop free of them.
    """
    chosen = jax.config.jax_compilation_cache_dir
    if chosen:
        return chosen
    path = os.fspath(directory or default_directory())
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        warning = errors.cache_dir_unusable(path, err)
        warnings.warn(warning, RuntimeWarning, stacklevel=_caller.user_level())
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
    if min_seconds == _JAX_DEFAULT_MIN_SECONDS:
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS
        )
    return path


def enable_from_env() -> None:
    """``compile_cache`` as ``SCANAX_COMPILE_CACHE`` asks, once per process."""
    global _env_checked
    if _env_checked:
        return
    _env_checked = True
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return
    compile_cache(None if value.lower() in ("1", "true", "yes", "on") else value)
