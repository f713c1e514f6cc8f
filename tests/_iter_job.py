"""A checkpointed fit on a resumable iterator, for test_resumable.py's kill -9
test: ``python tests/_iter_job.py CHECKPOINT_DIR OUT_FILE SEED`` trains
(resuming from CHECKPOINT_DIR) on ``Stream(SEED)`` and writes a hash of the
result. A restarted job is given another seed: only the saved iterator state
can give it the first job's batches."""

import hashlib
import sys

import jax.numpy as jnp
import numpy as np
import optax

import scanax

STEPS, EVERY = 60, 8


class Stream:
    """Batches drawn from an RNG seeded by ``seed``: a new stream with another
    seed draws other batches. Resumable as PyTorch loaders are."""

    def __init__(self, seed):
        self.seed, self.pos = seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng([self.seed, self.pos])
        self.pos += 1
        x = rng.normal(size=(8, 3)).astype(np.float32)
        return x, x.sum(1, keepdims=True)

    def state_dict(self):
        return {"seed": self.seed, "pos": self.pos}

    def load_state_dict(self, state):
        self.seed, self.pos = state["seed"], state["pos"]


def loss_fn(p, batch):
    return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)


def job(directory, seed, steps=STEPS):
    return scanax.fit(
        {"w": jnp.zeros((3, 1))}, optax.adam(0.05), loss_fn, Stream(seed),
        steps=steps, steps_per_call=4, progress=False, checkpoint_dir=directory,
        checkpoint_every=None if directory is None else EVERY,
    )  # fmt: skip


def digest(result):
    h = hashlib.sha256()
    for x in (result.model["w"], result.history["loss"]):
        h.update(np.asarray(x).tobytes())
    return f"{result.steps}:{h.hexdigest()}"


if __name__ == "__main__":
    out = digest(job(sys.argv[1] or None, int(sys.argv[3])))  # ("": no checkpoints)
    with open(sys.argv[2], "w") as f:
        f.write(out)
