"""``scanax.fit`` on an Equinox model with an ``eqx.nn.State``
(``eqx.nn.make_with_state``: BatchNorm's running statistics): the State's arrays
are carried, not trained, and come back from ``loss_fn`` as a third element,
against a hand-written loop of ``eqx.filter_jit`` steps that threads the state."""

import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scanax

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

from fit_helpers import BS, KEY, X, Y, batch_at  # noqa: E402

STEPS = 12


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        # (no bias before BatchNorm: its gradient is float noise, which Adam
        # turns into steps of lr)
        self.lin = eqx.nn.Linear(3, 8, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(8, "batch", momentum=0.9, mode="batch")
        self.out = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        return self.out(jax.nn.relu(h)), state


def make():
    return eqx.nn.make_with_state(Net)(jr.key(3))


def forward(model, state, x):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state
    )


def loss_fn(ms, batch):
    model, state = ms
    x, y = batch
    pred, state = forward(model, state, x)
    err = pred - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}, state


def stale_loss(ms, batch):  # the new state dropped
    return loss_fn(ms, batch)[:2]


def hand(tx, steps=STEPS, start=0, model=None, state=None, opt_state=None):
    """The loop fit replaces: the State threaded, only the model trained."""
    if model is None:
        model, state = make()
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = tx.init(params) if opt_state is None else opt_state

    @eqx.filter_jit
    def step(params, state, opt_state, batch):
        def objective(p):
            loss, metrics, new = loss_fn((eqx.combine(p, static), state), batch)
            return loss, new

        (loss, new), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new, opt_state, loss

    losses = []
    for t in range(start, start + steps):
        params, state, opt_state, loss = step(params, state, opt_state, batch_at(t))
        losses.append(float(loss))
    return eqx.combine(params, static), state, opt_state, np.array(losses)


def fit(ms, tx, loss=loss_fn, steps=STEPS, **kw):
    kw = {"batch_size": BS, "key": KEY, "progress": False, **kw}
    return scanax.fit(ms, tx, loss, (X, Y), steps=steps, **kw)


def close(a, b):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)


def test_the_state_is_threaded_and_not_trained():
    """With weight decay (which would shrink a trained State): the running
    statistics and the model equal the hand loop's, and so do the losses."""
    tx = optax.adamw(1e-2, weight_decay=0.5)
    model, state, _, losses = hand(tx)
    result = fit(make(), tx)
    np.testing.assert_allclose(result.history["loss"], losses, rtol=2e-5, atol=1e-6)
    got_model, got_state = result.model
    close(got_state, state)
    close(eqx.filter(got_model, eqx.is_inexact_array), eqx.filter(model, eqx.is_array))
    start = make()[1]
    moved = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(start))
    ]
    assert max(moved) > 1e-2  # (the statistics did move)


def test_the_optimizer_state_holds_no_state_arrays():
    """``tx.init`` of the trained leaves only: the same structure as the hand
    loop's ``tx.init(eqx.filter(model, eqx.is_inexact_array))``."""
    tx = optax.adam(1e-2)
    result = fit(make(), tx, steps=2)
    model, state = make()
    want = tx.init(eqx.filter(model, eqx.is_inexact_array))
    got = [np.shape(x) for x in jax.tree.leaves(result.optimizer)]
    assert got == [np.shape(x) for x in jax.tree.leaves(want)]


