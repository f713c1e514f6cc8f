"""scanax.fit on a device mesh (4 forced host devices, see conftest.py)."""

import functools as ft

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import scanax

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")

from fit_helpers import BS, KEY, TX, X, Y, batch_at  # noqa: E402
from helpers import close as _close  # noqa: E402

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS in conftest.py)"
)

SEEN = []  # shardings of the batch as the compiled step sees it


class MLP(nnx.Module):
    def __init__(self, rngs, annotate=False):
        init = nnx.initializers.lecun_normal()
        if annotate:
            init = nnx.with_partitioning(init, (None, "model"))
        self.l1 = nnx.Linear(3, 8, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, batch):
    x, y = batch
    jax.debug.inspect_array_sharding(x, callback=SEEN.append)
    return jnp.mean((model(x) - y) ** 2)


def run(mesh, data, annotate=False, **kw):
    if annotate:
        with jax.set_mesh(mesh):  # flax places annotated Variables eagerly
            model = MLP(nnx.Rngs(0), annotate)
            opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    else:
        model = MLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    result = scanax.fit(
        model,
        opt,
        loss_fn,
        data,
        steps=12,
        steps_per_call=6,
        progress=False,
        mesh=mesh,
        **kw,
    )
    return result, model, opt


close = ft.partial(_close, rtol=1e-5, atol=1e-6, structure=False)


@pytest.mark.parametrize("kind", ["array", "iterable"])
def test_mesh_matches_one_device_and_shards_the_batch(kind):
    mesh = jax.make_mesh((4,), ("data",))
    if kind == "array":
        data, kw = (X, Y), dict(batch_size=BS, key=KEY)
    else:
        data, kw = [batch_at(t) for t in range(12)], {}
    one, m1, o1 = run(None, data, **kw)
    SEEN.clear()
    many, m4, o4 = run(mesh, data, **kw)
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
    close(nnx.state(m4), nnx.state(m1))
    close(nnx.state(o4), nnx.state(o1))
    # The batch inside the step is split over the 4 devices of the 'data' axis.
    assert SEEN, "the step was not compiled with a mesh"
    sharding = SEEN[-1]
    assert len(sharding.device_set) == 4 and not sharding.is_fully_replicated
    assert sharding.shard_shape((BS, 3)) == (BS // 4, 3)
    # Parameters are replicated.
    assert m4.l1.kernel[...].sharding.is_fully_replicated


def test_nnx_sharding_annotations_are_followed():
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=auto)
    one, m1, _ = run(None, (X, Y), batch_size=BS)  # same values, one device
    many, m4, _ = run(mesh, (X, Y), annotate=True, batch_size=BS)
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
    close(nnx.state(m4), nnx.state(m1))
    assert m4.l1.kernel[...].sharding.spec == P(None, "model")
    assert m4.l2.kernel[...].sharding.is_fully_replicated


def test_a_model_on_an_explicit_mesh_is_given_back_on_it():
    """fit(mesh=) of a model made under ``jax.set_mesh`` of Explicit axes
    (``jax.make_mesh``'s default) runs on an Auto copy of the mesh and gives
    the state back on the user's mesh (the same buffers), so the model,
    ``evaluate(mesh=)`` and ``predict`` work inside ``jax.set_mesh(mesh)``
    after it (review: JAX's "context mesh ... should match the aval mesh"
    error); values as the Auto mesh's run; a second fit continues."""
    explicit = jax.make_mesh((2, 2), ("data", "model"))
    assert jax.sharding.AxisType.Explicit in explicit.axis_types
    auto = (jax.sharding.AxisType.Auto,) * 2
    _, m_ref, _ = run(jax.make_mesh((2, 2), ("data", "model"), axis_types=auto),
                      (X, Y), annotate=True, batch_size=BS)  # fmt: skip
    _, m, o = run(explicit, (X, Y), annotate=True, batch_size=BS)
    close(nnx.state(m), nnx.state(m_ref))
    kernel = m.l1.kernel[...]
    assert kernel.sharding.mesh == explicit and kernel.sharding.spec == P(None, "model")
    with jax.set_mesh(explicit):
        out = m(X[:4])
        got = scanax.evaluate(m, loss_fn, (X, Y), batch_size=BS, mesh=explicit)
        rows = scanax.predict(m, lambda model, b: model(b), X, batch_size=BS)
    close(out, m_ref(X[:4]))
    want = scanax.evaluate(m_ref, loss_fn, (X, Y), batch_size=BS)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    close(rows, m_ref(X))
    again = scanax.fit(m, o, loss_fn, (X, Y), steps=6, batch_size=BS, progress=False,
                       mesh=explicit)  # fmt: skip
    assert again.steps == 6 and m.l1.kernel[...].sharding.mesh == explicit


