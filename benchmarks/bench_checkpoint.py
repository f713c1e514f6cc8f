"""Checkpoint overhead of ``scanax.fit`` (issue 5): ``checkpoint_every=100`` vs none.

The same training (Adam, array data, ``progress=False``) with and without
``checkpoint_dir`` + ``checkpoint_every=100``, interleaved; each checkpointed run
writes to a fresh directory (otherwise it would resume, finished). Rows report
wall time per run and steps/s in the notes; ``ratio`` is the slowdown.

Run alone with ``python -m benchmarks.bench_checkpoint``.
"""

from __future__ import annotations

import shutil
import tempfile

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
    from benchmarks.bench_fit import MLP, mse, xent
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_fit import MLP, mse, xent  # type: ignore[no-redef]


def _case(name, sizes, batch, steps, loss_fn, repeats):
    n = batch * 100
    x = jr.normal(jr.key(0), (n, sizes[0]))
    if loss_fn is mse:
        y = jnp.sin(x[:, :1])
    else:
        y = jr.randint(jr.key(1), (n,), 0, sizes[-1])
    tx = optax.adam(1e-3)
    model = MLP(sizes, nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    root = tempfile.mkdtemp(prefix="scanax-bench-ckpt-")

    def run(every):
        def go():
            directory = tempfile.mkdtemp(dir=root) if every else None
            scanax.fit(
                model,
                opt,
                loss_fn,
                (x, y),
                steps=steps,
                batch_size=batch,
                progress=False,
                checkpoint_dir=directory,
                checkpoint_every=every,
            )
            jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
            if directory:
                shutil.rmtree(directory)

        return go

    try:
        t = _timing.interleaved({"ckpt": run(100), "plain": run(None)}, repeats=repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    desc = f"{name} MLP {'→'.join(map(str, sizes))}, batch {batch}, {steps} steps"
    notes = (
        f"{steps / t['ckpt']:.0f} steps/s with checkpoint_every=100 "
        f"({steps // 100} saves), {steps / t['plain']:.0f} steps/s without"
    )
    return [
        _timing.row(
            "checkpoint",
            desc,
            t["ckpt"],
            "fit without checkpoints",
            t["plain"],
            notes=notes,
        )
    ]


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 5
    rows = _case("tiny", (32, 32, 1), 8, 500 if quick else 2000, mse, repeats)
    rows += _case("small", (784, 256, 10), 64, 200 if quick else 1000, xent, repeats)
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
