"""``scanax.rnn`` against hand-written loops for a 4-layer GRU (issue 3).

4 ``nnx.GRUCell`` layers, hidden 128, T=128, B=32; forward + backward
(``jax.grad`` of a loss over all outputs and final states, w.r.t. the parameters),
under ``jax.jit``, interleaved medians. The baseline is the best of two hand-written
orderings with ``jax.lax.scan``: time-outer (one scan over time, layers unrolled
in its step) and layer-outer (one scan per layer). Target: ≤ 1.10×. A second row
compares with the hand-written loop of the order scanax's default picks on this
backend (``order="auto"``: layer-outer on CPU).

Run alone with ``python -m benchmarks.bench_rnn``. ``--orders`` instead times
``order="layer"`` against ``order="time"`` over a grid of cells and shapes (the
measurement behind ``order="auto"``; not part of ``python -m benchmarks``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
from flax import nnx

import scanax
from scanax._rnn import resolve_order

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

LAYERS, HIDDEN, T, B = 4, 128, 128, 32
TARGET = 1.10


def _cells():
    rngs = nnx.Rngs(0)
    return [nnx.GRUCell(HIDDEN, HIDDEN, rngs=rngs) for _ in range(LAYERS)]


def _hand_time_outer(cells, xs):
    def step(hs, x):
        new = []
        for cell, h in zip(cells, hs, strict=True):
            h, x = cell(h, x)
            new.append(h)
        return tuple(new), x

    h0 = tuple(jnp.zeros((B, HIDDEN)) for _ in cells)
    return jax.lax.scan(step, h0, xs)


def _hand_layer_outer(cells, xs):
    finals = []
    for cell in cells:
        h, xs = jax.lax.scan(lambda h, x, c=cell: c(h, x), jnp.zeros((B, HIDDEN)), xs)
        finals.append(h)
    return tuple(finals), xs


def _scanax(cells, xs):
    return scanax.rnn(cells, xs)


def _grad_fn(forward, graphdef, grad=True):
    """jit(grad(loss)) of a loss over all outputs and final states (or the loss)."""

    def loss(state, xs):
        finals, ys = forward(nnx.merge(graphdef, state), xs)
        return jnp.mean(ys**2) + sum(jnp.mean(h**2) for h in jax.tree.leaves(finals))

    return jax.jit(jax.grad(loss) if grad else loss)


def run(quick: bool = False) -> list[dict]:
    graphdef, state = nnx.split(_cells())
    xs = jr.normal(jr.key(1), (T, B, HIDDEN))
    fns = {
        "scanax": _grad_fn(_scanax, graphdef),
        "time-outer": _grad_fn(_hand_time_outer, graphdef),
        "layer-outer": _grad_fn(_hand_layer_outer, graphdef),
    }
    for fn in fns.values():  # compile outside the timing
        _timing.block(fn(state, xs))
    t = _timing.interleaved(
        {k: (lambda fn=fn: _timing.block(fn(state, xs))) for k, fn in fns.items()},
        repeats=5 if quick else 25,
    )
    best = min(("time-outer", "layer-outer"), key=t.__getitem__)
    case = f"{LAYERS}-layer GRU, H={HIDDEN}, T={T}, B={B}, fwd+bwd"
    other = "layer-outer" if best == "time-outer" else "time-outer"
    same = f"{resolve_order('auto')}-outer"
    return [
        _timing.row(
            "rnn",
            case,
            t["scanax"],
            f"hand-written {best}",
            t[best],
            target=TARGET,
            notes=f"hand-written {other}: {t[other]:.4g} s",
        ),
        _timing.row(
            "rnn",
            case,
            t["scanax"],
            f"hand-written {same} (same order)",
            t[same],
        ),
    ]


ORDER_GRID = [  # (cell, layers, hidden, T, B, with gradients)
    ("GRUCell", 4, 128, 128, 32, True),
    ("GRUCell", 2, 128, 128, 32, True),
    ("GRUCell", 8, 128, 128, 32, True),
    ("GRUCell", 4, 64, 128, 32, True),
    ("GRUCell", 4, 256, 128, 32, True),
    ("GRUCell", 4, 128, 128, 8, True),
    ("GRUCell", 4, 128, 128, 128, True),
    ("GRUCell", 4, 128, 512, 32, True),
    ("LSTMCell", 4, 128, 128, 32, True),
    ("SimpleCell", 4, 128, 128, 32, True),
    ("GRUCell", 4, 128, 128, 32, False),
]


def _order_row(cell, layers, hidden, t, b, grad, repeats) -> dict:
    rngs = nnx.Rngs(0)
    cells = [getattr(nnx, cell)(hidden, hidden, rngs=rngs) for _ in range(layers)]
    graphdef, state = nnx.split(cells)
    xs = jr.normal(jr.key(1), (t, b, hidden))

    def fn(order):
        return _grad_fn(lambda c, x: scanax.rnn(c, x, order=order), graphdef, grad)

    fns = {o: fn(o) for o in ("layer", "time")}
    for f in fns.values():
        _timing.block(f(state, xs))
    times = _timing.interleaved(
        {k: (lambda f=f: _timing.block(f(state, xs))) for k, f in fns.items()},
        repeats=repeats,
    )
    case = f"{layers} × {cell}, H={hidden}, T={t}, B={b}, " + (
        "fwd+bwd" if grad else "fwd"
    )
    return _timing.row("rnn order", case, times["layer"], "time", times["time"])


def orders(repeats: int = 9) -> list[dict]:
    """``order="layer"`` against ``order="time"``, one row per grid case."""
    return [_order_row(*case, repeats) for case in ORDER_GRID]


if __name__ == "__main__":
    import sys

    print(_timing.markdown(orders() if "--orders" in sys.argv[1:] else run()))
