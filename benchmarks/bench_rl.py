"""PPO on CartPole-v1 (issue 28): ``scanax.fit`` with ``scanax.Rollout`` against
the hand-written PureJaxRL loop, side by side.

PureJaxRL's CartPole defaults (``purejaxrl/ppo.py``): 4 environments, 128 steps
per rollout, 4 update epochs of 4 minibatches (128 transitions each), GAE with
gamma 0.99 and lambda 0.95, clip 0.2, entropy 0.01, value 0.5, global norm 0.5,
Adam(eps=1e-5) with the learning rate 2.5e-4 annealed linearly to 0 over the
updates, a tanh actor and a tanh critic of two 64-unit layers with orthogonal
initialisation (sqrt(2), the actor's head 0.01, the critic's 1.0; computed by
Gram-Schmidt, ``orthogonal`` below, on both sides: LAPACK's batched QR hung the
hand-written program on this machine). 5e5
environment steps (976 updates; quick mode 5e4), 8 seeds. The environment is
``benchmarks/_cartpole.py`` (gymnax's CartPole-v1, written in JAX here so that
the benchmark needs no gymnax).

* **hand-written**: ``jax.jit(jax.vmap(train))(jax.random.split(key, 8))``,
  ``train`` PureJaxRL's structure: a ``lax.scan`` over updates, each a
  ``lax.scan`` over the environment steps, GAE (a reverse scan), then a scan over
  epochs of a scan over minibatches. It returns what fit's history holds: the
  loss terms of every minibatch step and each update's mean return of the
  episodes that ended.
* **Rollout**: ``scanax.fit(scanax.population(make, 8, key=...), None, loss_fn,
  scanax.Rollout(collect, init, epochs=4, minibatches=4), steps=976 * 16,
  key=key)``, a pytree model (a dict of params) and ``optax.chain(
  optax.clip_by_global_norm(0.5), optax.adam(schedule, eps=1e-5))``; ``collect``
  runs the 128 x 4 environment steps and GAE and returns the 512 transitions.
* **single seed**: a solo ``fit`` against ``jax.jit(train)``.

Times are end to end: a fresh ``make``/model each repetition, the compiled
programs cleared first (``jax.clear_caches()`` and fit's own), so each pays its
compile, and the result read on the host. Target: Rollout / hand-written <=
1.05. In quick mode a second row per case times the same calls with the
programs compiled (a second run in the session); at the full size that would
double the benchmark's time (about 20 minutes on a loaded 2-core CPU).
Returns: the mean over seeds of the mean return of the episodes that ended in
the last 10 rollouts (rollouts where no episode ended are skipped). CartPole's
maximum is 500. With the hand-written loop's keys drawn as ``Rollout`` draws
them, the two agree to float rounding (checked by hand: losses of 48 steps to
4e-6, parameters to 3e-8).

Run alone with ``python -m benchmarks.bench_rl``.
"""

from __future__ import annotations

import functools as ft
import statistics
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import scanax
from scanax._fit import program as _fit_program

# The environment's functions by name, not the module: fit recognises
# functions it has compiled by their code and the globals they read, and a user's
# module read as a global (``env.step``) defeats that (see docs/compile.md).
try:
    from benchmarks import _timing
    from benchmarks._cartpole import ACTIONS, OBS_SIZE, reset, step
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from _cartpole import ACTIONS, OBS_SIZE, reset, step  # type: ignore[no-redef]

NUM_ENVS, NUM_STEPS = 4, 128
EPOCHS, MINIBATCHES = 4, 4
GAMMA, GAE_LAMBDA = 0.99, 0.95
CLIP_EPS, ENT_COEF, VF_COEF = 0.2, 0.01, 0.5
MAX_GRAD_NORM, LR = 0.5, 2.5e-4
HIDDEN, SEEDS = 64, 8
BATCH = NUM_ENVS * NUM_STEPS  # 512 transitions per rollout


# ------------------------------------------------------------------ the agent


