"""scanax.evaluate, scanax.predict and scanax.Ratio (issue 26) against references:
the full-dataset mean computed at once (uneven batches; NNX in eval mode with its
mode and state untouched, Equinox, TrainState, a population vs each member
alone), the model called on all the data at once, scikit-learn's precision,
recall and F1 (in evaluate and in fit's in-loop evaluation), per-batch keys, a
mesh, no retrace on a second call, and the errors."""

from __future__ import annotations

import functools as ft
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import close, count_compiles, count_traces, traced

import scanax
from scanax._fit.evaluate import evaluate, predict
from scanax._fit.metrics import Ratio

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
metrics = pytest.importorskip("sklearn.metrics")

allclose = ft.partial(close, rtol=2e-5, atol=1e-6)
N = 30  # uneven for batches of 7 and 8
# (a mesh of 4: XLA_FLAGS in conftest.py gives the CPU 4 devices; one GPU or TPU
# chip is one)
FOUR_DEVICES = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
X = jr.normal(jr.key(0), (N, 4))
Y = jnp.sum(X, 1, keepdims=True) + jnp.sin(3 * X[:, :1])


class Net(nnx.Module):
    """Dropout and BatchNorm: evaluation must switch both to eval mode."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def nnx_eval(model, batch):
    x, y = batch
    err = model(x) - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def trained_net():
    """A Net whose BatchNorm statistics are not their initial values."""
    model = Net(nnx.Rngs(0, dropout=1))
    model(X * 2 + 1)  # (train mode: updates the running averages)
    return model


def params_eval(params, batch):
    x, y = batch
    err = x @ params["w"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


PARAMS = {"w": jr.normal(jr.key(3), (4, 1))}


def at_once(fn, model, data):
    loss, extra = fn(model, data)
    return {"loss": loss, **extra}


# ------------------------------------------------------------------ evaluate


@pytest.mark.parametrize("batch_size", [7, 8, 30, 64, None])
def test_evaluate_equals_the_full_dataset_mean(batch_size):
    got = evaluate(PARAMS, params_eval, (X, Y), batch_size=batch_size)
    assert set(got) == {"loss", "mae"} and all(type(v) is float for v in got.values())
    allclose(got, at_once(params_eval, PARAMS, (X, Y)))


def test_nnx_in_eval_mode_and_the_model_untouched():
    model = trained_net()
    before = nnx.state(nnx.clone(model))
    got = evaluate(model, nnx_eval, (X, Y), batch_size=8)
    assert not model.drop.deterministic and model.bn.use_running_average is False
    allclose(nnx.state(model), before)
    ref = nnx.clone(model)
    ref.eval()
    allclose(got, at_once(nnx_eval, ref, (X, Y)))
    train = at_once(nnx_eval, nnx.clone(model), (X, Y))["loss"]
    assert abs(float(train) - got["loss"]) > 1e-3  # (train mode differs)

    def failing(model, batch):
        raise RuntimeError("inside eval_fn")

    with pytest.raises(RuntimeError, match="inside eval_fn"):
        evaluate(model, failing, (X, Y), batch_size=8)
    assert not model.drop.deterministic
    allclose(nnx.state(model), before)


def test_nnx_modules_in_a_dict_or_tuple_are_in_eval_mode():
    """A plain dict or tuple of NNX modules (an encoder and a head) is evaluated
    as ``nnx.Dict`` is: every module in eval mode (before: in train mode, its
    Dropout on and its BatchNorm on batch statistics), the user's untouched."""
    body, head = trained_net(), nnx.Linear(1, 1, rngs=nnx.Rngs(3))
    before = nnx.state(nnx.clone((body, head)))
    refs = nnx.clone((body, head))
    for m in refs:
        m.eval()
    want = at_once(lambda ms, b: nnx_eval(lambda x: ms[1](ms[0](x)), b), refs, (X, Y))
    for models, pick in [
        ({"body": body, "head": head}, lambda ms: (ms["body"], ms["head"])),
        ((body, head), lambda ms: ms),
        ([body, head], lambda ms: ms),
    ]:

        def eval_fn(ms, batch, pick=pick):
            b, h = pick(ms)
            return nnx_eval(lambda x: h(b(x)), batch)

        allclose(evaluate(models, eval_fn, (X, Y), batch_size=7), want)
        rows = predict(models, lambda ms, x, pick=pick: pick(ms)[1](pick(ms)[0](x)), X)
        allclose(rows, refs[1](refs[0](X)))
    assert not body.drop.deterministic and body.bn.use_running_average is False
    allclose(nnx.state((body, head)), before)


class DropHead(eqx.Module):
    drop: eqx.nn.Dropout
    lin: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.lin)(self.drop(x, key=None))


def test_a_container_of_nnx_and_equinox_modules_has_both_in_eval_mode():
    """An NNX body and an Equinox head in one tuple: the NNX modules in eval
    mode and the Equinox ones in inference mode (the head's Dropout was left
    on when the NNX path took containers)."""
    body = trained_net()
    head = DropHead(eqx.nn.Dropout(0.5), eqx.nn.Linear(1, 1, key=jr.key(2)))
    ref = nnx.clone(body)
    ref.eval()
    want = eqx.nn.inference_mode(head)(ref(X))

    def fn(models, x):
        return models[1](models[0](x))

    allclose(predict((body, head), fn, X, batch_size=7), want)
    got = evaluate((body, head), lambda ms, b: jnp.mean((fn(ms, b[0]) - b[1]) ** 2),
                   (X, Y), batch_size=7)  # fmt: skip
    allclose(got["loss"], jnp.mean((want - Y) ** 2))


