"""The headline ratios on whatever accelerator JAX finds, in at most ~5 minutes:
``python benchmarks/device_check.py`` (or ``python -m benchmarks.device_check``).

Run it whenever a GPU/TPU is lent (the project's CPU numbers are in README.md);
it prints one line per row, ``name: ratio (scanax s vs baseline s)``, and the
device, and writes nothing. Rows:

* ``scanax.scan`` vs ``lax.scan`` (a matmul body, 10,000 steps): the
  zero-cost rule (≈ 1.0);
* ``fit`` vs a hand-fused ``jax.jit(lax.scan)`` of the same Adam step (the
  tiny and small MLPs, 1000 steps);
* ``fit``'s execution: ``execution="stepwise"`` ÷ ``"fused"`` (the tiny and
  small MLPs, 1000 steps), and what ``execution="auto"`` chose for a fit long
  enough for its trial;
* ``linear_scan``'s methods at batch 1024, T = 1k and 4k, forward and gradient:
  each method ÷ ``lax.scan`` of the same recurrence, and ``auto`` ÷ the best
  (the rule off CPU is untested until this runs: chunked from 256 steps);
* ``scanax.rnn``'s two orders, 4-layer GRU, forward + backward: ``order="time"``
  ÷ ``order="layer"``;
* the small-CNN train step in ``scanax.scan`` vs ``lax.scan`` (the CPU conv
  layout rewrite does not apply off CPU: ≈ 1.0 expected).
"""

# ruff: noqa: B023  (each loop's closures are timed within their own iteration)
from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scanax

REPEATS = 5
QUICK = "--quick" in sys.argv  # tiny sizes: a smoke test of the script on CPU


def _time(fn, repeats=REPEATS):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pair(name, a, b, note=""):
    ta, tb = _time(a), _time(b)
    print(f"{name}: {ta / tb:.3f} ({ta:.4g} s vs {tb:.4g} s){note}", flush=True)
    return ta, tb


def scan_overhead():
    w = jax.random.normal(jax.random.key(0), (128, 128)) / 12

    def body(h, _):
        return jnp.tanh(h @ w), None

    h0 = jnp.ones((8, 128))
    n = 100 if QUICK else 10_000
    ours = jax.jit(lambda h: scanax.scan(body, h, None, length=n)[0])
    theirs = jax.jit(lambda h: jax.lax.scan(body, h, None, length=n)[0])
    _pair(
        "scanax.scan / lax.scan, matmul body, 10k steps",
        lambda: ours(h0),
        lambda: theirs(h0),
    )


def _mlp(sizes, key):
    keys = jax.random.split(key, len(sizes))
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


def _apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def fit_rows():
    for name, sizes, batch in (("tiny", (32, 32, 1), 8), ("small", (784, 256, 10), 64)):
        n = batch * 100
        x = jax.random.normal(jax.random.key(1), (n, sizes[0]))
        y = jnp.sin(x[:, : sizes[-1]])

        def loss_fn(p, b):
            return jnp.mean((_apply(p, b[0]) - b[1]) ** 2)

        tx = optax.adam(1e-3)
        p0 = _mlp(sizes, jax.random.key(0))

        def step(carry, i):
            p, o = carry
            j = i % 100
            b = (
                jax.lax.dynamic_slice_in_dim(x, j * batch, batch),
                jax.lax.dynamic_slice_in_dim(y, j * batch, batch),
            )
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), loss

        fused = jax.jit(lambda p, o: jax.lax.scan(step, (p, o), jnp.arange(1000)))
        one = jax.jit(lambda c, i: step(c, i))

        def ours():
            r = scanax.fit(
                p0, tx, loss_fn, (x, y), steps=1000, batch_size=batch, progress=False
            )
            return r.model

        def dispatched():
            c = (p0, tx.init(p0))
            for i in range(1000):
                c, _ = one(c, i)
            return c

        _pair(f"fit / hand-fused jit(lax.scan), {name} MLP, 1000 steps", ours,
              lambda: fused(p0, tx.init(p0)))  # fmt: skip
        _pair(f"fit (fused) / Python loop of a jit step, {name} MLP, 1000 steps",
              ours, dispatched)  # fmt: skip

        def stepwise():
            r = scanax.fit(p0, tx, loss_fn, (x, y), steps=1000, batch_size=batch,
                           progress=False, execution="stepwise")  # fmt: skip
            return r.model

        _pair(f"fit stepwise / fused, {name} MLP, 1000 steps", stepwise, ours)
        steps = 500 if QUICK else 20_000
        r = scanax.fit(p0, tx, loss_fn, (x, y), steps=steps, batch_size=batch,
                       progress=False, execution="auto")  # fmt: skip
        print(f"fit execution=auto chose: {r.execution} ({name} MLP, {steps} steps)")


