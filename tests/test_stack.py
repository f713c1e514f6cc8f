"""scanax.Stack against plain Python loops over the same layers."""

import dataclasses
import functools as ft

import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import scanax
from scanax import _backend, _stack as stack_module
from scanax._stack import plan

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

TOL = dict(rtol=1e-5, atol=1e-5)

# Tiny programs: skip XLA's expensive CPU optimisations, so that tests compile fast.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
jit = ft.partial(jax.jit, compiler_options=FAST)
filter_jit = ft.partial(eqx.filter_jit, compiler_options=FAST)


close = ft.partial(helpers.close, structure=False, **TOL)


def loop(layers, x, **kw):
    for layer in layers:
        x = layer(x, **kw)
    return x


def scans(fn, *args):
    """Lengths of the top-level scans in the jaxpr of fn(*args)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


# ---------------------------------------------------------------------------- layers


class EqxBlock(eqx.Module):
    lin: eqx.nn.Linear
    scale: float = eqx.field(static=True)

    def __init__(self, d, key, scale=1.0):
        self.lin = eqx.nn.Linear(d, d, key=key)
        self.scale = scale

    def __call__(self, x, *, gain=1.0):
        return x + self.scale * gain * jnp.tanh(self.lin(x))


def eqx_layers(n_mid=6):
    k = jr.split(jr.key(0), n_mid + 2)
    return (
        [eqx.nn.Linear(3, 4, key=k[0])]
        + [EqxBlock(4, key) for key in k[1:-1]]
        + [eqx.nn.Linear(4, 2, key=k[-1])]
    )


class NNXBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.relu(self.lin(self.norm(x)))


def nnx_layers(n_mid=6, seed=0):
    rngs = nnx.Rngs(seed)
    return (
        [nnx.Linear(3, 4, rngs=rngs)]
        + [NNXBlock(4, rngs) for _ in range(n_mid)]
        + [nnx.Linear(4, 2, rngs=rngs)]
    )


@jtu.register_dataclass
@dataclasses.dataclass
class Affine:
    """A plain callable pytree (no framework)."""

    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


def plain_layers(n_mid=6):
    k = jr.split(jr.key(1), n_mid + 2)
    first = Affine(jr.normal(k[0], (3, 4)), jnp.zeros(4))
    mid = [Affine(jr.normal(key, (4, 4)) * 0.5, jnp.full(4, 0.1)) for key in k[1:-1]]
    return [first, *mid, Affine(jr.normal(k[-1], (4, 2)), jnp.zeros(2))]


X = jr.normal(jr.key(2), (5, 3))


# ---------------------------------------------------------------------------- plan


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([0, 1, 1, 1, 1, 1, 1, 2], ((0, 1, 1), (1, 1, 6), (7, 1, 1))),
        ([0, 1] * 12, ((0, 2, 12),)),
        ([0] + [1, 2] * 3, ((0, 1, 1), (1, 2, 3))),
        ([0, 0, 1, 0, 1, 0, 1], ((0, 1, 1), (1, 2, 3))),  # beats greedy [0, 0], ...
        ([0, 0, 1, 0, 0, 1, 0, 0, 1], ((0, 3, 3),)),
        ([0, 1, 2], ((0, 1, 1), (1, 1, 1), (2, 1, 1))),
        ([0, 0], ((0, 1, 2),)),
    ],
)
def test_plan_groups_runs_and_periods(ids, expected):
    assert plan(ids) == expected


def _best_cost(ids):
    """Brute force: the least (layers traced, pieces) over all valid splits."""
    n = len(ids)
    if n == 0:
        return (0, 0)
    rest = _best_cost(ids[1:])
    best = (1 + rest[0], 1 + rest[1])
    for p in range(1, n // 2 + 1):
        for r in range(2, n // p + 1):
            if all(ids[j * p : (j + 1) * p] == ids[:p] for j in range(r)):
                rest = _best_cost(ids[p * r :])
                best = min(best, (p + rest[0], 1 + rest[1]))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_plan_tiles_layers_and_is_optimal(seed):
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, 1 + seed % 3, size=rng.integers(1, 11))]
    pieces = plan(ids)
    covered = 0
    for start, period, repeats in pieces:
        assert start == covered
        block = ids[start : start + period]
        for j in range(repeats):
            assert ids[start + j * period : start + (j + 1) * period] == block
        covered += period * repeats
    assert covered == len(ids)
    cost = (sum(p for _, p, _ in pieces), len(pieces))
    assert cost == _best_cost(ids)


# ---------------------------------------------------------------------------- Equinox


def test_equinox_values_grads_jit_vmap():
    layers = eqx_layers()
    stack = scanax.Stack(layers)
    assert isinstance(stack, eqx.Module) and isinstance(stack, scanax.Stack)
    assert stack.plan == ((0, 1, 1), (1, 1, 6), (7, 1, 1))

    traces = []

    def loss(model, x):
        traces.append(1)
        return jnp.sum(jax.vmap(model)(x) ** 2)

    ref_model = lambda ls: lambda x: loop(ls, x)
    step = filter_jit(eqx.filter_value_and_grad(loss))
    l1, g1 = step(stack, X)
    step(jax.tree.map(lambda a: a + 1, stack), X + 1)  # new values: no retrace
    assert len(traces) == 1
    l2, g2 = filter_jit(
        eqx.filter_value_and_grad(lambda ls, x: loss(ref_model(ls), x))
    )(layers, X)
    close(l1, l2)
    # the gradient is a Stack too: its per-layer views are the per-layer gradients
    assert isinstance(g1, scanax.Stack)
    close(list(g1), g2)


class Scaled(eqx.Module):
    w: jax.Array
    scale: float  # a Python number, not a static field: a leaf under jax.jit

    def __call__(self, x):
        return jnp.tanh(self.w @ x) * self.scale


def test_python_number_fields_under_jax_jit_and_grad():
    """Python numbers shared by a run stay unstacked; under ``jax.jit``/``jax.grad``
    they become 0-d tracers, which must not be taken for stacked arrays."""
    layers = [Scaled(jr.normal(k, (3, 3)), 0.5) for k in jr.split(jr.key(0), 4)]
    stack = scanax.Stack(layers)
    assert stack.plan == ((0, 1, 4),)
    x = jnp.ones(3)
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    close(jit(loss)(stack, x), loss(lambda x: loop(layers, x), x))
    g = jit(jax.grad(loss))(stack, x)
    g_ref = jax.grad(lambda ls, x: loss(lambda x: loop(ls, x), x))(layers, x)
    close([gi.w for gi in g], [gi.w for gi in g_ref])
    # One shared number: its gradient is the sum of the per-layer ones.
    close(g.pieces[0][0].scale, sum(gi.scale for gi in g_ref))
    close(jit(lambda m: m[2].w)(stack), layers[2].w)


def test_equal_numbers_of_different_types_are_not_grouped():
    w = jnp.eye(3)
    layers = [Scaled(w, 1), Scaled(w, 1.0), Scaled(w, True), Scaled(w, 1.0)]
    with pytest.warns(
        scanax.StackWarning, match=r"`scale` \(1 against 1\.0, in `scale`\)"
    ):
        stack = scanax.Stack(layers)
    assert stack.plan == ((0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1))
    assert [type(layer.scale) for layer in stack] == [int, float, bool, float]


def test_equinox_trains_with_optax():
    layers = eqx_layers(3)
    stack = scanax.Stack(layers)
    opt = optax.adam(1e-2)

    def train(model, loss):
        @filter_jit
        def step(model, state):
            value, grads = eqx.filter_value_and_grad(loss)(model, X)
            updates, state = opt.update(grads, state)
            return eqx.apply_updates(model, updates), state, value

        state = opt.init(eqx.filter(model, eqx.is_array))
        losses = []
        for _ in range(3):
            model, state, value = step(model, state)
            losses.append(float(value))
        return losses, model

    ls1, trained = train(stack, lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))
    ls2, trained_ref = train(
        layers, lambda ls, x: jnp.mean(jax.vmap(lambda v: loop(ls, v))(x) ** 2)
    )
    np.testing.assert_allclose(ls1, ls2, rtol=1e-5)
    close(list(trained), trained_ref)


def test_kwargs_remat_unroll():
    layers = eqx_layers(4)[1:-1]
    x = X[:, :1] * jnp.ones((5, 4))
    ref_loss = lambda ls, x: jnp.sum(jax.vmap(lambda v: loop(ls, v, gain=0.5))(x) ** 2)
    ref = filter_jit(eqx.filter_value_and_grad(ref_loss))(layers, x)
    policy = jax.checkpoint_policies.nothing_saveable
    for kw in [dict(remat=True), dict(remat=False), dict(remat=policy), dict(unroll=2)]:
        stack = scanax.Stack(layers, **kw)
        loss = lambda m, x: jnp.sum(jax.vmap(lambda v: m(v, gain=0.5))(x) ** 2)
        value, grads = filter_jit(eqx.filter_value_and_grad(loss))(stack, x)
        close((value, list(grads)), ref)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(scanax.Stack(layers, remat=True), x))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


def checkpoint_policies(fn, *args, param="policy"):
    """Policies (or another ``param``) of the checkpoints in fn's jaxpr:
    (outside scans, inside scans)."""
    outside, inside = [], []

    def walk(jaxpr, in_scan):
        for e in jaxpr.eqns:
            if e.primitive.name == "remat2":  # jax.checkpoint
                (inside if in_scan else outside).append(e.params[param])
            for sub in e.params.values():
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    walk(
                        getattr(sub, "jaxpr", sub),
                        in_scan or e.primitive.name == "scan",
                    )

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return outside, inside


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
def test_remat_default_by_backend(monkeypatch, backend):
    """A stacked run's default policy is the backend's (asked for on any
    machine): every matmul kept on CPU; elsewhere only those without batch
    dimensions (attention's scores recomputed). Values and gradients are the
    plain loop's."""
    from scanax import _backend

    monkeypatch.setattr(_backend, "platform", lambda: backend)
    want = (
        jax.checkpoint_policies.checkpoint_dots
        if backend == "cpu"
        else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    )
    layers = eqx_layers(3)
    stack = scanax.Stack(layers)
    fn = lambda m, x: jax.vmap(m)(x)
    assert checkpoint_policies(fn, stack, X) == ([], [want])
    g = jit(jax.grad(lambda m, x: jnp.sum(jnp.sin(fn(m, x)))))(stack, X)
    ref = jax.grad(lambda ls, x: jnp.sum(jnp.sin(jax.vmap(lambda v: loop(ls, v))(x))))(
        layers, X
    )
    close(list(g), ref)


def stacked_call(kind, layers, **kw):
    """``(fn, stack, graphdef)``: a Stack of ``layers`` and the call of it on a
    batch, ``fn(stack, x)`` (an NNX Stack split into its state)."""
    stack = scanax.Stack(layers, **kw)
    if kind == "eqx":
        return (lambda m, x: jax.vmap(m)(x)), stack, None
    graphdef, state = nnx.split(stack)
    return (lambda s, x: nnx.merge(graphdef, s)(x)), state, graphdef


def assert_loop_gradients(kind, layers, fn, stack, graphdef):
    """The gradient of ``sum(sin(fn(stack, X)))`` is the plain loop's, per
    layer (an NNX Stack's read back through its own indexing)."""
    g = jit(jax.grad(lambda m, x: jnp.sum(jnp.sin(fn(m, x)))))(stack, X)
    if kind == "eqx":
        ref = jax.grad(
            lambda ls, x: jnp.sum(jnp.sin(jax.vmap(lambda v: loop(ls, v))(x)))
        )(layers, X)
        close(list(g), ref)
    else:
        gd_layers, s_layers = nnx.split(layers)
        ref = jax.grad(lambda s, x: jnp.sum(jnp.sin(loop(nnx.merge(gd_layers, s), x))))(
            s_layers, X
        )
        got = [nnx.state(m) for m in nnx.merge(graphdef, g)]
        close(got, [ref[i] for i in range(len(layers))])


@pytest.mark.parametrize("kind", ["eqx", "nnx"])
@pytest.mark.parametrize("unroll", [1, True])
def test_checkpoints_inside_a_run_skip_cse_prevention(kind, unroll):
    """A layer checkpointed inside a run's scan loop does without CSE
    prevention (``prevent_cse=False``: there CSE cannot undo the checkpoint,
    and the prevention's optimization barriers can foil XLA's fusion, as
    ``jax.checkpoint`` documents); a layer outside any run, or in a run
    unrolled into straight-line code, keeps JAX's default. Values and
    gradients are the plain loop's."""
    layers = eqx_layers(3) if kind == "eqx" else nnx_layers(3)
    fn, stack, graphdef = stacked_call(kind, layers, remat=True, unroll=unroll)
    outside, inside = checkpoint_policies(fn, stack, X, param="prevent_cse")
    assert outside and set(outside) == {True}
    assert inside and set(inside) == {unroll is True}
    assert_loop_gradients(kind, layers, fn, stack, graphdef)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Halving:
    """A layer that halves its input's length: a run of them cannot be a
    scan's carry (the Stack loops over them in Python)."""

    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(self.w * x).reshape(-1, 2).mean(-1)


def test_checkpoints_of_a_run_looped_in_python_prevent_cse():
    """Layers that change the input's shape run as a Python loop, straight-line
    code: their checkpoints keep CSE prevention; the gradient is the loop's."""
    layers = [Halving(jnp.float32(0.5 + 0.1 * i)) for i in range(4)]
    stack = scanax.Stack(layers, remat=True)
    x = jnp.linspace(-1.0, 1.0, 64)
    fn = lambda m, x: m(x)
    outside, inside = checkpoint_policies(fn, stack, x, param="prevent_cse")
    assert outside == [True] * 4 and inside == []
    g = jit(jax.grad(lambda m, x: jnp.sum(jnp.sin(m(x))), argnums=(0, 1)))(stack, x)
    ref = jax.grad(lambda ls, x: jnp.sum(jnp.sin(loop(ls, x))), argnums=(0, 1))(
        layers, x
    )
    close(g[1], ref[1])
    close([layer.w for layer in g[0]], [layer.w for layer in ref[0]])


@pytest.mark.parametrize("kind", ["eqx", "nnx"])
def test_remat_default_keeps_matmuls_in_runs_only(kind):
    """By default only stacked runs are checkpointed, saving matmul results; the
    end layers run as written; remat=False checkpoints nothing; remat="sqrt"
    checkpoints chunks of the run's scan (3 blocks: a scan over one chunk of 2,
    then the chunk of 1 left), not the layers one by one; values and gradients are
    those of the plain loop in every case."""
    layers = eqx_layers(3) if kind == "eqx" else nnx_layers(3)
    dots = stack_module.default_policy(_backend.platform())
    cases = [(None, ([], [dots])), (False, ([], [])), ("sqrt", ([None], [None]))]
    for remat, want in cases:
        fn, stack, graphdef = stacked_call(kind, layers, remat=remat)
        assert checkpoint_policies(fn, stack, X) == want
        assert_loop_gradients(kind, layers, fn, stack, graphdef)


class EqxTagged(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return {"h": jnp.tanh(x["h"] * self.w), "mode": x["mode"], "n": x["n"]}


class NNXTagged(nnx.Module):
    def __init__(self, w):
        self.w = nnx.Param(jnp.float32(w))

    def __call__(self, x):
        return {"h": jnp.tanh(x["h"] * self.w[...]), "mode": x["mode"], "n": x["n"]}


@pytest.mark.parametrize("remat", [None, True, False])
@pytest.mark.parametrize("kind", ["eqx", "nnx"])
def test_non_array_leaves_in_x(kind, remat):
    """x with a string and None beside its arrays: they pass through every layer
    (checkpointed or not) unchanged; values and gradients are the plain loop's."""
    w = jnp.array([0.5, 1.0, 1.5, 2.0])
    x = {"h": jnp.linspace(0.1, 1.0, 3), "mode": "train", "n": None}
    layers = [(EqxTagged if kind == "eqx" else NNXTagged)(v) for v in w]
    stack = scanax.Stack(layers, remat=remat)

    def total(stack):
        out = stack(x)
        assert out["mode"] == "train" and out["n"] is None
        return jnp.sum(out["h"])

    def reference(w):
        h = x["h"]
        for v in w:
            h = jnp.tanh(h * v)
        return jnp.sum(h)

    np.testing.assert_allclose(total(stack), reference(w), rtol=1e-6)
    grad = (jax.grad if kind == "eqx" else nnx.grad)(total)(stack)
    got = jnp.stack([g.w[...] for g in grad]) if kind == "eqx" else grad.pieces[0][0].w
    np.testing.assert_allclose(got, jax.grad(reference)(w), rtol=1e-5)


class Noisy(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x, *, key, scale=1.0):
        return jnp.tanh(self.lin(x)) + scale * jr.normal(key, x.shape)


@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_per_layer_kwargs(framework):
    if framework == "equinox":
        k = jr.split(jr.key(5), 6)
        make = lambda i: Noisy(eqx.nn.Linear(3, 3, use_bias=i > 0, key=k[i]))
    else:
        rngs = nnx.Rngs(5)

        class NNXNoisy(nnx.Module):
            def __init__(self, bias):
                self.lin = nnx.Linear(3, 3, use_bias=bias, rngs=rngs)

            def __call__(self, x, *, key, scale=1.0):
                return jnp.tanh(self.lin(x)) + scale * jr.normal(key, x.shape)

        make = lambda i: NNXNoisy(i > 0)
    layers = [make(i) for i in range(6)]  # a single layer, then a run of 5
    keys = jr.split(jr.key(6), 6)
    stack = scanax.Stack(layers)
    assert stack.plan[1][2] == 5
    got = stack(X[0], per_layer={"key": keys}, scale=0.5)
    want = X[0]
    for layer, key in zip(layers, keys, strict=True):
        want = layer(want, key=key, scale=0.5)
    close(got, want)
    with pytest.raises(
        ValueError,
        match=r"^scanax\.Stack: per_layer\['key'\] is key<fry>\[5\], but it needs a "
        r"leading axis of length 6",
    ):
        stack(X, per_layer={"key": keys[:5]})
    with pytest.raises(TypeError, match=r"`per_layer` must be a dict"):
        stack(X, per_layer=keys)


# ---------------------------------------------------------------------------- NNX


class NNXModel(nnx.Module):
    def __init__(self, layers, stacked):
        self.body = scanax.Stack(layers) if stacked else nnx.List(layers)

    def __call__(self, x):
        return loop(self.body, x)


def test_nnx_nested_and_trained_with_optimizer_matches_unstacked():
    model = NNXModel(nnx_layers(), stacked=True)
    ref = NNXModel(nnx_layers(), stacked=False)
    assert isinstance(model.body, nnx.Module) and isinstance(model.body, scanax.Stack)
    assert model.body.plan == ((0, 1, 1), (1, 1, 6), (7, 1, 1))
    y = jnp.ones((5, 2))

    def train(model):
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))

        @jit  # the functional form of nnx.jit (docs/stack.md uses nnx.jit)
        def step(state):
            model, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - y) ** 2))(model)
            opt.update(model, grads)
            return loss, nnx.split((model, opt))[1]

        losses = []
        for _ in range(3):
            loss, state = step(state)
            losses.append(float(loss))
        nnx.update((model, opt), state)
        return losses

    np.testing.assert_allclose(train(model), train(ref), rtol=1e-5)
    for a, b in zip(model.body, ref.body, strict=True):
        close(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))


