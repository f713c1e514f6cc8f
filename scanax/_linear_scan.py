"""``scanax.linear_scan``: diagonal linear recurrences ``h_t = a_t * h_{t-1} + b_t``.

One body (``_core``) normalises a call: everything cast to the accumulation dtype,
resets and padding folded into ``a`` and ``b`` (a reset step has ``a_t = 0``; a
padding step has ``a_t = 1, b_t = 0``, so it holds the state), time moved to axis 0
(``time_major``: but for the associative scan off CPU). Three
interchangeable methods then run the recurrence in scan order: a ``lax.scan``
(``_sequential``), ``lax.associative_scan`` with the ``(a, b)`` monoid
(``_associative``), and a scan within chunks followed by a short scan over the chunk
carries and a correction (``_chunked``). ``resolve_method`` is the ``"auto"`` rule.
"""

from __future__ import annotations

import functools as ft
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _backend, _tree
from ._errors import linear as errors, seq_lengths_range

METHODS = ("auto", "sequential", "associative", "chunked")

# "auto" on a TPU: the chunked scan from this many steps (on a TPU v5e the
# fastest method at T 1k and 4k, forward and gradient: 0.84-0.97x lax.scan, the
# associative scan 1.3-2.5x).
TPU_CHUNKED_FROM = 256
# "auto" on a GPU: the associative scan while its gradient's working set, this
# many arrays of b's shape in the accumulation dtype (XLA's buffers for the
# gradient of a [T, 1024, 16] float32 call at T = 1k and 4k: 8 temporaries, plus
# a, b and h), takes at most this share of the device's memory; else chunked
# (3 temporaries). See docs/long_scans.md.
ASSOCIATIVE_ARRAYS = 11
ASSOCIATIVE_SHARE = 0.25
# A device that does not tell its memory is taken to have this much.
UNKNOWN_DEVICE_BYTES = 16 * 2**30


class Dtypes(NamedTuple):
    """The dtype a call accumulates in and the dtype it returns."""

    acc: Any
    out: Any


# ---------------------------------------------------------------------------- checks


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _complex_of(dtype: Any) -> Any:
    """The complex dtype of ``dtype``'s precision (complex64 for 16-bit floats)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(dtype)
    bits = jnp.finfo(dtype).bits
    return jax.dtypes.canonicalize_dtype(jnp.complex128 if bits > 32 else jnp.complex64)


def _real_of(dtype: Any) -> Any:
    return np.dtype(jnp.finfo(dtype).dtype)


def dtypes(a: Any, b: Any, h0: Any, acc_dtype: Any) -> Dtypes:
    """``acc``: the widest real precision of ``acc_dtype``, ``a``, ``b`` and ``h0``
    (``acc_dtype`` on a tie), complex if any of ``a``, ``b``, ``h0`` is. ``out``:
    ``b``'s dtype, complex of ``b``'s precision if ``a`` or ``h0`` is complex."""
    given = [x.dtype for x in (a, b, h0) if x is not None]
    acc = jax.dtypes.canonicalize_dtype(_real_of(acc_dtype))
    for dt in given:
        real = jax.dtypes.canonicalize_dtype(_real_of(dt))
        if jnp.finfo(real).bits > jnp.finfo(acc).bits:
            acc = real
    is_complex = [jnp.issubdtype(dt, jnp.complexfloating) for dt in given]
    if any(is_complex):
        acc = _complex_of(acc)
    out = jax.dtypes.canonicalize_dtype(b.dtype)  # (float64 NumPy input, x64 off)
    if any(is_complex) and not jnp.issubdtype(out, jnp.complexfloating):
        out = _complex_of(out)
    return Dtypes(acc, out)


def _as_array(x: Any, like: Any, acc_dtype: Any) -> Any:
    """Python numbers as arrays of the accumulation's real (or complex)
    precision: ``like``'s or ``acc_dtype``'s, the wider (a decay of 0.999 with
    bfloat16 ``b`` is not rounded to bfloat16's 1.0)."""
    if isinstance(x, (int, float, complex)) and not isinstance(x, bool):
        real = _real_of(dtypes(like, like, None, acc_dtype).acc)
        return jnp.asarray(x, _complex_of(real) if isinstance(x, complex) else real)
    return x


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, to) == to
    except ValueError:
        return False


