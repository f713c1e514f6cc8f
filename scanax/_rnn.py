"""``scanax.rnn``: multi-layer recurrent networks over cells of different widths."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _backend, _cells, _eager, _nnx, _tree
from ._errors import rnn as errors, seq_lengths_range, short_type
from ._loop import check_unroll
from ._scan import scan
from ._tree import same_types

ORDERS = ("auto", "time", "layer")

# ---------------------------------------------------------------------------- checks


def _time_axis(xs: Any, time_axis: Any) -> int:
    if not hasattr(xs, "ndim") or xs.ndim < 2:
        raise errors.bad_xs(xs, time_axis)
    if isinstance(time_axis, bool):
        raise errors.bad_xs(xs, time_axis)
    try:
        ax = operator.index(time_axis)
    except TypeError as err:
        raise errors.bad_xs(xs, time_axis) from err
    if not -xs.ndim <= ax < xs.ndim or ax % xs.ndim == xs.ndim - 1:
        raise errors.bad_xs(xs, time_axis)
    return ax % xs.ndim


def _plan(
    cells: tuple, x0: Any, init: Any, xs_desc: str, other_axes: list = ()
) -> tuple[list[_cells.Cell], tuple]:
    """Detect every cell's protocol, check widths and build the initial states.

    Runs each cell once abstractly (``jax.eval_shape``) on the previous layer's
    output, so every error is raised before the real loop is traced.
    ``other_axes``: ``(axis, batch shape)`` of the other axes that could be time,
    to name in an ``init`` error.
    """
    if init is not None:
        if not isinstance(init, (tuple, list)):
            raise errors.init_type(init)
        if len(init) != len(cells):
            raise errors.init_count(len(init), len(cells))
    batch = tuple(x0.shape[:-1])
    specs, states = [], []
    x = jax.ShapeDtypeStruct(x0.shape, x0.dtype)
    source = f"xs {xs_desc}"
    for i, cell in enumerate(cells):
        spec = _cells.detect(cell)
        if spec is None:
            raise errors.unknown_protocol(i, cell, "it is not callable")
        if spec.unbatched:
            spec.n_batch = len(batch)
        width = x.shape[-1]
        if spec.in_width is not None and spec.in_width != width:
            raise errors.width(i, cell, spec.in_width, width, source)
        default = _default_state(i, spec, cell, batch, width, x0.dtype, init)
        if init is None:
            if default is None:
                raise errors.no_state(i, cell, _cells.OUT_ATTRS)
            state = default
        else:
            state = init[i]
            if default is not None and not same_types(state, default):
                alt = [
                    a
                    for a, b in other_axes
                    if same_types(
                        state, _default_state(i, spec, cell, b, width, x0.dtype, init)
                    )
                ]
                alt_axis = alt[0] if alt else None
                raise errors.init_state(i, cell, state, default, alt_axis)
        try:
            out = _cells.eval_step(spec, cell, state, x)()
        except Exception as err:
            if _nnx.is_trace_level_error(err):  # flax: mutation in a trace
                raise errors.cell_mutates(i, cell, err) from err
            raise errors.call_failed(i, cell, x, source, err) from err
        if spec.kind == "?":
            spec.kind = _cells.probe_kind(spec, state, out) or "?"
            new = _cells.dtype_only_change(state, out)
            if spec.kind == "?" and new is not None:
                raise errors.state_dtype(i, cell, state, new, init is None, x0.dtype)
            if spec.kind == "?":
                raise errors.not_state_or_pair(i, cell, state, out)
            if spec.kind == "state":
                out = (out, out)
        new_state, y = out
        if not same_types(new_state, state):
            raise errors.state_changed(i, cell, state, new_state)
        if i + 1 < len(cells) and not isinstance(y, jax.ShapeDtypeStruct):
            raise errors.output_not_array(i, cell, y, cells[i + 1], i + 1)
        specs.append(spec)
        states.append(state)
        x = y
        source = f"the output of {errors.cell_name(i, cell)}"
    return specs, tuple(states)


def _default_state(
    i: int, spec: Any, cell: Any, batch: tuple, width: int, dtype: Any, init: Any
) -> Any:
    """The cell's default state (``Cell.default_state``), or None where its
    ``initialize_carry`` takes other arguments than flax's and ``init`` is given
    (nothing to check ``init`` against); refused naming the cell without ``init``."""
    try:
        return spec.default_state(cell, batch, width, dtype)
    except TypeError as err:
        if spec.kind != "flax":
            raise
        if init is not None:
            return None
        raise errors.initialize_carry_failed(i, cell, err) from err


def _other_time_axes(xs: Any, ax: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(axis, batch shape)`` for each other axis of ``xs`` that could be time."""
    shape = tuple(xs.shape[:-1])
    return [(a, shape[:a] + shape[a + 1 :]) for a in range(len(shape)) if a != ax]


