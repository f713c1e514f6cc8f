"""How a compiled call of ``scanax.fit`` groups its steps (``Plan``): chunks of
``k`` steps on the global step grid, cut at events; how long a chunk is
(``chunk_length``: from the step's estimated cost, off CPU), and the periods on
which the host ends calls (``host_cuts``), which ``k`` is fitted into."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _backend


class Plan(NamedTuple):
    """How a call's steps are grouped (``chunk_length``): chunks of ``k``
    steps, each a ``lax.scan`` with a static trip count over the steps ``[b, b
    + k)`` of the global grid (``b`` a multiple of ``k``: step ``t`` always
    runs at position ``t % k``, the same arithmetic however calls split the
    steps). A chunk runs the steps of that window that are the call's, up to
    the first multiple of each in-loop event's period (``periods``:
    evaluation every, a rollout's collection; ``every``: the in-loop progress
    reports') and the call's end; the window's other steps run masked. ``k``
    1: one step per loop iteration."""

    k: int
    periods: tuple[int, ...] = ()

    def end(self, t: Any, stop: Any, every: Any = None) -> Any:
        """Where the chunk of the step ``t`` ends (the step after its last),
        in a call that ends at ``stop`` (traced values, or ints on the
        host)."""
        low = jnp.minimum if isinstance(t, jax.Array) else min
        end = low(t - t % self.k + self.k, stop)
        for p in (*self.periods, *(() if every is None else (every,))):
            end = low(end, t + p - t % p)
        return end

    def count(self, start: int, steps: int, every: int | None = None) -> int:
        """The chunks of a call of ``steps`` steps from global step ``start``
        (on the host: what stepwise execution dispatches)."""
        chunks, t, stop = 0, start, start + steps
        while t < stop:
            t, chunks = self.end(t, stop, every), chunks + 1
        return chunks


def chunked() -> bool:
    """Whether calls run their steps in chunks of ``k`` (``chunk_length``):
    off CPU. On CPU ``k`` is 1 (an iteration of XLA:CPU's dynamic loop costs
    no round trip) and no step is masked."""
    return _backend.platform() != "cpu"


def host_cuts(
    checkpoint_every: int | None, bar_every: int | None, steps_per_call: int | None
) -> tuple[int, ...]:
    """The periods on which the host ends calls or reports cut chunks (a
    checkpoint's ``every`` and the bar's, on the global step grid; the length
    of calls fit does not size, ``steps_per_call`` or the source's, from the
    call's start), for ``chunk_length`` to fit ``k`` into: a call that ends
    inside a chunk's window runs the window's other steps masked, so a chunk
    of 64 under checkpoints every 100 steps computed 128-192 steps per call of
    100. Empty on CPU, where ``k`` is 1 and the programs must not depend on
    them. (Calls fit sizes end on the chunks' grid: ``Schedule.want``; in-loop
    reports of no set ``every``, on multiples of ``k``: ``Run.every``.) Best
    effort: a call from a step off the grid (a continued model) or periods
    whose common divisor is small still cut chunks."""
    if not chunked():
        return ()
    return tuple(p for p in (checkpoint_every, bar_every, steps_per_call) if p)


# ``chunk_length``: a chunk of about this long amortises the round trip a loop
# iteration over chunks and its boundaries' conditionals cost on a GPU (~14 us
# each on an H200) to about 2%; a cut chunk wastes at most this long.
_CHUNK_SECONDS = 2e-3


_MAX_CHUNK = 256


# A rough step time from its cost (``_step_seconds``): sustained matmul
# throughput, memory bandwidth and a floor for a step's kernel launches, for
# an accelerator of the H100/H200 class (within a few times elsewhere: the
# chunk length only needs the order of magnitude).
_FLOPS_PER_SECOND = 1e14


_BYTES_PER_SECOND = 2e12


_MIN_STEP_SECONDS = 2e-5


def chunk_length(step: Any, periods: tuple[int, ...] = ()) -> int:
    """The steps per chunk of a call whose step is the jaxpr ``step``, off
    CPU (on CPU it is 1: an iteration of XLA:CPU's dynamic loop costs no
    round trip, and the masks of cut chunks measured 6-13% of a small MLP's
    step there).

    About ``_CHUNK_SECONDS`` of estimated steps (a power of two, at most
    ``_MAX_CHUNK``; 1 for a step of a few milliseconds or more, whose round
    trip is negligible), no more than the shortest period (an in-loop event,
    or where the host ends calls: ``host_cuts``; each cuts a chunk), and a
    divisor of the periods' greatest common
    divisor when one is at least half as long (then every chunk is whole). A
    step with a host callback (``jax.debug.print``, ``io_callback``) runs one
    step per chunk: a masked step would call it too."""
    if _has_callback(step):
        return 1
    seconds = _step_seconds(step)
    k = 1
    while k * 2 <= _MAX_CHUNK and k * 2 * seconds <= _CHUNK_SECONDS:
        k *= 2
    if periods:
        k = min(k, *periods)
        g = math.gcd(*periods)
        d = max(d for d in range(1, k + 1) if g % d == 0)
        if 2 * d >= k:
            k = d
    return k


def _has_callback(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` calls the host (``jax.debug.print``/``callback``,
    ``io_callback``, ``pure_callback``)."""
    return any(
        "callback" in eqn.primitive.name or eqn.primitive.name == "debug_print"
        for eqn in _equations(jaxpr)
    )


def _equations(jaxpr: Any) -> Any:
    """Every equation of ``jaxpr`` and of the jaxprs it holds."""
    return (eqn for eqn, _ in _counted(jaxpr, 1))


def _counted(jaxpr: Any, times: int) -> Any:
    """``(equation, how many times it runs per call of jaxpr)`` for every
    equation of ``jaxpr`` and of the jaxprs it holds (a scan's body: its
    length times)."""
    for eqn in jaxpr.eqns:
        yield eqn, times
        inner = times * int(eqn.params.get("length", 1) or 1)
        for sub in _subjaxprs(eqn.params):
            yield from _counted(sub, inner)


def _subjaxprs(params: dict) -> Any:
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # a ClosedJaxpr
                yield v.jaxpr
            elif hasattr(v, "eqns"):  # a Jaxpr
                yield v


def _step_seconds(jaxpr: Any) -> float:
    """A step's time on an accelerator, roughly: its matmuls' and
    convolutions' flops, or the bytes of its inputs (not the constants it
    closes over, as the data) read and written three times (the state, its
    update, the gradients), or a floor."""
    flops = 0.0
    for eqn, times in _counted(jaxpr, 1):
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in contract)
            flops += times * 2.0 * k * math.prod(eqn.outvars[0].aval.shape)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec
            window = math.prod(rhs[d] for d in spec[2:]) * rhs[spec[1]]
            flops += times * 2.0 * window * math.prod(eqn.outvars[0].aval.shape)
    size = sum(
        math.prod(v.aval.shape) * v.aval.dtype.itemsize
        for v in jaxpr.invars
        if hasattr(v.aval, "shape") and hasattr(v.aval.dtype, "itemsize")
    )
    return max(
        flops / _FLOPS_PER_SECOND, 3 * size / _BYTES_PER_SECOND, _MIN_STEP_SECONDS
    )