def _check_a(a: Any, b: Any, axis: int) -> None:
    if not _is_array(a) or not _inexact(a):
        raise errors.a_type(a)
    if _broadcasts(a.shape, b.shape):
        # (aligned on the last axis, an `a` of 2+ axes short of the time axis
        # whose first is T long is read without time: per-batch where T == B)
        t = b.shape[axis]
        if 2 <= a.ndim < b.ndim - axis and a.shape[0] == t > 1:
            raise errors.a_ambiguous(a, b, axis)
        # (an `a` that lines up with time but, lacking it, would fit b without
        # its time axis: per sequence where a batch axis is as long as time)
        if b.ndim - axis <= a.ndim < b.ndim and a.ndim >= 2:
            at_time = a.shape[axis - (b.ndim - a.ndim)]
            timeless = b.shape[:axis] + b.shape[axis + 1 :]
            if at_time == t > 1 and _broadcasts(a.shape, timeless):
                raise errors.a_per_step_or_not(a, b, axis)
        return
    d = b.shape[-1]
    square = a.ndim >= 2 and a.shape[-2:] == (d, d)
    if square and (a.ndim > b.ndim or a.shape[-2] != b.shape[-2]):
        raise errors.a_not_diagonal(a, b, axis)
    raise errors.a_shape(a, b, axis)


def _leading_fit(x: Any, shape: tuple[int, ...]) -> bool:
    """``x``'s shape is a leading part of ``shape``, each axis equal or 1."""
    return x.ndim <= len(shape) and all(
        n in (1, m) for n, m in zip(x.shape, shape, strict=False)
    )


def _check(a, b, h0, axis, reset, seq_lengths, method, chunk, acc_dtype):
    """Validate a call before anything is traced; returns ``(a, axis,
    seq_lengths)`` with Python numbers and lists made arrays, ``axis`` made positive."""
    if not _is_array(b) or not _inexact(b) or b.ndim < 1:
        raise errors.b_type(b)
    if isinstance(axis, bool):
        raise errors.bad_axis(axis, b)
    try:
        ax = operator.index(axis)
    except TypeError as err:
        raise errors.bad_axis(axis, b) from err
    if not -b.ndim <= ax < b.ndim:
        raise errors.bad_axis(axis, b)
    ax %= b.ndim
    a = _as_array(a, b, acc_dtype)
    _check_a(a, b, ax)
    if h0 is not None:
        if not _is_array(h0) or not _inexact(h0):
            raise errors.h0_type(h0)
        want = b.shape[:ax] + b.shape[ax + 1 :]
        if tuple(h0.shape) != want:
            raise errors.h0_shape(h0, want, b, ax)
    if reset is not None:
        if not _is_array(reset) or reset.dtype != jnp.bool_:
            raise errors.reset_type(reset)
        if reset.ndim <= ax or not _leading_fit(reset, b.shape):
            raise errors.reset_shape(reset, b, ax)
    if seq_lengths is not None:
        if not _is_array(seq_lengths):
            seq_lengths = np.asarray(seq_lengths)
        if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
            raise errors.seq_lengths_type(seq_lengths)
        if not _leading_fit(seq_lengths, b.shape[:ax] + b.shape[ax + 1 :]):
            raise errors.seq_lengths_shape(seq_lengths, b, ax)
        bad = _tree.out_of_range(seq_lengths, b.shape[ax])
        if bad is not None:
            raise seq_lengths_range(errors.CALL, *bad, b.shape[ax])
    if not isinstance(method, str) or method not in METHODS:
        raise errors.bad_method(method, METHODS)
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise errors.bad_chunk(chunk)
        if method not in ("auto", "chunked"):
            raise errors.chunk_unused(method)
    try:
        real = jnp.issubdtype(acc_dtype, jnp.floating)
    except TypeError:
        real = False
    if not real:
        raise errors.acc_type(acc_dtype)
    return a, ax, seq_lengths