@pytest.mark.parametrize("remat", [False, True])
def test_nnx_layer_state_updates_are_written_back(remat):
    def layers():
        rngs = nnx.Rngs(0)
        return [nnx.BatchNorm(3, rngs=rngs) for _ in range(3)]

    stack, ref = scanax.Stack(layers(), remat=remat), layers()
    close(stack(X), loop(ref, X))
    close(
        [nnx.state(layer, nnx.BatchStat) for layer in stack],
        [nnx.state(layer, nnx.BatchStat) for layer in ref],
    )
    assert not jnp.allclose(stack[0].mean[...], 0.0)


def test_nnx_periodic_with_functions():
    rngs = nnx.Rngs(0)
    layers = [f for _ in range(3) for f in (nnx.Linear(3, 3, rngs=rngs), jax.nn.relu)]
    stack = scanax.Stack(layers)
    assert stack.plan == ((0, 2, 3),)
    close(stack(X), loop(layers, X))
    assert stack[1] is jax.nn.relu
    close(nnx.state(stack[4]), nnx.state(layers[4]))


class Sower(nnx.Module):
    """A layer that stores its output with ``sow`` (when ``sow`` is set)."""

    def __init__(self, rngs, sow=True):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.sows = sow

    def __call__(self, x):
        y = jnp.tanh(self.lin(x))
        if self.sows:
            self.sow(nnx.Intermediate, "y", y)
        return y


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
@pytest.mark.parametrize("capture", [False, True])
def test_nnx_sowing_stacked_layer_is_refused_and_nothing_changes(capture):
    rngs = nnx.Rngs(0)
    stack = scanax.Stack([Sower(rngs) for _ in range(4)])
    before = jax.tree.map(np.asarray, nnx.state(stack, nnx.Param))
    call = nnx.capture(stack, nnx.Intermediate) if capture else stack
    where = r"\['__captures__'\]\[0\]\['y'\]" if capture else r"\['y'\]"
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.Stack: a layer of a stacked run stored new values .*"
        rf"\(added layers\[0\]{where}.*Fix: return the value from the layer",
    ):
        call(X)
    # Refused while tracing: the stacked parameters are exactly as before.
    close(nnx.state(stack, nnx.Param), before)


