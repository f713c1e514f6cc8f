"""Convolutions made canonical (``scanax/_conv_layout.py``) and their use in scans.

Every rewritten program is compared with the program as JAX traces it (the
reference: ``lax.conv_general_dilated`` in the layout it was asked for), values
and gradients, under ``jit``/``vmap``/``grad``; and checked to hold only canonical
convolutions. ``scanax.scan`` of train steps is compared with ``lax.scan`` of the
same steps; a scan without convolutions gives exactly ``lax.scan``'s program.

Whether scans and fit's steps are rewritten is the backend's (``_backend.platform``):
on CPU their loop bodies hold only canonical convolutions (in the jaxpr and in
XLA:CPU's optimized program); elsewhere (a GPU, or CPU told it is one) they keep
the layouts JAX traced, those of ``lax.scan``'s program. Each test asserts the
fact of the backend it runs on; ``test_other_backends_keep_the_traced_layouts``
asks for a GPU's decision on any machine.
"""

from __future__ import annotations

import functools as ft
import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

import scanax
from scanax import _backend, _conv_layout as cl

CONV = "conv_general_dilated"


def convs(closed, inside=None):
    """The parameters of every convolution of a program, at any depth (only in
    the bodies of ``inside`` primitives, when given)."""
    found = []

    def visit(jaxpr, depth_ok):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == CONV and depth_ok:
                found.append(eqn.params)
            ok = depth_ok or eqn.primitive.name == inside
            for v in eqn.params.values():
                for s in v if isinstance(v, (tuple, list)) else (v,):
                    if hasattr(s, "eqns"):
                        visit(s, ok)
                    elif hasattr(s, "jaxpr") and hasattr(s.jaxpr, "eqns"):
                        visit(s.jaxpr, ok)

    visit(closed.jaxpr, inside is None)
    return found


def all_canonical(closed, inside=None):
    found = convs(closed, inside)
    return bool(found) and all(cl.is_canonical(p) for p in found)


def rewrites():
    """Whether scans and replays are rewritten here (on CPU, unless a test asks
    for another backend's decision)."""
    return cl.applies(_backend.platform())


def as_scanned(ours, theirs, inside="scan"):
    """Our loop body's convolutions against ``lax.scan``'s: all canonical where
    the backend rewrites (``lax.scan``'s not), else the same as traced."""
    if rewrites():
        assert all_canonical(ours, inside) and not all_canonical(theirs, inside)
    else:
        assert convs(ours, inside) == convs(theirs, inside) != []


def close(a, b, rtol=2e-5, atol=None):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        scale = float(np.max(np.abs(y))) or 1.0
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol or rtol * scale)


def rewritten(fn):
    """``fn`` evaluated by the rewriting interpreter (via ``rewrite``)."""

    def run(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        new = cl.rewrite(closed)
        flat = jax.core.eval_jaxpr(new.jaxpr, new.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), flat)

    return run


