import functools as ft

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scanax
from scanax._remat import chunk_size


def step(c, x):
    h, w = c
    a, b = x
    h = jnp.tanh(h @ w + a * b)
    return (h, w), (jnp.sum(h**2), h[0])


def inputs(n):
    h = jnp.linspace(-1.0, 1.0, 3)
    w = jnp.eye(3) * 0.9 + 0.05
    a = jnp.sin(jnp.arange(n * 3, dtype=jnp.float32)).reshape(n, 3)
    b = jnp.float32(0.5)
    return (h, w), (a, b)


def run(scan, init, xs, **kw):
    carry, ys = scan(step, init, xs, **kw)
    return jnp.sum(carry[0]) + jnp.sum(ys[0]) + jnp.sum(ys[1] ** 2)


def plain(init, xs, reverse=False, unroll=1):
    a, b = xs
    return run(
        lambda f, c, a: jax.lax.scan(lambda c, a: f(c, (a, b)), c, a, reverse=reverse),
        init,
        a,
    )


def ours(init, xs, remat, reverse=False, unroll=1):
    return run(
        scanax.scan,
        init,
        xs,
        in_axes=(0, None),
        remat=remat,
        reverse=reverse,
        unroll=unroll,
    )


close = ft.partial(helpers.close, rtol=2e-5, atol=1e-6, structure=False)


REMATS = {
    "true": True,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "sqrt": "sqrt",
}


@pytest.mark.parametrize(
    "remat, n, reverse",
    [(r, n, rev) for r in REMATS for n, rev in [(13, False), (9, True)]]
    + [("sqrt", 1, False), ("sqrt", 13, True)],
)
def test_values_and_gradients(remat, n, reverse):
    init, xs = inputs(n)
    unroll = 2 if n == 13 else 1
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)), static_argnums=(2,))(
        init, xs, reverse
    )
    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)), static_argnums=(2, 3, 4))(
        init, xs, REMATS[remat], reverse, unroll
    )
    close(got, want)


@pytest.mark.parametrize("remat", ["true", "sqrt"])
def test_forward_mode(remat):
    init, xs = inputs(10)
    tangents = jax.tree.map(jnp.ones_like, (init, xs))
    want = jax.jvp(lambda i, x: plain(i, x), (init, xs), tangents)
    got = jax.jvp(lambda i, x: ours(i, x, REMATS[remat]), (init, xs), tangents)
    close(got, want)


@pytest.mark.parametrize("remat", [True, "sqrt"])
def test_outputs_under_jit_and_vmap(remat):
    init, (a, b) = inputs(11)
    want = jax.vmap(lambda a: jax.lax.scan(lambda c, a: step(c, (a, b)), init, a))(
        jnp.stack([a, 2 * a])
    )
    got = jax.jit(
        jax.vmap(
            lambda a: scanax.scan(step, init, (a, b), in_axes=(0, None), remat=remat)
        )
    )(jnp.stack([a, 2 * a]))
    close(got, want)


def test_length_zero_and_no_outputs():
    carry, ys = scanax.scan(lambda c, x: (c + 1, None), 0.0, length=0, remat="sqrt")
    assert float(carry) == 0.0 and ys is None
    carry, ys = scanax.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(7), remat="sqrt")
    assert float(carry) == 7.0 and ys is None


@pytest.mark.parametrize("n, c", [(1, 1), (2, 2), (4, 2), (5, 3), (9, 3), (10, 4)])
def test_chunk_size(n, c):
    assert chunk_size(n) == c


