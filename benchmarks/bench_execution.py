"""``fit(execution=...)`` (issue 28): the fused loop against stepwise calls, and
what ``"auto"`` costs and picks.

Models, each trained by ``scanax.fit`` on array data (optax pytrees, Adam 1e-3,
softmax cross-entropy, shuffled random data), warm (a first fit compiles):

* MLPs 32→W→10, batch 64, for widths W = 32 (the tiny one), 256, 1024, 4096:
  from steps the host's dispatch dominates to steps the arithmetic does;
* the small digits CNN of ``bench_conv`` (conv 16 → conv 32 → dense 10, batch
  32), with fit's convolution rewrite (the default on CPU) and without it
  (``_conv_layout.applies`` patched off: what a loop body XLA runs slowly
  looks like, as the CNN did before the rewrite).

Rows: ``execution="stepwise"`` ÷ ``"fused"``, interleaved medians (the
crossover: where stepwise stops losing), and ``execution="auto"`` on a first
fit of a structure (fit's caches cleared, JAX's compile caches too) ÷ a first
``"fused"`` fit, on the CNN without the rewrite (where stepwise wins) and with
it, for a fit long enough for auto's trial; the notes say what auto chose.

Run alone with ``python -m benchmarks --only execution --out DIR``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import scanax
from scanax import _conv_layout
from scanax._fit import program as _fit_program

try:
    from benchmarks import _timing
    from benchmarks.bench_conv import apply as cnn_apply, init_params as cnn_params
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_conv import (
        apply as cnn_apply,  # type: ignore[no-redef]
        init_params as cnn_params,  # type: ignore[no-redef]
    )


def _mlp(width: int):
    k1, k2 = jr.split(jr.key(0))
    params = {
        "w1": jr.normal(k1, (32, width)) / jnp.sqrt(32.0),
        "b1": jnp.zeros(width),
        "w2": jr.normal(k2, (width, 10)) / jnp.sqrt(float(width)),
        "b2": jnp.zeros(10),
    }

    def loss_fn(p, batch):
        x, y = batch
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    x = jr.normal(jr.key(1), (4096, 32))
    y = jr.randint(jr.key(2), (4096,), 0, 10)
    return params, loss_fn, (x, y), 64


def _cnn():
    def loss_fn(p, batch):
        logits = cnn_apply(p, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    x = jr.normal(jr.key(1), (2048, 8, 8, 1))
    y = jr.randint(jr.key(2), (2048,), 0, 10)
    return cnn_params(jr.key(0)), loss_fn, (x, y), 32


class _NoRewrite:
    """fit's convolution rewrite switched off, for programs traced inside."""

    def __enter__(self):
        self.applies = _conv_layout.applies
        _conv_layout.applies = lambda backend: False
        _fit_program.PROGRAMS.clear()

    def __exit__(self, *exc):
        _conv_layout.applies = self.applies
        _fit_program.PROGRAMS.clear()


def _fresh():
    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()
    jax.clear_caches()


def _fit(model, execution, steps):
    params, loss_fn, data, batch = model
    r = scanax.fit(params, optax.adam(1e-3), loss_fn, data, steps=steps,
                   batch_size=batch, key=jr.key(3), progress=False,
                   execution=execution)  # fmt: skip
    _timing.block(r.model)
    return r


def _pair(model, steps, repeats):
    fns = {e: (lambda e=e: _fit(model, e, steps)) for e in ("fused", "stepwise")}
    return _timing.interleaved(fns, repeats=repeats)


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 5
    backend = jax.default_backend()
    rows = []
    widths = (32, 1024) if quick else (32, 256, 1024, 4096)
    for width in widths:
        steps = 2000 if width <= 256 else 300
        t = _pair(_mlp(width), steps, repeats)
        rows.append(
            _timing.row(
                "execution",
                f"MLP 32-{width}-10, batch 64, {steps} Adam steps: stepwise",
                t["stepwise"],
                'execution="fused"',
                t["fused"],
                notes=f"{t['fused'] / steps * 1e6:.0f} us/step fused ({backend})",
            )
        )
    cnn = _cnn()
    steps = 200 if quick else 400
    cases = [("conv rewrite on", None), ("conv rewrite off", _NoRewrite)]
    for label, context in cases:
        if context is None:
            t = _pair(cnn, steps, repeats)
        else:
            with context():
                t = _pair(cnn, steps, repeats)
        rows.append(
            _timing.row(
                "execution",
                f"digits CNN, batch 32, {steps} Adam steps ({label}): stepwise",
                t["stepwise"],
                'execution="fused"',
                t["fused"],
                notes=f"{t['fused'] / steps * 1e3:.2f} ms/step fused ({backend})",
            )
        )
    # auto on a first fit (compile included), long enough for its trial
    steps = 1500 if quick else 4000
    for label, context in cases:
        times: dict = {"auto": [], "fused": []}
        chosen = []
        for _ in range(max(2, repeats // 2)):
            for execution in ("auto", "fused"):
                _fresh()
                if context is None:
                    seconds, r = _timed_fit(cnn, execution, steps)
                else:
                    with context():
                        seconds, r = _timed_fit(cnn, execution, steps)
                times[execution].append(seconds)
                if execution == "auto":
                    chosen.append(r.execution)
        auto, fused = sorted(times["auto"]), sorted(times["fused"])
        rows.append(
            _timing.row(
                "execution",
                f"first fit, digits CNN, {steps} steps ({label}): auto",
                auto[len(auto) // 2],
                'first fit, execution="fused"',
                fused[len(fused) // 2],
                notes=f"auto chose {', '.join(chosen)} ({backend})",
            )
        )
    return rows


def _timed_fit(model, execution, steps):
    t0 = time.perf_counter()
    r = _fit(model, execution, steps)
    return time.perf_counter() - t0, r


if __name__ == "__main__":
    import json

    for row in run(quick=False):
        print(json.dumps(row))
