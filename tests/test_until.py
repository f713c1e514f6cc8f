import functools as ft

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scanax


def step(c, x):
    h, s = c
    a, w = x
    h = h * w + a
    return (h, s + jnp.sum(h)), (jnp.sum(h), h)


def until(c):
    return c[1] > 6.0


def inputs(n):
    h = jnp.array([0.1, -0.2])
    a = jnp.cos(jnp.arange(2 * n, dtype=jnp.float32)).reshape(n, 2) + 0.5
    return (h, jnp.float32(0.0)), (a, jnp.float32(0.9))


def python_loop(init, xs, reverse=False, n_steps=None):
    """The reference: a Python loop with `break` (or exactly `n_steps` steps)."""
    a, w = xs
    n = a.shape[0]
    order = range(n - 1, -1, -1) if reverse else range(n)
    carry, ys, steps = init, [None] * n, 0
    for i in order:
        if n_steps is not None and steps == n_steps:
            break
        carry, ys[i] = step(carry, (a[i], w))
        steps += 1
        if n_steps is None and bool(until(carry)):
            break
    y0 = jax.tree.map(jnp.zeros_like, step(init, (a[0], w))[1])
    ys = [y0 if y is None else y for y in ys]
    return carry, jax.tree.map(lambda *leaves: jnp.stack(leaves), *ys), steps


def ours(init, xs, reverse=False, **kw):
    return scanax.scan_until(
        step, init, xs, reverse=reverse, until=until, in_axes=(0, None), **kw
    )


close = ft.partial(helpers.close, rtol=2e-5, atol=1e-6, structure=False)


@pytest.mark.parametrize("n", [1, 3, 8, 30])
@pytest.mark.parametrize("reverse", [False, True])
def test_equals_python_loop_with_break(n, reverse):
    init, xs = inputs(n)
    carry, ys, steps = ours(init, xs, reverse)
    want_carry, want_ys, want_steps = python_loop(init, xs, reverse)
    close((carry, ys), (want_carry, want_ys))
    assert steps.dtype == jnp.int32 and int(steps) == want_steps


def test_stops_early_and_never():
    init, xs = inputs(30)
    assert 1 < int(ours(init, xs)[2]) < 30  # the case above stops in the middle
    never = scanax.scan_until(
        lambda c, x: (c + x, c), 0.0, jnp.ones(5), until=lambda c: c > 100
    )
    assert int(never[2]) == 5 and float(never[0]) == 5.0
    first = scanax.scan_until(
        lambda c, x: (c + x, c), 0.0, jnp.ones(5), until=lambda c: True
    )
    assert int(first[2]) == 1 and first[1].tolist() == [0.0, 0, 0, 0, 0]


def test_length_zero():
    carry, ys, steps = scanax.scan_until(
        lambda c, x: (c + 1, c), 0.0, length=0, until=lambda c: c > 1
    )
    assert float(carry) == 0.0 and ys.shape == (0,) and int(steps) == 0


@pytest.mark.parametrize("reverse", [False, True])
def test_gradients(reverse):
    init, xs = inputs(30)
    n_steps = int(ours(init, xs, reverse)[2])

    def loss(fn):
        def value(init, w):
            carry, ys, *_ = fn(init, (xs[0], w))
            return jnp.sum(carry[0]) + carry[1] + jnp.sum(ys[0]) + jnp.sum(ys[1] ** 2)

        return jax.value_and_grad(value, argnums=(0, 1))(init, xs[1])

    want = loss(lambda i, x: python_loop(i, x, reverse, n_steps))
    close(loss(lambda i, x: ours(i, x, reverse)), want)
    close(loss(jax.jit(lambda i, x: ours(i, x, reverse))), want)
    close(loss(jax.jit(lambda i, x: ours(i, x, reverse, unroll=3))), want)


@pytest.mark.parametrize(
    "remat", [True, "sqrt", jax.checkpoint_policies.nothing_saveable]
)
@pytest.mark.parametrize("reverse", [False, True])
def test_remat_values_and_gradients(remat, reverse):
    """remat changes what the differentiated scan stores, not what it computes:
    values and gradients equal the Python loop (30 steps: √T chunks of 6)."""
    init, xs = inputs(30)
    n_steps = int(ours(init, xs, reverse)[2])
    assert 0 < n_steps < 30

    def loss(fn):
        def value(init, w):
            carry, ys, *_ = fn(init, (xs[0], w))
            return jnp.sum(carry[0]) + carry[1] + jnp.sum(ys[1] ** 2)

        return jax.value_and_grad(value, argnums=(0, 1))(init, xs[1])

    want = loss(lambda i, x: python_loop(i, x, reverse, n_steps))
    close(loss(jax.jit(lambda i, x: ours(i, x, reverse, remat=remat))), want)
    close(ours(init, xs, reverse, remat=remat), python_loop(init, xs, reverse))