def default_chunk(length: int) -> int:
    """``chunk=None``: the power of two nearest ``sqrt(length)``, at least 8."""
    return max(8, 2 ** round(math.log2(max(length, 1)) / 2))


@ft.cache
def device_bytes() -> int:
    """The memory of the default device (``bytes_limit`` of its memory stats),
    or ``UNKNOWN_DEVICE_BYTES`` where it does not tell."""
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # (a backend without memory stats)
        stats = {}
    return int(stats.get("bytes_limit") or UNKNOWN_DEVICE_BYTES)


def resolve_method(
    method: str, length: int, backend: str | None = None, nbytes: int = 0
) -> str:
    """The method ``"auto"`` stands for, by backend (``_backend.platform``).

    * CPU: ``"sequential"``, the fastest there at every measured length, forward
      and gradient, and the cheapest to compile.
    * GPU: ``"associative"`` (0.01-0.03x the time of ``lax.scan`` on an H200,
      against 0.03-0.06x for the chunked scan), while ``ASSOCIATIVE_ARRAYS``
      arrays of ``nbytes`` (``b``'s size in the accumulation dtype) fit in
      ``ASSOCIATIVE_SHARE`` of the device's memory; else ``"chunked"``.
    * Other backends (TPU): ``"chunked"`` from ``TPU_CHUNKED_FROM`` steps,
      ``"sequential"`` below (measured on a TPU v5e: the chunked scan the
      fastest there, the associative scan slower than a loop).
    """
    if method != "auto":
        return method
    backend = backend or _backend.platform()
    if backend == "cpu" or length < 2:
        return "sequential"
    if backend == "gpu":
        fits = ASSOCIATIVE_ARRAYS * nbytes <= ASSOCIATIVE_SHARE * device_bytes()
        return "associative" if fits else "chunked"
    return "chunked" if length >= TPU_CHUNKED_FROM else "sequential"


# ---------------------------------------------------------------------------- methods
# Each takes a and b with time on ``axis`` (0 but for the associative scan off
# CPU; a's time axis may have size 1: the same a at every step), h0 (None:
# zeros), and returns (h at every step, time on ``axis``; h at the last step in
# scan order).


def _zeros_if_none(h0, b, axis):
    if h0 is not None:
        return h0
    return jnp.zeros(b.shape[:axis] + b.shape[axis + 1 :], b.dtype)


def _sequential(a, b, h0, axis, reverse, chunk, out):
    h0 = _zeros_if_none(h0, b, 0)

    def step(h, ab):
        a_t, b_t = ab
        h = a_t * h + b_t
        return h, h.astype(out)

    if a.shape[0] == 1:  # time-invariant: a is a constant of the body
        a_0 = a[0]
        last, h = jax.lax.scan(
            lambda h, b_t: step(h, (a_0, b_t)), h0, b, reverse=reverse
        )
    else:
        last, h = jax.lax.scan(step, h0, (a, b), reverse=reverse)
    return h, last


def _combine(earlier, later):
    """The monoid: ``(a1, b1)`` then ``(a2, b2)`` is ``(a2 a1, a2 b1 + b2)``."""
    a1, b1 = earlier
    a2, b2 = later
    return a2 * a1, a2 * b1 + b2