def test_evaluate_on_a_mesh_inside_its_set_mesh():
    """``evaluate(mesh=m)`` inside ``jax.set_mesh(m)`` (Explicit axes) of a
    model on one device: the value outside it (review: JAX's context-mesh
    error from inside the compiled evaluation)."""
    mesh = jax.make_mesh((4,), ("data",))
    model = MLP(nnx.Rngs(0))
    want = scanax.evaluate(model, loss_fn, (X, Y), batch_size=BS, mesh=mesh)
    with jax.set_mesh(mesh):
        got = scanax.evaluate(model, loss_fn, (X, Y), batch_size=BS, mesh=mesh)
    assert got == want


def test_annotated_model_with_an_early_stop_keeps_placements_across_calls():
    """The early stop's copy of the best state keeps the state's placement: an
    unannotated bias (replicated) came out of the first call split over
    "model", as XLA propagated it, and the second call, compiled for the
    first's arguments, failed in JAX's sharding check."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=auto)
    kw = dict(
        batch_size=BS,
        key=KEY,
        callbacks=[
            scanax.Eval((X, Y), every=3),
            scanax.EarlyStop("val_loss", patience=9),
        ],
    )
    one, m1, _ = run(None, (X, Y), **kw)
    many, m4, _ = run(mesh, (X, Y), annotate=True, **kw)
    assert many.steps == one.steps == 12
    np.testing.assert_allclose(many.history["loss"], one.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        many.history["val_loss"], one.history["val_loss"], rtol=1e-5
    )
    close(nnx.state(m4), nnx.state(m1))
    assert m4.l1.bias[...].sharding.is_fully_replicated


def test_mesh_errors():
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    kw = dict(steps=2, batch_size=BS, progress=False)
    with pytest.raises(
        TypeError,
        match=r"scanax.fit: `mesh` must be a "
        r"jax.sharding.Mesh, got str",
    ):
        scanax.fit(model, opt, loss_fn, (X, Y), mesh="data", **kw)
    with pytest.raises(
        ValueError,
        match=r"`mesh` has axes \('batch',\), but batches "
        r"are sharded over an axis named 'data'",
    ):
        scanax.fit(
            model, opt, loss_fn, (X, Y), mesh=jax.make_mesh((4,), ("batch",)), **kw
        )
    with pytest.raises(
        ValueError,
        match=r"batch_size 6 is not divisible by the "
        r"mesh's 'data' axis \(4 devices\)",
    ):
        scanax.fit(
            model,
            opt,
            loss_fn,
            (X, Y),
            mesh=jax.make_mesh((4,), ("data",)),
            steps=2,
            batch_size=6,
            progress=False,
        )
    with pytest.raises(ValueError, match=r"the batch size 6 is not divisible"):
        scanax.fit(
            model,
            opt,
            loss_fn,
            [(X[:6], Y[:6])],
            mesh=jax.make_mesh((4,), ("data",)),
            steps=1,
            progress=False,
        )
    with pytest.raises(
        ValueError,
        match=r"scanax.fit: batch\[1\] is float32\[\], with no leading batch axis",
    ):
        scanax.fit(
            model,
            opt,
            loss_fn,
            [(X[:8], jnp.float32(0.5))],
            mesh=jax.make_mesh((4,), ("data",)),
            steps=1,
            progress=False,
        )


def test_mesh_checkpoint_resume(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((4,), ("data",))
    kw = dict(batch_size=BS, key=KEY)
    straight, m1, _ = run(mesh, (X, Y), **kw)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    scanax.fit(
        model,
        opt,
        loss_fn,
        (X, Y),
        steps=6,
        steps_per_call=6,
        progress=False,
        mesh=mesh,
        checkpoint_dir=tmp_path,
        checkpoint_every=6,
        **kw,
    )
    resumed, m2, _ = run(
        mesh, (X, Y), checkpoint_dir=tmp_path, checkpoint_every=6, **kw
    )
    np.testing.assert_array_equal(resumed.history["loss"], straight.history["loss"])
    for a, b in zip(jtu.tree_leaves(nnx.state(m2)), jtu.tree_leaves(nnx.state(m1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert m2.l1.kernel[...].sharding.is_fully_replicated


def test_typed_key_placed_as_in_a_multi_process_job(monkeypatch):
    """With more than one process, arrays go through
    jax.make_array_from_process_local_data, which needs a NumPy form: a typed
    PRNG key travels as its key data and comes back a key (it raised before)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from scanax._fit import mesh as _mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    out = _mesh.replicate(mesh, {"key": jr.key(3), "x": jnp.arange(3.0)})
    assert jnp.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jr.key_data(out["key"]), jr.key_data(jr.key(3)))
    np.testing.assert_array_equal(out["x"], np.arange(3.0))
    assert out["x"].sharding == NamedSharding(mesh, PartitionSpec())