def _concrete_lengths(seq_lengths: Any, xs: Any, time_axis: Any) -> None:
    """``seq_lengths`` checked while its values are known (an un-jitted call
    runs compiled, where they are not): its range too."""
    if seq_lengths is not None:
        _check_seq_lengths(seq_lengths, xs, _time_axis(xs, time_axis))


def _check_seq_lengths(seq_lengths: Any, xs: Any, ax: int) -> Any:
    seq_lengths = (
        jnp.asarray(seq_lengths) if not hasattr(seq_lengths, "dtype") else seq_lengths
    )
    if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
        raise errors.seq_lengths_dtype(seq_lengths)
    shape = tuple(xs.shape[:-1])
    batch = shape[:ax] + shape[ax + 1 :]
    if tuple(seq_lengths.shape) != batch:
        alt = [a for a, b in _other_time_axes(xs, ax) if b == seq_lengths.shape]
        raise errors.seq_lengths_shape(
            seq_lengths, batch, xs, ax, alt[0] if alt else None
        )
    bad = _tree.out_of_range(seq_lengths, xs.shape[ax])
    if bad is not None:
        raise seq_lengths_range(errors.CALL, *bad, xs.shape[ax])
    return seq_lengths


# ---------------------------------------------------------------------------- loops


def _freeze(valid: Any, new: Any, old: Any) -> Any:
    """``new`` where the step is valid, else ``old``, broadcasting over features."""

    def pick(a, b):
        v = valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim))
        return jnp.where(v, a, b)

    return jtu.tree_map(pick, new, old)


def _mask_y(valid: Any, y: Any) -> Any:
    return _freeze(valid, y, jtu.tree_map(jnp.zeros_like, y))


def _steps(xs: Any, seq_lengths: Any) -> Any:
    """Step indices, scanned alongside xs; only needed to mask by length."""
    if seq_lengths is None:
        return None
    return jnp.arange(xs.shape[0], dtype=jnp.int32)


def _over_time(step, init, cells, xs, steps, reverse, unroll):
    """``scan`` of ``step(carry, (cells, x, t))``: ``cells`` broadcast to every
    step, ``xs`` and the step indices (None unless masking by length) scanned."""
    return scan(
        step,
        init,
        (cells, xs, steps),
        reverse=reverse,
        unroll=unroll,
        in_axes=(None, 0, None if steps is None else 0),
    )


def _time_outer(specs, cells, states, xs, seq_lengths, reverse, unroll):
    """One scan over time for each run of stepwise layers (layers unrolled in its
    step); a layer that runs whole sequences (``SequenceCell``) runs on its own."""
    finals = []
    for whole, group in itertools.groupby(range(len(specs)), lambda i: specs[i].whole):
        run = list(group)
        if whole:
            for i in run:
                final, xs = _whole(
                    specs[i], cells[i], states[i], xs, seq_lengths, reverse
                )
                finals.append(final)
            continue
        run = slice(run[0], run[-1] + 1)
        new, xs = _time_scan(
            specs[run], cells[run], states[run], xs, seq_lengths, reverse, unroll
        )
        finals.extend(new)
    return tuple(finals), xs