def _associative(a, b, h0, axis, reverse, chunk, out):
    """The hand-written ``lax.associative_scan`` of ``(a, b)`` along ``axis``
    (``a`` broadcast to ``b``'s shape, as one writes it: narrower, its gradient
    is reduced at every level, 1.09x slower on CPU), and ``h0`` added after the
    scan through the products of ``a`` it computes anyway: ``h_t = (prod a) h0
    + h_t`` from zeros (folding ``h0`` into the first step copied ``b``: 1.18-1.27x
    the hand-written scan on CPU)."""
    length = b.shape[axis]
    a = jnp.broadcast_to(a, b.shape)
    prod, h = jax.lax.associative_scan(_combine, (a, b), reverse=reverse, axis=axis)
    if h0 is not None:
        h = h + prod * jnp.expand_dims(h0, axis)
    end = 0 if reverse else length - 1
    return h, jax.lax.index_in_dim(h, end, axis, keepdims=False)


def _chunked(a, b, h0, axis, reverse, chunk, out):
    h0 = _zeros_if_none(h0, b, 0)
    a, b = (jnp.flip(x, 0) for x in (a, b)) if reverse else (a, b)
    length = b.shape[0]
    c = min(chunk or default_chunk(length), length)
    n = -(-length // c)
    pad = n * c - length
    a = jnp.broadcast_to(a, (length,) + a.shape[1:])
    if pad:  # identity steps at the end: they leave the state as it is
        a = jnp.concatenate([a, jnp.ones((pad,) + a.shape[1:], a.dtype)])
        b = jnp.concatenate([b, jnp.zeros((pad,) + b.shape[1:], b.dtype)])

    def chunks(x):  # [n * c, ...] -> [c, n, ...]: a scan over positions in a chunk
        return jnp.swapaxes(x.reshape((n, c) + x.shape[1:]), 0, 1)

    def within(carry, ab):  # every chunk from a zero state; A: the product of a
        prod, h = carry
        a_j, b_j = ab
        carry = (a_j * prod, a_j * h + b_j)
        return carry, carry

    start = (jnp.ones(a.shape[1:], a.dtype), jnp.zeros(b.shape[1:], b.dtype))
    (prod_end, h_end), (prod, h) = jax.lax.scan(
        within,
        jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), start),
        (chunks(a), chunks(b)),
    )

    def across(h, ends):  # the state entering each chunk
        p, e = ends
        return p * h + e, h

    last, h_in = jax.lax.scan(across, h0, (prod_end, h_end))
    h = h + prod * h_in[None]
    h = jnp.swapaxes(h, 0, 1).reshape((n * c,) + h.shape[2:])[:length]
    h = jnp.flip(h, 0) if reverse else h
    return h, last


RUN = {"sequential": _sequential, "associative": _associative, "chunked": _chunked}


# ---------------------------------------------------------------------------- body