class Noisy(nnx.Module):
    """Draws from its own stream, as a VAE's sampling layer does."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 1, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        mu = self.lin(x)
        return mu + jr.normal(self.rngs.noise(), mu.shape)


def test_a_model_drawing_from_its_own_rngs_warns_and_reseeding_from_the_key_works():
    """Each batch runs on a copy of the model as passed in: its own stream would
    give every batch the same draws (before: silently). A warning names the
    stream, for evaluate, predict and fit's evaluation (not an error: a
    ``rngs.fork()`` moves a stream and may draw nothing, e.g. for a Dropout in
    eval mode); the fix it gives (a key, reseeded from) matches a hand loop of
    reseeded copies, with no warning."""
    model = Noisy(nnx.Rngs(0, noise=1))
    msg = r"draws random numbers from the model's own RNG stream \(model.rngs.noise\)"
    msg += r"(?s:.*)nnx.reseed"
    with pytest.warns(RuntimeWarning, match="^scanax.predict: .*" + msg):
        rows = predict(model, lambda m, x: m(x), X[:24], batch_size=8)
    # (the repetition warned of: every batch drew the same noise)
    allclose(rows[:8] - model.lin(X[:8]), rows[8:16] - model.lin(X[8:16]))
    with pytest.warns(RuntimeWarning, match="^scanax.evaluate: .*" + msg):
        evaluate(model, lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), (X, Y))
    with pytest.warns(RuntimeWarning, match=msg):
        scanax.fit(
            model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
            lambda m, b: jnp.mean((m.lin(b[0]) - b[1]) ** 2), (X, Y), steps=2,
            batch_size=8, callbacks=[scanax.Eval((X, Y), every=1, fn=lambda m,
            b: jnp.mean((m(b[0]) - b[1]) ** 2))], progress=False,
        )  # fmt: skip

    def reseeded(m, x, key):
        nnx.reseed(m, noise=key)
        return m(x)

    key = jr.key(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = predict(model, reseeded, X[:24], batch_size=8, key=key)
    want = [reseeded(nnx.clone(model), X[s : s + 8], jr.fold_in(key, j))
            for j, s in enumerate(range(0, 24, 8))]  # fmt: skip
    allclose(got, jnp.concatenate(want))
    assert float(jnp.std(got[:8] - got[8:16])) > 0.1  # (draws differ per batch)


def test_equinox_in_inference_mode():
    class Drop(eqx.Module):
        mlp: eqx.nn.MLP
        drop: eqx.nn.Dropout

        def __call__(self, x, key=None):
            return self.mlp(self.drop(x, key=key))

    def eval_fn(model, batch, key):
        x, y = batch
        keys = jr.split(key, x.shape[0])
        return jnp.mean((jax.vmap(model)(x, keys) - y) ** 2)

    model = Drop(eqx.nn.MLP(4, 1, 8, 1, key=jr.key(0)), eqx.nn.Dropout(0.5))
    got = evaluate(model, eval_fn, (X, Y), batch_size=8, key=jr.key(1))
    inference = eqx.nn.inference_mode(model)
    allclose(got["loss"], eval_fn(inference, (X, Y), jr.key(9)))
    assert model.drop.inference is False


def test_trainstate_and_its_updates_dropped():
    from flax.training import train_state

    state = train_state.TrainState.create(
        apply_fn=lambda p, x: x @ p["w"], params=dict(PARAMS), tx=optax.sgd(0.1)
    )

    def eval_fn(s, batch):
        loss, extra = params_eval(s.params, batch)
        return loss, extra, {}  # (a loss_fn's TrainState updates)

    got = evaluate(state, eval_fn, (X, Y), batch_size=7)
    allclose(got, at_once(params_eval, PARAMS, (X, Y)))


def test_per_batch_keys():
    def eval_fn(params, batch, key):
        x, y = batch
        noise = jr.normal(key, y.shape)
        return jnp.mean((x @ params["w"] + noise - y) ** 2)

    key = jr.key(5)
    got = evaluate(PARAMS, eval_fn, (X, Y), batch_size=8, key=key)
    parts = [
        eval_fn(PARAMS, (X[s : s + 8], Y[s : s + 8]), jr.fold_in(key, j))
        * len(X[s : s + 8])
        for j, s in enumerate(range(0, N, 8))
    ]
    allclose(got["loss"], sum(parts) / N)


def make_member(key, lr):
    model = Net(nnx.Rngs(key))
    return model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)


@pytest.fixture(scope="module")
def pop():
    return scanax.population(make_member, 3, key=jr.key(4), lr=[0.01, 0.05, 0.1])


def test_population_equals_each_member_alone(pop):
    got = evaluate(pop, nnx_eval, (X, Y), batch_size=8)
    assert got["loss"].shape == (3,)
    for i in range(3):
        member = pop.member(i)[0]
        alone = evaluate(member, nnx_eval, (X, Y), batch_size=8)
        member.eval()
        ref = at_once(nnx_eval, member, (X, Y))
        for name in ("loss", "mae"):
            allclose(got[name][i], alone[name])
            allclose(got[name][i], ref[name])

    def with_hp(model, batch, hp):  # a member's hyperparameters
        return nnx_eval(model, batch)[0] * hp["lr"]

    scaled = evaluate(pop, with_hp, (X, Y), batch_size=8)
    allclose(scaled["loss"], got["loss"] * np.array([0.01, 0.05, 0.1]))


# ------------------------------------------------------------------ predict


def outputs(model, batch):
    x, _ = batch
    out = model(x)
    return {"y": out, "pair": (jnp.tanh(out), x[:, :2])}


@pytest.mark.parametrize("batch_size", [7, 30, None])
def test_predict_equals_the_model_on_all_the_data(batch_size):
    model = trained_net()
    got = predict(model, outputs, (X, Y), batch_size=batch_size)
    ref = nnx.clone(model)
    ref.eval()
    allclose(got, outputs(ref, (X, Y)))
    assert not model.drop.deterministic


def test_predict_population(pop):
    got = predict(pop, outputs, (X, Y), batch_size=8)
    assert got["y"].shape == (3, N, 1)
    for i in range(3):
        member = pop.member(i)[0]
        member.eval()
        allclose(jax.tree.map(lambda v: v[i], got), outputs(member, (X, Y)))
    # with the member's hyperparameters (before: refused as a key of JAX's)
    scaled = predict(pop, lambda m, b, hp: outputs(m, b)["y"] * hp["lr"], (X, Y))
    lrs = pop.hyperparameters["lr"]
    allclose(scaled, got["y"] * lrs[:, None, None])


# ------------------------------------------------------------------ Ratio metrics

C = 3  # classes
XC = jr.normal(jr.key(10), (103, 5))
LABELS = jr.randint(jr.key(11), (103,), 0, C)
W = jr.normal(jr.key(12), (5, C))


def scores(params, batch):
    """Binary precision/recall/F1 of class 1, per-class recall, accuracy."""
    x, y = batch
    pred = jnp.argmax(x @ params["w"], -1)
    p, t = pred == 1, y == 1
    tp, fp, fn = (jnp.sum(a & b) for a, b in ((p, t), (p, ~t), (~p, t)))
    onehot = jax.nn.one_hot(y, C, dtype=jnp.int32)
    hit = onehot * (pred == y)[:, None]
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y))
    return loss, {
        "precision": Ratio(tp, tp + fp),
        "recall": Ratio(tp, tp + fn),
        "f1": Ratio(2 * tp, 2 * tp + fp + fn),
        "class_recall": Ratio(jnp.sum(hit, 0), jnp.sum(onehot, 0)),
        "accuracy": jnp.mean(pred == y),
    }


def sklearn_scores(params, x, y):
    pred = np.asarray(jnp.argmax(x @ params["w"], -1))
    y = np.asarray(y)
    return {
        "precision": metrics.precision_score(y == 1, pred == 1),
        "recall": metrics.recall_score(y == 1, pred == 1),
        "f1": metrics.f1_score(y == 1, pred == 1),
        "class_recall": metrics.recall_score(y, pred, average=None),
        "accuracy": metrics.accuracy_score(y, pred),
    }


@pytest.mark.parametrize("batch_size", [10, 103])
def test_ratio_metrics_equal_sklearn(batch_size):
    got = evaluate({"w": W}, scores, (XC, LABELS), batch_size=batch_size)
    want = sklearn_scores({"w": W}, XC, LABELS)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6)
    assert got["class_recall"].shape == (C,)
    # (a mean of per-batch ratios is not it)
    pred, y = np.argmax(np.asarray(XC @ W), -1) == 1, np.asarray(LABELS) == 1
    means = [
        metrics.precision_score(y[s : s + 10], pred[s : s + 10], zero_division=0)
        for s in range(0, 103, 10)
    ]
    assert abs(np.mean(means) - want["precision"]) > 1e-3


def test_ratio_metrics_in_fits_evaluation_equal_sklearn():
    def loss_fn(params, batch):
        return scores(params, batch)[0]

    kw = dict(steps=6, batch_size=16, key=jr.key(1), progress=False)
    result = scanax.fit(
        {"w": W}, optax.sgd(0.5), loss_fn, (XC, LABELS), **kw,
        eval_data=(XC, LABELS), eval_every=3, eval_fn=scores, eval_batch_size=10,
        stop=scanax.EarlyStop("val_f1", patience=5),
    )  # fmt: skip
    history = result.history
    np.testing.assert_array_equal(history["val_step"], [3, 6])
    for k, steps in enumerate((3, 6)):
        ref = scanax.fit(
            {"w": W}, optax.sgd(0.5), loss_fn, (XC, LABELS), **{**kw, "steps": steps}
        )
        want = sklearn_scores(ref.model, XC, LABELS)
        for name, value in want.items():
            np.testing.assert_allclose(history[f"val_{name}"][k], value, rtol=1e-6)
    best = 3 if history["val_f1"][0] > history["val_f1"][1] else 6
    assert result.best_step == best


def test_ratio_from_loss_fn_is_recorded_as_its_step_value():
    def loss_fn(params, batch):
        loss, extra = scores(params, batch)
        return loss, {"precision": extra["precision"]}

    kw = dict(steps=3, batch_size=16, progress=False)
    result = scanax.fit({"w": W}, optax.sgd(0.1), loss_fn, (XC, LABELS), **kw)
    params = {"w": W}
    for t in range(3):  # in order, no key: batch t
        batch = (XC[t * 16 : (t + 1) * 16], LABELS[t * 16 : (t + 1) * 16])
        r = scores(params, batch)[1]["precision"]
        np.testing.assert_allclose(result.history["precision"][t], r.value, rtol=1e-6)
        grads = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_ratio_is_a_pytree_and_reads_as_its_value():
    r = Ratio(jnp.array([1, 3]), jnp.array([4, 4]))
    assert jax.tree.leaves(r)[0] is r.num and r.shape == (2,)
    assert r.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(r), [0.25, 0.75])
    np.testing.assert_allclose(jnp.asarray(r), [0.25, 0.75])
    doubled = jax.tree.map(lambda v: v * 2, r)
    assert isinstance(doubled, Ratio)
    np.testing.assert_array_equal(doubled.num, [2, 6])


def test_ratio_as_the_loss_gives_a_per_token_mean():
    """Sequences of different lengths: the loss per token over the dataset."""
    lengths = jr.randint(jr.key(2), (N,), 1, 6)
    mask = jnp.arange(5)[None, :] < lengths[:, None]
    values = jr.normal(jr.key(3), (N, 5))

    def eval_fn(params, batch):
        v, m = batch
        return Ratio(jnp.sum(jnp.where(m, (v - params["c"]) ** 2, 0.0)), jnp.sum(m))

    params = {"c": jnp.array(0.5)}
    got = evaluate(params, eval_fn, (values, mask), batch_size=7)
    want = np.sum(np.where(mask, (values - 0.5) ** 2, 0.0)) / np.sum(mask)
    np.testing.assert_allclose(got["loss"], want, rtol=1e-6)


# ------------------------------------------------------------------ compiling


def test_a_second_call_does_not_retrace():
    def counted_eval(model, batch):
        traced("eval")
        return nnx_eval(model, batch)

    def counted_predict(model, batch):
        traced("predict")
        return model(batch[0])

    with count_traces() as traces:
        evaluate(trained_net(), counted_eval, (X, Y), batch_size=8)
        predict(trained_net(), counted_predict, (X, Y), batch_size=8)
        # (a full batch and the remainder; one)
        assert (traces["eval"], traces["predict"]) == (2, 1)
        model = Net(nnx.Rngs(5, dropout=2))  # rebuilt, other values
        data = (X * 3, Y - 1)
        with count_compiles() as c:
            got = evaluate(model, counted_eval, data, batch_size=8)
            out = predict(model, counted_predict, data, batch_size=8)
        assert (traces["eval"], traces["predict"], c.n) == (2, 1, 0)
    model.eval()
    allclose(got, at_once(nnx_eval, model, data))
    allclose(out, model(data[0]))


@FOUR_DEVICES
def test_mesh_splits_the_batches():
    mesh = jax.make_mesh((4,), ("data",))
    got = evaluate(PARAMS, params_eval, (X, Y), batch_size=8, mesh=mesh)
    allclose(got, at_once(params_eval, PARAMS, (X, Y)))
    # (the default batch size, 30, rounded down to 28 for the mesh: before, a
    # refusal naming a batch_size never given)
    got = evaluate(PARAMS, params_eval, (X, Y), mesh=mesh)
    allclose(got, at_once(params_eval, PARAMS, (X, Y)))


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "call, kwargs, exc, match",
    [
        (
            "evaluate",
            dict(data=(X, Y[:5])),
            ValueError,
            r"(?s)^scanax.evaluate: the arrays in `data` must share.*"
            r"data\[1\]  float32\[5, 1\]: 5.*Fix",
        ),
        (
            "evaluate",
            dict(data=(X[:0], Y[:0])),
            ValueError,
            r"^scanax.evaluate: `data` has no examples \(float32\[0, 4\], "
            r"float32\[0, 1\]\)",
        ),
        (
            "evaluate",
            dict(batch_size=0),
            ValueError,
            "^scanax.evaluate: `batch_size` must be positive, got 0",
        ),
        (
            "predict",
            dict(batch_size=-2),
            ValueError,
            "^scanax.predict: `batch_size` must be positive, got -2",
        ),
        (
            "evaluate",
            dict(batch_size=2.5),
            TypeError,
            "`batch_size` must be a positive int or None, got float 2.5",
        ),
        (
            "evaluate",
            dict(fn=lambda m, b: jnp.zeros(3)),
            TypeError,
            r"^scanax.evaluate: `eval_fn` must return a scalar floating-point loss, "
            r"got float32\[3\].\nFix: reduce it",
        ),
        (
            "evaluate",
            dict(fn=lambda m, b, k: jr.normal(k)),
            TypeError,
            r"`eval_fn` uses its key `k` in eval mode .* but no `key` was given",
        ),
        (
            "evaluate",
            dict(fn=lambda m, b, c, d: 0.0),
            TypeError,
            r"`eval_fn` takes 4 required positional arguments \(m, b, c, d\)",
        ),
        (
            "evaluate",
            dict(fn=3),
            TypeError,
            "^scanax.evaluate: `eval_fn` must be a function",
        ),
        (
            "evaluate",
            dict(data=[X, Y]),
            TypeError,
            "`data` must be a pytree of arrays .* got a list",
        ),
        ("evaluate", dict(key=1), TypeError, "`key` must be one JAX random key"),
        (
            "evaluate",
            dict(model="w"),
            TypeError,
            "^scanax.evaluate: `model` holds no arrays",
        ),
        (
            "evaluate",
            dict(mesh="data"),
            TypeError,
            "`mesh` must be a jax.sharding.Mesh",
        ),
        (
            "predict",
            dict(fn=lambda m, b: jnp.sum(b[0])),
            TypeError,
            r"^scanax.predict: `fn` must return arrays with a leading batch axis .* out is float32\[\]",
        ),
        (
            "predict",
            dict(fn=lambda m, b, k, j: b),
            TypeError,
            r"`fn` takes 4 required .* scanax.predict calls fn\(model, batch\) or "
            r"fn\(model, batch, key\)",
        ),
    ],
)
def test_errors(call, kwargs, exc, match):
    fn = kwargs.pop(
        "fn", params_eval if call == "evaluate" else lambda p, b: b[0] @ p["w"]
    )
    args = (kwargs.pop("model", PARAMS), fn, kwargs.pop("data", (X, Y)))
    kwargs.setdefault("batch_size", 8)
    with pytest.raises(exc, match=match):
        (evaluate if call == "evaluate" else predict)(*args, **kwargs)


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_a_call_without_the_function_or_the_data_is_named(call):
    """``predict(model, x)`` (Keras's form) and ``evaluate(model, eval_fn)``:
    scanax's message with the call to write (it was Python's "missing 1
    required positional argument: 'data'"); nothing is traced."""
    run = getattr(scanax, call)
    name = "eval_fn" if call == "evaluate" else "fn"
    with count_compiles() as c:
        with pytest.raises(
            TypeError,
            match=rf"(?s)scanax.{call} takes \(model, {name}, data\): got "
            rf"float32\[{X.shape[0]}, {X.shape[1]}\] second and no data.*Fix: "
            rf"scanax.{call}\(model, ",
        ):
            run(PARAMS, X, batch_size=8)
        with pytest.raises(
            TypeError, match=rf"(?s)scanax.{call}: `data` is missing.*Fix: "
        ):
            run(PARAMS, lambda p, b: jnp.mean(b), batch_size=8)
    assert c.n == 0


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_data_or_batch_size_by_position_is_named(call):
    """``evaluate(model, fn, x, y)`` (Keras's form) and ``batch_size`` by
    position: scanax's message with the call to write (it was Python's "takes
    from 2 to 3 positional arguments but 4 were given"); nothing traced."""
    run = getattr(scanax, call)
    name = "eval_fn" if call == "evaluate" else "fn"
    fn = params_eval if call == "evaluate" else lambda p, b: b[0] @ p["w"]
    with count_compiles() as c:
        with pytest.raises(
            TypeError,
            match=rf"(?s)^scanax.{call} takes 3 positional arguments \(model, {name}, "
            rf"data\), got 4: after `data` came float32\[{Y.shape[0]}, 1\].*Fix: "
            rf"`data` is one argument .*{call}\(model, {name}, \{{'x': x, 'y': y\}}",
        ):
            run(PARAMS, fn, X, Y)
        with pytest.raises(
            TypeError,
            match=rf"(?s)got 4: after `data` came int 8\..*Fix: the options after "
            rf"`data` are keywords: {call}\(model, {name}, data, batch_size=8, ",
        ):
            run(PARAMS, fn, (X, Y), 8)
    assert c.n == 0


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_an_nnx_optimizer_given_as_the_model_is_named(call):
    """The optimizer instead of its model (both are NNX objects): named before
    anything runs (it was flax's AttributeError from ``.eval()``)."""
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    fn = (lambda m, b: jnp.mean(m(b[0]))) if call == "evaluate" else (lambda m, b: m(b))
    data = (X, Y) if call == "evaluate" else X
    with pytest.raises(
        TypeError,
        match=rf"(?s)scanax.{call}: `model` is an nnx.Optimizer.*Fix: pass the model "
        r"itself",
    ):
        (evaluate if call == "evaluate" else predict)(opt, fn, data, batch_size=8)


@FOUR_DEVICES
def test_mesh_errors(pop):
    mesh = jax.make_mesh((4,), ("data",))
    with pytest.raises(ValueError, match=r"`batch_size` \(6\) must be divisible by "):
        evaluate(PARAMS, params_eval, (X, Y), batch_size=6, mesh=mesh)
    small = (X[:3], Y[:3])
    with pytest.raises(ValueError, match=r"`batch_size` \(by default 3, the dataset's"):
        evaluate(PARAMS, params_eval, small, mesh=mesh)
    with pytest.raises(ValueError, match=r"`batch_size` \(3, the dataset's size: 8 is"):
        evaluate(PARAMS, params_eval, small, batch_size=8, mesh=mesh)
    with pytest.raises(ValueError, match="no 'data' axis"):
        evaluate(PARAMS, params_eval, (X, Y), mesh=jax.make_mesh((4,), ("model",)))
    with pytest.raises(ValueError, match="not supported for a scanax.Population"):
        evaluate(pop, nnx_eval, (X, Y), batch_size=8, mesh=mesh)


def test_a_ratio_over_nothing_is_zero_as_sklearn_gives():
    """Precision when nothing is predicted positive: 0/0 counts, 0 (as
    scikit-learn's zero_division=0 and Keras's Precision), not NaN."""
    metrics = pytest.importorskip("sklearn.metrics")
    y = np.array([1, 0, 1, 0], np.int32)
    pred = np.zeros(4, np.int32)

    def eval_fn(model, batch):
        yb, pb = batch
        tp = jnp.sum((pb == 1) & (yb == 1)).astype(jnp.int32)
        fp = jnp.sum((pb == 1) & (yb == 0)).astype(jnp.int32)
        return jnp.float32(0.0), {"precision": scanax.Ratio(tp, tp + fp)}

    out = scanax.evaluate({"w": jnp.zeros(())}, eval_fn, (y, pred), batch_size=2)
    assert out["precision"] == metrics.precision_score(y, pred, zero_division=0) == 0
    assert float(np.asarray(scanax.Ratio(jnp.int32(0), jnp.int32(0)))) == 0.0


# --------------------------------- issue 38: keys, metric rule, evaluation errors


def keyed_eval(model, batch, rngs=None):
    """As the Flax NNX tutorial's loss: a key for Dropout, unused in eval mode."""
    return nnx_eval(model, batch)


def test_a_key_taking_eval_fn_needs_no_key_when_eval_mode_draws_none():
    """Dropout is off in eval mode: the result does not depend on the key, so
    no ``key=`` is asked for (before: refused) and the result is the
    key-less evaluation's; the same for a population and ``predict``."""
    model = trained_net()
    got = evaluate(model, keyed_eval, (X, Y), batch_size=8)
    allclose(got, evaluate(model, nnx_eval, (X, Y), batch_size=8))
    pop = scanax.population(make_member, 2, key=jr.key(4), lr=[0.01, 0.05])
    allclose(
        evaluate(pop, keyed_eval, (X, Y), batch_size=8),
        evaluate(pop, nnx_eval, (X, Y), batch_size=8),
    )
    allclose(
        predict(model, lambda m, b, key: outputs(m, b), (X, Y), batch_size=8),
        predict(model, outputs, (X, Y), batch_size=8),
    )


def test_a_key_used_in_eval_mode_is_asked_for_before_anything_runs():
    def noisy(params, batch, key):
        return params_eval(params, batch)[0] + jr.normal(key)

    def noisy_rows(params, x, rng):
        return x @ params["w"] + jr.normal(rng, (x.shape[0], 1))

    with count_compiles() as compiles:
        with pytest.raises(
            TypeError,
            match=r"(?s)^scanax.evaluate: `eval_fn` uses its key `key` in eval mode"
            r".*no `key` was given.*Fix: pass key=jax.random.key\(seed\)",
        ):
            evaluate(PARAMS, noisy, (X, Y), batch_size=8)
        with pytest.raises(
            TypeError, match=r"^scanax.predict: `fn` uses its key `rng` in eval mode"
        ):
            predict(PARAMS, noisy_rows, X, batch_size=8)
    assert compiles.n == 0


def test_predict_gives_per_batch_keys_as_evaluate_does():
    def noisy_rows(params, x, key):
        return x @ params["w"] + jr.normal(key, (x.shape[0], 1))

    key = jr.key(5)
    got = predict(PARAMS, noisy_rows, X, batch_size=8, key=key)
    # batch j: rows j*8 ... (the last batch: the last 8 rows, its new ones kept)
    parts = [noisy_rows(PARAMS, X[s : s + 8], jr.fold_in(key, j)) for j, s in
             enumerate(range(0, 24, 8))]  # fmt: skip
    last = noisy_rows(PARAMS, X[N - 8 :], jr.fold_in(key, 3))[-(N - 24) :]
    allclose(got, jnp.concatenate([*parts, last]))


@pytest.mark.parametrize(
    "metric, found",
    [
        (lambda e: jax.lax.complex(e, e), r"metric metrics\['m'\] returned by "
         r"`eval_fn` is complex64\[\].*Fix: return a real value"),
        (lambda e: Ratio(jax.lax.complex(e, e), 1.0), r"scanax.Ratio: `num` must "
         r"be a real array or number .* got complex64"),
        (lambda e: np.array("abc"), r"metric metrics\['m'\] returned by `eval_fn` "
         r"is str\d*\[\].*Fix: return numbers"),
        (lambda e: e * jnp.ones(3), None),  # an array metric: kept
    ],
    ids=["complex", "complex-ratio", "string", "array"],
)  # fmt: skip
def test_one_metric_rule_in_evaluate_and_fits_evaluation(metric, found):
    """Complex and text metrics are refused by name, in ``evaluate`` and in
    fit's evaluation alike (before: a complex metric came back as its real
    part, with only a ComplexWarning); an array metric works in both, with
    its shape."""

    def eval_fn(params, batch):
        loss, extra = params_eval(params, batch)
        return loss, {"m": metric(extra["mae"])}

    kw = dict(steps=2, batch_size=8, progress=False, eval_data=(X, Y), eval_every=1)
    if found is None:
        got = evaluate(PARAMS, eval_fn, (X, Y), batch_size=7)
        mae = evaluate(PARAMS, params_eval, (X, Y), batch_size=7)["mae"]
        assert got["m"].shape == (3,)
        allclose(got["m"], np.full(3, mae, np.float32))
        # (trained by it too: a training metric of the same shape)
        out = scanax.fit(PARAMS, optax.sgd(0.0), eval_fn, (X, Y), **kw)
        assert out.history["val_m"].shape == out.history["m"].shape == (2, 3)
        allclose(out.history["val_m"], np.full((2, 3), mae, np.float32))
        for t in range(2):
            batch = (X[t * 8 : t * 8 + 8], Y[t * 8 : t * 8 + 8])
            allclose(out.history["m"][t], eval_fn(PARAMS, batch)[1]["m"])
        return
    prefix = "" if found.startswith("scanax.Ratio") else "{call}: "
    with pytest.raises(
        TypeError, match="(?s)^" + prefix.format(call="scanax.evaluate") + found
    ):
        evaluate(PARAMS, eval_fn, (X, Y), batch_size=7)
    with pytest.raises(
        TypeError, match="(?s)^" + prefix.format(call="scanax.fit") + found
    ):
        scanax.fit(PARAMS, optax.sgd(0.1), params_eval, (X, Y), eval_fn=eval_fn, **kw)


def per_example_eval(params, batch):
    x, y = batch
    return params_eval(params, batch)[0], {"pred": x @ params["w"]}


@pytest.mark.parametrize(
    "batch_size, sizes",
    [(8, (8, 6)), (10, (10, 20)), (30, (30, 60)), (None, (30, 60)), (64, (30, 60))],
)
def test_a_per_example_metric_is_refused_naming_it(batch_size, sizes):
    """A metric whose shape follows the batch size cannot be averaged over the
    dataset: refused whether the batches are uneven (before: a raw broadcasting
    error of the last, smaller batch) or not (before: averaged position by
    position over the batches, or returned per example from one batch)."""
    a, b = sizes
    with pytest.raises(
        ValueError,
        match=r"(?s)^scanax.evaluate: `eval_fn` returns metrics whose shape depends "
        rf"on the batch size:\n  metrics\['pred'\]  \[{a}, 1\] \(batch of {a}\), "
        rf"\[{b}, 1\] \(batch of {b}\).*Fix: reduce it over the batch .* "
        "scanax.predict",
    ):
        evaluate(PARAMS, per_example_eval, (X, Y), batch_size=batch_size)


def test_a_per_example_metric_in_fits_evaluation_is_refused_with_even_batches():
    with pytest.raises(
        ValueError, match=r"metrics\['pred'\]  \[10, 1\] \(batch of 10\)"
    ):
        scanax.fit(
            PARAMS,
            optax.sgd(0.1),
            lambda p, b: params_eval(p, b)[0],
            (X, Y),
            steps=2,
            batch_size=10,
            key=jr.key(0),
            progress=False,
            callbacks=[
                scanax.Eval((X, Y), every=2, batch_size=10, fn=per_example_eval)
            ],
        )


def test_a_per_class_metric_and_a_fixed_batch_reshape_pass_with_even_batches():
    """The second look at another batch size refuses only what changes with it:
    a metric per class is kept, and a function that only takes its own batch
    size (a reshape to it) still evaluates."""

    def eval_fn(params, batch):
        x, y = batch
        err = (x @ params["w"] - y).reshape(10, 1)  # (only batches of 10)
        return jnp.mean(err**2), {"per_col": jnp.mean(jnp.abs(x), axis=0)}

    got = evaluate(PARAMS, eval_fn, (X, Y), batch_size=10)
    want = {
        "loss": jnp.mean((X @ PARAMS["w"] - Y) ** 2),
        "per_col": jnp.mean(jnp.abs(X), 0),
    }
    allclose(got, want)


def test_ratio_refuses_what_is_not_a_real_array():
    with pytest.raises(
        TypeError, match=r"^scanax.Ratio: `num` must be a real array .* got str"
    ):
        Ratio("3", 1)
    with pytest.raises(
        ValueError,
        match=r"^scanax.Ratio: the shapes of `num` \(float32\[3\]\) and `den` "
        r"\(float32\[2\]\) do not broadcast",
    ):
        Ratio(jnp.ones(3), jnp.ones(2))
    r = Ratio(jnp.arange(3), 2)
    assert jax.tree.map(lambda x: None, r).num is None  # (rebuilt unchecked)
    assert Ratio(True, 1).value == 1.0


@pytest.mark.parametrize(
    "call, data, found",
    [
        ("evaluate", {"x": X, "y": Y}, r"TypeError .* dict: \['x'\] float32\[8, 4\]"),
        ("evaluate", (X[:, :3], Y), r"TypeError .* tuple: \[0\] float32\[8, 3\]"),
        ("predict", {"x": X}, r"KeyError .* dict: \['x'\] float32\[8, 4\]"),
    ],
)
def test_data_unlike_what_the_function_reads_is_named(call, data, found):
    fn = params_eval if call == "evaluate" else (lambda p, b: b[0] @ p["w"])
    name = "eval_fn" if call == "evaluate" else "fn"
    exc = TypeError
    with pytest.raises(
        exc,
        match=rf"(?s)^scanax.{call}: `{name}` raised {found}.*Fix: if `{name}` reads "
        "another structure",
    ):
        getattr(scanax, call)(PARAMS, fn, data, batch_size=8)


def test_a_key_is_followed_through_jitted_helpers_and_loops():
    """What ``uses_key`` follows: a ``jax.jit`` helper given the key but
    returning nothing drawn from it leaves the result key-free (no ``key=``
    needed); a key that reaches the loss only through a loop's carry, a later
    step's, is found (a loop's outputs count as depending on all its inputs)."""

    @jax.jit
    def helper(x, key):
        return x * 2, jr.normal(key)  # (the draw is dropped below)

    def jitted(params, batch, key):
        loss, _ = params_eval(params, batch)
        doubled, _ = helper(loss, key)
        return doubled

    got = evaluate(PARAMS, jitted, (X, Y), batch_size=8)
    allclose(got["loss"], 2 * evaluate(PARAMS, params_eval, (X, Y))["loss"])

    def through_a_carry(params, batch, key):
        def body(carry, _):
            a, b = carry
            return (b, jr.normal(key)), a  # the key's draw reaches a a step later

        _, outs = jax.lax.scan(body, (0.0, 0.0), None, length=3)
        return params_eval(params, batch)[0] + outs[-1]

    with pytest.raises(TypeError, match="uses its key `key` in eval mode"):
        evaluate(PARAMS, through_a_carry, (X, Y), batch_size=8)


@pytest.mark.parametrize(
    "signature, population, takes",
    [
        ("model, batch", False, (False, False)),
        ("model, batch, key", False, (False, True)),
        ("model, batch, rngs=None", False, (False, True)),
        ("model, batch, rng=None", False, (False, True)),
        ("model, batch, scale=2.0", False, (False, False)),
        ("model, batch, *args", False, (False, True)),
        ("model, batch, hp", True, (True, False)),
        ("model, batch, hp, rngs=None", True, (True, True)),
        ("model, batch, key=None", True, (False, True)),
        ("model, batch, hp=None", True, (False, False)),
    ],
)
def test_the_key_rule(signature, population, takes):
    """``_keys.arguments``, the one rule of fit, evaluate and predict."""
    from scanax._fit import keys as _keys

    ns: dict = {}
    exec(f"def fn({signature}): pass", ns)
    assert _keys.arguments(ns["fn"], "scanax.fit", "loss_fn", population)[:2] == takes


def test_a_batch_that_is_one_array_is_described_as_one():
    """A function failing on a batch that is one array: the batch is named by
    its shape and dtype, not by its tracer's class."""
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.predict: `fn` raised TypeError.*A batch of `data` is an "
        r"array: float32\[5, 4\]\.\nFix:",
    ) as caught:
        predict(
            {"w": jnp.ones(3)}, lambda p, x: x @ p["w"], jnp.ones((10, 4)), batch_size=5
        )
    assert "Tracer" not in str(caught.value)


