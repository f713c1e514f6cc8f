"""A small environment, policy and PPO-style loss for ``scanax.Rollout``'s tests
(``test_rollout.py``) and its kill -9 job (``python tests/_rollout_job.py
CHECKPOINT_DIR OUT_FILE``: trains, resuming from CHECKPOINT_DIR, and writes the
hash of the final state)."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hashlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import scanax  # noqa: E402

ENVS, T, OBS, ACTIONS = 4, 8, 3, 2
STEPS, EVERY = 48, 8


def env_reset(key):
    """A deterministic environment: a point ``s`` the agent pushes with
    actions 0/1; reward for moving ``s[0]`` towards 0."""
    return jr.normal(key, (ENVS, OBS))


def env_step(s, action):
    push = jnp.where(action == 1, 0.3, -0.3)[:, None]
    s2 = 0.9 * s + push * jnp.array([1.0, 0.5, 0.0])
    reward = -jnp.abs(s2[:, 0])
    return s2, reward


def logits_of(params, obs):
    return jnp.tanh(obs @ params["w1"]) @ params["w2"]


def collect(params, carry, key):
    """``T`` steps of ``ENVS`` environments with the current policy."""

    def one(s, k):
        logits = logits_of(params, s)
        action = jr.categorical(k, logits)
        logp = jax.nn.log_softmax(logits)[jnp.arange(ENVS), action]
        s2, reward = env_step(s, action)
        return s2, (s, action, logp, reward)

    s, (obs, act, logp, rew) = jax.lax.scan(one, carry, jr.split(key, T))
    adv = rew - rew.mean()
    batch = {
        "obs": obs.reshape(-1, OBS),
        "act": act.reshape(-1),
        "logp": logp.reshape(-1),
        "adv": adv.reshape(-1),
    }
    return batch, s, {"reward": rew.mean()}


def loss_fn(params, batch):
    """PPO's clipped surrogate objective."""
    logits = logits_of(params, batch["obs"])
    logp = jax.nn.log_softmax(logits)[jnp.arange(batch["act"].shape[0]), batch["act"]]
    ratio = jnp.exp(logp - batch["logp"])
    clipped = jnp.clip(ratio, 0.8, 1.2)
    loss = -jnp.mean(jnp.minimum(ratio * batch["adv"], clipped * batch["adv"]))
    return loss, {"ratio": ratio.mean()}


def params0(key=None):
    k1, k2 = jr.split(jr.key(0) if key is None else key)
    return {
        "w1": 0.5 * jr.normal(k1, (OBS, 8)),
        "w2": 0.5 * jr.normal(k2, (8, ACTIONS)),
    }


def job(directory):
    return scanax.fit(
        params0(),
        optax.adam(1e-2),
        loss_fn,
        scanax.Rollout(collect, env_reset, epochs=2, minibatches=4),
        steps=STEPS,
        key=jr.key(3),
        steps_per_call=4,
        progress=False,
        checkpoint_dir=directory,
        checkpoint_every=None if directory is None else EVERY,
    )


def digest(result):
    h = hashlib.sha256()
    leaves = jtu.tree_leaves((result.model, result.optimizer)) + [
        result.history["loss"],
        result.history["rollout_reward"],
    ]
    for x in leaves:
        h.update(np.asarray(x).tobytes())
    return f"{result.steps}:{h.hexdigest()}"


if __name__ == "__main__":
    out = digest(job(sys.argv[1] or None))
    with open(sys.argv[2], "w") as f:
        f.write(out)
