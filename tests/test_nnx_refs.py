"""NNX models whose Variables hold array refs (``nnx.var_defaults(ref=True)``,
Flax's mutable-array mode): ``fit`` (with evaluation, early stopping, a second
call, checkpoints), ``evaluate``, ``predict``, populations and ``scan`` give what
the same model with plain Variables gives, bit for bit, and write the results
into the user's refs, which the Variables keep.

Before 2026-12-07 ``fit`` refused such a model (first a ``TypeError`` from
``int()`` of a ref, then a wrong "the optimizer's `wrt` chooses none of the
model's Variables"), and ``scan`` failed in JAX ("mutable array references
cannot be returned")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
if not hasattr(nnx, "var_defaults"):
    pytest.skip("this Flax has no array-ref Variables", allow_module_level=True)

import scanax  # noqa: E402

X = jax.random.normal(jax.random.key(0), (48, 3))
Y = jnp.sum(X, axis=1, keepdims=True)


def make(ref: bool, key: jax.Array | None = None):
    seed = 0 if key is None else key
    with nnx.var_defaults(ref=ref):
        rngs = nnx.Rngs(seed)
        model = nnx.Sequential(
            nnx.Linear(3, 8, rngs=rngs),
            nnx.Dropout(0.2, rngs=rngs),
            nnx.BatchNorm(8, rngs=rngs),
            nnx.Linear(8, 1, rngs=rngs),
        )
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, optimizer


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def raw(*nodes) -> list:
    leaves = nnx.graph.flatten(list(nodes))[1].leaves
    return [v.get_raw_value() if isinstance(v, nnx.Variable) else v for v in leaves]


def values(*nodes) -> list[np.ndarray]:
    out = []
    for x in raw(*nodes):
        x = x[...] if isinstance(x, jax.Ref) else x
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def train(ref: bool, execution: str) -> dict:
    model, optimizer = make(ref)
    before = raw(model, optimizer)
    kw = dict(batch_size=16, progress=False, key=jax.random.key(5), execution=execution)
    first = scanax.fit(
        model,
        optimizer,
        loss_fn,
        (X, Y),
        steps=12,
        callbacks=[
            scanax.Eval((X, Y), every=4),
            scanax.EarlyStop("val_loss", patience=50),
        ],
        **kw,
    )
    second = scanax.fit(model, optimizer, loss_fn, (X, Y), steps=6, **kw)
    if ref:  # the user's refs, written in place
        after = raw(model, optimizer)
        assert all(isinstance(x, jax.Ref) for x in after)
        assert all(x is y for x, y in zip(after, before))
    return {
        "state": values(model, optimizer),
        "loss": np.concatenate([first.history["loss"], second.history["loss"]]),
        "val": first.history["val_loss"],
        "evaluate": scanax.evaluate(model, loss_fn, (X, Y), batch_size=16),
        "predict": scanax.predict(model, lambda m, x: m(x), X, batch_size=16),
        "step": int(optimizer.step[...]),
    }


@pytest.mark.parametrize("execution", ["fused", "stepwise"])
def test_fit_evaluate_predict_equal_plain_variables(execution):
    ours, plain = train(True, execution), train(False, execution)
    assert ours["step"] == plain["step"] == 18
    assert_same(ours["state"], plain["state"])
    for k in ("loss", "val", "predict"):
        np.testing.assert_array_equal(ours[k], plain[k])
    assert ours["evaluate"] == plain["evaluate"]
    assert np.isfinite(ours["loss"]).all() and ours["loss"][-1] < ours["loss"][0]


def test_a_checkpointed_run_resumes_into_the_refs(tmp_path):
    kw = dict(batch_size=16, progress=False, key=jax.random.key(5))
    whole, whole_opt = make(False)
    scanax.fit(whole, whole_opt, loss_fn, (X, Y), steps=10, **kw)

    model, optimizer = make(True)
    ckpt = [scanax.Checkpoint(tmp_path / "ckpt", every=5)]
    scanax.fit(model, optimizer, loss_fn, (X, Y), steps=5, callbacks=ckpt, **kw)
    again, again_opt = make(True)  # a new process would build it anew
    before = raw(again, again_opt)
    ckpt = [scanax.Checkpoint(tmp_path / "ckpt", every=5)]
    res = scanax.fit(again, again_opt, loss_fn, (X, Y), steps=10, callbacks=ckpt, **kw)
    # restored at step 5 (the refs written), trained on to step 10
    assert res.steps == 10 and int(again_opt.step[...]) == 10
    assert all(x is y for x, y in zip(raw(again, again_opt), before))
    assert_same(values(again, again_opt), values(whole, whole_opt))


def test_a_population_equals_one_of_plain_variables():
    def member(ref):
        def make_member(key):
            return make(ref, key)

        return make_member

    out = {}
    for ref in (True, False):
        pop = scanax.population(member(ref), 3, key=jax.random.key(1))
        res = scanax.fit(
            pop, None, loss_fn, (X, Y), steps=8, batch_size=16, progress=False,
            key=jax.random.key(2),
        )  # fmt: skip
        members = [values(*pop.member(i)) for i in range(3)]
        out[ref] = (res.history["loss"], [x for m in members for x in m])
    np.testing.assert_array_equal(out[True][0], out[False][0])
    assert_same(out[True][1], out[False][1])


def body(model, x):
    y = model(x)
    model.bias[...] = model.bias[...] + jnp.sum(y)  # a state change per step
    return model, jnp.sum(y**2)


def test_scan_carries_a_model_of_refs_as_the_python_loop_does():
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    bias = model.bias.get_raw_value()
    plain = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    xs = X[:6]
    expected = []
    for x in xs:  # the reference: a Python loop on plain Variables
        plain, y = body(plain, x)
        expected.append(y)

    out, ys = scanax.scan(body, model, xs)
    assert out is model and model.bias.get_raw_value() is bias
    np.testing.assert_allclose(ys, jnp.stack(expected), rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], plain.bias[...], rtol=1e-6)
    np.testing.assert_array_equal(model.kernel[...], plain.kernel[...])


def test_scan_inside_jit_writes_the_traced_refs():
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    plain = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    xs = X[:6]

    @nnx.jit
    def run(model, xs):
        return scanax.scan(body, model, xs)[1]

    ys = run(model, xs)
    expected = scanax.scan(body, plain, xs)[1]
    np.testing.assert_allclose(ys, expected, rtol=1e-6)
    np.testing.assert_allclose(model.bias[...], plain.bias[...], rtol=1e-6)


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 3, rngs=rngs)
        self.b = nnx.Linear(3, 3, rngs=rngs)
        self.b.kernel = self.a.kernel  # weight tying: one Variable, two paths
        self.out = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.b(self.a(x)))


def test_tied_weights_stay_tied_and_train_as_plain_ones():
    out = {}
    for ref in (True, False):
        with nnx.var_defaults(ref=ref):
            model = Tied(nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        res = scanax.fit(
            model, optimizer, loss_fn, (X, Y), steps=6, batch_size=16,
            progress=False, key=jax.random.key(1),
        )  # fmt: skip
        assert model.a.kernel is model.b.kernel
        _, ys = scanax.scan(lambda m, x: (m, jnp.sum(m(x))), model, X[:4])
        out[ref] = [res.history["loss"], np.asarray(ys), *values(model, optimizer)]
    assert_same(out[True], out[False])


def test_two_variables_holding_one_ref_are_refused_by_name():
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        model.twin = nnx.Param(jnp.zeros(1))
    model.twin.set_raw_value(model.bias.get_raw_value())
    before = values(model)
    with pytest.raises(
        ValueError, match="(?s)two different Variables.*same array ref.*Fix"
    ):
        scanax.evaluate(model, loss_fn, (X, Y), batch_size=16)
    with pytest.raises(ValueError, match="two different Variables"):
        scanax.scan(lambda m, x: (m, jnp.sum(m(x))), model, X[:3])
    assert_same(values(model), before)


def train_body(carry, x):
    model, optimizer = carry
    loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return carry, loss


def test_scan_of_a_training_step_outside_jit():
    """``scanax.scan`` called eagerly (its compiled-program cache) on a step
    taking gradients, as under ``nnx.jit``, as with plain Variables."""
    xs = jax.random.normal(jax.random.key(3), (4, 2, 3))
    out = {}
    for ref in (True, False):
        with nnx.var_defaults(ref=ref):
            model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        eager = scanax.scan(train_body, (model, optimizer), xs)[1]
        jitted = nnx.jit(lambda m, o: scanax.scan(train_body, (m, o), xs)[1])(
            model, optimizer
        )
        out[ref] = [eager, jitted, *values(model, optimizer)]
    assert_same(out[True], out[False])


def test_scan_of_refs_closed_over_by_jax_jit_is_the_python_loop():
    """Flax's array-ref mode lets a ``jax.jit`` closure write a model's refs;
    scan's carry does so too (before 2026-12-07 it was refused with NNX's
    trace-level message, which holds for plain Variables only)."""
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    bias = model.bias.get_raw_value()
    plain = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    xs = X[:5]
    run = jax.jit(lambda xs: scanax.scan(body, model, xs)[1])
    for _ in range(2):  # the second call reads the refs the first one wrote
        expected = []
        for x in xs:
            plain, y = body(plain, x)
            expected.append(y)
        np.testing.assert_allclose(run(xs), jnp.stack(expected), rtol=1e-6)
        np.testing.assert_allclose(model.bias[...], plain.bias[...], rtol=1e-6)
    assert model.bias.get_raw_value() is bias


def test_plain_variables_beside_refs_under_a_jax_jit_closure_are_named():
    with nnx.var_defaults(ref=True):
        ours = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    plain = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    before = values(ours, plain)

    def step(carry, x):
        a, b = carry
        a, y = body(a, x)
        b, z = body(b, x)
        return (a, b), y + z

    with pytest.raises(TypeError, match=r"carry\[1\] \(Linear\) was made outside"):
        jax.jit(lambda xs: scanax.scan(step, (ours, plain), xs)[1])(X[:3])
    assert_same(values(ours, plain), before)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.tanh(self.norm(self.lin(x)))


def test_a_stack_of_ref_layers_holds_refs_of_its_own_as_plain_layers_run():
    """A Stack copies its layers; of layers holding array refs, into refs of its
    own, so that it runs (training-mode BatchNorm writing its statistics) inside
    a ``jax.jit`` closure as the model's other layers do."""
    xs = jax.random.normal(jax.random.key(4), (3, 6, 4))

    def layers(ref):  # a stacked run of three blocks, then one layer alone
        with nnx.var_defaults(ref=ref):
            blocks = [Block(nnx.Rngs(i)) for i in range(3)]
            return [*blocks, nnx.BatchNorm(4, rngs=nnx.Rngs(3))]

    given = layers(True)
    kept = values(*given)
    ours, plain = scanax.Stack(given), scanax.Stack(layers(False))
    held = raw(ours)
    assert all(isinstance(r, jax.Ref) for r in held)
    assert not {id(r) for r in held} & {id(r) for r in raw(*given)}
    # eagerly, then inside a jax.jit closure (plain Variables: through nnx.jit)
    np.testing.assert_array_equal(ours(xs[0]), plain(xs[0]))
    closure = jax.jit(lambda x: ours(x))
    through = nnx.jit(lambda stack, x: stack(x))
    for x in xs[1:]:
        np.testing.assert_array_equal(closure(x), through(plain, x))
    assert_same(values(ours), values(plain))
    assert [id(r) for r in raw(ours)] == [id(r) for r in held]
    assert_same(values(*given), kept)  # the user's layers: untouched
    # A Stack of plain layers turned into refs afterwards (`nnx.with_vars`) too.
    as_refs = nnx.with_vars(scanax.Stack(layers(False)), ref=True)
    replay = scanax.Stack(layers(False))
    for x in xs:
        np.testing.assert_array_equal(jax.jit(lambda x: as_refs(x))(x), replay(x))
    assert_same(values(as_refs), values(replay))


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (conftest.py)")
def test_fit_on_a_mesh_equals_plain_variables():
    mesh = jax.make_mesh((2,), ("data",))
    out = {}
    for ref in (True, False):
        model, optimizer = make(ref)
        res = scanax.fit(
            model, optimizer, loss_fn, (X, Y), steps=4, batch_size=16,
            progress=False, key=jax.random.key(1), mesh=mesh,
        )  # fmt: skip
        out[ref] = [res.history["loss"], *values(model, optimizer)]
    assert_same(out[True], out[False])


