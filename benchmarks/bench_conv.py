"""Convolutions inside compiled loops (issue 28): ``scanax.scan`` of CNN train steps.

The model is a small CNN for sklearn's digits (8x8x1 images, random here): Conv
3x3 16 -> ReLU -> Conv 3x3 32 -> ReLU -> Dense 10, NHWC, plain JAX with optax's
Adam, batch 32, 200 steps, softmax cross-entropy. Candidates, the same step and
batches for all:

* ``scanax.scan`` of the step, jitted (its convolutions made canonical on CPU);
* ``lax.scan`` of the same step, jitted (the backward pass's convolutions as JAX
  emits them: slow inside a loop body on XLA:CPU);
* a Python loop of one ``jax.jit`` step (each convolution compiled on its own).

Each run ends with the trained parameters and losses on the host
(``block_until_ready``). Per-run rows exclude compilation (a warm-up call
first); the "compile included" rows time one call of a freshly jitted function.
Target: ``scanax.scan`` <= 0.2x ``lax.scan`` on CPU.

Run alone with ``python -m benchmarks --only conv --out DIR``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

_DN = ("NHWC", "HWIO", "NHWC")


def init_params(key):
    k1, k2, k3 = jr.split(key, 3)
    he = lambda k, shape, fan_in: jr.normal(k, shape) * jnp.sqrt(2.0 / fan_in)
    return {
        "c1": (he(k1, (3, 3, 1, 16), 9), jnp.zeros(16)),
        "c2": (he(k2, (3, 3, 16, 32), 144), jnp.zeros(32)),
        "d": (he(k3, (8 * 8 * 32, 10), 8 * 8 * 32), jnp.zeros(10)),
    }


def apply(params, x):
    for name in ("c1", "c2"):
        w, b = params[name]
        x = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_DN)
        x = jax.nn.relu(x + b)
    w, b = params["d"]
    return x.reshape(x.shape[0], -1) @ w + b


def make_step(tx):
    def loss_fn(params, batch):
        x, y = batch
        logits = apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def _fresh_fit():
    """Forget every program fit compiled (its caches and JAX's): the next fit
    traces and compiles as a first call in a process does."""
    from scanax._fit import program as _fit_program

    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()
    jax.clear_caches()


def data(steps, batch):
    x = jr.normal(jr.key(1), (steps, batch, 8, 8, 1))
    y = jr.randint(jr.key(2), (steps, batch), 0, 10)
    return x, y


def run(quick: bool = False) -> list[dict]:
    steps, batch = 200, 32
    repeats = 3 if quick else 7
    tx = optax.adam(1e-3)
    step = make_step(tx)
    params = init_params(jr.key(0))
    state0 = (params, tx.init(params))
    xs = data(steps, batch)
    batches = [(xs[0][t], xs[1][t]) for t in range(steps)]

    def fused(scan):
        return jax.jit(lambda s, xs: scan(step, s, xs))

    ours, theirs, one = fused(scanax.scan), fused(jax.lax.scan), jax.jit(step)

    def looped(jitted):
        s = state0
        for b in batches:
            s, loss = jitted(s, b)
        return s, loss

    candidates = {
        "scanax": lambda: _timing.block(ours(state0, xs)),
        "lax": lambda: _timing.block(theirs(state0, xs)),
        "loop": lambda: _timing.block(looped(one)),
    }
    # fit (default options) on the same batches in order, against the same loop.
    X, Y = xs[0].reshape(-1, 8, 8, 1), xs[1].reshape(-1)

    def loss_fn(params, batch):
        logits = apply(params, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    def fitted():
        r = scanax.fit(params, tx, loss_fn, (X, Y), steps=steps, batch_size=batch,
                       progress=False)  # fmt: skip
        return _timing.block(r.model)

    candidates["fit"] = fitted
    t = _timing.interleaved(candidates, repeats=repeats)

    # Compile included: a fresh jitted function per call (a new trace and compile).
    fresh = {
        "scanax": lambda: _timing.block(fused(scanax.scan)(state0, xs)),
        "lax": lambda: _timing.block(fused(jax.lax.scan)(state0, xs)),
        "loop": lambda: _timing.block(looped(jax.jit(make_step(tx)))),
        "fit": lambda: (_fresh_fit(), fitted())[1],  # what a first fit pays
    }
    c = _timing.interleaved(fresh, repeats=max(3, repeats // 2), warmup=0)

    desc = f"digits CNN conv16-conv32-dense10, batch {batch}, {steps} Adam steps"
    backend = jax.default_backend()
    return [
        _timing.row(
            "conv",
            desc,
            t["scanax"],
            "jax.jit(lax.scan) of the same step",
            t["lax"],
            0.2 if backend == "cpu" else None,
            notes=f"{t['lax'] / t['scanax']:.1f}x faster ({backend})",
        ),
        _timing.row(
            "conv",
            desc,
            t["scanax"],
            "Python loop of one jax.jit step",
            t["loop"],
            notes=f"{t['loop'] / t['scanax']:.1f}x faster ({backend})",
        ),
        _timing.row(
            "conv",
            "scanax.fit (default), " + desc,
            t["fit"],
            "Python loop of one jax.jit step",
            t["loop"],
            1.0 if backend == "cpu" else None,
        ),
        _timing.row(
            "conv",
            desc + ", compile included",
            c["scanax"],
            "jax.jit(lax.scan) of the same step",
            c["lax"],
        ),
        _timing.row(
            "conv",
            desc + ", compile included",
            c["scanax"],
            "Python loop of one jax.jit step",
            c["loop"],
        ),
        _timing.row(
            "conv",
            "scanax.fit (default), " + desc + ", compile included",
            c["fit"],
            "Python loop of one jax.jit step, compile included",
            c["loop"],
        ),
    ]


if __name__ == "__main__":
    print(_timing.markdown(run(quick=True)))