def _bytes_per_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jtu.tree_leaves(tree))


def test_fsdp_splits_parameters_and_optimizer_state_and_matches_replicated():
    mesh = jax.make_mesh((4,), ("data",))
    one, m1, o1 = run(mesh, (X, Y), batch_size=BS, key=KEY)
    fsdp, m4, o4 = run(mesh, (X, Y), batch_size=BS, key=KEY, shard="fsdp")
    np.testing.assert_allclose(fsdp.history["loss"], one.history["loss"], rtol=1e-5)
    close(nnx.state(m4), nnx.state(m1))
    close(nnx.state(o4), nnx.state(o1))
    # Each leaf on its largest axis that 4 divides; Adam's moments as their
    # parameter; l2's bias (1 element) and the step counts stay replicated.
    assert m4.l1.kernel[...].sharding.spec == P(None, "data")  # [3, 8]
    assert m4.l2.kernel[...].sharding.spec == P("data")  # [8, 1]
    assert m4.l2.bias[...].sharding.is_fully_replicated
    mu = o4.opt_state[0].mu
    assert mu["l1"]["kernel"][...].sharding.spec == P(None, "data")
    state = (nnx.state(m4), nnx.state(o4))
    replicated = (nnx.state(m1), nnx.state(o1))
    # 3 x (3*8 + 8 + 8 [split in 4] + 1) floats + 2 step counts, against 3 x 41 + 2.
    assert _bytes_per_device(replicated) == (3 * 41 + 2) * 4
    assert _bytes_per_device(state) == (3 * (40 // 4 + 1) + 2) * 4


def test_fsdp_keeps_shardings_leaves_already_have_and_warns_for_the_rest():
    """A pytree (Equinox-style) leaf placed by the user keeps its spec; a leaf
    with no axis divisible by the 'data' size stays replicated, listed once."""
    mesh = jax.make_mesh((4,), ("data",))
    placed = jax.device_put(
        jnp.ones((8, 4)), jax.sharding.NamedSharding(mesh, P(None, "data"))
    )
    params = {"w": placed, "v": jnp.ones((8, 6)), "odd": jnp.ones((3, 5))}

    def loss(p, batch):
        x, _ = batch
        return jnp.mean(x[:, :1] * (p["w"].sum() + p["v"].sum() + p["odd"].sum()))

    with pytest.warns(
        RuntimeWarning,
        match=r"(?s)shard='fsdp' leaves 3 state leaves replicated: no free axis is "
        r"divisible by the mesh's 'data' size 4:\n.*  model\['odd'\] +float32\[3, 5\]",
    ):
        result = scanax.fit(
            params,
            optax.adam(1e-2),
            loss,
            (X, Y),
            steps=2,
            batch_size=BS,
            progress=False,
            mesh=mesh,
            shard="fsdp",
        )
    assert result.model["w"].sharding.spec == P(None, "data")  # the user's
    assert result.model["v"].sharding.spec == P("data")  # the rule's: 8
    assert result.model["odd"].sharding.is_fully_replicated
    plain = scanax.fit(
        {k: np.asarray(v) for k, v in params.items()},
        optax.adam(1e-2),
        loss,
        (X, Y),
        steps=2,
        batch_size=BS,
        progress=False,
    )
    close(result.model, plain.model)


def test_shard_errors():
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    kw = dict(steps=2, batch_size=BS, progress=False)
    with pytest.raises(ValueError, match=r"shard='zero' is not a sharding rule"):
        scanax.fit(
            model,
            opt,
            loss_fn,
            (X, Y),
            mesh=jax.make_mesh((4,), ("data",)),
            shard="zero",
            **kw,
        )
    with pytest.raises(ValueError, match=r"shard='fsdp' needs a mesh to shard over"):
        scanax.fit(model, opt, loss_fn, (X, Y), shard="fsdp", **kw)


def test_array_data_already_on_the_mesh_keeps_its_sharding():
    """Rows split over 'data' (in several processes: each process's own rows,
    from jax.make_array_from_process_local_data) stay split; other arrays are
    replicated."""
    from scanax._fit import mesh as _mesh

    mesh = jax.make_mesh((4,), ("data",))
    rows = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("data")))
    placed = _mesh.place_data(_mesh.auto(mesh), (rows, Y))
    assert placed[0].sharding.spec == P("data")
    assert placed[1].sharding.is_fully_replicated
    split, _, _ = run(mesh, (rows, Y), batch_size=BS, key=KEY)
    whole, _, _ = run(mesh, (X, Y), batch_size=BS, key=KEY)
    np.testing.assert_allclose(split.history["loss"], whole.history["loss"], rtol=1e-6)


