"""``fit(epochs=E)``: exactly ``E * (n // batch_size)`` steps, the same as
``steps=``, and ``history["epoch"]``."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import scanax

X = jr.normal(jr.key(0), (50, 3))
Y = X.sum(1, keepdims=True)
P = {"w": jnp.zeros((3, 1))}


def loss_fn(p, batch):
    return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)


def _fit(model=P, **kw):
    kw = {"batch_size": 8, "key": jr.key(1), "progress": False, **kw}
    return scanax.fit(model, optax.sgd(0.1), loss_fn, (X, Y), **kw)


def test_epochs_equal_their_steps():
    by_epochs, by_steps = _fit(epochs=3), _fit(steps=18)  # 50 // 8 = 6 a pass
    assert by_epochs.steps == 18
    np.testing.assert_array_equal(by_epochs.history["loss"], by_steps.history["loss"])
    np.testing.assert_array_equal(by_epochs.model["w"], by_steps.model["w"])
    np.testing.assert_array_equal(by_epochs.history["epoch"], np.repeat([1, 2, 3], 6))
    assert "epoch" not in by_steps.history


def test_the_epoch_count_continues_across_calls():
    first = _fit(epochs=1)
    more = scanax.fit(
        first.model, optax.sgd(0.1), loss_fn, (X, Y), epochs=2, batch_size=8,
        key=jr.key(1), opt_state=first.optimizer, progress=False,
    )  # fmt: skip
    np.testing.assert_array_equal(more.history["epoch"], np.repeat([2, 3], 6))
    np.testing.assert_array_equal(
        more.history["loss"], _fit(epochs=3).history["loss"][6:]
    )


def test_epochs_with_accumulation_and_a_population():
    acc = _fit(epochs=2, accumulate=3)  # 12 batches: 4 steps of 3
    assert acc.steps == 4
    np.testing.assert_array_equal(acc.history["epoch"], [1, 1, 2, 2])

    def make(key, lr):
        return {"w": jnp.zeros((3, 1))}, optax.sgd(lr)

    pop = scanax.population(make, 2, key=jr.key(2), lr=jnp.array([0.1, 0.05]))
    out = scanax.fit(
        pop, None, loss_fn, (X, Y), epochs=2, batch_size=8, key=jr.key(1),
        progress=False,
    )  # fmt: skip
    np.testing.assert_array_equal(out.steps, [12, 12])
    np.testing.assert_array_equal(out.history["epoch"], np.repeat([1, 2], 6))


def test_errors():
    with pytest.raises(TypeError, match="how long to train is missing"):
        _fit()
    with pytest.raises(TypeError, match="steps=3 and epochs=2 are both given"):
        _fit(steps=3, epochs=2)
    with pytest.raises(ValueError, match="accumulate=4 does not divide"):
        _fit(epochs=3, accumulate=4)
    with pytest.raises(TypeError, match="`epochs` must be a positive int"):
        _fit(epochs=1.5)
    batches = [(X[:8], Y[:8])] * 3
    with pytest.raises(TypeError, match="epochs=2 needs array data") as err:
        scanax.fit(P, optax.sgd(0.1), loss_fn, batches, epochs=2, progress=False)
    # a list's length is known: the message says what fit does with it
    assert "a list of 3 batches is taken once, in order" in str(err.value)
    assert "pass steps=len(batches) for one pass" in str(err.value)
    with pytest.raises(TypeError, match="this data's length is not known"):
        scanax.fit(P, optax.sgd(0.1), loss_fn, iter(batches), epochs=2,
                   progress=False)  # fmt: skip
    one = scanax.fit(
        P, optax.sgd(0.1), loss_fn, batches, steps=len(batches), progress=False
    )  # fmt: skip (the fix, as the message says)
    assert one.steps == 3


def test_evaluation_defaults_to_every_epoch_with_epochs():
    by_epochs = _fit(epochs=3, eval_data=(X[:10], Y[:10]))
    by_steps = _fit(steps=18, eval_data=(X[:10], Y[:10]), eval_every=6)
    np.testing.assert_array_equal(by_epochs.history["val_step"], [6, 12, 18])
    np.testing.assert_array_equal(
        by_epochs.history["val_loss"], by_steps.history["val_loss"]
    )
    stopped = _fit(epochs=3, stop=scanax.EarlyStop("loss", patience=0))
    assert stopped.steps in (6, 12, 18)  # checked at epoch ends only
    with pytest.raises(TypeError, match="eval_every"):  # steps=: no default
        _fit(steps=18, eval_data=(X[:10], Y[:10]))


def test_an_eval_per_epoch_needs_an_epoch_of_whole_steps():
    """6 batches an epoch, 4 per step: 12 batches train 3 steps (as without
    the evaluation), but no step ends an epoch, so there is no per-epoch
    evaluation to default to: said so, before anything runs (the message had
    said to train by epochs=, which this call does)."""
    assert _fit(epochs=2, accumulate=4).steps == 3
    with pytest.raises(
        ValueError,
        match=r"(?s)an epoch of 6 batches is not a whole number of optimizer steps "
        r"of accumulate=4.*every=N.*divides 6 \(1, 2, 3, 6\)",
    ):
        _fit(epochs=2, accumulate=4, callbacks=[scanax.Eval((X[:10], Y[:10]))])
    given = _fit(epochs=2, accumulate=4, eval_data=(X[:10], Y[:10]), eval_every=1)
    np.testing.assert_array_equal(given.history["val_step"], [1, 2, 3])


def test_a_metric_named_epoch_is_refused_with_epochs():
    """Under epochs= the history's "epoch" is fit's, and a loss_fn metric of
    that name was overwritten there while log sinks got the user's value:
    refused by name before any step. With steps= the name is the user's."""

    def with_epoch(p, batch):
        return loss_fn(p, batch), {"epoch": jnp.float32(123.0)}

    kw = {"batch_size": 8, "key": jr.key(1), "progress": False}
    mine = scanax.fit(P, optax.sgd(0.1), with_epoch, (X, Y), steps=6, **kw)
    np.testing.assert_array_equal(mine.history["epoch"], np.full(6, 123.0))
    with pytest.raises(
        ValueError, match="(?s)loss_fn returns a metric named 'epoch'.*'my_epoch'"
    ):
        scanax.fit(P, optax.sgd(0.1), with_epoch, (X, Y), epochs=1, **kw)