def test_nnx_capture_passes_through_a_stack():
    """``nnx.capture`` around a model holding a Stack: layers called directly sow
    as usual, stacked ones run as without capture."""
    rngs = nnx.Rngs(0)
    layers = [Sower(rngs, sow=False) for _ in range(4)] + [Sower(rngs)]
    stack = scanax.Stack(layers)
    assert stack.plan == ((0, 1, 4), (4, 1, 1))
    y, captured = nnx.capture(stack, nnx.Intermediate)(X)
    close(y, loop([lambda x, f=f: jnp.tanh(f.lin(x)) for f in layers], X))
    (value,) = jax.tree.leaves(captured)
    close(value, y)  # the last layer's own output
    # Nothing of the capture stays behind, and a second capture gives the same.
    assert not nnx.state(stack, nnx.Intermediate)
    y2, captured2 = nnx.capture(stack, nnx.Intermediate)(X)
    close((y2, captured2), (y, captured))


class DropBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs=None):
        return self.drop(self.lin(x), rngs=rngs)


@pytest.mark.parametrize("remat", [None, False])
def test_nnx_rngs_keyword_is_refused_with_per_layer_keys_as_the_fix(remat):
    rngs = nnx.Rngs(0)
    stack = scanax.Stack([DropBlock(rngs) for _ in range(3)], remat=remat)
    with pytest.raises(
        ValueError,
        match=r"(?s)scanax.Stack: the layers change the NNX object passed as keyword "
        r"argument rngs\..*per_layer=\{'rngs': jax.random.split\(key, 3\)\}",
    ):
        stack(X, rngs=nnx.Rngs(dropout=1))
    keys = jr.split(jr.key(1), 3)
    got = stack(X, per_layer={"rngs": keys})
    want = X
    for layer, key in zip(stack, keys, strict=True):
        want = layer(want, rngs=key)
    close(got, want)