def checkpoints(fn, *args, param="policy"):
    """The policy (or another ``param``) of every ``jax.checkpoint`` in fn's
    jaxpr, nested ones too."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name in ("remat2", "checkpoint"):  # jax.checkpoint
                found.append(e.params[param])
            for sub in e.params.values():
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("remat", list(REMATS))
def test_remat_checkpoints_the_body(remat):
    """The option really checkpoints (values alone would not show a remat that did
    nothing): one jax.checkpoint of the body with the policy given, or, for
    "sqrt", one per chunk of steps (16 steps: a scan over 4 chunks)."""
    init, xs = inputs(16)
    found = checkpoints(lambda i, x: ours(i, x, REMATS[remat]), init, xs)
    want = None if REMATS[remat] in (True, "sqrt") else REMATS[remat]
    assert found == [want]
    assert checkpoints(lambda i, x: ours(i, x, False), init, xs) == []


def test_in_loop():
    """Every step inside the scan's loop: not unrolled into straight-line
    code (fully, or a remainder after the loop), at least two trips."""
    from scanax._remat import in_loop

    assert in_loop(1, 2) and in_loop(False, 16) and in_loop(2, 8) and in_loop(4, 8)
    assert not in_loop(True, 16) and not in_loop(1, 1) and not in_loop(8, 8)
    assert not in_loop(3, 8) and not in_loop(16, 8)
    assert not in_loop(True, 0) and not in_loop(1, 0) and not in_loop(True, 1)


@pytest.mark.parametrize("unroll", [True, 1, 2])
def test_an_empty_scan_with_remat_is_lax_scans(unroll):
    """No steps, checkpointed, any unroll: what ``lax.scan`` gives (the CSE
    rule divided by a zero length when unrolled fully)."""
    body = lambda c, x: (c + x, c * x)
    xs = jnp.zeros((0, 3))
    want = jax.lax.scan(body, jnp.ones(3), xs, unroll=unroll)
    got = scanax.scan(body, jnp.ones(3), xs, remat=True, unroll=unroll)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, want)
    assert got[1].shape == (0, 3)


@pytest.mark.parametrize(
    "remat, n, unroll, want",
    [
        (True, 16, 1, [False]),  # (inside the loop: CSE cannot undo it)
        (True, 16, 4, [False]),
        (True, 16, True, [True]),  # (straight-line code: prevented)
        (True, 16, 3, [True]),  # (a remainder after the loop)
        (True, 1, 1, [True]),  # (a loop of one trip, removed)
        ("sqrt", 16, 1, [False]),  # (4 chunks of 4 in the outer scan)
        ("sqrt", 13, 1, [False, True]),  # (3 chunks of 4, then a tail of 1)
    ],
)
def test_checkpoints_prevent_cse_only_outside_a_loop(remat, n, unroll, want):
    """``jax.checkpoint`` needs ``prevent_cse`` only where its recomputation
    could be merged with the forward pass: in straight-line code (an unrolled
    scan, a loop of one trip, the tail chunk of ``remat="sqrt"``), not inside
    a loop. Values and gradients are the plain scan's either way."""
    init, xs = inputs(n)
    fn = lambda i, x: ours(i, x, remat, unroll=unroll)
    assert checkpoints(fn, init, xs, param="prevent_cse") == want
    close(jax.grad(fn)(init, xs), jax.grad(plain)(init, xs))


def test_sqrt_is_nested_scans():
    init, xs = inputs(16)
    jaxpr = jax.make_jaxpr(lambda i, x: ours(i, x, "sqrt"))(init, xs)
    outer = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(outer) == 1 and outer[0].params["length"] == 4


def test_sqrt_cuts_gradient_memory():
    d, n = 16, 1000

    def loss(h, a, remat):
        def body(h, a):
            h = jnp.tanh(h * 0.9 + a)
            return h, jnp.sum(h)

        h, ys = scanax.scan(body, h, a, remat=remat)
        return jnp.sum(h) + jnp.sum(ys)

    def temp(remat):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
        compiled = grad.lower(jnp.ones(d), jnp.ones((n, d)), remat).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain_bytes, sqrt_bytes = temp(False), temp("sqrt")
    assert sqrt_bytes <= 0.3 * plain_bytes, (sqrt_bytes, plain_bytes)


@pytest.mark.parametrize(
    "bad, err, match",
    [
        ("half", ValueError, r'scanax.scan: `remat` must be False, True, "sqrt" or a'),
        (3, TypeError, r"scanax.scan: `remat` must be .* got int 3"),
    ],
)
def test_bad_remat(bad, err, match):
    with pytest.raises(err, match=match):
        scanax.scan(lambda c, x: (c, None), 0.0, length=3, remat=bad)


@pytest.mark.parametrize(
    "factory", ["save_only_these_names", "save_any_names_but_these"]
)
def test_an_uncalled_policy_factory_is_named(factory):
    """``jax.checkpoint_policies.save_only_these_names`` makes a policy; passed
    uncalled it was JAX's "unexpected keyword argument 'out_dtype'" from
    inside the gradient. Named before anything is traced, for scan and Stack;
    called, it is a policy like any other (the gradient equals the plain
    scan's)."""
    make = getattr(jax.checkpoint_policies, factory)
    xs = jnp.linspace(0.1, 1.0, 5)

    def step(c, x):
        return jnp.tanh(c * x), c

    def loss(h, remat):
        return scanax.scan(step, h, xs, remat=remat)[1].sum()

    with pytest.raises(
        TypeError, match=rf"(?s)scanax.scan: `remat` is .*{factory}.*Fix: call it"
    ):
        jax.grad(loss)(1.0, make)
    with pytest.raises(TypeError, match=rf"scanax.Stack: `remat` is .*{factory}"):
        scanax.Stack([lambda x: x, lambda x: x], remat=make)
    want = jax.grad(lambda h: jax.lax.scan(step, h, xs)[1].sum())(1.0)
    np.testing.assert_allclose(jax.grad(loss)(1.0, make("a")), want, rtol=1e-6)