def linear_rows():
    from scanax._linear_scan import linear_scan

    batch = 8 if QUICK else 1024
    for t in (64, 128) if QUICK else (1024, 4096):
        shape = (t, batch, 16)
        a = jax.random.uniform(jax.random.key(0), shape, minval=0.5, maxval=0.99)
        b = jax.random.normal(jax.random.key(1), shape)

        def ref(a, b):
            def f(h, ab):
                h = ab[0] * h + ab[1]
                return h, h

            return jax.lax.scan(f, jnp.zeros_like(b[0]), (a, b))[1]

        fns = {"lax.scan": jax.jit(ref)}
        for m in ("sequential", "associative", "chunked", "auto"):
            fns[m] = jax.jit(lambda a, b, m=m: linear_scan(a, b, method=m)[0])
        for kind in ("forward", "gradient"):
            if kind == "gradient":
                fns = {
                    k: jax.jit(
                        jax.grad(lambda a, b, f=f: jnp.sum(f(a, b) ** 2), (0, 1))
                    )
                    for k, f in fns.items()
                }
            times = {k: _time(lambda f=f: f(a, b), 3) for k, f in fns.items()}
            base = times["lax.scan"]
            best = min(times[m] for m in ("sequential", "associative", "chunked"))
            cells = ", ".join(
                f"{m} {times[m] / base:.2f}"
                for m in ("sequential", "associative", "chunked")
            )
            print(
                f"linear_scan ÷ lax.scan, batch {batch}, T={t}, {kind}: {cells}; "
                f"auto ÷ best {times['auto'] / best:.2f} ({base:.4g} s lax.scan)",
                flush=True,
            )


def rnn_rows():
    from flax import nnx

    cells = [nnx.GRUCell(64, 64, rngs=nnx.Rngs(i)) for i in range(4)]
    x = jax.random.normal(jax.random.key(0), (16 if QUICK else 256, 32, 64))

    def loss(cells, order):
        return jnp.sum(scanax.rnn(cells, x, order=order)[1] ** 2)

    grads = {o: nnx.jit(nnx.grad(lambda c, o=o: loss(c, o))) for o in ("time", "layer")}
    _pair("rnn order='time' / order='layer', 4-layer GRU, T 256, fwd+bwd",
          lambda: grads["time"](cells), lambda: grads["layer"](cells))  # fmt: skip


def conv_rows():
    x = jax.random.normal(jax.random.key(0), (32, 8, 8, 1))
    y = jax.random.randint(jax.random.key(1), (32,), 0, 10)
    k1 = jax.random.normal(jax.random.key(2), (3, 3, 1, 16)) * 0.3
    k2 = jax.random.normal(jax.random.key(3), (3, 3, 16, 32)) * 0.1
    wd = jax.random.normal(jax.random.key(4), (8 * 8 * 32, 10)) * 0.01
    p0 = {"k1": k1, "k2": k2, "wd": wd}
    tx = optax.adam(1e-3)

    def loss_fn(p):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.nn.relu(
            jax.lax.conv_general_dilated(
                x, p["k1"], (1, 1), "SAME", dimension_numbers=dn
            )
        )
        h = jax.nn.relu(
            jax.lax.conv_general_dilated(
                h, p["k2"], (1, 1), "SAME", dimension_numbers=dn
            )
        )
        logits = h.reshape(32, -1) @ p["wd"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(c, _):
        p, o = c
        g = jax.grad(loss_fn)(p)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), None

    ours = jax.jit(lambda: scanax.scan(step, (p0, tx.init(p0)), None, length=200)[0])
    theirs = jax.jit(lambda: jax.lax.scan(step, (p0, tx.init(p0)), None, length=200)[0])
    _pair("scanax.scan / lax.scan, small CNN Adam step, 200 steps", ours, theirs)


def main() -> int:
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"jax {jax.__version__}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    for part in (scan_overhead, fit_rows, linear_rows, rnn_rows, conv_rows):
        try:
            part()
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"{part.__name__}: failed: {type(err).__name__}: {err}", flush=True)
    print(f"total: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