# ---------------------------------------------------------------------------- pytrees


def test_plain_pytrees_values_grads_views():
    layers = plain_layers()
    stack = scanax.Stack(layers)
    assert type(stack) is scanax.Stack
    assert len(stack) == len(layers) and stack.plan[1] == (1, 1, 6)
    for got, want in zip(list(stack), layers, strict=True):
        assert jtu.tree_structure(got) == jtu.tree_structure(want)
        close(got, want)
    # functions are layers too (leaves of the Stack, as of the list given)
    with_fn = scanax.Stack([*layers[:3], jnp.sin, *layers[3:]])
    close(with_fn(X), loop([*layers[:3], jnp.sin, *layers[3:]], X))
    assert list(with_fn)[3] is jnp.sin
    close(stack[-1], layers[-1])
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    l1, g1 = jit(jax.value_and_grad(loss))(stack, X)
    l2, g2 = jit(jax.value_and_grad(lambda ls, x: loss(lambda v: loop(ls, v), x)))(
        layers, X
    )
    close((l1, list(g1)), (l2, g2))
    close(jax.vmap(stack)(X[:, None]), jax.vmap(lambda v: loop(layers, v))(X[:, None]))


def test_periodic_pattern_is_one_scan():
    k = jr.split(jr.key(3), 8)
    attn = [Affine(jr.normal(key, (3, 3)) * 0.5, jnp.zeros(3)) for key in k[:4]]
    mlp = [Affine(jr.normal(key, (3, 3)) * 0.5, jnp.ones(3)) for key in k[4:]]
    mlp = [dataclasses.replace(m, b=jnp.ones((1, 3))) for m in mlp]  # another type
    layers = [layer for pair in zip(attn, mlp, strict=True) for layer in pair]
    stack = scanax.Stack(layers)
    assert stack.plan == ((0, 2, 4),)
    assert scans(stack, X) == [4]
    close(stack(X), loop(layers, X))
    close(list(stack), layers)


