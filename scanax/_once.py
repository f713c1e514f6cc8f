"""Work that runs only where it is due, inside a compiled loop: ``once_if``, a
``lax.cond``, or, inside ``branch_free(True)``, a loop of at most one trip.

A ``lax.cond`` in a loop's body changes how XLA:TPU places the loop's state. Its
memory-space assignment keeps a small model's whole training state in on-chip
memory across the loop only when the loop holds no conditional, and a
conditional at a boundary every 64 steps moves that state to HBM for every
step. Measured on one TPU v5e (jax 0.10.2), the 784-256-10 MLP, chunks of 64
steps, per step relative to the same loop without the work: a ``lax.cond``
evaluating every 128 steps 1.82× (1.40× for a 32-32-1 MLP); the same
evaluation in a ``while_loop`` of zero or one trip 0.99× (0.99×). Nesting does
not help: the cond in an outer loop over inner loops of chunks costs the same.
On a GPU each costs one predicate read on the host where it runs.

Where the boundary comes every step (fit's calls on CPU, and elsewhere a step
too long to chunk) the loop is the slower: on XLA:CPU, fit with an evaluation
every 100 steps and ``EarlyStop``, 1000 steps, the one-trip loop took 1.52×
(32-32-1 MLP) and 1.23× (784-256-10) the cond's time (it carries the state
through the loop each step). So ``scanax.fit``'s loop over chunks traces its
boundaries inside ``branch_free(k > 1)``; everything else keeps ``lax.cond``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

_STATE = threading.local()


@contextlib.contextmanager
def branch_free(on: bool) -> Iterator[None]:
    """While tracing inside: ``once_if`` is a loop of at most one trip
    (``on``) or a ``lax.cond`` (not ``on``; the default outside)."""
    before = getattr(_STATE, "on", False)
    _STATE.on = on
    try:
        yield
    finally:
        _STATE.on = before


def once_if(
    due: Any, work: Callable[..., Any], skip: Callable[..., Any], *args: Any
) -> Any:
    """``work(*args)`` where ``due`` (a traced bool scalar) is true, else
    ``skip(*args)`` (the same shapes and dtypes): ``lax.cond(due, work, skip,
    *args)``, or inside ``branch_free(True)`` a ``lax.while_loop`` of at most
    one trip that starts from ``skip(*args)`` (no conditional: see the
    module's docstring)."""
    if not getattr(_STATE, "on", False):
        return jax.lax.cond(due, work, skip, *args)

    def body(state: tuple) -> tuple:
        return jnp.zeros((), bool), work(*args)

    init = (jnp.asarray(due), skip(*args))
    return jax.lax.while_loop(lambda s: s[0], body, init)[1]