def test_an_eval_fn_returning_only_metrics_is_told_to_add_its_loss():
    """A dict of metrics alone: the message says what the evaluation's loss is
    (not the training wording, which named the differentiated element)."""

    def metrics_only(params, batch):
        return {"mae": jnp.mean(jnp.abs(batch[0] @ params["w"] - batch[1]))}

    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.evaluate: `eval_fn` returned a dict \('mae'\).*Fix: "
        r"return `\(loss, \{...metrics\}\)`.*val_loss in fit",
    ):
        scanax.evaluate(PARAMS, metrics_only, (X, Y), batch_size=16)


@pytest.mark.parametrize("call", ["evaluate", "predict", "fit"])
def test_a_function_reading_the_nnx_model_from_outside_is_named(call):
    """The user's model (in train mode: Dropout draws, BatchNorm updates) read
    from the closure, not the eval-mode copy passed in: named with the fix
    (before: flax's TraceContextError from inside the trace)."""
    model = trained_net()
    before = nnx.state(model)

    def fn(m, batch):
        x, y = batch
        return model(x) if call == "predict" else jnp.mean((model(x) - y) ** 2)

    name = {"evaluate": "eval_fn", "predict": "fn", "fit": "eval_fn"}[call]
    with pytest.raises(
        TypeError,
        match=rf"(?s)^scanax.{call}: `{name}` reads the model as `model` from outside"
        rf".*the copy in eval mode.*Fix: use the argument, def {name}\(model, batch\)",
    ):
        if call == "fit":
            opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
            scanax.fit(
                model, opt, lambda m, b: nnx_eval(m, b)[0], (X, Y), steps=2,
                batch_size=10, key=jr.key(0), progress=False,
                callbacks=[scanax.Eval((X, Y), every=2, fn=fn)],
            )  # fmt: skip
        else:
            getattr(scanax, call)(model, fn, (X, Y), batch_size=10)
    allclose(nnx.state(model), before)


