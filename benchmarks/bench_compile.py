"""What users wait for when they rebuild things (issues 13 and 18), side by side.

Tiny MLP 32→32→1, batch 8, MSE, Adam, 1000 steps, on one process's CPU:

* **rebuilt per call**: a notebook cell re-run or a sweep iteration builds the
  model, a new ``optax.adam(1e-3)`` and a re-defined ``loss_fn``, then trains and
  reads the last loss on the host. ``scanax.fit`` against a Python loop of
  ``@nnx.jit`` steps rebuilt the same way (its step function is re-defined too, as
  it is in such a cell). Target: fit ≥ 5× faster (ratio ≤ 0.2).
* **compile**: the time a first call pays over a steady-state call of the same
  steps (first call after ``jax.clear_caches()`` and scanax's own caches, minus a
  compiled call), fit against the same steps hand-fused into one
  ``jax.jit(lax.scan)`` (split/merge, value_and_grad, update, pre-stacked
  batches). Target ≤ 1.2 (tiny and small MLP).
* **epoch loop**: 40 ``fit`` calls of 25 steps (continuing) against one call of
  1000 steps, everything compiled, tiny and small MLP. Target ≤ 1.5. Next to it
  the floor: the same split for a hand-fused jitted chunk (what any loop of
  short calls that returns to Python pays).

Run alone with ``python -m benchmarks.bench_compile``.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from flax import nnx

import scanax
from scanax._fit import program as _fit_program

try:
    from benchmarks import _timing
    from benchmarks.bench_fit import MLP
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_fit import MLP  # type: ignore[no-redef]


def _data(sizes, batch, steps):
    n = batch * min(steps, 125)
    x = jr.normal(jr.key(0), (n, sizes[0]))
    if sizes[-1] == 1:
        y = jnp.sin(x[:, :1])
    else:
        y = jr.randint(jr.key(1), (n,), 0, sizes[-1])
    per_epoch = n // batch
    batches = [
        (
            x[(t % per_epoch) * batch : (t % per_epoch + 1) * batch],
            y[(t % per_epoch) * batch : (t % per_epoch + 1) * batch],
        )
        for t in range(steps)
    ]
    return x, y, batches


def _make_loss(classify):
    """A new loss function object with the same code, as a re-run cell makes."""
    if classify:

        def loss_fn(model, batch):
            x, y = batch
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    else:

        def loss_fn(model, batch):
            x, y = batch
            return jnp.mean((model(x) - y) ** 2)

    return loss_fn


def _rebuilt(repeats):
    sizes, batch, steps = (32, 32, 1), 8, 1000
    x, y, batches = _data(sizes, batch, steps)

    def run_fit():
        model = MLP(sizes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        r = scanax.fit(
            model,
            optimizer,
            _make_loss(False),
            (x, y),
            steps=steps,
            batch_size=batch,
            progress=False,
        )
        float(r.history["loss"][-1])

    def run_loop():
        model = MLP(sizes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        loss_fn = _make_loss(False)

        @nnx.jit
        def step(model, optimizer, b):
            loss, grads = nnx.value_and_grad(loss_fn)(model, b)
            optimizer.update(model, grads)
            return loss

        for b in batches:
            loss = step(model, optimizer, b)
        float(loss)

    t = _timing.interleaved({"fit": run_fit, "loop": run_loop}, repeats=repeats)
    return [
        _timing.row(
            "compile",
            "tiny MLP 32→32→1, batch 8, 1000 steps, model/optimizer/loss_fn "
            "rebuilt per call",
            t["fit"],
            "Python loop of nnx.jit steps, rebuilt the same way",
            t["loop"],
            0.2,
            notes=f"{t['loop'] / t['fit']:.1f}x faster",
        )
    ]


def _hand_fused(graphdef, loss_fn):
    """The same steps fused by hand: ``jax.jit(lax.scan)`` of split/merge,
    value_and_grad and the optimizer's update over pre-stacked batches."""

    def step(state, b):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return nnx.split((model, opt))[1], loss

    return jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))


def _clear():
    jax.clear_caches()
    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()


