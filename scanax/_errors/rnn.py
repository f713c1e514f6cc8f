"""Messages of ``scanax.rnn``'s errors."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu
import numpy as np

from . import short_type

_CALL = "scanax.rnn"
CALL = _CALL

SUPPORTED = (
    "  - `cell(h, x) -> h` (any callable; the output is the new state h)\n"
    "  - `cell(carry, x) -> (carry, y)` (any callable, and Flax NNX cells: "
    "nnx.GRUCell, nnx.LSTMCell, nnx.OptimizedLSTMCell, nnx.SimpleCell)\n"
    "  - eqx.nn.GRUCell: `cell(x, h) -> h`\n"
    "  - eqx.nn.LSTMCell: `cell(x, (h, c)) -> (h, c)`, output h"
)


def describe(tree: Any) -> str:
    """``float32[4]`` for one array, ``(float32[4], float32[4])`` for a tuple."""
    leaves = jtu.tree_leaves(tree)
    if len(leaves) == 1 and jtu.tree_structure(tree).num_nodes == 1:
        return short_type(leaves[0])
    return str(jtu.tree_map(short_type, tree)).replace("'", "")


def cell_name(i: int, cell: Any) -> str:
    return f"cells[{i}] ({type(cell).__name__})"


def unknown_protocol(i: int, cell: Any, detail: str) -> TypeError:
    return TypeError(
        f"{_CALL}: cannot tell how to call {cell_name(i, cell)}: {detail}.\n"
        f"Supported cell protocols:\n{SUPPORTED}\n"
        "Fix: wrap the cell in a small function or module with one of these "
        "signatures."
    )


def not_state_or_pair(i: int, cell: Any, state: Any, out: Any) -> TypeError:
    return unknown_protocol(
        i,
        cell,
        f"called as cell(h, x) with h {describe(state)} it returned {describe(out)}: "
        "neither a new h of the same type nor a pair (new h, y)",
    )


def width(i: int, cell: Any, want: int, got: int, source: str) -> ValueError:
    return ValueError(
        f"{_CALL}: {cell_name(i, cell)} expects inputs of width {want}, but {source} "
        f"has width {got}.\nFix: build {cell_name(i, cell).split(' ')[0]} with input "
        f"width {got}, or change the layer before it to output width {want}."
    )


def call_failed(i: int, cell: Any, x: Any, source: str, err: Exception) -> ValueError:
    said = str(err).lower()
    if any(w in said for w in ("shape", "dimension", "incompatible", "size")):
        fix = "check that its input width matches the previous layer's output width."
    else:  # (not about shapes: a dtype the cell's operations refuse...)
        fix = (
            "the error above is the cell's own; call the cell on one step of "
            "this input outside scanax.rnn to debug it."
        )
    return ValueError(
        f"{_CALL}: {cell_name(i, cell)} failed on an input {short_type(x)} (width "
        f"{x.shape[-1]}, from {source}); see the error above.\nFix: {fix}"
    )


def cell_mutates(i: int, cell: Any, err: Exception) -> TypeError:
    flax_says = str(err).split(" (http")[0]
    fix = (
        "return the value from the cell instead of storing it on the cell "
        "(`Module.sow`, counters, caches)."
    )
    if "Rng" in flax_says:  # (nnx.Dropout's key count, advanced at each draw)
        fix = (
            "draw no random numbers in the cell (its key count cannot advance "
            "inside the loop): apply `nnx.Dropout` to the outputs `ys` after "
            "`scanax.rnn` (a mask per step and unit, as between layers of "
            "stacked RNNs), or use `nnx.RNN`, which splits the cell's keys per "
            "step."
        )
    return TypeError(
        f"{_CALL}: {cell_name(i, cell)} changes its own attributes or Variables "
        f"while running (flax says: {flax_says}). The cells run read-only inside "
        f"the loop.\nFix: {fix}"
    )


def output_not_array(i: int, cell: Any, y: Any, after: Any, j: int) -> TypeError:
    return TypeError(
        f"{_CALL}: the output of {cell_name(i, cell)} is {describe(y)}, but "
        f"{cell_name(j, after)} reads it as its input, which must be one array.\n"
        "Fix: have the cell return one array as its output. A cell whose state is "
        "not its output (a tuple state) can return the pair (new_state, y), as "
        "Flax cells do."
    )


def state_dtype(
    i: int, cell: Any, state: Any, new: Any, default: bool, xs_dtype: Any
) -> TypeError:
    name = np.dtype(xs_dtype).name
    why = (
        f"With init=None the state starts in the dtype of `xs` ({name})"
        if default
        else "The state is `init`'s"
    )
    return TypeError(
        f"{_CALL}: {cell_name(i, cell)} returns its state in another dtype: given "
        f"h {describe(state)}, it returned {describe(new)}. {why}, but "
        "the cell computes in another one, so the state cannot be a loop carry.\n"
        "Fix: give `xs` the dtype of the cell's parameters, or pass `init=` in the "
        "dtype the cell returns."
    )


def no_state(i: int, cell: Any, width_attrs: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"{_CALL}: cannot tell the state shape of {cell_name(i, cell)}: it has none of "
        f"the attributes {', '.join(width_attrs)}.\nFix: pass `init=` with one "
        "state per cell."
    )


def initialize_carry_failed(i: int, cell: Any, err: Exception) -> TypeError:
    return TypeError(
        f"{_CALL}: {cell_name(i, cell)} has an `initialize_carry` method, read as "
        "flax's cell protocol, initialize_carry(input_shape, rngs=...), but calling "
        f"it so failed: {type(err).__name__}: {err}.\nFix: pass `init=` with one "
        "state per cell (its default is then not needed), or give the method "
        "flax's signature."
    )


def init_count(n_init: int, n_cells: int) -> ValueError:
    return ValueError(
        f"{_CALL}: `init` has {n_init} states for {n_cells} cells.\nFix: pass one "
        "state per cell, as a tuple, or init=None for the cells' default states."
    )


def init_type(init: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `init` must be a tuple (or list) of per-layer states or None, got "
        f"{short_type(init)}.\nFix: pass init=(state_0, state_1, ...), one per cell."
    )


def _other_time_axis(what: str, alt: int | None) -> str:
    """The fix when ``what`` fits ``xs`` with time on axis ``alt`` instead."""
    if alt is None:
        return ""
    layout = " (batch-major [B, T, D], as nnx.RNN)" if alt == 1 else ""
    return (
        f"{what} fits xs with time on axis {alt}{layout}: if that is your layout, "
        f"pass time_axis={alt}. Otherwise "
    )


def init_state(
    i: int, cell: Any, got: Any, want: Any, alt: int | None = None
) -> TypeError:
    fix = _other_time_axis(f"init[{i}]", alt)
    return TypeError(
        f"{_CALL}: init[{i}] does not match the state of {cell_name(i, cell)}:\n"
        f"  init[{i}]  {describe(got)}\n  expected  {describe(want)}\n"
        f"Fix: {fix}pass init[{i}] with the structure, shapes and "
        "dtypes expected (the batch axes of xs, then the cell's state width)."
    )


def state_changed(i: int, cell: Any, state: Any, new: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: {cell_name(i, cell)} changes the type of its state:\n"
        f"  state in   {describe(state)}\n  state out  {describe(new)}\n"
        f"Fix: pass init[{i}] of the type the cell returns, or make the cell return a "
        "state of the type it is given."
    )


def seq_lengths_dtype(seq_lengths: Any) -> TypeError:
    return TypeError(
        f"{_CALL}: `seq_lengths` must be an integer array, got "
        f"{short_type(seq_lengths)}.\nFix: pass `jnp.asarray(lengths, jnp.int32)`."
    )


def seq_lengths_shape(
    seq_lengths: Any, batch: tuple[int, ...], xs: Any, ax: int, alt: int | None
) -> ValueError:
    fix = _other_time_axis("`seq_lengths`", alt)
    return ValueError(
        f"{_CALL}: `seq_lengths` must have one entry per sequence, shape {batch} (the "
        f"batch axes of xs {short_type(xs)} with time_axis={ax}), "
        f"got {short_type(seq_lengths)}.\nFix: {fix}pass an int "
        "array of the batch shape."
    )


def bad_xs(xs: Any, time_axis: Any) -> Exception:
    if not hasattr(xs, "ndim") or not hasattr(xs, "shape"):
        return TypeError(
            f"{_CALL}: `xs` must be an array with a time axis and a feature axis, "
            f"got {short_type(xs)}.\nFix: pass an array such as float32[T, D] or "
            "float32[T, B, D]."
        )
    return ValueError(
        f"{_CALL}: time_axis={time_axis!r} is not a valid time axis of xs "
        f"{short_type(xs)}: it must be an axis other than the last (feature) axis.\n"
        "Fix: use time_axis=0 for time-major [T, B, D] or 1 for batch-major [B, T, D]."
    )


def bad_order(order: Any, orders: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"{_CALL}: `order` must be one of {orders}, got {order!r}.\nFix: leave it "
        "out ('auto': the faster order for the backend), or use order='time' "
        "(time-outer scan, layers unrolled per step) or order='layer' (one scan "
        "over time per layer)."
    )


def no_cells() -> ValueError:
    return ValueError(f"{_CALL}: `cells` is empty.\nFix: pass at least one cell.")


def birnn_init(init: Any) -> TypeError:
    return TypeError(
        "scanax.birnn: `init` must be None or a pair (forward_init, "
        f"backward_init), got {short_type(init)}.\nFix: pass init=(fwd, bwd)."
    )