def test_remat_sqrt_lowers_gradient_memory():
    """remat="sqrt" stores O(√T) carries in the differentiated scan (T = 1000,
    stopping late): compiled temp memory of the gradient well under the plain one."""
    h0 = jnp.zeros((8, 64))
    w = jnp.eye(64) * 0.5

    def grad_fn(remat):
        def value(h0, w):
            def body(h, x):
                return jnp.tanh(h @ w + x), None

            h, _, _ = scanax.scan_until(
                body,
                h0,
                jnp.ones((1000, 64)) * 1e-3,
                until=lambda h: jnp.mean(h) > 10.0,
                remat=remat,
            )
            return jnp.sum(h)

        return jax.jit(jax.grad(value, argnums=1)).lower(h0, w).compile()

    plain, sqrt = grad_fn(False), grad_fn("sqrt")
    ratio = (
        sqrt.memory_analysis().temp_size_in_bytes
        / plain.memory_analysis().temp_size_in_bytes
    )
    assert ratio < 0.3
    np.testing.assert_allclose(sqrt(h0, w), plain(h0, w), rtol=1e-5)


def test_bad_remat():
    with pytest.raises(ValueError, match=r"^scanax\.scan_until: `remat` must be False"):
        ours(*inputs(3), remat="sqr")


def test_gradient_through_closure_and_forward_mode():
    def run(p):
        carry, _, steps = scanax.scan_until(
            lambda c, x: (c * p + x, None), 1.0, jnp.ones(20), until=lambda c: c > 5.0
        )
        return carry

    def reference(p, n):
        c = 1.0
        for _ in range(n):
            c = c * p + 1.0
        return c

    n = int(
        scanax.scan_until(
            lambda c, x: (c * 1.2 + x, None), 1.0, jnp.ones(20), until=lambda c: c > 5
        )[2]
    )
    assert n == 3
    g = jax.grad(run)(1.2)
    np.testing.assert_allclose(g, jax.grad(reference)(1.2, n), rtol=1e-5)
    _, t = jax.jvp(run, (1.2,), (1.0,))
    np.testing.assert_allclose(t, g, rtol=1e-5)


def test_without_gradients_it_is_a_while_loop():
    init, xs = inputs(30)
    jaxpr = str(jax.make_jaxpr(lambda i: ours(i, xs))(init))
    assert "while" in jaxpr and "scan" not in jaxpr
    calls = []

    def counted(c, x):
        jax.debug.callback(lambda: calls.append(1))
        return step(c, x)

    carry, ys, steps = scanax.scan_until(
        counted, init, xs, until=until, in_axes=(0, None)
    )
    assert len(calls) == int(steps) < 30  # the steps after the stop never run


def test_vmap():
    init, xs = inputs(30)
    scale = jnp.array([0.5, 1.0, 2.0])

    def one(s):
        return ours((init[0] * s, init[1]), (xs[0] * s, xs[1]))

    got = jax.vmap(one)(scale)
    for k, s in enumerate(scale):
        want = python_loop((init[0] * s, init[1]), (xs[0] * s, xs[1]))
        close(jax.tree.map(lambda a: a[k], got[:2]), want[:2])
        assert int(got[2][k]) == want[2]


def test_nnx_carry():
    nnx = pytest.importorskip("flax.nnx")

    class Acc(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(()))

    def body(m, x):
        m.total.value = m.total.value + x
        return m, m.total.value

    m = Acc()
    out, ys, steps = scanax.scan_until(
        body, m, jnp.arange(10.0), until=lambda m: m.total.value > 5
    )
    assert out is m and float(m.total.value) == 6.0 and int(steps) == 4


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (
            lambda c: c,
            TypeError,
            r"scanax.scan_until: `until\(carry\)` must return a scalar bool "
            r"\(bool\[\]\), got float32\[3\]",
        ),
        (
            lambda c: c > 0,
            TypeError,
            r"`until\(carry\)` must return a scalar bool \(bool\[\]\), got bool\[3\]",
        ),
        (
            lambda c: None,
            TypeError,
            r"`until\(carry\)` must return a scalar bool \(bool\[\]\), got a non-array",
        ),
        (3, TypeError, r"scanax.scan_until: `until` must be a function"),
    ],
)
def test_bad_until(bad, err, match):
    with pytest.raises(err, match=match):
        scanax.scan_until(lambda c, x: (c, None), jnp.zeros(3), length=3, until=bad)


@pytest.mark.parametrize(
    "order",
    ["vmap(grad)", "grad(vmap)", "grad(jit(vmap))", "vmap(grad(jit))"],
)
def test_gradients_with_vmap(order):
    def run(p):
        carry, _, _ = scanax.scan_until(
            lambda c, x: (c * p + x, c), 1.0, jnp.ones(20), until=lambda c: c > 5.0
        )
        return carry

    def reference(p):
        n = {1.1: 4, 1.2: 3, 1.5: 3}[round(float(p), 1)]  # steps until c > 5
        return jax.grad(lambda p: ft.reduce(lambda c, _: c * p + 1.0, range(n), 1.0))(p)

    ps = jnp.array([1.1, 1.2, 1.5])
    fns = {
        "vmap(grad)": jax.vmap(jax.grad(run)),
        "grad(vmap)": jax.grad(lambda ps: jax.vmap(run)(ps).sum()),
        "grad(jit(vmap))": jax.grad(jax.jit(lambda ps: jax.vmap(run)(ps).sum())),
        "vmap(grad(jit))": jax.vmap(jax.grad(jax.jit(run))),
    }
    np.testing.assert_allclose(fns[order](ps), [reference(p) for p in ps], rtol=1e-5)