def _compile(name, sizes, batch, steps, repeats):
    """First-call overhead (first call minus a compiled call), fit vs hand-fused."""
    classify = sizes[-1] != 1
    x, y, batches = _data(sizes, batch, steps)
    stacked = jax.tree.map(lambda *b: jnp.stack(b), *batches)
    loss_fn = _make_loss(classify)

    def fresh():
        model = MLP(sizes, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def fit_call(model, optimizer):
        r = scanax.fit(
            model,
            optimizer,
            loss_fn,
            (x, y),
            steps=steps,
            batch_size=batch,
            progress=False,
            steps_per_call=steps,
        )
        float(r.history["loss"][-1])

    def fused_call(model, optimizer, fused):
        graphdef, state = nnx.split((model, optimizer))
        fn = fused[0] or _hand_fused(graphdef, loss_fn)
        fused[0] = fn
        state, losses = fn(state, stacked)
        nnx.update((model, optimizer), state)
        float(losses[-1])

    overhead = {"fit": [], "fused": []}
    for _ in range(repeats):
        # fit: first call (everything cleared) and a second, compiled one.
        _clear()
        m, o = fresh()
        t0 = time.perf_counter()
        fit_call(m, o)
        first = time.perf_counter() - t0
        m, o = fresh()
        t0 = time.perf_counter()
        fit_call(m, o)
        overhead["fit"].append(first - (time.perf_counter() - t0))
        # hand-fused
        _clear()
        fused = [None]
        m, o = fresh()
        t0 = time.perf_counter()
        fused_call(m, o, fused)
        first = time.perf_counter() - t0
        m, o = fresh()
        t0 = time.perf_counter()
        fused_call(m, o, fused)
        overhead["fused"].append(first - (time.perf_counter() - t0))
    fit_s = statistics.median(overhead["fit"])
    fused_s = statistics.median(overhead["fused"])
    what = "first-call overhead (compile)"
    return [
        _timing.row(
            "compile",
            f"{name} MLP {'→'.join(map(str, sizes))}, batch {batch}, {steps} steps: "
            + what,
            fit_s,
            "hand-fused jax.jit(lax.scan), first-call overhead",
            fused_s,
            1.2,
        )
    ]


def _epoch_loop(name, sizes, batch, repeats):
    """40 continuing ``fit`` calls of 25 steps against one of 1000; and the same
    split for a hand-fused ``jax.jit(lax.scan)`` chunk (25 steps per call, the
    losses read on the host after each, as fit's history is): what any loop
    that returns to Python between short calls pays at least."""
    classify = sizes[-1] != 1
    x, y, batches = _data(sizes, batch, 1000)
    stacked = jax.tree.map(lambda *b: jnp.stack(b), *batches)
    loss_fn = _make_loss(classify)
    model = MLP(sizes, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def call(steps):
        return scanax.fit(
            model,
            optimizer,
            loss_fn,
            (x, y),
            steps=steps,
            batch_size=batch,
            key=jr.key(0),
            progress=False,
        )

    def run_loop():
        for _ in range(40):
            r = call(25)
        float(r.history["loss"][-1])

    def run_one():
        float(call(1000).history["loss"][-1])

    graphdef, state = nnx.split((model, optimizer))
    fused = _hand_fused(graphdef, loss_fn)
    pieces = [
        jax.tree.map(lambda a, i=i: a[i * 25 : (i + 1) * 25], stacked)
        for i in range(40)
    ]
    held = [state]

    def fused_loop():
        s = held[0]
        for xs in pieces:
            s, losses = fused(s, xs)
            np.asarray(losses)

    def fused_one():
        _, losses = fused(held[0], stacked)
        np.asarray(losses)

    t = _timing.interleaved(
        {"loop": run_loop, "one": run_one, "floop": fused_loop, "fone": fused_one},
        repeats=repeats,
    )
    label = f"{name} MLP {'→'.join(map(str, sizes))}, batch {batch}"
    return [
        _timing.row(
            "compile",
            f"epoch loop: 40 fit calls of 25 steps ({label}, compiled)",
            t["loop"],
            "one fit call of 1000 steps",
            t["one"],
            1.5,
        ),
        _timing.row(
            "compile",
            f"floor: 40 hand-fused jitted calls of 25 steps ({label})",
            t["floop"],
            "one hand-fused jitted call of 1000 steps",
            t["fone"],
            notes="what any host loop of short calls pays at least",
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 9
    rows = _rebuilt(repeats)
    rows += _compile("tiny", (32, 32, 1), 8, 1000, 2 if quick else 5)
    rows += _compile("small", (784, 256, 10), 64, 1000, 2 if quick else 5)
    rows += _epoch_loop("tiny", (32, 32, 1), 8, repeats)
    rows += _epoch_loop("small", (784, 256, 10), 64, repeats)
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
