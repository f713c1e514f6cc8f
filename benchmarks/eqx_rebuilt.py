"""``fit`` of an Equinox MLP rebuilt per call, against a Python loop of
``eqx.filter_jit`` steps rebuilt the same way (a notebook cell or a sweep
iteration run again): 200 steps, the losses on the host, interleaved medians.

Run: ``python benchmarks/eqx_rebuilt.py`` (the README's "rebuilt per call"
Equinox row).
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


def fitted() -> np.ndarray:
    model = eqx.nn.MLP(8, 1, 16, 1, key=jax.random.key(0))
    result = scanax.fit(
        model, optax.adam(1e-3), loss, (X, Y), steps=STEPS, batch_size=B,
        progress=False, key=jax.random.key(1),
    )  # fmt: skip
    return np.asarray(result.history["loss"])


def looped() -> np.ndarray:
    model = eqx.nn.MLP(8, 1, 16, 1, key=jax.random.key(0))
    tx = optax.adam(1e-3)
    state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, batch):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    losses = []
    for t in range(STEPS):
        i = (t * B) % len(X)
        model, state, value = step(model, state, (X[i : i + B], Y[i : i + B]))
        losses.append(value)
    return np.asarray(jnp.stack(losses))


def main() -> None:
    for f in (fitted, looped):
        f()
        f()
    times: dict[str, list[float]] = {"fit": [], "loop": []}
    for _ in range(ROUNDS):
        for name, f in (("fit", fitted), ("loop", looped)):
            began = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - began)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"fit {ms['fit']:.1f} ms, loop {ms['loop']:.1f} ms, "
        f"fit ÷ loop {ms['fit'] / ms['loop']:.3f}"
    )


if __name__ == "__main__":
    main()