def test_fsdp_leaves_a_size_0_parameter_replicated_across_calls():
    """A size-0 leaf has nothing to split: replicated (its outputs are), so
    that a second call's inputs have the placement the program was compiled
    for (sharding it made that call fail: "input shardings that disagree")."""
    mesh = jax.make_mesh((4,), ("data",))
    params = {"w": jnp.ones((3, 8)) * 0.1, "z": jnp.zeros((0, 4))}

    def loss(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] - y[:, :1]) ** 2) + jnp.sum(p["z"])

    kw = dict(batch_size=BS, progress=False, mesh=mesh, shard="fsdp")
    result = scanax.fit(params, optax.adam(1e-2), loss, (X, Y), steps=8, **kw,
                        steps_per_call=4)  # fmt: skip
    alone = scanax.fit(params, optax.adam(1e-2), loss, (X, Y), steps=8, **kw)
    assert result.steps == 8
    assert result.model["z"].shape == (0, 4)
    assert result.model["z"].sharding.is_fully_replicated
    assert result.model["w"].sharding.spec == P(None, "data")
    np.testing.assert_allclose(result.model["w"], alone.model["w"], rtol=1e-6)


class DeepNarrow(nnx.Module):
    """A Stack of more layers (8) than its width (4): the layer axis is the
    stacked leaves' largest."""

    def __init__(self, rngs):
        self.blocks = scanax.Stack([nnx.Linear(4, 4, rngs=rngs) for _ in range(8)])

    def __call__(self, x):
        return jnp.mean(self.blocks(x), axis=-1, keepdims=True)


