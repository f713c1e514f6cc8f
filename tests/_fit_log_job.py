"""A checkpointed training job with a CSV log, for the kill -9 test in
test_fit_features.py.

``python tests/_fit_log_job.py CHECKPOINT_DIR LOG_CSV`` trains (resuming from
CHECKPOINT_DIR if it has checkpoints) and logs window means to LOG_CSV;
``job(None, path)`` is the same run without checkpoints, in-process.
"""

import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import nnx

import scanax

STEPS = 120
X = jr.normal(jr.key(0), (40, 3))
Y = jnp.sin(X[:, :1])


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.lin(x)))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def job(directory, log):
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    scanax.fit(
        model,
        optimizer,
        loss_fn,
        (X, Y),
        steps=STEPS,
        batch_size=8,
        key=jr.key(3),
        steps_per_call=4,
        progress=False,
        checkpoint_dir=directory,
        checkpoint_every=None if directory is None else 8,
        log=scanax.CSV(log),
        log_every=3,
    )


if __name__ == "__main__":
    job(sys.argv[1] or None, sys.argv[2])
