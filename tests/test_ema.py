"""``fit(ema=decay)``: the moving average of the trained parameters, against
the formula over a hand-written loop, for every model kind; a non-finite step
does not update it; checkpoints and ``ema_state=`` continue it exactly."""

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
TX = optax.adam(0.05)
P0 = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(())}
DECAY = 0.9


def loss_fn(p, batch):
    return jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)


def _fit(model=P0, tx=TX, loss=loss_fn, **kw):
    kw = {"steps": 20, "batch_size": 16, "progress": False, "ema": DECAY, **kw}
    return scanax.fit(model, tx, loss, (X, Y), **kw)


def reference(steps=20, bad=None):
    """The documented average over a hand-written loop (batches in order);
    ``bad``: a step whose gradient is NaN (not applied: the loop stops)."""
    p, o, e = P0, TX.init(P0), P0
    for t in range(steps):
        if t == bad:
            break
        i = t % 4
        g = jax.grad(loss_fn)(p, (X[i * 16 : (i + 1) * 16], Y[i * 16 : (i + 1) * 16]))
        u, o = TX.update(g, o, p)
        p = optax.apply_updates(p, u)
        e = jtu.tree_map(lambda e, p: DECAY * e + (1 - DECAY) * p, e, p)
    return p, e


def _close(a, b, tol=1e-6):
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=tol)


@pytest.fixture(scope="module")
def whole():
    return _fit()


def test_the_average_follows_the_formula(whole):
    p, e = reference()
    _close(whole.model, p)
    _close(whole.ema, e)
    assert _fit(ema=None).ema is None


@pytest.mark.parametrize("kind", ["nnx", "equinox", "trainstate"])
def test_every_model_kind(kind):
    _, e = reference()
    if kind == "nnx":
        nnx = pytest.importorskip("flax.nnx")

        class Lin(nnx.Module):
            def __init__(self):
                self.w, self.b = nnx.Param(P0["w"]), nnx.Param(P0["b"])
                self.count = nnx.BatchStat(jnp.zeros(()))  # not trained

        def loss(m, batch):
            return loss_fn({"w": m.w[...], "b": m.b[...]}, batch)

        model = Lin()
        out = _fit(model, nnx.Optimizer(model, TX, wrt=nnx.Param), loss)
        assert isinstance(out.ema, Lin) and out.ema is not model
        _close({"b": out.ema.b[...], "w": out.ema.w[...]}, e)
    elif kind == "equinox":
        eqx = pytest.importorskip("equinox")

        class Lin(eqx.Module):
            w: jax.Array
            b: jax.Array
            steps: jax.Array  # an int array: carried, not trained

        def loss(m, batch):
            return loss_fn({"w": m.w, "b": m.b}, batch)

        out = _fit(Lin(P0["w"], P0["b"], jnp.zeros((), jnp.int32)), TX, loss)
        assert isinstance(out.ema, Lin)
        _close({"b": out.ema.b, "w": out.ema.w}, e)
    else:
        ts = pytest.importorskip("flax.training.train_state")
        state = ts.TrainState.create(apply_fn=None, params=P0, tx=TX)

        def loss(s, batch):
            return loss_fn(s.params, batch)

        out = _fit(state, None, loss)
        _close(out.ema.params, e)
        assert int(out.ema.step) == 20


def test_a_non_finite_step_does_not_update_the_average():
    def loss(p, batch):
        bad = jnp.where(jnp.abs(p["b"]) > 0.3, jnp.nan, 0.0)  # after a few steps
        return loss_fn(p, batch) + bad

    with pytest.warns(RuntimeWarning, match="non-finite loss"):
        out = _fit(loss=loss)
    assert out.steps < 20
    _, e = reference(bad=out.steps)
    _close(out.ema, e)


def test_calls_and_checkpoints_continue_the_average(whole, tmp_path):
    first = _fit(steps=12)
    more = _fit(first.model, steps=8, ema_state=first.ema, opt_state=first.optimizer)
    _close(more.ema, whole.ema, 0.0)
    # a checkpointed run restarted from the top resumes the average exactly
    _fit(steps=12, checkpoint_dir=tmp_path, checkpoint_every=4)
    resumed = _fit(checkpoint_dir=tmp_path, checkpoint_every=4)
    _close(resumed.ema, whole.ema, 0.0)


def test_evaluations_on_the_average():
    """ema_eval=True: the in-loop evaluation after step 10 is the loss of the
    average at step 10 on all the data."""
    out = _fit(ema_eval=True, eval_data=(X, Y), eval_every=10)
    _, e10 = reference(10)
    np.testing.assert_allclose(
        out.history["val_loss"][0], loss_fn(e10, (X, Y)), rtol=1e-5
    )
    plain = _fit(eval_data=(X, Y), eval_every=10)
    p10, _ = reference(10)
    np.testing.assert_allclose(
        plain.history["val_loss"][0], loss_fn(p10, (X, Y)), rtol=1e-5
    )


def test_errors():
    with pytest.raises(
        ValueError, match=r"scanax.Ema: the decay 1.0 \(ema=1.0\) is not in \[0, 1\)"
    ):
        _fit(ema=1.0)
    with pytest.raises(
        TypeError,
        match=r"scanax.Ema: its decay \(fit.s `ema` shorthand\) must be a decay",
    ):
        _fit(ema="0.9")
    with pytest.raises(TypeError, match="`ema_eval` is given without `ema`"):
        _fit(ema=None, ema_eval=True)
    with pytest.raises(
        TypeError, match=r"`ema_state` \(scanax.Ema.s `state`\) is not a model of this"
    ):
        _fit(ema_state={"w": jnp.zeros((2, 1)), "b": jnp.zeros(())})


def test_population_members_equal_solo_fits(whole):
    def make(key, lr):
        return P0, optax.adam(lr)

    pop = scanax.population(make, 2, key=jr.key(0), lr=jnp.array([0.05, 0.01]))
    kw = {"batch_size": 16, "progress": False, "ema": DECAY}
    out = scanax.fit(pop, None, loss_fn, (X, Y), steps=12, **kw)
    _close(out.ema[0], _fit(steps=12).ema)
    slow = _fit(tx=optax.adam(0.01), steps=12).ema
    _close(out.ema[1], slow)
    more = scanax.fit(pop, None, loss_fn, (X, Y), steps=8, ema_state=out.ema, **kw)
    _close(more.ema[0], whole.ema)
    assert len(more.ema) == 2 and isinstance(more.ema[1], dict)


def test_a_numpy_decay_is_a_decay(whole):
    out = _fit(ema=np.float32(DECAY))
    # (float32(0.9) is 0.9 - 2.4e-8: over 20 steps the averages differ by a
    # few 1e-7, the rounding of the update's arithmetic included)
    _close(out.ema, whole.ema, 1e-6)
