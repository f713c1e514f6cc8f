"""Messages of ``scanax.linear_scan``'s errors."""

from __future__ import annotations

from typing import Any

from . import short_type

_CALL = "scanax.linear_scan"
CALL = _CALL


def _shape(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _layouts(b: Any, axis: int) -> str:
    """The shapes of a time-invariant and of a per-step ``a`` for this ``b``."""
    return (
        f"time-invariant {_shape(b.shape[axis + 1 :])} or per-step "
        f"{_shape(b.shape[axis:])} (or b's full shape {_shape(b.shape)})"
    )


def b_type(b: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `b` must be a floating or complex array with a time axis, got "
        f"{short_type(b)}.\nFix: pass b as an array such as float32[T, D] (e.g. "
        "`jnp.asarray(b, jnp.float32)`)."
    )


def bad_axis(axis: Any, b: Any) -> ValueError:
    return ValueError(
        f"{_CALL}: axis={axis!r} is not an axis of b {short_type(b)}.\nFix: pass "
        "the time axis of b: axis=0 for time-major [T, ...], axis=1 for "
        "batch-major [B, T, ...]."
    )


def a_type(a: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `a` must be a floating or complex array or number, got "
        f"{short_type(a)}.\nFix: pass the decay as floats, e.g. "
        "`jnp.asarray(a, jnp.float32)`."
    )


def a_not_diagonal(a: Any, b: Any, axis: int) -> ValueError:
    d = b.shape[-1]
    return ValueError(
        f"{_CALL}: `a` {short_type(a)} looks like a [{d}, {d}] matrix per state, but "
        f"b is {short_type(b)}: linear_scan only runs diagonal recurrences, "
        "h_t = a_t * h_{t-1} + b_t elementwise. Expected a broadcastable to b: "
        f"{_layouts(b, axis)}.\nFix: diagonalise the transition (e.g. with "
        "`jnp.linalg.eig`, then scan the eigenvalues with b in the eigenbasis), or "
        "run a dense recurrence with `scanax.scan`."
    )


def a_ambiguous(a: Any, b: Any, axis: int) -> ValueError:
    k = b.ndim - axis - a.ndim  # (the axes a lacks down to the time axis)
    lead = b.ndim - a.ndim
    step = (*a.shape[:1], *(1,) * k, *a.shape[1:])
    same = (*(1,) * k, *a.shape)
    nones = ", ".join(["None"] * k)
    return ValueError(
        f"{_CALL}: `a` {short_type(a)} against b {short_type(b)} (time on axis "
        f"{axis}) is ambiguous: aligned on the last axis it has no time axis "
        f"(its first axis lines up with b's axis {lead}), yet that axis is as long "
        f"as time ({b.shape[axis]}), so it may be meant per step.\nFix: per step, "
        f"`a[:, {nones}]` ({_shape(step)}); the same at every step, "
        f"`a[{nones}]` ({_shape(same)})."
    )


def a_per_step_or_not(a: Any, b: Any, axis: int) -> ValueError:
    lead = b.ndim - a.ndim  # (the axes a lacks in front)
    at = axis - lead  # (a's axis that lines up with time)
    full = (*(1,) * lead, *a.shape)
    idx = ", ".join([":"] * (at + 1) + ["None"])
    timeless = (*a.shape[: at + 1], 1, *a.shape[at + 1 :])
    return ValueError(
        f"{_CALL}: `a` {short_type(a)} against b {short_type(b)} (time on axis "
        f"{axis}) is ambiguous: aligned on the last axis its axis {at} lines up "
        f"with time (a decay per step), yet it also fits b without its time axis "
        f"(b's axis {axis - 1} is as long as time, {b.shape[axis]}), so it may be "
        f"meant per sequence.\nFix: per step, `a[{', '.join(['None'] * lead)}]` "
        f"({_shape(full)}); the same at every step, `a[{idx}]` ({_shape(timeless)})."
    )


def a_shape(a: Any, b: Any, axis: int) -> ValueError:
    return ValueError(
        f"{_CALL}: `a` {short_type(a)} does not broadcast to b {short_type(b)} "
        f"(time on axis {axis}). Expected a of b's shape or broadcastable to it, "
        f"aligned on the last axis: {_layouts(b, axis)}.\nFix: reshape a, e.g. "
        "add the batch axes as size 1 (`a[:, None]`)."
    )


def h0_type(h0: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `h0` must be a floating or complex array, got "
        f"{short_type(h0)}.\nFix: pass h0 as floats (or leave it out: zeros)."
    )


def h0_shape(h0: Any, want: tuple[int, ...], b: Any, axis: int) -> ValueError:
    return ValueError(
        f"{_CALL}: `h0` {short_type(h0)} must have the shape of b {short_type(b)} "
        f"without its time axis {axis}, {_shape(want)}.\nFix: pass h0 of shape "
        f"{_shape(want)}, or leave it out (zeros)."
    )


def _prefix(b: Any, axis: int) -> str:
    return _shape(b.shape[: axis + 1])


def reset_type(reset: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `reset` must be a bool array, got {short_type(reset)}.\nFix: "
        "pass a mask, e.g. `reset = tokens == BOS` (True where the state restarts)."
    )


def reset_shape(reset: Any, b: Any, axis: int) -> ValueError:
    return ValueError(
        f"{_CALL}: `reset` {short_type(reset)} does not fit b {short_type(b)} "
        f"(time on axis {axis}). Expected b's leading axes, at least up to and "
        f"including time, {_prefix(b, axis)}, each of b's size or 1 (broadcast over "
        "the axes left out, aligned on the first axis).\nFix: pass reset of shape "
        f"{_prefix(b, axis)}, or with the batch axes too, e.g. "
        f"{_shape(b.shape[: max(axis + 1, b.ndim - 1)])}."
    )


def seq_lengths_type(seq_lengths: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `seq_lengths` must be an integer array, got "
        f"{short_type(seq_lengths)}.\nFix: pass `jnp.asarray(lengths, jnp.int32)`."
    )


def seq_lengths_shape(seq_lengths: Any, b: Any, axis: int) -> ValueError:
    rest = b.shape[:axis] + b.shape[axis + 1 :]
    return ValueError(
        f"{_CALL}: `seq_lengths` {short_type(seq_lengths)} must have one length per "
        f"sequence: the leading batch axes of b {short_type(b)} without its time "
        f"axis {axis}, a leading part of {_shape(rest)} (each of b's size or 1).\n"
        f"Fix: pass lengths of shape {_shape(rest[:1])} for b [T, B, D] or [B, T, "
        "D]; check `axis` if b is batch-major."
    )


def bad_method(method: Any, methods: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"{_CALL}: `method` must be one of {methods}, got {method!r}.\nFix: leave "
        "it out ('auto': the faster method for the backend and length)."
    )


def bad_chunk(chunk: Any) -> Exception:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        return TypeError(
            f"{_CALL}: `chunk` must be a positive Python int or None, got "
            f"{short_type(chunk)}.\nFix: pass e.g. chunk=64, or None for the default."
        )
    return ValueError(
        f"{_CALL}: `chunk` must be positive, got {chunk}.\nFix: pass the number of "
        "steps per chunk, e.g. chunk=64, or None for the default."
    )


def chunk_unused(method: str) -> ValueError:
    return ValueError(
        f"{_CALL}: `chunk` only applies to method='chunked' (or 'auto'), but "
        f"method={method!r}.\nFix: drop `chunk`, or pass method='chunked'."
    )


def acc_type(acc_dtype: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `acc_dtype` must be a floating dtype, got {acc_dtype!r}.\nFix: "
        "pass jnp.float32 (the default) or jnp.float64."
    )