@pytest.mark.parametrize("make", [eqx_layers, nnx_layers, plain_layers])
def test_jaxpr_has_one_scan_of_length_6(make):
    stack = scanax.Stack(make())
    x = X[0] if make is eqx_layers else X
    assert scans(lambda v: stack(v), x) == [6]


def test_identical_layers_that_change_shape_fall_back_to_a_loop():
    halve = lambda x: x[::2]
    stack = scanax.Stack([jnp.tanh, halve, halve, halve])
    x = jnp.arange(16.0)
    close(stack(x), halve(halve(halve(jnp.tanh(x)))))
    assert scans(stack, x) == []


class Tagger(eqx.Module):
    a: jax.Array

    def __call__(self, x):
        h, tag = x
        return h * self.a, tag + "a"  # changes a non-array part of x


def test_identical_layers_that_change_static_parts_of_x_fall_back_to_a_loop():
    layers = [Tagger(jnp.array(2.0)) for _ in range(3)]
    stack = scanax.Stack(layers)
    x = (jnp.ones(2), "")
    got, want = stack(x), loop(layers, x)
    assert got[1] == want[1] == "aaa"
    close(got[0], want[0])
    assert scans(lambda h: stack((h, ""))[0], x[0]) == []


@pytest.mark.standard_promotion("bfloat16 input to float32 layers, on purpose")
@pytest.mark.parametrize("kind", ["eqx", "nnx"])
def test_a_first_block_that_casts_x_is_called_alone_and_the_rest_scanned(kind):
    """bfloat16 input to float32 layers: only the first layer changes x's
    dtype, so it is called on its own and the other 7 are one scan (before:
    the whole run fell back to a Python loop, 8 layers traced). Values and
    gradients are the loop's."""
    keys = jr.split(jr.key(0), 8)
    if kind == "eqx":
        layers = [eqx.nn.Linear(4, 4, key=k) for k in keys]
    else:
        layers = [nnx.Linear(4, 4, rngs=nnx.Rngs(int(i))) for i in range(8)]
    stack = scanax.Stack(layers)
    x = jr.normal(jr.key(1), (3, 4), jnp.bfloat16)
    if kind == "eqx":
        x = x[0]
    assert scans(stack, x) == [7]
    got, want = stack(x), loop(layers, x)
    assert got.dtype == want.dtype == jnp.float32
    close(got, want)
    if kind == "eqx":
        loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
        g = jit(jax.grad(loss))(stack, x)
        ref = jax.grad(lambda ls, x: jnp.sum(jnp.sin(loop(ls, x))))(layers, x)
        close([(layer.weight, layer.bias) for layer in g],
              [(layer.weight, layer.bias) for layer in ref])  # fmt: skip


def test_a_layer_failing_in_a_looped_run_is_named_by_its_own_index():
    """Layers that change x's shape run as a loop; the one that fails (the
    4th halving of 8) is named by its index with the layer before it as the
    fix (before: layers[0], "must take the Stack's input")."""
    layers = [Halving(jnp.float32(1.0 + i)) for i in range(4)]
    stack = scanax.Stack(layers)
    with pytest.raises(
        (TypeError, ValueError),
        match=r"(?s)scanax.Stack: layers\[3\] \(Halving\) raised .* on its input "
        r"x float32\[1\].*Fix: layers\[3\] must take the output of layers\[2\]",
    ):
        stack(jnp.ones(8))
    close(stack(jnp.ones(16)), loop(layers, jnp.ones(16)))


class NNXScaled(nnx.Module):
    """A Python number in a Variable (a scale), and a counter from 0."""

    def __init__(self, scale, seed):
        self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
        self.scale = nnx.Variable(scale)
        self.count = nnx.BatchStat(0)

    def __call__(self, x):
        self.count.set_value(self.count.get_value() + 1)
        return jnp.tanh(self.lin(x)) * self.scale.get_value()


