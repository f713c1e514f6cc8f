"""``scanax.fit`` against hand-written training loops (issue 4), side by side.

Two models, Adam, the same batches (array data in order, no shuffle) for every
candidate:

* tiny MLP 32→32→1, batch 8, 1000 steps (MSE);
* small MLP 784→256→10, batch 64 (softmax cross-entropy).

Candidates: ``scanax.fit`` (defaults, ``progress=False``); a Python loop of
``@nnx.jit`` steps; a Python loop of ``jax.jit`` steps over ``nnx.split`` state
(merge/split inside); one hand-fused ``jax.jit(lax.scan)``: ``nnx.split`` the
model and optimizer, scan, ``nnx.update`` them (the same job as ``fit``); and the
same scan on state kept split between runs (no NNX objects at all: a lower bound).
Targets: fit ≤ 0.05× the ``nnx.jit`` loop (≥ 20× faster) on the tiny model; fit ≤
1.3× the hand-fused scan on both. Each candidate ends by waiting for its trained
model's first kernel (and its losses), so all do the same work: train, then have
the result on hand.

Run alone with ``python -m benchmarks.bench_fit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]


class MLP(nnx.Module):
    def __init__(self, sizes, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def xent(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _case(name, sizes, batch, steps, loss_fn, repeats):
    n = batch * min(steps, 125)
    x = jr.normal(jr.key(0), (n, sizes[0]))
    if loss_fn is mse:
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
    stacked = jax.tree.map(lambda *b: jnp.stack(b), *batches)
    tx = optax.adam(1e-3)

    def fresh():
        model = MLP(sizes, nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    # scanax.fit
    fit_model, fit_opt = fresh()

    def run_fit():
        r = scanax.fit(
            fit_model,
            fit_opt,
            loss_fn,
            (x, y),
            steps=steps,
            batch_size=batch,
            progress=False,
        )
        _timing.block(r.model.layers[0].kernel[...])

    # Python loop of nnx.jit steps
    nnx_model, nnx_opt = fresh()

    @nnx.jit
    def nnx_step(model, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return loss

    def run_nnx_loop():
        for b in batches:
            loss = nnx_step(nnx_model, nnx_opt, b)
        _timing.block(loss)

    # Python loop of jax.jit steps on split state
    graphdef, state0 = nnx.split(fresh())

    def pure_step(state, b):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return nnx.split((model, opt))[1], loss

    jit_step = jax.jit(pure_step)
    jit_state = [state0]

    def run_jit_loop():
        s = jit_state[0]
        for b in batches:
            s, loss = jit_step(s, b)
        jit_state[0] = s
        _timing.block(loss)

    # Hand-fused: one jitted lax.scan over split state. As a user writes it:
    # split the model and optimizer, scan, write the result back (what fit does);
    # and, for reference, with the state kept split between runs.
    fused = jax.jit(lambda s, xs: jax.lax.scan(pure_step, s, xs))
    hand_model, hand_opt = fresh()
    fused_state = [nnx.split(fresh())[1]]

    def run_fused():
        _, s = nnx.split((hand_model, hand_opt))
        s, losses = fused(s, stacked)
        nnx.update((hand_model, hand_opt), s)
        _timing.block((losses, hand_model.layers[0].kernel[...]))

    def run_fused_state():
        s, losses = fused(fused_state[0], stacked)
        fused_state[0] = s
        _timing.block(losses)

    # Two interleaved groups: fit against the fused scans (close: many repeats), and
    # fit against the Python loops (far apart, and slow: fewer repeats).
    t = _timing.interleaved(
        {"fit": run_fit, "fused": run_fused, "state": run_fused_state},
        repeats=4 * repeats,
    )
    slow = _timing.interleaved(
        {"fit": run_fit, "nnx": run_nnx_loop, "jit": run_jit_loop}, repeats=repeats
    )
    desc = f"{name} MLP {'→'.join(map(str, sizes))}, batch {batch}, {steps} steps"
    rows = [
        _timing.row(
            "fit",
            desc,
            t["fit"],
            "hand-fused lax.scan (split, scan, update)",
            t["fused"],
            1.3,
        ),
        _timing.row(
            "fit",
            desc,
            t["fit"],
            "hand-fused lax.scan on already-split state",
            t["state"],
            notes="no split/update of the NNX objects: a lower bound",
        ),
        _timing.row(
            "fit",
            desc,
            slow["fit"],
            "Python loop of nnx.jit steps",
            slow["nnx"],
            0.05 if name == "tiny" else None,
            notes=f"{slow['nnx'] / slow['fit']:.1f}x faster",
        ),
        _timing.row(
            "fit",
            desc,
            slow["fit"],
            "Python loop of jax.jit split/merge steps",
            slow["jit"],
            notes=f"{slow['jit'] / slow['fit']:.1f}x faster",
        ),
    ]
    return rows


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 11
    rows = _case("tiny", (32, 32, 1), 8, 1000, mse, repeats)
    rows += _case("small", (784, 256, 10), 64, 100 if quick else 300, xent, repeats)
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