def test_ratio_counts_past_int32_are_summed_exactly():
    """A per-token loss over 3e9 tokens (1e9 a batch): the int32 token counts'
    sum is past int32's range (before: wrapped round, a negative loss), and
    an integer numerator keeps its exact count."""
    x = jnp.arange(3.0)

    def eval_fn(params, batch):
        tokens = jnp.int32(1_000_000_000) + batch[0].astype(jnp.int32)
        # (the tokens a batch: 3e9 + 3 over 3 batches)
        return scanax.Ratio(2.0 * tokens.astype(jnp.float32), tokens), {
            "per_batch": scanax.Ratio(tokens, jnp.int32(1))
        }

    got = evaluate(PARAMS, eval_fn, x, batch_size=1)
    assert got["loss"] == 2.0
    assert got["per_batch"] == pytest.approx(1e9 + 1, rel=1e-7)


def test_float64_metrics_are_kept_in_float64_with_x64():
    """Under jax_enable_x64, a float64 metric (and a Ratio of int64 counts) is
    summed and divided in float64 (before: cast to float32 and rounded)."""
    with jax.enable_x64(True):
        x = jnp.full((4,), 1 + 1e-12, jnp.float64)

        def eval_fn(params, batch):
            n = jnp.asarray(batch.shape[0], jnp.int64) * 10**10
            return jnp.mean(batch), {"r": scanax.Ratio(n, n * 2)}

        got = evaluate({"w": jnp.zeros((), jnp.float64)}, eval_fn, x, batch_size=3)
    assert got["loss"] - 1 == pytest.approx(1e-12, rel=1e-3)
    # (an x64 quotient: exact on CPU; XLA:TPU's emulated float64 division is
    # off by a few units in the 15th digit, far below float32's 6e-8)
    assert got["r"] == pytest.approx(0.5, rel=1e-13)