def _trailing(x: Any, ndim: int) -> Any:
    """``x`` with size-1 axes appended up to ``ndim`` (leading-aligned broadcast)."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def time_major(method: str, backend: str) -> bool:
    """Whether a method runs with time moved to axis 0: the sequential and
    chunked scans always; the associative scan on CPU, where XLA's strided
    slices of an inner time axis cost more than two transposes (a batch-major
    minimal LRU, ``[32, T, 64-256]`` complex64, forward + gradient: 0.81-0.97x
    the time of ``vmap`` of the hand-written scan over the batch); elsewhere it
    scans ``b`` where its time axis is (on a GPU every level is a pass over
    memory, and so is each transpose; not measured. On a TPU v5e both layouts
    measured the same, 1.10-1.38x that ``vmap``)."""
    return method != "associative" or backend == "cpu"


@ft.partial(
    jax.jit,
    static_argnames=("axis", "reverse", "method", "chunk", "types", "major"),
)
def _core(a, b, h0, reset, seq_lengths, *, axis, reverse, method, chunk, types, major):
    """The call in ``b``'s layout (time on ``axis``): ``a`` made ``b``'s rank
    (size-1 axes where it is broadcast), resets and padding folded into ``a``
    and ``b``, time moved to axis 0 if ``major``, then the method."""
    nd = b.ndim
    b = b.astype(types.acc)
    a = a.astype(types.acc).reshape((1,) * (nd - a.ndim) + a.shape)
    length = b.shape[axis]
    h0 = None if h0 is None else h0.astype(types.acc)
    if reset is not None:  # a reset step forgets h_{t-1}: a_t = 0
        a = jnp.where(_trailing(reset, nd), jnp.zeros((), a.dtype), a)
    if seq_lengths is not None:  # a padding step holds the state: a_t = 1, b_t = 0
        steps = jax.lax.broadcasted_iota(jnp.int32, (length,), 0)
        steps = steps.reshape((1,) * axis + (length,) + (1,) * (nd - 1 - axis))
        lengths = _trailing(seq_lengths.astype(steps.dtype), nd - 1)
        valid = steps < jnp.expand_dims(lengths, axis)
        a = jnp.where(valid, a, jnp.ones((), a.dtype))
        b = jnp.where(valid, b, jnp.zeros((), b.dtype))
    if length == 0:
        return b.astype(types.out), _zeros_if_none(h0, b, axis).astype(types.out)
    run_axis = 0 if major else axis
    a, b = (jnp.moveaxis(x, axis, run_axis) for x in (a, b))
    h, last = RUN[method](a, b, h0, run_axis, reverse, chunk, types.out)
    return jnp.moveaxis(h.astype(types.out), run_axis, axis), last.astype(types.out)


# ---------------------------------------------------------------------------- public


def linear_scan(
    a: Any,
    b: Any,
    h0: Any = None,
    *,
    axis: int = 0,
    reverse: bool = False,
    reset: Any = None,
    seq_lengths: Any = None,
    method: str = "auto",
    chunk: int | None = None,
    acc_dtype: Any = jnp.float32,
) -> tuple[Any, Any]:
    """Run the diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` over time.

    The recurrence of linear RNNs and state-space layers (LRU, S5, minGRU, Mamba's
    scan), computed by a sequential scan, a parallel (associative) scan or a
    chunked scan, all with the same results, under ``jit``, ``vmap`` and ``grad``.

    Conceptually equivalent to (time on axis 0, no ``reset``/``seq_lengths``)::

        def linear_scan(a, b, h0=None, reverse=False):
            a = broadcast_to(a, b.shape)
            h = zeros(b.shape[1:]) if h0 is None else h0
            hs = [None] * len(b)
            for t in (reversed(range(len(b))) if reverse else range(len(b))):
                h = a[t] * h + b[t]
                hs[t] = h
            return stack(hs), h

    Arguments:
        a: the diagonal decay, an array or number broadcastable to ``b`` (NumPy
            rules, aligned on the last axis): time-invariant (e.g. ``[D]``) or per
            step (e.g. ``[T, D]`` or ``b``'s shape). Real or complex. A matrix per
            state (``[D, D]`` for ``b`` ``[T, D]``) is refused: only diagonal
            recurrences run here (where ``T == D`` it reads as a per-step ``a``).
        b: the inputs, a floating or complex array with time on ``axis``.
        h0: the state before the first step, of ``b``'s shape without the time
            axis; default zeros.
        axis: the time axis of ``b`` (and of the returned ``h``): 0 for
            time-major ``[T, B, D]``, 1 for batch-major ``[B, T, D]``.
        reverse: run from the last step to the first (``h_t = a_t * h_{t+1} +
            b_t``); ``h`` stays aligned with ``b`` and ``h_last`` is ``h`` at the
            first step.
        reset: optional bool array: at a step where it is True, ``h_{t-1}`` is
            taken as zero (``h_t = b_t``). Its shape is ``b``'s leading axes, at
            least up to and including the time axis, each of ``b``'s size or 1,
            broadcast over the axes left out (aligned on the *first* axis):
            ``[T]`` or ``[T, B]`` for ``b`` ``[T, B, D]``, ``[B, T]`` for ``b``
            ``[B, T, D]`` with ``axis=1``; or ``b``'s full shape.
        seq_lengths: optional int array, one length per sequence: ``b``'s leading
            axes without the time axis (``[B]`` for ``[T, B, D]`` or ``[B, T,
            D]``), each of ``b``'s size or 1. Padding steps (``t >= length``) are
            not applied: the state is held there, so ``h`` at a padding step is the
            last valid ``h`` (``h0`` before a reversed sequence's first valid step),
            and ``h_last`` is each sequence's ``h`` at its own length. With
            ``reverse=True`` each sequence starts at its own last valid step.
        method: ``"sequential"`` (``lax.scan``), ``"associative"``
            (``lax.associative_scan``: ``log2(T)`` levels of elementwise work),
            ``"chunked"`` (a scan over the ``chunk`` positions of all chunks at
            once, a scan over the chunk carries, and a correction: ``chunk +
            T / chunk`` loop iterations), or ``"auto"`` (default):
            ``"sequential"`` on CPU, where it was the fastest at every measured
            length, forward and gradient; ``"associative"`` on a GPU (30-100x
            faster than a loop over time on an H200), ``"chunked"`` where its
            working set (about 11 arrays of ``b``'s size, for the gradient)
            would take more than a quarter of the device's memory; on a TPU
            ``"chunked"`` from 256 steps, the fastest on a TPU v5e (see
            ``docs/long_scans.md``).
        chunk: the chunk length of ``method="chunked"`` (or ``"auto"`` when it
            picks it); default the power of two nearest ``sqrt(T)``, at least 8.
        acc_dtype: the least precision of the accumulation: the recurrence runs in
            the widest of ``acc_dtype``, ``a``'s, ``b``'s and ``h0``'s real
            precisions (bfloat16 inputs accumulate in float32), in its complex
            counterpart (complex64 for float32) when any of them is complex.

    Returns:
        ``(h, h_last)``: ``h`` at every step, of ``b``'s shape with time on
        ``axis``, and ``h`` at the last step in scan order (the first with
        ``reverse``), of ``h0``'s shape. Both in ``b``'s dtype, made complex of
        ``b``'s precision when ``a`` or ``h0`` is complex (a complex ``a`` with a
        real ``b`` gives a complex ``h``).

    Raises:
        TypeError: ``a``, ``b``, ``h0`` not floating or complex, ``reset`` not
            bool, ``seq_lengths`` not integer, a non-int ``chunk``, a non-float
            ``acc_dtype``.
        ValueError: ``a`` not broadcastable to ``b`` or a matrix per state, ``h0``
            of the wrong shape, ``reset`` or ``seq_lengths`` that do not fit ``b``,
            a bad ``axis``, an unknown ``method``, ``chunk`` not positive or given
            with a method other than ``"chunked"``/``"auto"``.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> h, h_last = scanax.linear_scan(jnp.full(2, 0.5), jnp.ones((3, 2)))
        >>> h[:, 0].tolist()
        [1.0, 1.5, 1.75]
        >>> h, _ = scanax.linear_scan(0.5, jnp.ones((3, 2)), reset=jnp.array(
        ...     [False, True, False]), method="associative")
        >>> h[:, 0].tolist()
        [1.0, 1.0, 1.5]
    """
    a, ax, seq_lengths = _check(
        a, b, h0, axis, reset, seq_lengths, method, chunk, acc_dtype
    )
    types = dtypes(a, b, h0, acc_dtype)
    nbytes = math.prod(b.shape) * np.dtype(types.acc).itemsize
    method = resolve_method(method, b.shape[ax], nbytes=nbytes)
    major = time_major(method, _backend.platform())
    with jax.named_scope("scanax.linear_scan"):
        return _core(
            a,
            b,
            h0,
            reset,
            seq_lengths,
            axis=ax,
            reverse=bool(reverse),
            method=method,
            chunk=chunk,
            types=types,
            major=major,
        )