def orthogonal(scale):
    """``jax.nn.initializers.orthogonal(scale)`` for a 2-D shape, by Gram-Schmidt
    (twice per column) instead of LAPACK's QR: the same matrix (the QR's Q with
    its signs fixed) to float rounding. jaxlib 0.10.2's batched QR kernels fan
    out onto the intra-op thread pool they run on and can deadlock it: on this
    2-core machine the hand-written ``jax.jit(jax.vmap(train))`` hung in one
    benchmark run of three, inside the QRs of its initialisers. Both sides use
    this initialiser, so the comparison is unchanged."""

    def init(key, shape, dtype=jnp.float32):
        n_rows, n_cols = shape
        tall = n_rows >= n_cols
        a = jr.normal(key, (n_rows, n_cols) if tall else (n_cols, n_rows), dtype)
        q = _gram_schmidt(a)
        return scale * (q if tall else q.T)

    return init


@jax.jit  # (compiled once per shape: the solo ``make`` runs eagerly)
def _gram_schmidt(a):
    def column(q, j):
        v = a[:, j]
        for _ in range(2):  # ("twice is enough")
            v = v - q @ (q.T @ v)
        return q.at[:, j].set(v / jnp.linalg.norm(v)), None

    return jax.lax.scan(column, jnp.zeros_like(a), jnp.arange(a.shape[1]))[0]


def init_params(key):
    """PureJaxRL's ``ActorCritic``: two tanh MLPs, orthogonal kernels, zero
    biases."""
    sizes = [(OBS_SIZE, HIDDEN), (HIDDEN, HIDDEN)]
    scales = {"actor": [2**0.5, 2**0.5, 0.01], "critic": [2**0.5, 2**0.5, 1.0]}
    out = {"actor": ACTIONS, "critic": 1}
    params = {}
    for name, net_key in zip(("actor", "critic"), jr.split(key)):
        layers = []
        for k, (n_in, n_out), s in zip(
            jr.split(net_key, 3), [*sizes, (HIDDEN, out[name])], scales[name]
        ):
            w = orthogonal(s)(k, (n_in, n_out), jnp.float32)
            layers.append({"w": w, "b": jnp.zeros(n_out)})
        params[name] = layers
    return params


def _mlp(layers, x):
    for layer in layers[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ layers[-1]["w"] + layers[-1]["b"]


def policy(params, obs):
    """``(logits, value)``."""
    return _mlp(params["actor"], obs), _mlp(params["critic"], obs)[..., 0]


def schedule(num_updates):
    """PureJaxRL's ``linear_schedule`` (``count``: optimizer steps)."""

    def lr(count):
        return LR * (1.0 - (count // (MINIBATCHES * EPOCHS)) / num_updates)

    return lr


def optimizer(num_updates):
    return optax.chain(
        optax.clip_by_global_norm(MAX_GRAD_NORM),
        optax.adam(schedule(num_updates), eps=1e-5),
    )


def loss_fn(params, batch):
    """PureJaxRL's ``_loss_fn``: clipped surrogate, clipped value loss, entropy
    bonus; the advantages normalised per minibatch."""
    logits, value = policy(params, batch["obs"])
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, batch["action"][:, None], axis=1)[:, 0]
    v_old = batch["value"]
    v_clipped = v_old + jnp.clip(value - v_old, -CLIP_EPS, CLIP_EPS)
    value_loss = (
        0.5
        * jnp.maximum(
            (value - batch["target"]) ** 2, (v_clipped - batch["target"]) ** 2
        ).mean()
    )
    ratio = jnp.exp(logp - batch["logp"])
    gae = batch["advantage"]
    gae = (gae - gae.mean()) / (gae.std() + 1e-8)
    actor_loss = -jnp.minimum(
        ratio * gae, jnp.clip(ratio, 1.0 - CLIP_EPS, 1.0 + CLIP_EPS) * gae
    ).mean()
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1).mean()
    total = actor_loss + VF_COEF * value_loss - ENT_COEF * entropy
    return total, {
        "value_loss": value_loss,
        "actor_loss": actor_loss,
        "entropy": entropy,
    }


# ------------------------------------------------------------------ the rollout


def env_init(key):
    """``NUM_ENVS`` environments, reset: ``(obs, states)``."""
    return jax.vmap(reset)(jr.split(key, NUM_ENVS))


def _rollout(params, obs, states, key):
    """``NUM_STEPS`` steps of the policy: PureJaxRL's ``_env_step`` scan, then
    GAE with the value of the last observation."""

    def one(carry, key):
        obs, states = carry
        act_key, step_key = jr.split(key)
        logits, value = policy(params, obs)
        action = jr.categorical(act_key, logits)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=1)[
            :, 0
        ]
        obs2, states, reward, done, returned = jax.vmap(step)(
            jr.split(step_key, NUM_ENVS), states, action
        )
        t = {"obs": obs, "action": action, "logp": logp, "value": value,
             "reward": reward, "done": done, "returned": returned}  # fmt: skip
        return (obs2, states), t

    (obs, states), traj = jax.lax.scan(one, (obs, states), jr.split(key, NUM_STEPS))
    _, last_value = policy(params, obs)

    def gae_step(carry, t):
        gae, next_value = carry
        not_done = 1.0 - t["done"]
        delta = t["reward"] + GAMMA * next_value * not_done - t["value"]
        gae = delta + GAMMA * GAE_LAMBDA * not_done * gae
        return (gae, t["value"]), gae

    _, adv = jax.lax.scan(
        gae_step, (jnp.zeros_like(last_value), last_value), traj, reverse=True,
        unroll=16,
    )  # fmt: skip
    done = traj["done"]
    finished = jnp.sum(done)
    ret = jnp.where(finished > 0, jnp.sum(traj["returned"] * done) / finished, jnp.nan)
    batch = {
        "obs": traj["obs"].reshape(BATCH, OBS_SIZE),
        "action": traj["action"].reshape(BATCH),
        "logp": traj["logp"].reshape(BATCH),
        "value": traj["value"].reshape(BATCH),
        "advantage": adv.reshape(BATCH),
        "target": (adv + traj["value"]).reshape(BATCH),
    }
    return batch, obs, states, {"return": ret, "episodes": finished.astype(jnp.float32)}


