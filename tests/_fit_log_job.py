"""A checkpointed training job with a CSV log, for the kill -9 test in
test_fit_features.py: ``_fit_kill_job``'s model, data and loss, logged.

``python tests/_fit_log_job.py CHECKPOINT_DIR LOG_CSV`` trains (resuming from
CHECKPOINT_DIR if it has checkpoints) and logs window means to LOG_CSV;
``job(None, path)`` is the same run without checkpoints, in-process.
"""

import sys

import jax.random as jr
from _fit_kill_job import TX, Net, X, Y, loss_fn
from flax import nnx

import scanax

STEPS = 48  # (killed once step 16 is saved: 32 steps left to resume)


def job(directory, log):
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
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
