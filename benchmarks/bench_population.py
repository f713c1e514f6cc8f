"""Populations (issue 14): a learning-rate sweep of 64 tiny MLPs, side by side.

Tiny MLP 32→32→1, batch 8, MSE, Adam, 1000 steps, one process's CPU, end to end
(the call returns when the losses are on the host):

* **population**: ``scanax.population`` of 64 members (64 learning rates) and one
  ``scanax.fit``, population built inside the timing, compiled programs cached
  (a second sweep in the same session).
* **sequential, reused**: 64 ``scanax.fit`` calls on members built with
  ``optax.inject_hyperparams(optax.adam)``, so that one compiled loop serves every
  learning rate (the best a sequential sweep can do). Target: population ≥ 5×
  faster (ratio ≤ 0.2).
* **sequential, rebuilt**: 64 ``scanax.fit`` calls each building a new model and
  ``optax.adam(lr)``, as a sweep script does (each new ``lr`` is a new program).
  Target: population ≥ 50× faster (ratio ≤ 0.02).
* **floor**: the same sweep hand-written in pure JAX, ``jax.jit(jax.vmap(train))``
  over the members' own batches, compiled once: what one vmapped loop of these
  members costs at least on this machine, next to the same sequential baseline.
* **1024 members**: one population ``fit`` of 1024 members, 1000 steps; the
  process's peak resident memory is reported (bound: 2 GiB).

Run alone with ``python -m benchmarks.bench_population``.
"""

from __future__ import annotations

import resource

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
    from benchmarks.bench_fit import MLP
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_fit import MLP  # type: ignore[no-redef]

SIZES, BATCH, STEPS = (32, 32, 1), 8, 1000
X = jr.normal(jr.key(0), (BATCH * 125, 32))
Y = jnp.sin(X[:, :1])


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def make(key, lr):
    model = MLP(SIZES, nnx.Rngs(key))
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def make_injected(key, lr):
    """The learning rate as optimizer state, set after building: every member has
    the same optimizer structure and code, so one compiled loop serves all."""
    model = MLP(SIZES, nnx.Rngs(key))
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.opt_state.hyperparams["learning_rate"].value = jnp.float32(lr)
    return model, optimizer


