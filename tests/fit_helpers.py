"""What the test files of ``scanax.fit`` share: one regression task (its data,
``batch_at``: the batch fit uses at each step) and a model of each kind trained on
it (NNX, Equinox, TrainState) with its loss. One object each (``MLP``, ``TX``,
``nnx_loss``...) for every file, so that fit's compiled programs are shared across
the suite."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
train_state = pytest.importorskip("flax.training.train_state")

N, BS = 48, 8  # 6 batches per epoch
X = jr.normal(jr.key(0), (N, 3))
Y = jnp.sin(X @ jnp.array([[1.0], [-2.0], [0.5]]))
KEY = jr.key(7)
TX = optax.adam(1e-2)  # one transformation object: same tx, same compiled chunk


def batch_at(t, key=KEY, n=N, bs=BS):
    """The batch ``fit`` uses at step t (documented order)."""
    per_epoch = n // bs
    start = (t % per_epoch) * bs
    if key is None:
        idx = jnp.arange(start, start + bs)
    else:
        data = (
            jr.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        )
        seed = [int(v) for v in np.asarray(data).ravel()] + [t // per_epoch]
        perm = np.random.default_rng(seed).permutation(n)
        idx = perm[start : start + bs]
    return X[idx], Y[idx]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def nnx_loss(model, batch):
    x, y = batch
    err = model(x) - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def nnx_pair(seed=0):
    model = MLP(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


# ---------------------------------------------------------------------------- Equinox


def eqx_loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def eqx_model():
    return eqx.nn.MLP(3, 1, 8, 1, key=jr.key(0))


# ---------------------------------------------------------------------------- TrainState


def ts_make():
    params = {
        "w": jr.normal(jr.key(1), (3, 1)) * 0.1,
        "b": jnp.zeros((1,)),
    }
    return train_state.TrainState.create(apply_fn=ts_apply, params=params, tx=TX)


def ts_apply(params, x):
    return x @ params["w"] + params["b"]


def ts_loss(state, batch):
    x, y = batch
    return jnp.mean((state.apply_fn(state.params, x) - y) ** 2)


def joined(parts, name):
    """``history[name]`` of consecutive ``fit`` calls, joined along the steps
    (the last axis: a population's is ``[members, steps]``)."""
    return np.concatenate([p.history[name] for p in parts], axis=-1)