def collect(params, carry, key):
    """``scanax.Rollout``'s ``collect``: one rollout with the current policy."""
    obs, states = carry
    batch, obs, states, metrics = _rollout(params, obs, states, key)
    return batch, (obs, states), metrics


# ------------------------------------------------------------------ the two trainers


def make_train(num_updates):
    """PureJaxRL's ``make_train``: ``train(key)`` -> the history."""
    tx = optimizer(num_updates)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train(key):
        key, init_key, reset_key = jr.split(key, 3)
        params = init_params(init_key)
        opt_state = tx.init(params)
        obs, states = env_init(reset_key)

        def update(runner, _):
            params, opt_state, obs, states, key = runner
            key, collect_key = jr.split(key)
            batch, obs, states, metrics = _rollout(params, obs, states, collect_key)

            def epoch(carry, _):
                params, opt_state, key = carry
                key, perm_key = jr.split(key)
                perm = jr.permutation(perm_key, BATCH)
                mbs = jax.tree.map(
                    lambda x: jnp.take(x, perm, axis=0).reshape(
                        MINIBATCHES, -1, *x.shape[1:]
                    ),
                    batch,
                )

                def minibatch(carry, mb):
                    params, opt_state = carry
                    (loss, aux), grads = grad_fn(params, mb)
                    updates, opt_state = tx.update(grads, opt_state, params)
                    return (optax.apply_updates(params, updates), opt_state), (
                        loss,
                        aux,
                    )

                (params, opt_state), out = jax.lax.scan(
                    minibatch, (params, opt_state), mbs
                )
                return (params, opt_state, key), out

            (params, opt_state, key), losses = jax.lax.scan(
                epoch, (params, opt_state, key), None, EPOCHS
            )
            return (params, opt_state, obs, states, key), (losses, metrics)

        runner = (params, opt_state, obs, states, key)
        runner, (losses, metrics) = jax.lax.scan(update, runner, None, num_updates)
        return {"params": runner[0], "loss": losses, "metrics": metrics}

    return train


def make(num_updates, key):
    """One member of the population: a dict of params and its optimizer."""
    return init_params(key), optimizer(num_updates)


def fit_rollout(num_updates, key, seeds):
    """``scanax.fit`` with a ``Rollout``: ``seeds`` members (None: one model)."""
    rollout = scanax.Rollout(collect, env_init, epochs=EPOCHS, minibatches=MINIBATCHES)
    steps = num_updates * EPOCHS * MINIBATCHES
    model_key, fit_key = jr.split(key)
    if seeds is None:
        params, tx = make(num_updates, model_key)
        return scanax.fit(
            params, tx, loss_fn, rollout, steps=steps, key=fit_key, progress=False
        )
    pop = scanax.population(ft.partial(make, num_updates), seeds, key=model_key)
    return scanax.fit(pop, None, loss_fn, rollout, steps=steps, key=fit_key,
                      progress=False)  # fmt: skip