def _whole(spec, cell, state, xs, seq_lengths, reverse):
    """A ``SequenceCell`` layer: all steps in one call; zero outputs past lengths."""
    final, ys = spec.run_sequence(cell, state, xs, reverse, seq_lengths)
    if seq_lengths is not None:
        valid = jnp.arange(xs.shape[0]).reshape((-1,) + (1,) * seq_lengths.ndim)
        ys = _mask_y(valid < seq_lengths, ys)
    return final, ys


def _time_scan(specs, cells, states, xs, seq_lengths, reverse, unroll):
    """One scan over time; every layer runs inside the step (layers unrolled)."""
    steps = _steps(xs, seq_lengths)

    def step(carry, inp):
        cells_, x, t = inp
        new_states = []
        for spec, cell, state in zip(specs, cells_, carry, strict=True):
            new, x = spec.step(cell, state, x)
            if seq_lengths is not None:
                new = _freeze(t < seq_lengths, new, state)
            new_states.append(new)
        if seq_lengths is not None:
            x = _mask_y(t < seq_lengths, x)
        return tuple(new_states), x

    return _over_time(step, states, cells, xs, steps, reverse, unroll)


def _layer_outer(specs, cells, states, xs, seq_lengths, reverse, unroll):
    """One scan over time per layer; layer ``i + 1`` reads all of layer ``i``'s ys."""
    steps = _steps(xs, seq_lengths)
    finals = []
    for spec, cell, state in zip(specs, cells, states, strict=True):
        if spec.whole:
            final, xs = _whole(spec, cell, state, xs, seq_lengths, reverse)
            finals.append(final)
            continue

        def step(carry, inp, spec=spec):
            cell_, x, t = inp
            new, y = spec.step(cell_, carry, x)
            if seq_lengths is not None:
                new = _freeze(t < seq_lengths, new, carry)
            return new, y

        final, xs = _over_time(step, state, cell, xs, steps, reverse, unroll)
        finals.append(final)
    if seq_lengths is not None:
        valid = steps.reshape((-1,) + (1,) * seq_lengths.ndim) < seq_lengths
        xs = _mask_y(valid, xs)
    return tuple(finals), xs


# ---------------------------------------------------------------------------- public