# name: (lhs shape, rhs shape, conv keyword arguments)
CASES = {
    "2d nhwc stride": (
        (2, 9, 8, 4),
        (3, 3, 4, 6),
        dict(
            window_strides=(2, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "2d nchw dilations": (
        (2, 4, 9, 8),
        (6, 4, 3, 2),
        dict(
            window_strides=(1, 2),
            padding=((1, 2), (0, 1)),
            lhs_dilation=(2, 1),
            rhs_dilation=(1, 2),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        ),
    ),
    "2d valid groups": (
        (3, 8, 7, 4),
        (3, 2, 2, 6),
        dict(
            window_strides=(1, 1),
            padding="VALID",
            feature_group_count=2,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
    ),
    "2d mixed layouts": (
        (7, 2, 3, 8),
        (4, 3, 3, 2),
        dict(
            window_strides=(1, 1),
            padding="SAME_LOWER",
            rhs_dilation=(2, 1),
            dimension_numbers=("HNCW", "OHIW", "CWNH"),
        ),
    ),
    "1d": (
        (2, 11, 3),
        (4, 3, 5),
        dict(
            window_strides=(2,),
            padding=((2, 1),),
            rhs_dilation=(2,),
            dimension_numbers=("NWC", "WIO", "NWC"),
        ),
    ),
    "3d": (
        (2, 3, 5, 4, 4),
        (5, 3, 2, 2, 3),
        dict(
            window_strides=(1, 2, 1),
            padding="SAME",
            dimension_numbers=("NCDHW", "OIDHW", "NCDHW"),
        ),
    ),
}


def _case(name, dtype=jnp.float32):
    lhs_shape, rhs_shape, kw = CASES[name]
    k1, k2 = jr.split(jr.key(len(name)))
    x = jr.normal(k1, lhs_shape).astype(dtype)
    w = jr.normal(k2, rhs_shape).astype(dtype)
    conv = ft.partial(lax.conv_general_dilated, **kw)
    return conv, x, w


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_gradients_equal_and_canonical(name):
    conv, x, w = _case(name)
    loss = lambda x, w: jnp.sum(jnp.sin(conv(x, w)))
    grad = jax.grad(loss, argnums=(0, 1))
    # The backward pass traced, then rewritten (a train step in a loop body), and
    # the rewritten forward pass, differentiated. (Two programs: one compile each.)
    ours = jax.jit(
        lambda x, w: (
            rewritten(conv)(x, w),
            rewritten(grad)(x, w),
            jax.grad(rewritten(loss), (0, 1))(x, w),
        )
    )(x, w)
    want = jax.jit(lambda x, w: (conv(x, w), grad(x, w), grad(x, w)))(x, w)
    close(ours, want)
    assert all_canonical(cl.rewrite(jax.make_jaxpr(grad)(x, w)))
    assert all_canonical(jax.make_jaxpr(jax.grad(rewritten(loss)))(x, w)) is False


def test_batch_group_count():
    """The kernel gradient of a grouped convolution has batch_group_count > 1;
    it is rewritten like any other."""
    conv, x, w = _case("2d valid groups")
    grad = jax.grad(lambda w: jnp.sum(conv(x, w) ** 2))
    found = convs(jax.make_jaxpr(grad)(w))
    assert any(p["batch_group_count"] == 2 for p in found)
    assert all_canonical(cl.rewrite(jax.make_jaxpr(grad)(w)))
    # and one written directly, NCHW
    x2 = jr.normal(jr.key(3), (4, 3, 6, 5))
    w2 = jr.normal(jr.key(4), (6, 3, 2, 2))
    direct = lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "VALID", batch_group_count=2
    )
    both = lambda grad, direct: jax.jit(lambda: (grad(w), direct(x2, w2)))()
    close(both(rewritten(grad), rewritten(direct)), both(grad, direct))


@pytest.mark.parametrize("name", ["2d nchw dilations", "1d", "3d"])
def test_bfloat16(name):
    conv, x, w = _case(name, jnp.bfloat16)
    grad = jax.grad(lambda x, w: jnp.sum(conv(x, w).astype(jnp.float32) ** 2), (0, 1))
    wide = lambda x, w: conv(x, w, preferred_element_type=jnp.float32)
    both = lambda conv, grad, wide: jax.jit(
        lambda x, w: (conv(x, w), grad(x, w), wide(x, w))
    )(x, w)
    ours = both(rewritten(conv), rewritten(grad), rewritten(wide))
    want = both(conv, grad, wide)
    assert [a.dtype for a in jax.tree.leaves(ours)] == [
        a.dtype for a in jax.tree.leaves(want)
    ]
    assert ours[0].dtype == jnp.bfloat16 and ours[2].dtype == jnp.float32
    close(ours[0], want[0], rtol=1e-2)
    close(ours[1], want[1], rtol=2e-2)
    close(ours[2], want[2])


def test_jit_vmap_grad_of_wrap(monkeypatch):
    # the rewrite under jit, vmap and grad, on any backend (it is CPU's decision)
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    conv, x, w = _case("2d nchw dilations")
    loss = lambda x, w: jnp.sum(jnp.tanh(conv(x, w)))
    g = jax.grad(loss, (0, 1))
    ws = jnp.stack([w, -2 * w])

    def all_of(loss, g):  # the transformations, in one program (one compile)
        return (
            loss(x, w),
            jax.vmap(loss, (None, 0))(x, ws),
            jax.grad(loss, (0, 1))(x, w),
            g(x, w),
            jax.vmap(g, (None, 0))(x, ws),  # batched after the rewrite
        )

    ours = jax.jit(lambda: all_of(cl.wrap(loss), cl.wrap(g)))
    close(ours(), jax.jit(lambda: all_of(loss, g))())
    # (the gradient of the wrapped loss is JAX's, of the canonical forward pass)
    wrapped_g = lambda: (cl.wrap(g)(x, w), jax.vmap(cl.wrap(g), (None, 0))(x, ws))
    assert all_canonical(jax.make_jaxpr(wrapped_g)())


def test_nested_programs_rewritten():
    conv, x, w = _case("2d nchw dilations")

    @jax.custom_vjp
    def custom(x, w):
        return conv(x, w)

    custom.defvjp(
        lambda x, w: (conv(x, w), (x, w)), lambda res, g: jax.vjp(conv, *res)[1](g)
    )

    @jax.custom_jvp
    def custom_j(x):
        return jnp.sin(conv(x, w))

    custom_j.defjvp(lambda p, t: (custom_j(*p), jnp.cos(conv(p[0], w)) * conv(t[0], w)))

    def fn(x, w, loop=True):
        a = jax.jit(conv)(x, w)
        b = jax.checkpoint(conv)(x, w)
        c = lax.cond(jnp.sum(x) > 0, conv, lambda x, w: -conv(x, w), x, w)
        d, _ = lax.scan(
            lambda c, _: (c + conv(x, w), None), jnp.zeros_like(a), length=2
        )
        e = 0.0
        if loop:  # (no reverse mode for while_loop)
            body = lambda c: (c[0] + 1, c[1] + conv(x, w))
            e = lax.while_loop(lambda c: c[0] < 2, body, (0, jnp.zeros_like(a)))[1]
        return a + b + c + d + e + custom(x, w) + custom_j(x)

    closed = jax.make_jaxpr(fn)(x, w)
    assert cl.has_conv(closed) and not all_canonical(closed)
    new = cl.rewrite(closed)
    assert all_canonical(new) and len(convs(new)) == len(convs(closed))
    close(jax.jit(rewritten(fn))(x, w), jax.jit(fn)(x, w))
    g = jax.grad(lambda x, w: jnp.sum(fn(x, w, loop=False) ** 2), (0, 1))
    close(jax.jit(rewritten(g))(x, w), jax.jit(g)(x, w))
    assert all_canonical(cl.rewrite(jax.make_jaxpr(g)(x, w)))


def test_has_conv():
    conv, x, w = _case("1d")
    zeros = lambda x: jnp.zeros((2, 4, 5))
    nested = lambda x: lax.cond(True, lambda x: jax.jit(conv)(x, w), zeros, x)
    assert cl.has_conv(jax.make_jaxpr(nested)(x))
    assert cl.has_conv(jax.make_jaxpr(jax.checkpoint(lambda x: conv(x, w)))(x).jaxpr)
    assert not cl.has_conv(jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * x)(x))
    closed = jax.make_jaxpr(jnp.sin)(x)
    assert cl.rewrite(closed) is closed


def test_applies_cpu_only_and_replay():
    assert cl.applies("cpu") and not cl.applies("gpu") and not cl.applies("tpu")
    conv, x, w = _case("2d mixed layouts")
    closed = jax.make_jaxpr(conv)(x, w)
    close(
        cl.replay(closed, x, w), jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, w)
    )
    replayed = jax.make_jaxpr(lambda x, w: cl.replay(closed, x, w))(x, w)
    if rewrites():
        assert all_canonical(replayed)
    else:
        assert str(replayed) == str(closed)
    plain = jax.make_jaxpr(jnp.sin)(x)
    assert str(jax.make_jaxpr(lambda x: cl.replay(plain, x))(x)) == str(plain)


def test_wrap_elsewhere_and_disable_jit_is_fn(monkeypatch):
    conv, x, w = _case("2d nchw dilations")
    with jax.disable_jit():
        close(cl.wrap(conv)(x, w), conv(x, w))
    monkeypatch.setattr(cl, "applies", lambda backend: False)
    assert str(jax.make_jaxpr(cl.wrap(conv))(x, w)) == str(jax.make_jaxpr(conv)(x, w))


# ---------------------------------------------------------------------------- scans


def test_scan_without_conv_is_lax_scan():
    inner = jax.jit(lambda c: jnp.tanh(c) @ jnp.ones((3, 3)))
    f = lambda c, x: (inner(c) * x + 1.0, jnp.sin(c))
    args = (jnp.ones(3), jnp.arange(12.0).reshape(4, 3))
    for kw in [{}, {"reverse": True}, {"unroll": 2}]:
        ours = jax.make_jaxpr(lambda c, x: scanax.scan(f, c, x, **kw))(*args)
        theirs = jax.make_jaxpr(lambda c, x: lax.scan(f, c, x, **kw))(*args)
        assert str(ours) == str(theirs)
    g = lambda c, x: jax.grad(lambda c: scanax.scan(f, c, x)[0].sum())(c)
    h = lambda c, x: jax.grad(lambda c: lax.scan(f, c, x)[0].sum())(c)
    assert str(jax.make_jaxpr(g)(*args)) == str(jax.make_jaxpr(h)(*args))


def _train(scan, model_step, state, xs):
    """The jitted loop's result and its compiled program's convolutions' layouts
    (XLA's ``dim_labels``: ``b01f_01io->b01f`` is the canonical 2-D one)."""
    compiled = jax.jit(lambda s, xs: scan(model_step, s, xs)).lower(state, xs).compile()
    labels = set(re.findall(r"dim_labels=([^,\s]+)", compiled.as_text()))
    return compiled(state, xs), labels


def _check_loop(model_step, state, xs, vmap=False):
    """scanax.scan of ``model_step`` against lax.scan's: losses and final state,
    vmapped over two starts, and only canonical convolutions in scanax's loop
    body (lax.scan's are not), in the jaxpr and in XLA's optimized program."""
    ours, labels = _train(scanax.scan, model_step, state, xs)
    theirs, their_labels = _train(lax.scan, model_step, state, xs)
    close(ours, theirs, rtol=1e-4)
    assert np.all(np.isfinite(np.asarray(ours[1])))
    if rewrites() and jax.default_backend() == "cpu":  # XLA:CPU's program
        canonical = re.compile(r"b(\d+)f_\1io->b\1f")
        assert labels and all(canonical.fullmatch(x) for x in labels), labels
        assert not all(canonical.fullmatch(x) for x in their_labels), their_labels
    if vmap:  # over two starting points
        params, opt_state = state
        two = jax.tree.map(lambda a: jnp.stack([a, a * 0.5]), params)
        vm = lambda scan: jax.jit(
            jax.vmap(lambda p: scan(model_step, (p, opt_state), xs))
        )(two)
        close(vm(scanax.scan), vm(lax.scan), rtol=1e-4)
    body = lambda scan: jax.make_jaxpr(lambda s, xs: scan(model_step, s, xs))(state, xs)
    as_scanned(body(scanax.scan), body(lax.scan))
    return ours


def test_scan_of_plain_jax_cnn_train_steps():
    optax = pytest.importorskip("optax")
    import benchmarks.bench_conv as bench

    tx = optax.adam(1e-2)
    params = bench.init_params(jr.key(0))
    xs = jax.tree.map(lambda a: a[:, :4], bench.data(3, 8))
    _check_loop(bench.make_step(tx), (params, tx.init(params)), xs)


def test_scan_of_nnx_conv_train_steps():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.c1 = nnx.Conv(1, 4, (3, 3), strides=(2, 2), rngs=rngs)
            self.c2 = nnx.Conv(
                4,
                4,
                (3, 3),
                kernel_dilation=2,
                feature_group_count=2,
                padding="VALID",
                rngs=rngs,
            )
            self.d = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            x = jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))
            return self.d(x.mean((1, 2)))

    model = CNN(nnx.Rngs(0))
    tx = optax.adam(1e-2)
    xs = (jr.normal(jr.key(1), (3, 4, 12, 12, 1)), jr.randint(jr.key(2), (3, 4), 0, 3))

    # NNX objects carried by scanax.scan (nnx.Optimizer), against lax.scan on split state
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def nnx_step(carry, batch):
        m, o = carry
        x, y = batch
        loss, g = nnx.value_and_grad(
            lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        )(m)
        o.update(m, g)
        return (m, o), loss

    gd, s0 = nnx.split((model, opt))

    def split_step(s, batch):
        (m, o), loss = nnx_step(nnx.merge(gd, s), batch)
        return nnx.split((m, o))[1], loss

    theirs = jax.jit(lambda s, xs: lax.scan(split_step, s, xs))(s0, xs)
    (m, o), losses = scanax.scan(nnx_step, (model, opt), xs)
    close(losses, theirs[1], rtol=1e-4)
    close(nnx.state((m, o)), theirs[0], rtol=1e-4)
    assert int(o.step[...]) == 3
    ours = jax.make_jaxpr(lambda s, xs: scanax.scan(nnx_step, nnx.merge(gd, s), xs)[1])
    theirs = jax.make_jaxpr(lambda s, xs: lax.scan(split_step, s, xs)[1])
    as_scanned(ours(s0, xs), theirs(s0, xs))


