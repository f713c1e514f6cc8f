"""``fit`` of an Equinox MLP rebuilt per call, against a Python loop of
``eqx.filter_jit`` steps rebuilt the same way (a notebook cell or a sweep
iteration run again): 200 steps, the losses on the host, interleaved medians.
Also with a BatchNorm layer and its ``eqx.nn.State`` (``make_with_state``),
threaded through the loop's steps as through fit's.

Run: ``python benchmarks/eqx_rebuilt.py`` (the "rebuilt per call" Equinox rows
of docs/performance.md).
"""

from __future__ import annotations

import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import scanax

X = jax.random.normal(jax.random.key(0), (512, 8))
Y = jnp.sin(X[:, :1])
B, STEPS, ROUNDS = 32, 200, 7


def loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


class BNMLP(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(8, 16, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(16, "batch", mode="batch")
        self.out = eqx.nn.Linear(16, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        return self.out(jax.nn.relu(h)), state


def bn_loss(model_state, batch):
    model, state = model_state
    x, y = batch
    pred, state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return jnp.mean((pred - y) ** 2), {}, state


def make(bn: bool):
    if bn:
        return eqx.nn.make_with_state(BNMLP)(jax.random.key(0)), bn_loss
    return eqx.nn.MLP(8, 1, 16, 1, key=jax.random.key(0)), loss


def fitted(bn: bool) -> np.ndarray:
    model, fn = make(bn)
    result = scanax.fit(
        model, optax.adam(1e-3), fn, (X, Y), steps=STEPS, batch_size=B,
        progress=False, key=jax.random.key(1),
    )  # fmt: skip
    return np.asarray(result.history["loss"])


def looped(bn: bool) -> np.ndarray:
    model, fn = make(bn)
    model, held = model if bn else (model, None)
    tx = optax.adam(1e-3)
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, held, state, batch):
        def objective(m):
            if bn:
                value, _, new = fn((m, held), batch)
                return value, new
            return fn(m, batch), None

        (value, held), grads = eqx.filter_value_and_grad(objective, has_aux=True)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = tx.update(grads, state, params)
        return eqx.apply_updates(model, updates), held, state, value

    losses = []
    for t in range(STEPS):
        i = (t * B) % len(X)
        model, held, state, value = step(
            model, held, state, (X[i : i + B], Y[i : i + B])
        )
        losses.append(value)
    return np.asarray(jnp.stack(losses))


def main() -> None:
    for bn in (False, True):
        for f in (fitted, looped):
            f(bn)
            f(bn)
        times: dict[str, list[float]] = {"fit": [], "loop": []}
        for _ in range(ROUNDS):
            for name, f in (("fit", fitted), ("loop", looped)):
                began = time.perf_counter()
                f(bn)
                times[name].append(time.perf_counter() - began)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        what = "BatchNorm MLP, (model, eqx.nn.State)" if bn else "MLP"
        print(
            f"{what}: fit {ms['fit']:.1f} ms, loop {ms['loop']:.1f} ms, "
            f"fit ÷ loop {ms['fit'] / ms['loop']:.3f}"
        )


if __name__ == "__main__":
    main()
