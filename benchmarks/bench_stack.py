"""``scanax.Stack`` against an unrolled Python loop over the same layers (issue 3).

L heavy blocks (LayerNorm + MLP 256→1024→256 with a residual), as Equinox modules,
L ∈ {8, 24, 64}. For each L, side by side in one process:

* compile time of ``jax.jit(jax.grad(loss))`` (trace + lower + compile, a fresh
  function each time); targets: ≥ 4× faster at L=24, ≥ 20× at L=64, i.e. ratios
  ≤ 0.25 and ≤ 0.05;
* run time of the compiled gradient, interleaved medians; target ≤ 1.15×. A third
  row times a hand-written ``jax.lax.scan`` over the same stacked parameters that
  stores every residual (what ``Stack(remat=False)`` does). ``Stack``'s default
  keeps only the matmul results of scanned layers and recomputes the elementwise
  work in the backward pass: on CPU, storing a scanned layer's residuals costs
  more than recomputing them.

Run alone with ``python -m benchmarks.bench_stack``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

D, H, B = 256, 1024, 128  # B: rows (tokens) per call
COMPILE_TARGETS = {24: 0.25, 64: 0.05}
RUN_TARGET = 1.15


class Block(eqx.Module):
    scale: jax.Array
    shift: jax.Array
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.scale, self.shift = jnp.ones(D), jnp.zeros(D)
        self.w1 = jr.normal(k1, (D, H)) / D**0.5
        self.b1 = jnp.zeros(H)
        self.w2 = jr.normal(k2, (H, D)) / H**0.5
        self.b2 = jnp.zeros(D)

    def __call__(self, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        h = (x - mu) * jax.lax.rsqrt(var + 1e-5) * self.scale + self.shift
        return x + jax.nn.gelu(h @ self.w1 + self.b1) @ self.w2 + self.b2


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


class Unrolled(eqx.Module):
    layers: tuple

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _hand_scan_loss(stacked, x):
    x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, stacked)
    return jnp.mean(x**2)


def _compile(model, x) -> tuple[float, object]:
    """Seconds to trace, lower and compile jit(grad(loss)), and the executable."""
    # A new function object each time: nothing is reused from an earlier compile.
    fn = jax.jit(jax.grad(lambda m, x: _loss(m, x)))
    out = []
    seconds = _timing.timed(lambda: out.append(fn.lower(model, x).compile()))
    return seconds, out[0]


def _case(n_layers: int, repeats: int, compile_repeats: int) -> list[dict]:
    layers = [Block(k) for k in jr.split(jr.key(0), n_layers)]
    stack, unrolled = scanax.Stack(layers), Unrolled(tuple(layers))
    x = jr.normal(jr.key(1), (B, D))
    c_stack, g_stack = min(
        (_compile(stack, x) for _ in range(compile_repeats)), key=lambda r: r[0]
    )
    c_unrolled, g_unrolled = min(
        (_compile(unrolled, x) for _ in range(compile_repeats)), key=lambda r: r[0]
    )
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    g_hand = jax.jit(jax.grad(_hand_scan_loss)).lower(stacked, x).compile()
    t = _timing.interleaved(
        {
            "stack": lambda: _timing.block(g_stack(stack, x)),
            "unrolled": lambda: _timing.block(g_unrolled(unrolled, x)),
            "hand": lambda: _timing.block(g_hand(stacked, x)),
        },
        repeats=repeats,
    )
    case = f"L={n_layers}, B={B}, {D}→{H}→{D}"
    return [
        _timing.row(
            "stack compile jit(grad)",
            case,
            c_stack,
            "unrolled loop",
            c_unrolled,
            target=COMPILE_TARGETS.get(n_layers),
            notes=f"speed-up {c_unrolled / c_stack:.1f}×",
        ),
        _timing.row(
            "stack run grad",
            case,
            t["stack"],
            "unrolled loop",
            t["unrolled"],
            target=RUN_TARGET,
        ),
        _timing.row(
            "stack run grad",
            case,
            t["stack"],
            "hand-written lax.scan",
            t["hand"],
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    sizes = (8, 24) if quick else (8, 24, 64)
    rows = []
    for n in sizes:
        rows += _case(
            n,
            repeats=5 if quick else (31 if n <= 24 else 15),
            compile_repeats=1 if quick or n > 24 else 3,
        )
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