def test_fit_and_evaluate_of_a_stack_of_ref_layers_equal_plain_layers():
    x = jax.random.normal(jax.random.key(6), (32, 4))
    data = (x, jnp.sum(x, axis=1, keepdims=True))

    def stack_loss(stack, batch):
        return jnp.mean((jnp.sum(stack(batch[0]), 1, keepdims=True) - batch[1]) ** 2)

    out = {}
    for ref in (True, False):
        with nnx.var_defaults(ref=ref):
            stack = scanax.Stack([Block(nnx.Rngs(i)) for i in range(3)])
            optimizer = nnx.Optimizer(stack, optax.adam(1e-2), wrt=nnx.Param)
        res = scanax.fit(
            stack, optimizer, stack_loss, data, steps=6, batch_size=8,
            progress=False, key=jax.random.key(1),
        )  # fmt: skip
        metrics = scanax.evaluate(stack, stack_loss, data, batch_size=8)
        out[ref] = [res.history["loss"], metrics["loss"], *values(stack, optimizer)]
    assert_same(out[True], out[False])


def test_a_carried_model_written_through_the_closure_too_is_refused():
    """``f`` writing the carried model's refs through its closure (the object
    passed, not the one it is given): the carry's values would be written over
    those writes at the end (a silent wrong result before 2026-12-07)."""
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    before = values(model)

    def step(m, x):
        model.kernel[...] = model.kernel[...] + 1.0  # the closure's object
        return m, jnp.sum(m(x))

    match = r"(?s)`f` writes carry\['kernel'\] through its closure.*Fix"
    with pytest.raises(ValueError, match=match):
        scanax.scan(step, model, X[:3])
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda xs: scanax.scan(step, model, xs)[1])(X[:3])
    assert_same(values(model), before)