@pytest.mark.standard_promotion("a Python int counter in a Variable, as NNX has it")
def test_nnx_variables_holding_python_numbers_are_stacked_as_arrays():
    """Variables holding a Python float and an int counter are stacked as
    the arrays NNX makes of them (before: AttributeError 'float' object has
    no attribute 'shape' at construction): the loop's values and counts; a
    Variable holding a string is refused by its path."""
    layers = [NNXScaled(0.5 + i, i) for i in range(3)]
    ref = [NNXScaled(0.5 + i, i) for i in range(3)]
    stack = scanax.Stack(layers)
    assert stack.plan == ((0, 1, 3),)  # (one run of 3: stacked)
    x = jnp.ones((2, 4))
    close(stack(x), loop(ref, x))
    assert [int(layer.count.get_value()) for layer in stack] == [1, 1, 1]
    assert [layer.count.get_value() for layer in ref] == [1, 1, 1]

    class Named(nnx.Module):
        def __init__(self, seed):
            self.lin = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
            self.name = nnx.Variable("block")

        def __call__(self, x):
            return self.lin(x)

    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.Stack: layers\[0\]\.name \(Variable\) holds str;.*Fix: "
        "keep a value that is not an array as a plain attribute",
    ):
        scanax.Stack([Named(i) for i in range(3)])


def test_nnx_layers_sharing_one_rngs_are_told_to_fork_it():
    """Blocks that keep the same nnx.Rngs share its count: the fix named is
    rngs.fork() per layer (before: "share weights explicitly"), and it works."""

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            return self.lin(x) + 0.1 * self.rngs.normal(x.shape)

    rngs = nnx.Rngs(0)
    with pytest.raises(
        ValueError, match=r"(?s)share the Variable at \.rngs.*rngs\.fork\(\)"
    ):
        scanax.Stack([Noisy(rngs) for _ in range(3)])
    layers = [Noisy(rngs.fork()) for _ in range(3)]
    ref = nnx.clone(layers)
    stack = scanax.Stack(layers)
    close(stack(jnp.ones(4)), loop(ref, jnp.ones(4)))


# ---------------------------------------------------------------------------- why not


class IndexedBlock(eqx.Module):
    """A per-layer index as a static field: the trap of issue 18."""

    lin: eqx.nn.Linear
    idx: int = eqx.field(static=True)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x)) / (self.idx + 1)


class ArrayIndexedBlock(eqx.Module):
    """The fix: the index as an array field, stacked with the weights."""

    lin: eqx.nn.Linear
    idx: jax.Array

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x)) / (self.idx + 1)


class NNXIndexedBlock(nnx.Module):
    def __init__(self, idx, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.idx = idx  # a plain attribute: static for NNX

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x)) / (self.idx + 1)


def test_repr_lists_the_runs():
    assert repr(scanax.Stack(eqx_layers())) == (
        "Stack(8 layers: Linear(3→4), 6 × EqxBlock scanned, Linear(4→2))"
    )
    assert repr(scanax.Stack(nnx_layers())) == (
        "Stack(8 layers: Linear(3→4), 6 × NNXBlock scanned, Linear(4→2))"
    )
    assert repr(scanax.Stack([jnp.abs] + [jnp.tanh, jnp.sin] * 3)) == (
        "Stack(7 layers: abs, 3 × [tanh, sin] scanned)"
    )
    assert repr(scanax.Stack([jnp.abs])) == "Stack(1 layer: abs)"


def test_warns_once_when_only_a_number_prevents_stacking():
    keys = jr.split(jr.key(0), 5)
    layers = [eqx.nn.Linear(3, 4, key=keys[0])] + [
        IndexedBlock(eqx.nn.Linear(4, 4, key=k), i) for i, k in enumerate(keys[1:])
    ]
    with pytest.warns(
        scanax.StackWarning,
        match=r"^scanax\.Stack: layers\[1\] and layers\[2\] \(IndexedBlock\) differ only "
        r"in a number, `idx` \(0 against 1; 3 such pairs, in `idx`\), so they cannot "
        r"share one scan: .* traced on its own: Stack\(5 layers: Linear\(3→4\), "
        r"IndexedBlock, IndexedBlock, IndexedBlock, IndexedBlock\)\.\nFix: hold the "
        r"number as an array.*`jnp\.asarray\(idx\)`.*"
        r"`stack\(x, per_layer=\{'idx': jnp\.arange\(5\)\}\)`\. If the layer needs a "
        r"Python number .*scanax\.StackWarning\)`\.$",
    ) as record:
        stack = scanax.Stack(layers)
    assert len(record) == 1 and record[0].filename == __file__
    assert stack.plan == tuple((i, 1, 1) for i in range(5))
    # Once: calling, jit, tree_map and grad of the Stack say nothing more.
    x = X[0]
    close(stack(x), loop(layers, x))
    close(jit(lambda m, x: m(x))(stack, x), loop(layers, x))
    jax.tree.map(lambda a: a, stack)
    eqx.filter_grad(lambda m: jnp.sum(m(x)))(stack)
    # The fix: the index as an array field is stacked, with the same values.
    fixed = [layers[0]] + [
        ArrayIndexedBlock(b.lin, jnp.asarray(b.idx)) for b in layers[1:]
    ]
    fixed_stack = scanax.Stack(fixed)
    assert fixed_stack.plan == ((0, 1, 1), (1, 1, 4))
    close(fixed_stack(x), loop(layers, x))