def test_scan_of_equinox_conv_train_steps():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    k1, k2, k3 = jr.split(jr.key(0), 3)
    model = [
        eqx.nn.Conv1d(2, 4, 3, stride=2, padding=1, key=k1),
        eqx.nn.Conv3d(1, 2, 2, dilation=(1, 2, 1), padding="SAME", key=k2),
        eqx.nn.Linear(4, 2, key=k3),
    ]
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(1e-2)

    def forward(m, x):  # x: [C=2, W=9], one example (vmapped below)
        c1, c3, lin = m
        h = jax.nn.relu(c1(x))  # [4, 5]
        h = c3(h[None, :, :, None].repeat(2, axis=3))  # [2, 4, 5, 2]
        return lin(h.mean((0, 2, 3)))

    def step(state, batch):
        p, opt_state = state
        x, y = batch
        loss_fn = lambda p: jnp.mean(
            (jax.vmap(ft.partial(forward, eqx.combine(p, static)))(x) - y) ** 2
        )
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), loss

    xs = (jr.normal(jr.key(1), (3, 4, 2, 9)), jr.normal(jr.key(2), (3, 4, 2)))
    _check_loop(step, (params, tx.init(params)), xs, vmap=True)


def test_grad_of_scan_over_convs():
    """Gradients through the loop (the body a forward pass): JAX differentiates
    the rewritten body; equal to lax.scan's, under jit, vmap and grad."""
    conv = ft.partial(
        lax.conv_general_dilated,
        window_strides=(1, 1),
        padding="SAME",
        rhs_dilation=(1, 2),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    x = jr.normal(jr.key(0), (2, 3, 6, 6))
    w = jr.normal(jr.key(1), (3, 3, 3, 3)) * 0.3
    ws = jnp.stack([w, -w, 0.5 * w])
    same = lambda c, w: jnp.tanh(conv(c, w)) + c

    def loss(scan, x, ws):
        carry, ys = scan(lambda c, w: (same(c, w), jnp.sum(c**2)), x, ws)
        return jnp.sum(carry**2) + jnp.sum(ys)

    g = lambda scan: jax.jit(jax.grad(ft.partial(loss, scan), (0, 1)))(x, ws)
    close(g(scanax.scan), g(lax.scan), rtol=1e-4)
    xs2 = jnp.stack([x, -x])
    v = lambda scan: jax.jit(
        jax.vmap(jax.grad(ft.partial(loss, scan), (0, 1)), (0, None))
    )(xs2, ws)
    close(v(scanax.scan), v(lax.scan), rtol=1e-4)
    fwd = lambda scan: jax.make_jaxpr(ft.partial(loss, scan))(x, ws)
    as_scanned(fwd(scanax.scan), fwd(lax.scan))


def test_stack_of_conv_layers():
    nnx = pytest.importorskip("flax.nnx")
    layers = [nnx.Conv(3, 3, (3, 3), rngs=nnx.Rngs(i)) for i in range(3)]
    stack = scanax.Stack(layers)
    x = jr.normal(jr.key(0), (2, 6, 6, 3))

    def ref(x):
        for layer in layers:
            x = layer(x)
        return x

    close(stack(x), ref(x))
    gx = lambda fn: jax.grad(lambda x: jnp.sum(jnp.sin(fn(x))))(x)
    close(gx(stack), gx(ref), rtol=1e-4)
    gd, state = nnx.split(stack)
    closed = jax.make_jaxpr(lambda s, x: nnx.merge(gd, s)(x))(state, x)
    if rewrites():
        assert all_canonical(closed, inside="scan")
    else:  # (NNX's own layout, NHWC/HWIO/NHWC, is the canonical one)
        assert convs(closed, inside="scan") == [convs(jax.make_jaxpr(ref)(x))[0]]


def test_other_backends_keep_the_traced_layouts(monkeypatch):
    """A GPU's (or TPU's) programs, asked for on any machine: scans of CNN
    train steps, their gradients and replays keep the layouts JAX traced, with
    the values of ``lax.scan``."""
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    assert not rewrites()
    test_scan_of_plain_jax_cnn_train_steps()
    test_grad_of_scan_over_convs()
    test_applies_cpu_only_and_replay()


_HIDDEN_SOURCE_INFO = """
import sys, warnings
import jax, jax.extend, jax.extend.core, jax._src
for name in ("jax._src.source_info_util", "jax.extend.source_info_util"):
    parent, _, child = name.rpartition(".")
    sys.modules[name] = None  # `import` of it fails, as on a JAX that moved it
    if hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)
warnings.simplefilter("error")
import jax.numpy as jnp, numpy as np, scanax
from scanax import _conv_layout as cl
assert cl._source_info is None
conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")  # NCHW, OIHW
x, w = jnp.ones((2, 3, 6, 6)), jnp.full((3, 3, 3, 3), 0.05)
step = lambda c, w: (jnp.tanh(conv(c, w)), jnp.sum(c))
ws = jnp.stack([w, -w])
ours = jax.jit(lambda x: scanax.scan(step, x, ws))(x)
theirs = jax.jit(lambda x: jax.lax.scan(step, x, ws))(x)
for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
h, _ = scanax.linear_scan(0.5, jnp.ones((4, 2)))
assert h[-1, 0] == 1.875
print("ran", jax.default_backend())
"""


def test_import_and_scan_without_jax_source_info():
    """``jax._src.source_info_util`` (which this module once imported) and its
    ``jax.extend`` home hidden: scanax imports, and a scan of convolutions is
    rewritten (on CPU) without source information, with ``lax.scan``'s values."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _HIDDEN_SOURCE_INFO],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ran")


def test_without_jax_extend_core_the_rewrite_switches_off(monkeypatch):
    """On a JAX without ``jax.extend.core`` a loop body runs as traced, with a
    warning (once) pointing at the user's line."""
    conv, x, w = _case("2d nchw dilations")
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    monkeypatch.setattr(cl, "_core", None)
    cl._warn_unavailable.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"has no `jax.extend.core`") as seen:
        closed = jax.make_jaxpr(cl.wrap(conv))(x, w)
    assert seen[0].filename == __file__
    assert str(closed) == str(jax.make_jaxpr(conv)(x, w))
    cl._warn_unavailable.cache_clear()
