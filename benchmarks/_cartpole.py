"""CartPole-v1 in pure JAX, with gymnax's semantics, for ``bench_rl.py``.

Written here so that the benchmark runs without gymnax; what it copies from
gymnax (``gymnax/environments/classic_control/cartpole.py``) and PureJaxRL's
``LogWrapper`` (``purejaxrl/wrappers.py``):

* the physics constants and the Euler step of ``CartPole.step_env``;
* termination at ``|x| > 2.4`` or ``|theta| > 12`` degrees, truncation at 500
  steps (both are ``done``; PureJaxRL's GAE treats them alike);
* reward 1 per step;
* a reset draws the four state variables uniformly from ``[-0.05, 0.05]``;
* ``step`` resets automatically on ``done`` (gymnax's ``Environment.step``: the
  observation returned is then the new episode's first one), with the key split
  as gymnax splits it;
* the running episode return and the return of the episode that just ended
  (``returned_return``), as ``LogWrapper`` keeps them for logging.

One environment; ``jax.vmap`` runs several. Checked against gymnax's formulas
by ``step``'s docstring example (an upright pole, pushed right).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr

GRAVITY = 9.8
MASSCART = 1.0
MASSPOLE = 0.1
TOTAL_MASS = MASSPOLE + MASSCART
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds between state updates
THETA_THRESHOLD = 12 * 2 * jnp.pi / 360
X_THRESHOLD = 2.4
MAX_STEPS = 500

OBS_SIZE, ACTIONS = 4, 2


class State(NamedTuple):
    """One environment's state: gymnax's ``EnvState`` and ``LogWrapper``'s
    counters."""

    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array
    time: jax.Array  # int32: steps in this episode
    episode_return: jax.Array  # the running episode's return so far
    returned_return: jax.Array  # the return of the last episode that ended


def observe(s: State) -> jax.Array:
    return jnp.stack([s.x, s.x_dot, s.theta, s.theta_dot])


def reset(key: jax.Array) -> tuple[jax.Array, State]:
    """``(obs, state)`` of a new episode."""
    x, x_dot, theta, theta_dot = jr.uniform(key, (4,), minval=-0.05, maxval=0.05)
    zero = jnp.zeros((), jnp.float32)
    s = State(x, x_dot, theta, theta_dot, jnp.zeros((), jnp.int32), zero, zero)
    return observe(s), s


def _physics(s: State, action: jax.Array) -> State:
    force = FORCE_MAG * action - FORCE_MAG * (1 - action)
    cos, sin = jnp.cos(s.theta), jnp.sin(s.theta)
    temp = (force + POLEMASS_LENGTH * s.theta_dot**2 * sin) / TOTAL_MASS
    thetaacc = (GRAVITY * sin - cos * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * cos**2 / TOTAL_MASS)
    )
    xacc = temp - POLEMASS_LENGTH * thetaacc * cos / TOTAL_MASS
    return s._replace(
        x=s.x + TAU * s.x_dot,
        x_dot=s.x_dot + TAU * xacc,
        theta=s.theta + TAU * s.theta_dot,
        theta_dot=s.theta_dot + TAU * thetaacc,
        time=s.time + 1,
    )


def _done(s: State) -> jax.Array:
    out = (jnp.abs(s.x) > X_THRESHOLD) | (jnp.abs(s.theta) > THETA_THRESHOLD)
    return out | (s.time >= MAX_STEPS)


def step(key: jax.Array, s: State, action: jax.Array) -> tuple:
    """``(obs, state, reward, done, returned_return)``: one step of action 0
    (push left) or 1 (push right), the episode reset when it ended.

    ``returned_return`` is the return of the episode that ended (meaningful
    where ``done``), as PureJaxRL's ``info["returned_episode_returns"]``.

    >>> import jax, jax.numpy as jnp
    >>> obs, s = reset(jax.random.key(0))
    >>> s = s._replace(x=jnp.float32(0), x_dot=jnp.float32(0), theta=jnp.float32(0),
    ...                theta_dot=jnp.float32(0))
    >>> obs, s, r, done, _ = step(jax.random.key(1), s, jnp.int32(1))
    >>> [round(float(v), 5) for v in (s.x, s.x_dot, s.theta, s.theta_dot, r)]
    [0.0, 0.19512, 0.0, -0.29268, 1.0]
    """
    _, reset_key = jr.split(key)
    moved = _physics(s, action)
    done = _done(moved)
    reward = jnp.ones((), jnp.float32)
    ret = s.episode_return + reward
    _, fresh = reset(reset_key)
    new = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, moved)
    new = new._replace(
        episode_return=jnp.where(done, 0.0, ret),
        returned_return=jnp.where(done, ret, s.returned_return),
    )
    return observe(new), new, reward, done, new.returned_return