def _hand_written(n):
    """The floor: the same sweep written by hand, PureJaxRL style, in pure JAX:
    ``jax.jit(jax.vmap(train))`` where ``train`` is a ``lax.scan`` of
    value_and_grad and Adam (``inject_hyperparams``, the learning rate traced)
    over the member's own shuffled batches (index arrays drawn per call, on
    device). No finiteness test, no history beyond the losses, no NNX. Returns a
    zero-argument callable (compiled once, reused) giving the last losses."""
    nb = X.shape[0] // BATCH
    epochs = -(-STEPS // nb)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)

    def init(key):
        k1, k2 = jr.split(key)
        lecun = jax.nn.initializers.lecun_normal()
        return [
            {"w": lecun(k1, (32, 32)), "b": jnp.zeros(32)},
            {"w": lecun(k2, (32, 1)), "b": jnp.zeros(1)},
        ]

    def apply(p, x):
        return jax.nn.relu(x @ p[0]["w"] + p[0]["b"]) @ p[1]["w"] + p[1]["b"]

    def train(params, lr, idx):
        state = tx.init(params)
        state.hyperparams["learning_rate"] = lr

        def step(carry, i):
            p, s = carry
            x, y = X[i], Y[i]
            loss, g = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(p)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        return jax.lax.scan(step, (params, state), idx)[1]

    def orders(key):
        perms = [jr.permutation(jr.fold_in(key, e), X.shape[0]) for e in range(epochs)]
        return jnp.concatenate(perms)[: STEPS * BATCH].reshape(STEPS, BATCH)

    @jax.jit
    def sweep(keys, lrs, fit_keys):
        params = jax.vmap(init)(keys)
        return jax.vmap(train)(params, lrs, jax.vmap(orders)(fit_keys))[:, -1]

    lrs = jnp.asarray(np.logspace(-4, -2, n).astype(np.float32))
    keys, fit_keys = jr.split(jr.key(0), n), jr.split(jr.key(1), n)
    return lambda: np.asarray(sweep(keys, lrs, fit_keys))


def _sweep(n, repeats, rebuilt_members):
    lrs = np.logspace(-4, -2, n).astype(np.float32)
    keys = jr.split(jr.key(0), n)
    fit_keys = jr.split(jr.key(1), n)
    common = dict(steps=STEPS, batch_size=BATCH, progress=False)

    def population():
        pop = scanax.population(make, n, key=jr.key(0), lr=lrs)
        r = scanax.fit(pop, None, loss_fn, (X, Y), key=jr.key(1), **common)
        return r.history["loss"][:, -1]

    def sequential(builder, members):
        out = []
        for i in range(members):
            model, opt = builder(keys[i], float(lrs[i]))
            r = scanax.fit(model, opt, loss_fn, (X, Y), key=fit_keys[i], **common)
            out.append(float(r.history["loss"][-1]))
        return out

    t = _timing.interleaved(
        {
            "population": population,
            "reused": lambda: sequential(make_injected, n),
            "hand": _hand_written(n),
        },
        repeats=repeats,
    )
    # Rebuilt: every member compiles; run once per repeat (it takes a minute).
    rebuilt = _timing.interleaved(
        {
            "population": population,
            "rebuilt": lambda: sequential(make, rebuilt_members),
        },
        repeats=max(1, repeats // 3),
        warmup=0,
    )
    scale = n / rebuilt_members
    note = "" if scale == 1 else f" (first {rebuilt_members} members, times x{scale:g})"
    return [
        _timing.row(
            "population",
            f"{n} tiny MLPs x {STEPS} steps: one population fit",
            t["population"],
            f"{n} sequential fits, one compiled loop (inject_hyperparams)",
            t["reused"],
            0.2,
        ),
        _timing.row(
            "population",
            "floor: the same sweep hand-written, jax.jit(jax.vmap(train)) in pure JAX",
            t["hand"],
            f"{n} sequential fits, one compiled loop (inject_hyperparams)",
            t["reused"],
            notes="what one vmapped loop of these members computes in at least",
        ),
        _timing.row(
            "population",
            f"{n} tiny MLPs x {STEPS} steps: one population fit",
            t["population"],
            "the hand-written jax.jit(jax.vmap(train)) above",
            t["hand"],
        ),
        _timing.row(
            "population",
            f"{n} tiny MLPs x {STEPS} steps: one population fit",
            rebuilt["population"],
            f"{n} sequential fits, new model + optax.adam(lr) each{note}",
            rebuilt["rebuilt"] * scale,
            0.02,
        ),
    ]


def _large(n):
    lrs = np.logspace(-4, -2, n).astype(np.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = _timing.timed(
        lambda: scanax.fit(
            scanax.population(make, n, key=jr.key(0), lr=lrs),
            None,
            loss_fn,
            (X, Y),
            steps=STEPS,
            batch_size=BATCH,
            key=jr.key(1),
            progress=False,
        ).history["loss"][:, -1]
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux)
    return [
        _timing.row(
            "population",
            f"{n} tiny MLPs x {STEPS} steps (first call, compile included)",
            t,
            "peak resident memory of the process, GiB (bound 2)",
            peak,
            notes=f"peak RSS {peak:.2f} GiB (before: {before / 2**20:.2f} GiB)",
        )
    ]


def run(quick: bool = False) -> list[dict]:
    rows = _sweep(64, 3 if quick else 5, 8 if quick else 64)
    rows += _large(1024)
    return rows


if __name__ == "__main__":
    print(jax.devices())
    print(_timing.markdown(run()))
