"""fit across the processes of a ``jax.distributed`` job on this machine (issue 17).

The small MLP (784→256→10, batch 64, softmax cross-entropy, Adam) trained by
``scanax.fit(..., mesh=mesh)`` in 1, 2 and 4 processes on localhost, one CPU
device per process (gloo collectives), data-parallel and ``shard="fsdp"``. Each
job first runs a short ``fit`` (compiles), then times ``STEPS`` continuing
steps, the call returning with the history on the host; process 0 reports.

Rows: steps/s of N processes against 1 process (ratio = time per step, N ÷ 1),
and the per-device bytes of parameters + Adam state, replicated against
``shard="fsdp"`` over 4 devices (from ``jax.Array.addressable_shards``). On a
2-core machine more processes cannot speed anything up: the rows measure the
cost of the per-step gradient all-reduce between processes, not scaling.

Run alone with ``python -m benchmarks.bench_multiprocess``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

try:
    from benchmarks import _timing
    from benchmarks.bench_first_run import MLP_SOURCE
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_first_run import MLP_SOURCE  # type: ignore[no-redef]

STEPS = 200
MARK = "MP_BENCH_JSON "
TIMEOUT = 300

_CHILD = """
import json, sys, time
process, count = int(sys.argv[1]), int(sys.argv[2])
port, shard = sys.argv[3], sys.argv[4]
import numpy as np
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if count > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=count, process_id=process,
                               initialization_timeout=60)
import jax.numpy as jnp, jax.tree_util as jtu, optax
from flax import nnx
import scanax

rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 784), dtype=np.float32)
y = rng.integers(0, 10, 4096).astype(np.int32)

MLP_SOURCE

def loss_fn(model, batch):
    xb, yb = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

mesh = jax.make_mesh((jax.device_count(),), ("data",))
model = MLP((784, 256, 10), nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
kw = dict(batch_size=64, key=jax.random.key(0), progress=False, mesh=mesh)
if shard != "none":
    kw["shard"] = shard
scanax.fit(model, optimizer, loss_fn, (x, y), steps=20, **kw)  # compiles
t0 = time.perf_counter()
r = scanax.fit(model, optimizer, loss_fn, (x, y), steps=STEPS, **kw)
float(r.history["loss"][-1])
seconds = time.perf_counter() - t0
leaves = jtu.tree_leaves((nnx.state(model), nnx.state(optimizer)))
per_device = sum(a.addressable_shards[0].data.nbytes for a in leaves)
if process == 0:
    print(MARK + json.dumps({"steps_per_s": STEPS / seconds, "bytes": per_device}),
          flush=True)
""".replace("STEPS", str(STEPS)).replace("MLP_SOURCE", MLP_SOURCE)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _job(count: int, shard: str) -> dict:
    """One job of ``count`` processes (one CPU device each); process 0's report."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    port = str(_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MARK_LINE + _CHILD, str(i), str(count), port, shard],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            p.kill()
    for line in outs[0][0].splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(
        f"bench_multiprocess: the {count}-process job failed:\n{outs[0][1][-3000:]}"
    )


MARK_LINE = f"MARK = {MARK!r}\n"


def run(quick: bool = False) -> list[dict]:
    rows = []
    counts = (1, 2) if quick else (1, 2, 4)
    jobs = {}  # (shard, processes): process 0's report
    for shard in ("none", "fsdp"):
        one = _job(1, shard)
        for count in counts[1:]:
            many = jobs[shard, count] = _job(count, shard)
            rows.append(
                _timing.row(
                    "multiprocess",
                    f"small MLP, {count} processes x 1 CPU device, shard={shard!r}: "
                    "time per step",
                    1 / many["steps_per_s"],
                    "1 process x 1 device",
                    1 / one["steps_per_s"],
                    notes=f"{many['steps_per_s']:.0f} vs {one['steps_per_s']:.0f} "
                    "steps/s; 2 cores: collective overhead, not speed-up",
                )
            )
    replicated, fsdp = jobs["none", counts[-1]], jobs["fsdp", counts[-1]]
    rows.append(
        _timing.row(
            "multiprocess",
            f"small MLP, parameters + Adam state per device, shard='fsdp' over "
            f"{counts[-1]} processes",
            fsdp["bytes"],
            "replicated",
            replicated["bytes"],
            unit="B",
        )
    )
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
