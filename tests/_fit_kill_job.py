"""A small checkpointed training job, for the kill -9 test in test_checkpoint.py.

``python tests/_fit_kill_job.py CHECKPOINT_DIR OUT_FILE`` trains (resuming from
CHECKPOINT_DIR if it has checkpoints) and writes the hash of the final state.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hashlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import scanax  # noqa: E402

STEPS, EVERY = 120, 8
X = jr.normal(jr.key(0), (40, 3))
Y = jnp.sin(X[:, :1])
TX = optax.adam(1e-2)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.lin(x))))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def job(directory):
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    result = scanax.fit(
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
        checkpoint_every=None if directory is None else EVERY,
    )
    return result


def digest(result):
    h = hashlib.sha256()
    leaves = jtu.tree_leaves((nnx.state(result.model), nnx.state(result.optimizer))) + [
        result.history["loss"]
    ]
    for x in leaves:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jr.key_data(x)
        h.update(np.asarray(x).tobytes())
    return f"{result.steps}:{h.hexdigest()}"


if __name__ == "__main__":
    out = digest(job(sys.argv[1] or None))  # ("": no checkpoints)
    with open(sys.argv[2], "w") as f:
        f.write(out)