def test_fsdp_never_splits_a_stacks_layer_axis():
    """``shard="fsdp"`` splits a stacked ``[8, 4, 4]`` kernel and ``[8, 4]`` bias
    on a within-layer axis, their Adam moments alike (review: on the layer
    axis, the largest, so the scan over the layers gathered the whole stack
    each step); values as on one device."""
    mesh = jax.make_mesh((4,), ("data",))
    x = jr.normal(jr.key(0), (32, 4))
    data = (x, jnp.sin(x[:, :1]))

    def fitted(**kw):
        model = DeepNarrow(nnx.Rngs(0))
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
        plain = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
        scanax.fit(model, opt, plain, data, steps=6, batch_size=8, key=KEY,
                   progress=False, **kw)  # fmt: skip
        return model, opt

    one, _ = fitted()
    model, opt = fitted(mesh=mesh, shard="fsdp")
    close(nnx.state(model), nnx.state(one))
    run_ = model.blocks.pieces[0][0]
    kernel, bias = run_.kernel[...], run_.bias[...]
    assert kernel.sharding.spec == P(None, "data") and bias.sharding.spec == P(
        None, "data"
    )
    assert kernel.addressable_shards[0].data.shape == (8, 1, 4)
    mu = opt.opt_state[0].mu["blocks"]["pieces"][0][0]["kernel"][...]
    assert mu.sharding.spec == P(None, "data")
    close(model(x), one(x))


class StackedMLP(nnx.Module):
    """Annotated layers in a Stack, and one outside it."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        layers = [nnx.Linear(8, 8, kernel_init=init, rngs=rngs) for _ in range(3)]
        self.blocks = scanax.Stack(layers)
        self.plain = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(self.plain(self.blocks(x)), axis=-1)


@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_stacked_layers_keep_their_sharding_annotations_with_the_layer_axis(axes):
    """Stacking adds the layer axis to each annotation, as nnx.vmap with
    transform_metadata={nnx.PARTITION_NAME: None} does: a stacked kernel
    [3, in, out] is split on its output axis, as its layers were (before:
    (None, 'model') kept, so fit(mesh=) split the input axis); a layer taken
    out of the Stack has its own annotation back. Under a mesh of explicit
    axes, a first layer that shards x is called on its own (x's type changed:
    before, JAX's scan error). Values equal the same layers looped."""
    kind = getattr(jax.sharding.AxisType, axes.capitalize())
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind,) * 2)
    x = jr.normal(jr.key(0), (8, 8))
    with jax.set_mesh(mesh):  # (flax places annotated Variables eagerly)
        model = StackedMLP(nnx.Rngs(0))
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
        kernel = model.blocks.pieces[0][0].kernel
        assert kernel.get_metadata()["out_sharding"] == (None, None, "model")
        assert kernel[...].sharding.spec == P(None, None, "model")
        assert model.blocks[1].kernel.get_metadata()["out_sharding"] == (None, "model")
        got = model.blocks(x)
        want = x
        for layer in model.blocks:
            want = layer(want)
    close(got, want)
    if axes == "explicit":
        return
    loss = lambda m, b: jnp.mean(m(b) ** 2)  # noqa: E731
    scanax.fit(model, opt, loss, x, steps=2, batch_size=4, key=KEY, progress=False,
               mesh=mesh)  # fmt: skip
    kernel = model.blocks.pieces[0][0].kernel
    assert kernel[...].sharding.spec == P(None, None, "model")
    assert model.plain.kernel[...].sharding.spec == P(None, "model")


def test_a_short_sharding_annotation_gets_the_layer_axis_too():
    """An annotation shorter than the kernel's rank (("model",): its first
    axis split) is stacked as (None, "model"), as nnx.vmap gives it, and
    fit(mesh=) keeps the layer axis whole (review: left ("model",), which
    split the layers over the mesh)."""
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model",))
    with jax.set_mesh(mesh):
        stack = scanax.Stack(
            [nnx.Linear(8, 8, kernel_init=init, rngs=nnx.Rngs(i)) for i in range(4)]
        )
        opt = nnx.Optimizer(stack, TX, wrt=nnx.Param)
    kernel = stack.pieces[0][0].kernel
    assert kernel.get_metadata()["out_sharding"] == (None, "model")
    assert stack[2].kernel.get_metadata()["out_sharding"] == ("model",)
    x = jr.normal(jr.key(0), (8, 8))
    loss = lambda m, b: jnp.mean(m(b) ** 2)  # noqa: E731
    scanax.fit(
        stack, opt, loss, x, steps=2, batch_size=4, key=KEY, progress=False, mesh=mesh
    )
    assert stack.pieces[0][0].kernel[...].sharding.spec == P(None, "model")