def test_refs_closed_over_by_vmap_or_grad_are_named():
    """JAX cannot write a batched or differentiated value into a ref closed
    over by ``jax.vmap``/``jax.grad`` (it raised after writing some): scanax
    names the carry's Variables before writing any."""
    with nnx.var_defaults(ref=True):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    before = values(model)
    match = r"(?s)^scanax.scan: the array refs of carry\['bias'\].*(batched|differentiated) value.*Nothing was written"
    with pytest.raises(TypeError, match=match):
        jax.vmap(lambda x: scanax.scan(body, model, x[None])[1])(X[:2])
    with pytest.raises(TypeError, match=match):
        jax.grad(lambda x: jnp.sum(scanax.scan(body, model, x[None])[1]))(X[0])
    assert_same(values(model), before)


class TiedLayer(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.b.kernel = self.a.kernel  # one Variable, two paths, in one layer
        self.norm = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.norm(self.b(self.a(x))))


def test_a_ref_stack_of_tied_layers_under_nnx_grad_is_flax_s_sequential():
    """Under ``nnx.grad``, Flax's own models of refs update BatchNorm's statistics
    otherwise than plain ones (Flax's behaviour): a Stack of ref layers does
    what an ``nnx.Sequential`` of those layers does; tied weights stay tied."""
    xs = jax.random.normal(jax.random.key(7), (2, 5, 4))
    out = {}
    for kind in ("Sequential", "Stack"):
        with nnx.var_defaults(ref=True):
            layers = [TiedLayer(nnx.Rngs(i)) for i in range(3)]
            model = (nnx.Sequential if kind == "Sequential" else scanax.Stack)(
                *([layers] if kind == "Stack" else layers)
            )
        grad = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=1)
        out[kind] = [np.asarray(grad(model, x)) for x in xs]  # train mode
        if kind == "Stack":
            out[kind] += values(model)
        else:  # (each leaf of the layers, stacked as the Stack holds them)
            per = [values(layer) for layer in layers]
            out[kind] += [np.stack(leaf) for leaf in zip(*per)]
    for ours, flax in zip(out["Stack"], out["Sequential"], strict=True):
        np.testing.assert_allclose(ours, flax, rtol=1e-5, atol=1e-6)


class Masked(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.mask = jnp.array([1.0, 0.0])  # an array attribute, not a Variable

    def __call__(self, x):
        return self.lin(x) * self.mask


def test_an_array_attribute_beside_refs_under_a_jax_jit_closure_is_named():
    """NNX will not set a plain array attribute from a closure (its refs it
    would): scanax names the object, where Flax's own error said nothing of
    the carry; eagerly, it is carried as any array."""
    with nnx.var_defaults(ref=True):
        model = Masked()
    before = values(model)

    def step(m, x):
        m.lin.bias[...] = m.lin.bias[...] + jnp.sum(m(x))
        return m, jnp.sum(m(x))

    with pytest.raises(TypeError, match=r"carry \(Masked\) was made outside"):
        jax.jit(lambda xs: scanax.scan(step, model, xs)[1])(X[:3])
    assert_same(values(model), before)
    plain = Masked()
    expected = []
    for x in X[:3]:
        plain, y = step(plain, x)
        expected.append(y)
    np.testing.assert_allclose(scanax.scan(step, model, X[:3])[1], expected, rtol=1e-6)
