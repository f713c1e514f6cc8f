"""``fit(precision="bfloat16")``: the loss computed in bfloat16 on cast copies,
float32 parameters, optimizer state, gradients and history, against a
hand-written loop doing the same casts."""

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import scanax

X = jr.normal(jr.key(0), (64, 3))
Y = X @ jnp.array([[1.0], [2.0], [-1.0]])
LABELS = (X[:, 0] > 0).astype(jnp.int32)  # an int leaf: never cast
TX = optax.adam(0.05)
P0 = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(())}
BF16 = jnp.bfloat16


def loss_fn(p, batch):
    x, y, labels = batch
    # (checked while tracing: what the step computes in)
    assert x.dtype == BF16 and p["w"].dtype == BF16 and labels.dtype == jnp.int32
    err = x @ p["w"] + p["b"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def _fit(model=P0, tx=TX, loss=loss_fn, **kw):
    kw = {"steps": 20, "batch_size": 16, "progress": False, **kw}
    return scanax.fit(model, tx, loss, (X, Y, LABELS), precision="bfloat16", **kw)


def reference(steps=20):
    def cast(t):
        return jtu.tree_map(
            lambda a: a.astype(BF16) if jnp.issubdtype(a.dtype, jnp.floating) else a, t
        )

    def objective(p, batch):
        return loss_fn(cast(p), cast(batch))[0].astype(jnp.float32)

    p, o, losses = P0, TX.init(P0), []
    for t in range(steps):
        i = t % 4
        batch = (X[i * 16 : (i + 1) * 16], Y[i * 16 : (i + 1) * 16], LABELS[:16])
        batch = batch[:2] + (LABELS[i * 16 : (i + 1) * 16],)
        loss, g = jax.value_and_grad(objective)(p, batch)
        assert all(x.dtype == jnp.float32 for x in jtu.tree_leaves(g))
        u, o = TX.update(g, o, p)
        p = optax.apply_updates(p, u)
        losses.append(loss)
    return p, o, np.array(losses)


def test_equals_the_hand_written_cast_loop():
    out = _fit()
    p, o, losses = reference()
    assert out.history["loss"].dtype == np.float32
    assert out.history["mae"].dtype == np.float32
    # (within one bfloat16 rounding: XLA may order a bfloat16 sum otherwise)
    np.testing.assert_allclose(out.history["loss"], losses, rtol=8e-3)
    for a, b in zip(
        jtu.tree_leaves((out.model, out.optimizer)), jtu.tree_leaves((p, o))
    ):
        assert a.dtype == b.dtype  # float32 parameters and moments
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-4)


def test_nnx_with_batchnorm_and_dropout():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 8, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
            self.out = nnx.Linear(8, 1, rngs=nnx.Rngs(2))

        def __call__(self, x):
            h = self.lin(x)
            assert h.dtype == BF16  # (the Linear computes in bfloat16)
            return self.out(self.drop(self.bn(h)))

    def loss(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    model = Net()
    mean0 = np.asarray(model.bn.mean[...])
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    out = _fit(model, optimizer, loss, eval_data=(X, Y, LABELS), eval_every=10)
    assert np.isfinite(out.history["loss"]).all()
    assert np.isfinite(out.history["val_loss"]).all()
    assert model.lin.kernel.dtype == jnp.float32 and model.bn.mean.dtype == jnp.float32
    assert not np.allclose(model.bn.mean[...], mean0)  # statistics written back
    # Dropout's RNG advanced: two more steps give other masks than a re-run
    counts = [int(x) for x in jtu.tree_leaves(nnx.state(model, nnx.RngCount))]
    assert counts and max(counts) >= 20


def test_trainstate_and_a_population_member():
    ts = pytest.importorskip("flax.training.train_state")

    def apply(params, x):
        return x @ params["w"] + params["b"]

    def loss(state, batch):
        return loss_fn(state.params, batch)

    state = ts.TrainState.create(apply_fn=apply, params=P0, tx=TX)
    out = _fit(state, None, loss)
    p, _, losses = reference()
    np.testing.assert_allclose(out.history["loss"], losses, rtol=8e-3)
    np.testing.assert_allclose(out.model.params["w"], p["w"], rtol=2e-2, atol=1e-4)

    def make(key):
        return P0, TX

    pop = scanax.population(make, 2, key=jr.key(0))
    both = _fit(pop, None)
    np.testing.assert_allclose(both.history["loss"][1], losses, rtol=8e-3)


def test_errors():
    with pytest.raises(ValueError, match="precision='float16' needs dynamic loss"):
        scanax.fit(P0, TX, loss_fn, (X, Y, LABELS), steps=1, batch_size=16,
                   precision="float16")  # fmt: skip
    with pytest.raises(ValueError, match="precision='half' is not one fit knows"):
        scanax.fit(P0, TX, loss_fn, (X, Y, LABELS), steps=1, batch_size=16,
                   precision="half")  # fmt: skip