def test_warns_for_nnx_numbers_and_periods_but_not_for_other_differences():
    rngs = nnx.Rngs(0)
    with pytest.warns(
        scanax.StackWarning,
        match=r"(?s)layers\[0\] and layers\[2\] \(NNXIndexedBlock\) differ only in a "
        r"number, `idx` \(0 against 1; 2 such pairs.*"
        r"`self\.idx = nnx\.Variable\(jnp\.asarray\(idx\)\)`",
    ):
        scanax.Stack(
            [f for i in range(3) for f in (NNXIndexedBlock(i, rngs), jax.nn.relu)]
        )
    # Other differences (widths, functions, structure) are plain heterogeneity.
    k = jr.split(jr.key(1), 3)
    scanax.Stack(
        [
            eqx.nn.Linear(4, 4, key=k[0]),
            eqx.nn.Linear(4, 4, use_bias=False, key=k[1]),
            eqx.nn.Linear(4, 3, key=k[2]),
        ]
    )
    scanax.Stack([eqx.nn.Lambda(jnp.tanh), eqx.nn.Lambda(jnp.sin)])
    scanax.Stack([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])


# ---------------------------------------------------------------------------- eager


@pytest.mark.parametrize("make", [eqx_layers, nnx_layers, plain_layers])
def test_eager_calls_reuse_the_compiled_program(make):
    layers = make()
    stack = scanax.Stack(layers)
    x = X[0] if make is eqx_layers else X
    for i in range(3):
        with helpers.count_compiles() as c:
            got = stack(x + i)
        close(got, loop(layers, x + i))
        assert i == 0 or c.n == 0


def test_eager_layer_called_directly_may_read_values_as_before():
    """Eagerly, a layer the Stack calls directly still gets concrete arrays: a
    call whose trace needs values runs as it did before eager calls were cached."""
    flip = lambda x: x if float(x.sum()) > 0 else -x
    stack = scanax.Stack([flip, jnp.tanh, jnp.tanh])
    for sign in (1.0, -1.0):
        close(stack(sign * X), loop([flip, jnp.tanh, jnp.tanh], sign * X))
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(stack)(X)


def test_eager_nnx_state_updates_are_written_back_each_call():
    def layers():
        rngs = nnx.Rngs(0)
        return [nnx.BatchNorm(3, rngs=rngs) for _ in range(3)]

    stack, ref = scanax.Stack(layers()), layers()
    for i in range(3):
        with helpers.count_compiles() as c:
            got = stack(X * (i + 1))
        close(got, loop(ref, X * (i + 1)))
        assert i == 0 or c.n == 0
        close(
            [nnx.state(layer, nnx.BatchStat) for layer in stack],
            [nnx.state(layer, nnx.BatchStat) for layer in ref],
        )


def test_eager_nnx_layers_with_an_array_attribute():
    """A plain array attribute (data in flax 0.12, no Variable): stacked per
    layer, eagerly as under nnx.jit (the eager call had failed on it: review
    2026-12-07)."""

    class Scaled(nnx.Module):
        def __init__(self, s):
            self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.s = jnp.asarray(s)

        def __call__(self, x):
            return self.lin(x) * self.s

    def layers():
        return [Scaled(s) for s in (1.0, 2.0, 0.5)]

    stack, want = scanax.Stack(layers()), loop(layers(), X)
    close(stack(X), want)
    close(nnx.jit(lambda s, x: s(x))(stack, X), want)


# ---------------------------------------------------------------------------- errors


def test_errors():
    with pytest.raises(TypeError, match=r"^scanax\.Stack: `layers` must be a sequence"):
        scanax.Stack(jnp.sin)
    with pytest.raises(ValueError, match=r"^scanax\.Stack: `layers` is empty"):
        scanax.Stack([])
    with pytest.raises(
        TypeError,
        match=r"^scanax\.Stack: layers\[1\] is not callable: got "
        r"float32\[3\]",
    ):
        scanax.Stack([jnp.sin, jnp.ones(3)])
    stack = scanax.Stack([jnp.sin, jnp.cos])
    with pytest.raises(
        IndexError,
        match=r"^scanax\.Stack: index 2 is out of range for a "
        r"Stack of 2 layers",
    ):
        stack[2]
    assert stack[np.int64(1)] is jnp.cos and stack[jnp.int32(-2)] is jnp.sin
    for bad, shown in [(1.0, "float"), (True, "bool True"), (slice(0, 1), "slice")]:
        with pytest.raises(
            TypeError,
            match=rf"^scanax\.Stack: a Stack is indexed by one integer, got {shown}",
        ):
            stack[bad]
    shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    other = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    other.kernel = shared.kernel
    with pytest.raises(
        TypeError,
        match=r"^scanax\.Stack: layers\[0\] is a Linear \(Flax NNX\) but layers\[1\] "
        r"is a Linear holding arrays outside",
    ):
        scanax.Stack([shared, eqx.nn.Linear(2, 2, key=jr.key(0))])
    with pytest.raises(
        ValueError,
        match=r"^scanax\.Stack: layers\[0\] and layers\[1\] "
        r"share the Variable at",
    ):
        scanax.Stack([shared, other])
    with pytest.raises(
        TypeError,
        match=r"^scanax\.Stack: `remat` must be None, False, True, \"sqrt\" or a "
        r"jax\.checkpoint_policies policy, got str 'half'\.\nFix: leave it out",
    ):
        scanax.Stack([jnp.sin, jnp.cos], remat="half")


@pytest.mark.parametrize(
    "make",
    [
        lambda: [jnp.sin, jnp.cos],
        lambda: [eqx.nn.Linear(2, 2, key=jr.key(0)) for _ in range(2)],
        lambda: [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(2)],
    ],
    ids=["pytree", "equinox", "nnx"],
)
def test_error_misspelled_keyword_names_stack(make):
    """A misspelled keyword is named against Stack's own keywords (it reached an
    internal class's __init__ before), for every framework's Stack."""
    with pytest.raises(TypeError) as err:
        scanax.Stack(make(), unrol=2)
    msg = str(err.value)
    assert msg.startswith(
        "scanax.Stack() got an unexpected keyword argument 'unrol'. "
        "Did you mean `unroll`?\nFix: Stack takes `layers` and the keywords "
        "remat, unroll;"
    ), msg
    assert "Body" not in msg and "__init__" not in msg