def rnn(
    cells: Any,
    xs: Any,
    init: Sequence[Any] | None = None,
    *,
    seq_lengths: Any = None,
    reverse: bool = False,
    time_axis: int = 0,
    order: str = "auto",
    unroll: int | bool = 1,
) -> tuple[tuple[Any, ...], Any]:
    """Run a multi-layer RNN over time-major ``xs`` (time on axis 0, ``[T, B, D]``).

    Layer ``i + 1`` reads layer ``i``'s output at each step. **Time is axis 0** by
    default, for every kind of cell (as in ``jax.lax.scan``); ``nnx.RNN`` and most
    data pipelines are batch-major ``[B, T, D]``: pass ``time_axis=1`` (``ys`` come
    back batch-major too). A batch-major array passed with ``time_axis=0`` is read
    as ``T = B`` steps of ``T`` sequences: an error says so only where a shape
    (``seq_lengths``, ``init``) shows it.

    Conceptually equivalent to::

        def rnn(cells, xs, init=None, *, reverse=False, time_axis=0):
            states = list(init or default_states(cells))
            ys = []
            steps = range(T)[::-1] if reverse else range(T)
            for t in steps:
                x = xs[t]                      # (time on time_axis)
                for i, cell in enumerate(cells):
                    states[i], x = step(cell, states[i], x)
                ys.append(x)
            if reverse:
                ys = ys[::-1]                  # outputs aligned with the inputs
            return tuple(states), stack(ys, axis=time_axis)

    where ``step`` calls the cell in its own protocol (detected, no annotation):
    ``cell(h, x) -> h`` (output = new state), ``cell(carry, x) -> (carry, y)`` (Flax
    NNX cells and any such callable), ``eqx.nn.GRUCell`` ``cell(x, h) -> h`` and
    ``eqx.nn.LSTMCell`` ``cell(x, (h, c)) -> (h, c)`` (output ``h``). Equinox cells
    are unbatched: scanax vmaps them over the batch axes of ``xs``.

    Arguments:
        cells: one cell or a sequence of cells; widths may differ between layers.
        xs: an array ``[..., D]`` with time on ``time_axis``; the axes other than time
            and the last (features) are batch axes.
        init: a tuple (or list) with one state per cell, or None for the cells'
            default states: their own carry initialiser (NNX ``initialize_carry``,
            with ``nnx.Rngs(0)``), else zeros of the cell's state width.
        seq_lengths: optional int array, one length per sequence (the batch shape).
            Past its length a sequence's states are frozen, so ``final_states`` holds
            each sequence's state at its last valid step, and its outputs are zero.
            Costs no memory in ``T`` (no history of states is kept).
        reverse: process from the last step to the first; ``ys`` stay aligned with
            ``xs``. With ``seq_lengths``, each sequence starts at its own last valid
            step.
        time_axis: which axis of ``xs`` (and ``ys``) is time: 0 (default) for
            time-major ``[T, B, D]``, 1 for batch-major ``[B, T, D]`` (as
            ``nnx.RNN``).
        order: ``"time"``: one scan over time with all layers unrolled in its
            step (a ``SequenceCell`` layer runs on its own, between such
            scans). ``"layer"``: one scan over time per layer (layer ``i``'s
            whole output sequence feeds layer ``i + 1``). ``"auto"`` (default):
            ``"layer"`` on CPU, the faster there (``benchmarks/bench_rnn.py``);
            ``"time"`` on other backends (not measured), as it runs ``len(cells)``
            times fewer loop iterations, each with a fixed cost on GPU. All give
            the same results.
        unroll: as in ``jax.lax.scan``.

    Returns:
        ``(final_states, ys)``: a tuple with one final state per cell, and the last
        layer's outputs at every step, time on ``time_axis``.

    Raises:
        TypeError: a cell that follows no supported protocol, ``init`` of the wrong
            type or with a state of the wrong structure/shape/dtype, non-integer
            ``seq_lengths``, ``xs`` not an array.
        ValueError: a cell whose input width differs from the previous layer's
            output width, a wrong number of ``init`` states, ``seq_lengths`` of the
            wrong shape, a bad ``time_axis`` or ``order``. When ``seq_lengths`` or an
            ``init`` state would fit with another axis of ``xs`` as time, the
            message says which ``time_axis`` that is.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> def cell(h, x):
        ...     return jnp.tanh(h + x)
        >>> states, ys = scanax.rnn([cell, cell], jnp.ones((5, 3)), init=(
        ...     jnp.zeros(3), jnp.zeros(3)))
        >>> ys.shape
        (5, 3)
    """
    check_unroll(errors.CALL, unroll)
    if _eager.active():  # un-jitted: compile once per distinct program
        _concrete_lengths(seq_lengths, xs, time_axis)
        return _eager.call(
            rnn,
            cells,
            xs,
            init,
            seq_lengths=seq_lengths,
            reverse=reverse,
            time_axis=time_axis,
            order=order,
            unroll=unroll,
        )
    if isinstance(cells, (tuple, list)) or (
        not callable(cells) and isinstance(cells, Iterable)
    ):
        cells = tuple(cells)  # also an nnx.List of cells
    else:
        cells = (cells,)
    if not cells:
        raise errors.no_cells()
    if order not in ORDERS:
        raise errors.bad_order(order, ORDERS)
    ax = _time_axis(xs, time_axis)
    xs_t = jnp.moveaxis(xs, ax, 0) if ax else xs
    if seq_lengths is not None:
        seq_lengths = _check_seq_lengths(seq_lengths, xs, ax)
    x0 = jax.ShapeDtypeStruct(xs_t.shape[1:], xs_t.dtype)
    specs, states = _plan(cells, x0, init, short_type(xs), _other_time_axes(xs, ax))
    loop = _time_outer if resolve_order(order) == "time" else _layer_outer
    with jax.named_scope("scanax.rnn"):
        finals, ys = loop(specs, cells, states, xs_t, seq_lengths, reverse, unroll)
    return finals, (jtu.tree_map(lambda a: jnp.moveaxis(a, 0, ax), ys) if ax else ys)