@pytest.mark.parametrize("call", ["evaluate", "predict", "fit", "fit eval"])
def test_data_of_strings_or_objects_is_refused_by_path(call):
    """A NumPy array JAX cannot hold (strings, objects) in the data: named by
    its path with the fix (before: JAX's bare "Dtype <U1 is not a valid JAX
    array type", or an abstract-array error)."""
    ids = np.array([f"id{i}" for i in range(N)])
    data = {"x": np.asarray(X), "y": np.asarray(Y), "ids": ids}

    def fn(params, batch):
        return params_eval(params, (batch["x"], batch["y"]))

    name = "eval_data" if call == "fit eval" else "data"
    with pytest.raises(
        TypeError,
        match=rf"(?s)^scanax.{call.split()[0]}: `{name}` holds arrays JAX cannot put "
        rf"on a device.*{name}\['ids'\]  <U4 \[30\].*Fix: encode them as numbers",
    ):
        if call == "evaluate":
            evaluate(PARAMS, fn, data)
        elif call == "predict":
            predict(PARAMS, lambda p, b: b["x"] @ p["w"], data)
        else:
            train = (X, Y) if call == "fit eval" else data
            loss = params_eval if call == "fit eval" else fn
            scanax.fit(
                PARAMS, optax.sgd(0.1), lambda p, b: loss(p, b)[0], train, steps=2,
                batch_size=10, progress=False,
                callbacks=[scanax.Eval(data, every=2, fn=fn)] if call == "fit eval" else [],
            )  # fmt: skip
