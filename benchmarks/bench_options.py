"""What ``fit``'s per-step options cost: ``ema=`` (a moving average of the
parameters kept in the loop), ``precision="bfloat16"`` (the loss computed in
bfloat16 on cast copies) and ``precision="float16"`` (the same in float16, with
dynamic loss scaling: a select per state leaf each step), each ÷ the same
``fit`` without it.

The small MLP 784→256→10 (batch 64, softmax cross-entropy, Adam 1e-3) and the
tiny MLP 32→32→1 (batch 8, MSE), 1000 steps per call, compiled (each call
continues the same model), interleaved in one process. Targets: ``ema=`` ≤ 1.05
on the small MLP; bfloat16 and float16 measured (on CPU they are emulated: they
buy memory, not speed).

Run alone with ``python -m benchmarks.bench_options``.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
    from benchmarks.bench_fit import MLP, mse, xent
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_fit import MLP, mse, xent  # type: ignore[no-redef]

STEPS = 1000
NETWORKS = {"tiny": ((32, 32, 1), 8), "small": ((784, 256, 10), 64)}


def _fns(name: str, steps: int) -> dict:
    sizes, batch = NETWORKS[name]
    loss_fn = mse if sizes[-1] == 1 else xent
    rng = np.random.default_rng(0)
    n = batch * 100
    x = rng.standard_normal((n, sizes[0]), dtype=np.float32)
    y = np.sin(x[:, :1]) if sizes[-1] == 1 else rng.integers(0, sizes[-1], n)
    data = jax.device_put((x, y.astype(np.float32 if sizes[-1] == 1 else np.int32)))

    def make(**options):
        model = MLP(sizes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        state = {"ema": None}

        def call():
            kw = dict(options)
            if "ema" in kw and state["ema"] is not None:
                kw["ema_state"] = state["ema"]
            r = scanax.fit(
                model, optimizer, loss_fn, data, steps=steps, batch_size=batch,
                key=jax.random.key(0), progress=False, **kw,
            )  # fmt: skip
            float(r.history["loss"][-1])
            _timing.block(r.model.layers[0].kernel[...])
            if "ema" in kw:
                state["ema"] = r.ema
                _timing.block(r.ema.layers[0].kernel[...])

        return call

    return {
        "plain": make(),
        "ema": make(ema=0.999),
        "bf16": make(precision="bfloat16"),
        "f16": make(precision="float16"),
    }


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 9
    rows = []
    for name in NETWORKS:
        steps = 200 if quick else STEPS
        t = _timing.interleaved(_fns(name, steps), repeats=repeats)
        desc = f"{name} MLP {'→'.join(map(str, NETWORKS[name][0]))}, {steps} steps"
        target = 1.05 if name == "small" else None
        rows.append(
            _timing.row(
                "fit options",
                f"ema=0.999, {desc}",
                t["ema"],
                "the same fit without",
                t["plain"],
                target,
            )  # fmt: skip
        )
        rows.append(
            _timing.row(
                "fit options",
                f'precision="bfloat16", {desc}',
                t["bf16"],
                "the same fit in float32",
                t["plain"],
            )  # fmt: skip
        )
        rows.append(
            _timing.row(
                "fit options",
                f'precision="float16" (loss scaling), {desc}',
                t["f16"],
                "the same fit in float32",
                t["plain"],
            )  # fmt: skip
        )
    return rows


if __name__ == "__main__":
    for r in run(quick="--quick" in __import__("sys").argv):
        s, b = r["scanax"], r["baseline_value"]
        print(f"{r['case']}: {r['ratio']:.3f} ({s:.4f} s vs {b:.4f} s)")