def resolve_order(order: str) -> str:
    """``"time"`` or ``"layer"``; ``"auto"`` picks by the backend
    (``_backend.platform``)."""
    if order != "auto":
        return order
    return "layer" if _backend.platform() == "cpu" else "time"


def birnn(
    forward: Any,
    backward: Any,
    xs: Any,
    init: tuple[Any, Any] | None = None,
    *,
    seq_lengths: Any = None,
    time_axis: int = 0,
    order: str = "auto",
    unroll: int | bool = 1,
) -> tuple[tuple[tuple[Any, ...], tuple[Any, ...]], Any]:
    """Bidirectional ``scanax.rnn``: ``forward`` cells read ``xs`` first to last,
    ``backward`` cells last to first; their outputs are concatenated on the last axis.

    Conceptually equivalent to::

        fwd_states, fwd_ys = scanax.rnn(forward, xs, init_fwd, ...)
        bwd_states, bwd_ys = scanax.rnn(backward, xs, init_bwd, ..., reverse=True)
        return (fwd_states, bwd_states), jnp.concatenate([fwd_ys, bwd_ys], axis=-1)

    the same as ``nnx.Bidirectional(nnx.RNN(f), nnx.RNN(b))`` with ``return_carry``.

    Arguments:
        forward, backward: a cell or a sequence of cells each, as in ``scanax.rnn``.
        xs, seq_lengths, time_axis, order, unroll: as in ``scanax.rnn`` (with
            ``seq_lengths``, the backward pass starts at each sequence's last
            valid step, and outputs past a sequence's length are zero).
        init: None, or ``(forward_init, backward_init)``, each as ``init`` of
            ``scanax.rnn``.

    Returns:
        ``((forward_states, backward_states), ys)``.
    """
    if _eager.active():  # un-jitted: one program for both directions
        _concrete_lengths(seq_lengths, xs, time_axis)
        return _eager.call(
            birnn,
            forward,
            backward,
            xs,
            init,
            seq_lengths=seq_lengths,
            time_axis=time_axis,
            order=order,
            unroll=unroll,
        )
    if init is None:
        init = (None, None)
    elif not isinstance(init, (tuple, list)) or len(init) != 2:
        raise errors.birnn_init(init)
    kw = dict(seq_lengths=seq_lengths, time_axis=time_axis, order=order, unroll=unroll)
    with _direction("forward"):
        fwd_states, fwd_ys = rnn(forward, xs, init[0], **kw)
    with _direction("backward"):
        bwd_states, bwd_ys = rnn(backward, xs, init[1], reverse=True, **kw)
    return (fwd_states, bwd_states), jnp.concatenate([fwd_ys, bwd_ys], axis=-1)


@contextlib.contextmanager
def _direction(name: str) -> Any:
    """``rnn``'s refusals inside ``birnn`` say which direction's cells they
    name (both are ``cells[0]``...)."""
    try:
        yield
    except (TypeError, ValueError) as err:
        message = str(err)
        if type(err) not in (TypeError, ValueError) or not message.startswith(
            errors.CALL + ":"
        ):
            raise
        rest = message[len(errors.CALL) + 1 :]
        raise type(err)(f"scanax.birnn, the {name} cells:{rest}") from err