def test_error_layers_misspelled():
    with pytest.raises(TypeError, match=r"argument 'layer'\. Did you mean `layers`\?"):
        scanax.Stack(layer=[jnp.sin])


def test_plain_stack_copies():
    """copy.copy and copy.deepcopy make the object without arguments: a plain
    Stack copies (it raised `layers` is empty); Stack() is still refused."""
    import copy

    stack = scanax.Stack([jnp.abs] + [lambda x: 2.0 * x] * 4)
    x = jnp.float32(-1.5)
    for made in (copy.copy(stack), copy.deepcopy(stack)):
        assert isinstance(made, scanax.Stack) and made.plan == stack.plan
        assert float(made(x)) == float(stack(x)) == 24.0
    with pytest.raises(ValueError, match=r"`layers` is empty"):
        scanax.Stack()


def test_stack_keywords_are_the_constructors():
    """The keywords Stack checks are exactly its constructor's."""
    import inspect

    params = inspect.signature(stack_module.Body.__init__).parameters
    kw = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert tuple(kw) == stack_module._KEYWORDS


@pytest.mark.parametrize(
    "make, x, kwargs, at, before",
    [
        (  # a run of three, then a layer of another width
            lambda ks: (
                [eqx.nn.Linear(3, 3, key=k) for k in ks[:3]]
                + [eqx.nn.Linear(4, 4, key=ks[5])]
            ),
            jnp.ones(3),
            {},
            3,
            "the output of layers\\[2\\]",
        ),
        (  # the input of another width than the scanned run's first layer
            lambda ks: [eqx.nn.Linear(3, 3, key=k) for k in ks[:4]],
            jnp.ones(4),
            {},
            0,
            "the Stack's input",
        ),
        (  # a keyword the layers do not take
            lambda ks: [eqx.nn.Linear(3, 3, key=k) for k in ks[:4]],
            jnp.ones(3),
            {"train": True},
            0,
            "the Stack's input and the keyword arguments \\['train'\\] .*per_layer=",
        ),
        (
            lambda ks: [
                nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
                nnx.Linear(5, 4, rngs=nnx.Rngs(1)),
            ],
            jnp.ones((2, 3)),
            {},
            1,
            "the output of layers\\[0\\]",
        ),
    ],
    ids=["mismatched_layer", "input_width", "keyword", "nnx"],
)
def test_a_layer_failing_on_its_input_is_named(make, x, kwargs, at, before):
    """A layer that fails while traced on its input (JAX's own shape error,
    or a keyword it does not take) is named by its index, with its input and
    what it must take, the original chained; the Stack still works after."""
    layers = make(jr.split(jr.key(0), 8))
    stack = scanax.Stack(layers)
    with pytest.raises(
        TypeError,
        match=f"(?s)scanax.Stack: layers\\[{at}\\] \\(Linear\\) raised TypeError on "
        f"its input x float32.*The layers run in order.*Fix: layers\\[{at}\\] must "
        f"take {before}",
    ) as caught:
        stack(x, **kwargs)
    assert isinstance(caught.value.__cause__, TypeError)
    if at == 0 and not kwargs:  # (the right input: the Python loop's answer)
        y = jnp.ones(3)
        want = y
        for layer in layers:
            want = layer(want)
        np.testing.assert_allclose(stack(y), want, rtol=1e-6)


def test_layers_in_an_nnx_list_stack_and_layers_as_arguments_are_named():
    """An nnx.List is a sequence of layers: stacked as a list is (before:
    refused with a hint about stacked layers); Stack(l1, l2), nnx.Sequential's
    habit, and an nnx.Sequential itself are named with the fix (before:
    Python's "Stack.__new__() takes from 1 to 2 positional arguments")."""
    layers = [nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)]
    x = jr.normal(jr.key(0), (2, 4))
    want = x
    for layer in layers:
        want = layer(want)
    np.testing.assert_allclose(
        scanax.Stack(nnx.List(layers))(x), want, rtol=1e-5, atol=1e-6
    )
    with pytest.raises(
        TypeError,
        match=r"got 2 layers as separate arguments.*\nFix: pass them in a list",
    ):
        scanax.Stack(layers[0], layers[1])
    with pytest.raises(
        TypeError, match=r"got Sequential\.\nFix: pass its layers: Stack\(list\("
    ):
        scanax.Stack(nnx.Sequential(*layers))


class _DecodingBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(2, 8, rngs=rngs, decode=False)
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x, decode=None):
        x = x + self.attn(x, decode=decode)
        return x + jnp.tanh(self.fc(x))


def _init_caches(node):
    for _, module in nnx.iter_modules(node):
        if isinstance(module, nnx.MultiHeadAttention):
            module.init_cache((2, 5, 8))


def test_a_decoding_cache_added_after_the_stack_is_named_with_the_fix():
    """``init_cache`` through ``nnx.iter_modules`` on a built Stack adds
    unstacked Variables to its run: a ValueError naming one and the fix
    (review: a bare IndexError from inside the scan), nothing changed; with
    the caches made on the layers first, a decoding step equals the layers
    looped."""
    x = jr.normal(jr.key(0), (2, 1, 8))
    stack = scanax.Stack([_DecodingBlock(nnx.Rngs(i)) for i in range(3)])
    _init_caches(stack)
    before = jax.tree.map(np.asarray, nnx.state(stack))
    with pytest.raises(
        ValueError,
        match=r"(?s)the stacked run of layers\[0:3\] holds layers\[0\]\['attn'\]\['cache_index'\] "
        r"= int32\[\], without the leading axis of its 3 blocks.*Fix: add it to the layers "
        "before building the Stack",
    ):
        stack(x, decode=True)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(stack), before)
    blocks = [_DecodingBlock(nnx.Rngs(i)) for i in range(3)]
    _init_caches(nnx.List(blocks))
    stack = scanax.Stack(blocks)
    got = stack(x, decode=True)
    want = x
    for block in blocks:
        want = block(want, decode=True)
    close(got, want)
