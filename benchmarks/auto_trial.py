"""What ``fit(execution="auto")`` costs a first fit (issue 38), by hand:
``python benchmarks/auto_trial.py [PAIRS] [STEPS]`` from a checkout.

The Flax NNX MNIST tutorial's CNN (conv 32 → conv 64 → dense 256 → 10, batch
32, AdamW, evaluation every 200 steps) on synthetic 28×28 images, each fit in
a fresh process (its first compile included), ``"fused"`` and ``"auto"``
alternating (which goes first alternates by pair). Prints each run's wall
time, what ran last, and whether ``auto`` started a trial, then the ratios
auto ÷ fused. Not a ``bench_*.py`` module: ``python -m benchmarks`` does not
run it (fresh processes take minutes).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
from functools import partial
import jax, jax.numpy as jnp, jax.random as jr, optax
from flax import nnx
import scanax
from scanax._fit import schedule as _fit_schedule

trial = []
start_trial = _fit_schedule.Execution._start_trial
def started(self, args):
    trial.append(time.perf_counter())
    return start_trial(self, args)
_fit_schedule.Execution._start_trial = started

class CNN(nnx.Module):
    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)
    def __call__(self, x):
        x = self.pool(nnx.relu(self.conv1(x)))
        x = self.pool(nnx.relu(self.conv2(x)))
        x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
        return self.linear2(x)

def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}

x = jr.normal(jr.key(0), (8192, 28, 28, 1))
y = jr.randint(jr.key(1), (8192,), 0, 10)
model = CNN(rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
jax.block_until_ready((x, y))
began = time.perf_counter()
r = scanax.fit(model, optimizer, loss_fn, (x, y), steps=int(sys.argv[2]),
               batch_size=32, key=jr.key(2), progress=False,
               eval_data=(x[:1000], y[:1000]), eval_every=200,
               execution=sys.argv[1])
took = time.perf_counter() - began
print(took, r.execution, bool(trial), os.getloadavg()[0])
"""


def _one(mode: str, steps: int) -> tuple[float, str, bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(steps)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), out[1], out[2] == "True", float(out[3])


def main(pairs: int = 3, steps: int = 1200) -> None:
    ratios = []
    for i in range(pairs):
        order = ("fused", "auto") if i % 2 == 0 else ("auto", "fused")
        times = {}
        for mode in order:
            took, ran, tried, load = _one(mode, steps)
            times[mode] = took
            print(f"{mode:5s} {took:6.2f} s  ran {ran}  trial {tried}  load {load:.1f}")
        ratios.append(times["auto"] / times["fused"])
        time.sleep(1)
    shown = ", ".join(f"{r:.2f}" for r in ratios)
    print(
        f"auto / fused: {shown} (median {statistics.median(ratios):.2f}; "
        f"{os.cpu_count()} cores)"
    )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