def _final_return(returns, last=10):
    """Mean over seeds of the mean return in the last ``last`` rollouts where
    an episode ended. ``returns``: [seeds, rollouts]."""
    returns = np.atleast_2d(np.asarray(returns, np.float64))[:, -last:]
    return float(np.mean(np.nanmean(returns, axis=1)))


def _clear():
    jax.clear_caches()
    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()


# ------------------------------------------------------------------ the benchmark


def _compare(num_updates, seeds, repeats, compiled):
    """Interleaved wall times (compile included; then, if ``compiled``, the same
    call again with the programs compiled) and the final returns of both ways,
    for ``seeds`` seeds (None: one seed, solo fit vs ``jax.jit(train)``). The
    order alternates between repetitions."""
    returns = {"rollout": [], "hand": []}

    def rollout_run(i):
        r = fit_rollout(num_updates, jr.key(i), seeds)
        return np.asarray(r.history["rollout_return"])

    def hand_run(i, jitted=None):
        if jitted is None:
            train = make_train(num_updates)
            jitted = jax.jit(train if seeds is None else jax.vmap(train))
        key = jr.key(i) if seeds is None else jr.split(jr.key(i), seeds)
        out = jax.block_until_ready(jitted(key))
        return np.asarray(out["metrics"]["return"]), jitted

    first = {"rollout": [], "hand": []}
    again = {"rollout": [], "hand": []}
    for rep in range(repeats):
        for name in ("rollout", "hand")[:: 1 if rep % 2 == 0 else -1]:
            _clear()
            t0 = time.perf_counter()  # compile included
            if name == "rollout":
                out = rollout_run(rep)
            else:
                out, jitted = hand_run(rep)
            first[name].append(time.perf_counter() - t0)
            returns[name].append(_final_return(out))
            if not compiled:
                continue
            t0 = time.perf_counter()  # the same call again: the programs compiled
            if name == "rollout":
                rollout_run(rep)
            else:
                hand_run(rep, jitted)
            again[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in first.items()}
    med2 = {k: statistics.median(v) if v else None for k, v in again.items()}
    ret = {k: float(np.mean(v)) for k, v in returns.items()}
    print(
        f"bench_rl: {seeds} seeds: first {first}, again {again}, returns {returns}",
        flush=True,
    )
    return med, med2, ret, first, again


def _spread(times):
    pairs = zip(times["rollout"], times["hand"])
    ratios = [a / b for a, b in pairs]
    parts = [f"{k} {min(v):.1f}-{max(v):.1f} s" for k, v in times.items()]
    return ", ".join(parts) + f"; ratio {min(ratios):.3f}-{max(ratios):.3f}"


def run(quick: bool = False, timesteps: float | None = None, repeats: int = 3):
    """The rows: 8 seeds, then 1 seed; in quick mode also the compiled calls
    (at the full size they would double the benchmark's time)."""
    timesteps = timesteps or (5e4 if quick else 5e5)
    num_updates = int(timesteps) // NUM_STEPS // NUM_ENVS
    rows = []
    for seeds in (SEEDS, None):
        what = f"{seeds} seeds" if seeds else "1 seed"
        if seeds:
            hand = f"hand-written jax.jit(jax.vmap(train)) over {seeds} keys"
        else:
            hand = "hand-written jax.jit(train)"
        fit = f"population fit of {seeds}" if seeds else "solo fit"
        med, med2, ret, first, again = _compare(num_updates, seeds, repeats, quick)
        case = f"PPO CartPole, {timesteps:.0e} steps, {what}: {fit} + Rollout"
        rows.append(
            _timing.row("rl", case + " (compile included)", med["rollout"], hand,
                        med["hand"], 1.05,
                        notes=f"{repeats} runs: {_spread(first)}")
        )  # fmt: skip
        if quick:
            rows.append(
                _timing.row("rl", case + " (compiled)", med2["rollout"],
                            hand + ", compiled", med2["hand"],
                            notes=f"{repeats} runs: {_spread(again)}")
            )  # fmt: skip
        rows.append(
            _timing.row("rl", case + ": final mean episode return", ret["rollout"],
                        hand + ": final mean episode return", ret["hand"],
                        unit="return",
                        notes="mean over seeds and runs of the last 10 rollouts' "
                        "mean return (max 500)")
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    print(jax.devices())
    print(_timing.markdown(run()))
