"""Recurrent cell protocols: detection, default states and one uniform step.

``scanax.rnn`` accepts cells written against different conventions. Each cell is
matched, without annotation, to one protocol, which gives a uniform
``step(cell, state, x) -> (state, y)``:

- ``flax``: Flax NNX cells (anything with ``initialize_carry``, e.g. ``nnx.GRUCell``,
  ``nnx.LSTMCell``, ``nnx.OptimizedLSTMCell``, ``nnx.SimpleCell``):
  ``cell(carry, x) -> (carry, y)``; batched natively.
- ``eqx_gru``: ``eqx.nn.GRUCell``: ``cell(x, h) -> h``, output ``h``; unbatched, so it
  is vmapped over any batch axes.
- ``eqx_lstm``: ``eqx.nn.LSTMCell``: ``cell(x, (h, c)) -> (h, c)``, output ``h``;
  unbatched.
- ``state``: any other callable with ``cell(h, x) -> h`` (the output is the new state).
- ``pair``: any other callable with ``cell(carry, x) -> (carry, y)``.

A ``flax`` or ``pair`` cell that also has a ``run_sequence`` method (``SequenceCell``:
``scanax.LRU``, ``scanax.MinGRU``) runs a whole layer's sequence in one call instead
of one step per time (a linear recurrence over all steps at once); its ``__call__``
stays the one-step definition, used when it shares a loop with other layers.

Nothing here imports a framework: Flax NNX is reached through ``_nnx`` and Equinox
looked up in ``sys.modules`` (if the user has such a cell, its framework is already
imported).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from . import _nnx
from ._tree import same_types

# Attribute names that give a generic cell's widths (`dim`: the state width of a
# plain `cell(h, x) -> h` function object).
IN_ATTRS = ("input_size", "in_features")
OUT_ATTRS = ("hidden_size", "hidden_features", "dim")


def _attr_int(cell: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(cell, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _is_nnx_cell(cell: Any) -> bool:
    return _nnx.is_node(cell) and callable(getattr(cell, "initialize_carry", None))


def _eqx_kind(cell: Any) -> str | None:
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return None
    if isinstance(cell, eqx.nn.GRUCell):
        return "eqx_gru"
    if isinstance(cell, eqx.nn.LSTMCell):
        return "eqx_lstm"
    return None


SEQUENCE_METHOD = "run_sequence"


class SequenceCell(Protocol):
    """A ``cell(carry, x) -> (carry, y)`` that also runs a whole sequence at once.

    ``run_sequence(carry, xs, reverse=, seq_lengths=)`` takes time-major ``xs``
    (``[T, *batch, D]``) and returns ``(final carry, ys)``: the same as calling the
    cell at every step (from the last with ``reverse``), with, for each sequence,
    the carry at its own length (steps ``t >= length`` not applied) as the final
    carry; ``ys`` past a sequence's length are not read.
    """

    def __call__(self, carry: Any, x: Any) -> tuple[Any, Any]: ...

    def run_sequence(
        self, carry: Any, xs: Any, *, reverse: bool = False, seq_lengths: Any = None
    ) -> tuple[Any, Any]: ...


@dataclasses.dataclass
class Cell:
    """How to run one cell: its protocol, widths and batch handling."""

    kind: str  # "flax", "eqx_gru", "eqx_lstm", "state", "pair", or "?" (undecided)
    in_width: int | None
    out_width: int | None
    n_batch: int = 0  # batch axes to vmap over (unbatched Equinox cells only)
    sequence: bool = False  # has a `run_sequence` method (a SequenceCell)

    @property
    def unbatched(self) -> bool:
        return self.kind in ("eqx_gru", "eqx_lstm")

    @property
    def whole(self) -> bool:
        """Runs a whole sequence in one call (``SequenceCell.run_sequence``)."""
        return self.sequence and self.kind in ("flax", "pair")

    def default_state(
        self, cell: Any, batch: tuple[int, ...], width: int, dtype: Any
    ) -> Any:
        """The state ``init=None`` stands for (inputs ``[*batch, width]``), or None."""
        if self.kind == "flax":
            # The rng is only used by random carry initialisers; zeros ignore it.
            return cell.initialize_carry((*batch, width), rngs=_nnx.rngs(0))
        if self.kind in ("eqx_gru", "eqx_lstm"):
            zeros = jnp.zeros((*batch, cell.hidden_size), cell.weight_hh.dtype)
            return zeros if self.kind == "eqx_gru" else (zeros, zeros)
        if self.out_width is None:
            return None
        return jnp.zeros((*batch, self.out_width), dtype)

    def step(self, cell: Any, state: Any, x: Any) -> tuple[Any, Any]:
        """One time step in the uniform form ``(state, x) -> (state, y)``."""
        if self.kind in ("flax", "pair"):
            return cell(state, x)
        if self.kind == "state":
            new = cell(state, x)
            return new, new
        fn = self._eqx_step
        for _ in range(self.n_batch):
            fn = jax.vmap(fn, in_axes=(None, 0, 0))
        return fn(cell, state, x)

    def run_sequence(
        self, cell: Any, state: Any, xs: Any, reverse: bool, seq_lengths: Any
    ) -> tuple[Any, Any]:
        """A whole layer in one call (``whole`` cells): ``(final state, ys)``."""
        run = getattr(cell, SEQUENCE_METHOD)
        return run(state, xs, reverse=reverse, seq_lengths=seq_lengths)

    def _eqx_step(self, cell: Any, state: Any, x: Any) -> tuple[Any, Any]:
        new = cell(x, state)
        return new, (new if self.kind == "eqx_gru" else new[0])


def detect(cell: Any) -> Cell | None:
    """The protocol of ``cell`` as far as it can be told without running it.

    Returns None for objects that are not callable. Generic callables get kind
    ``"?"``: :func:`probe_kind` settles between ``state`` and ``pair``.
    """
    sequence = callable(getattr(cell, SEQUENCE_METHOD, None))
    if _is_nnx_cell(cell):
        return Cell(
            "flax",
            getattr(cell, "in_features", None),
            getattr(cell, "hidden_features", None),
            sequence=sequence,
        )
    kind = _eqx_kind(cell)
    if kind is not None:
        return Cell(kind, cell.input_size, cell.hidden_size)
    if not callable(cell):
        return None
    return Cell(
        "?", _attr_int(cell, IN_ATTRS), _attr_int(cell, OUT_ATTRS), sequence=sequence
    )


def dtype_only_change(state: Any, out: Any) -> Any:
    """The new state of a cell whose output matches ``state`` (as a new h or as a
    pair's first element) in all but dtype, else None."""
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    for new in (out, out[0] if pair else None):
        if (
            new is not None
            and same_types(state, new, dtypes=False)
            and not same_types(state, new)
        ):
            return new
    return None


def probe_kind(spec: Cell, state: Any, out: Any) -> str | None:
    """``state`` or ``pair`` from what a generic cell returned, or None if neither."""
    if same_types(state, out):
        return "state"
    if isinstance(out, (tuple, list)) and len(out) == 2 and same_types(state, out[0]):
        return "pair"
    return None


def eval_step(spec: Cell, cell: Any, state: Any, x: Any) -> Callable[[], Any]:
    """A thunk running one step abstractly (``jax.eval_shape``)."""
    if spec.kind == "?":
        return lambda: jax.eval_shape(lambda s, v: cell(s, v), state, x)
    return lambda: jax.eval_shape(lambda s, v: spec.step(cell, s, v), state, x)