def test_continuing_equals_one_call_and_accumulate_threads_the_state():
    tx = optax.adam(1e-2)
    whole = fit(make(), tx)
    first = fit(make(), tx, steps=STEPS // 2)
    second = fit(first.model, tx, opt_state=first.optimizer, steps=STEPS // 2)
    close(second.model, whole.model)
    np.testing.assert_allclose(
        np.concatenate([first.history["loss"], second.history["loss"]]),
        whole.history["loss"],
        rtol=2e-5,
        atol=1e-6,
    )
    # accumulate=2: each micro-batch sees the statistics the one before left;
    # the same as optax.MultiSteps over twice the data steps
    acc = fit(make(), tx, steps=4, accumulate=2)
    model, state, _, _ = hand(optax.MultiSteps(tx, 2), steps=8)
    close(acc.model, (model, state))


def test_evaluation_and_predict_use_the_running_statistics():
    """In-loop evaluation runs in inference mode on the State as trained (the
    third element dropped); ``scanax.evaluate`` the same."""
    tx = optax.adam(1e-2)
    result = fit(make(), tx, callbacks=[scanax.Eval((X, Y), every=STEPS)])
    model, state = result.model
    inference = eqx.nn.inference_mode(model)
    pred, _ = forward(inference, state, X)
    want = float(jnp.mean((pred - Y) ** 2))
    np.testing.assert_allclose(result.history["val_loss"][-1], want, rtol=1e-5)
    got = scanax.evaluate(result.model, loss_fn, (X, Y), batch_size=len(X))
    np.testing.assert_allclose(got["loss"], want, rtol=1e-5)


def test_a_state_not_returned_warns_and_stays():
    with pytest.warns(UserWarning, match=r"eqx.nn.State.*third element"):
        result = fit(make(), optax.adam(1e-2), loss=stale_loss, steps=2)
    close(result.model[1], make()[1])  # (not trained either)


def test_a_wrong_third_element_is_named():
    def not_a_state(ms, batch):
        loss, metrics, state = loss_fn(ms, batch)
        return loss, metrics, {"bn": 1.0}

    def other_dtype(ms, batch):
        loss, metrics, state = loss_fn(ms, batch)
        return loss, metrics, jax.tree.map(lambda a: a.astype(jnp.float16), state)

    model, state = make()
    before = jax.tree.map(np.asarray, eqx.filter((model, state), eqx.is_array))
    with pytest.raises(TypeError, match=r"eqx.nn.State.*got dict"):
        fit((model, state), optax.adam(1e-2), loss=not_a_state, steps=2)
    with pytest.raises(TypeError, match=r"(?s)model\[1\].*float16"):
        fit((model, state), optax.adam(1e-2), loss=other_dtype, steps=2)
    close((model, state), before)
    # a third element for a model with no State
    params = {"w": jnp.zeros((3, 1))}

    def third(p, batch):
        return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2), {}, p

    with pytest.raises(TypeError, match=r"third element.*eqx.nn.State"):
        fit(params, optax.adam(1e-2), loss=third, steps=2)


def test_two_states_are_refused():
    model, state = make()
    with pytest.raises(TypeError, match=r"2 eqx.nn.State.*\[1\].*\[2\]"):
        fit((model, state, state), optax.adam(1e-2), steps=2)


def test_without_warnings_when_returned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit(make(), optax.adam(1e-2), steps=2)


def test_a_population_stepwise_and_evaluate_thread_the_state():
    lrs = np.array([1e-2, 3e-2], np.float32)

    made = []

    def member(key, lr):
        made.append(lr)
        return make(), optax.adam(lr)

    pop = scanax.population(member, 2, key=KEY, lr=lrs)
    result = scanax.fit(
        pop,
        None,
        loss_fn,
        (X, Y),
        steps=STEPS,
        batch_size=BS,
        key=KEY,
        progress=False,
    )
    for i, lr in enumerate(lrs):  # (member i's fit key: the population contract's)
        solo = fit(make(), optax.adam(float(lr)), key=jr.split(KEY, 2)[i])
        close(result.model[i], solo.model)
        np.testing.assert_allclose(
            result.history["loss"][i], solo.history["loss"], rtol=2e-5, atol=1e-6
        )
    got = scanax.evaluate(pop, loss_fn, (X, Y), batch_size=len(X))
    solo = fit(make(), optax.adam(float(lrs[0])), key=jr.split(KEY, 2)[0])
    want = scanax.evaluate(solo.model, loss_fn, (X, Y), batch_size=len(X))
    np.testing.assert_allclose(got["loss"][0], want["loss"], rtol=1e-5)

    # a second evaluation builds no member again (``make`` with a member's
    # own float; the list makes ``member`` unfingerprintable, so the program
    # is traced again, with traced values)
    def built():
        return sum(isinstance(lr, float) for lr in made)

    before = built()
    again = scanax.evaluate(pop, loss_fn, (X, Y), batch_size=len(X))
    assert built() == before, made
    np.testing.assert_array_equal(again["loss"], got["loss"])
    stepwise = fit(make(), optax.adam(1e-2), execution="stepwise")
    close(stepwise.model, fit(make(), optax.adam(1e-2)).model)


def test_precision_casts_the_weights_not_the_state():
    """Under Precision("bfloat16") the weights reach the loss in bfloat16 and
    the State in float32 (running statistics updated in bfloat16 stalled 15%
    low: review 2026-12-06), as NNX's BatchNorm statistics and a TrainState's
    batch_stats stay float32."""
    seen = {}

    def loss(ms, batch):
        model, state = ms
        seen["weight"] = model.lin.weight.dtype
        seen["state"] = {x.dtype for x in jax.tree.leaves(state)}
        return loss_fn(ms, batch)

    fit(
        make(),
        optax.adam(1e-2),
        loss=loss,
        steps=2,
        callbacks=[scanax.Precision("bfloat16")],
    )
    assert seen["weight"] == jnp.bfloat16
    assert seen["state"] <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


def test_returned_state_mistakes():
    def given_back(ms, batch):  # the new State dropped, the old returned
        loss, metrics, _ = loss_fn(ms, batch)
        return loss, metrics, ms[1]

    def no_metrics(ms, batch):
        loss, _, state = loss_fn(ms, batch)
        return loss, state

    def none_metrics(ms, batch):
        loss, _, state = loss_fn(ms, batch)
        return loss, None, state

    with pytest.warns(UserWarning, match=r"returns the State it was given"):
        result = fit(make(), optax.adam(1e-2), loss=given_back, steps=2)
    close(result.model[1], make()[1])
    with pytest.raises(
        TypeError,
        match=r"(?s)tuple of 2 .*State comes third.*"
        r"return loss, metrics, state",
    ):
        fit(make(), optax.adam(1e-2), loss=no_metrics, steps=2)
    with pytest.raises(TypeError, match=r"second element must be the metrics dict"):
        fit(make(), optax.adam(1e-2), loss=none_metrics, steps=2)


def test_a_state_without_arrays_trains():
    """make_with_state of a model with no stateful layer: a State with no
    arrays, returned as the others are (a script with BatchNorm behind a
    flag); it trains as the same model without a State."""

    class Plain(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self, key):
            self.lin = eqx.nn.Linear(3, 1, key=key)

        def __call__(self, x, state):
            return self.lin(x), state

    model, state = eqx.nn.make_with_state(Plain)(jr.key(0))
    assert not jax.tree.leaves(state)
    tx = optax.adam(1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fit((model, state), tx, steps=4)
    want = fit(model, tx, loss=lambda m, b: loss_fn((m, state), b)[:2], steps=4)
    close(got.model[0], want.model)
