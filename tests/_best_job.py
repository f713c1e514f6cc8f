"""A fit that improves at every evaluation and keeps the best in BEST_DIR, for
test_best.py's kill -9 test: ``python tests/_best_job.py BEST_DIR [pop]``
(``pop``: a population of ``len(LRS)`` members)."""

import sys

import jax.numpy as jnp
import jax.random as jr
import optax

import scanax

X = jr.normal(jr.key(0), (64, 3))
Y = X @ jnp.array([[1.0], [2.0], [-1.0]])
P0 = {"w": jnp.zeros((3, 1))}
LRS = jnp.array([0.002, 0.01, 0.02])


def loss_fn(p, batch):
    return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)


def make(key, lr):
    return {"w": 0.1 * jr.normal(key, (3, 1))}, optax.sgd(lr)


if __name__ == "__main__":
    pop = sys.argv[2:] == ["pop"]
    model = scanax.population(make, len(LRS), key=jr.key(1), lr=LRS) if pop else P0
    scanax.fit(
        model, None if pop else optax.sgd(0.01), loss_fn, (X, Y), steps=3000,
        batch_size=16, steps_per_call=2, eval_data=(X, Y), eval_every=2,
        progress=False, stop=scanax.EarlyStop("val_loss", patience=None),
        best_dir=sys.argv[1],
    )  # fmt: skip
