import functools as ft

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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
    # (called eagerly, the folded constant comes back as the jax.Array a
    # compiled call gives: review, a JAX literal class that had no
    # block_until_ready)
    for out in (carry, ys, steps):
        assert isinstance(out, jax.Array)
        out.block_until_ready()
    assert steps.dtype == jnp.int32


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


# A tanh recurrence h = tanh(h @ W + x) over 1000 steps that stops late: the
# compiled gradient of sum(h**2) for h0 and W, one per remat (shared by tests).
H0, W64 = jnp.full((8, 64), 0.01), jnp.eye(64) * 0.5 + 0.01


@ft.cache
def tanh_grad(remat):
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
        return jnp.sum(h**2)

    return jax.jit(jax.grad(value, argnums=(0, 1))).lower(H0, W64).compile()


def test_remat_sqrt_lowers_gradient_memory():
    """remat="sqrt" stores O(√T) carries in the differentiated scan (T = 1000,
    stopping late): compiled temp memory of the gradient well under the plain one."""
    h0, w = H0, W64
    plain, sqrt = tanh_grad(False), tanh_grad("sqrt")
    ratio = helpers.working_bytes(sqrt) / helpers.working_bytes(plain)
    assert ratio < 0.3
    np.testing.assert_allclose(sqrt(h0, w)[1], plain(h0, w)[1], rtol=1e-5)


def test_stored_linearization_keeps_broadcast_values_once():
    """remat=False stores each step's linearization; a value the step only reads
    (a 64×64 weight, closed over) is kept once, not once per step: temp memory
    of the gradient far under T copies of it, gradients equal remat=True's
    (which stores carries and recomputes each step)."""
    h0, w = H0, W64
    grad_fn = tanh_grad
    saved, recomputed = grad_fn(False), grad_fn(True)
    temp = saved.memory_analysis().temp_size_in_bytes
    # Per step: the carry and the step's own residuals (a few carries' worth),
    # not the weight (eight carries' worth).
    assert temp < 1000 * 4 * h0.nbytes < 1000 * w.nbytes
    close(saved(h0, w), recomputed(h0, w))


def test_a_weight_read_inside_a_jitted_layer_is_kept_once():
    """The residuals of a ``jax.jit``-wrapped layer that depend only on its
    weight are found inside the jit and kept once (memory as lax.scan's
    gradient, not T copies of the weight); gradients equal the masked scan's."""
    w = jnp.eye(128) * 0.5 + 0.001

    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ (2.0 * w))

    def value(h0, w, until_fn):
        h, _, _ = until_fn(h0, w)
        return jnp.sum(h**2)

    def ours(h0, w):
        return scanax.scan_until(
            lambda h, _: (layer(h, w), None), h0, length=100,
            until=lambda h: jnp.mean(h) > 10.0,
        )  # fmt: skip

    h0 = jnp.full((2, 128), 0.01)
    grad = jax.jit(jax.grad(lambda h, w: value(h, w, ours), argnums=(0, 1)))
    temp = grad.lower(h0, w).compile().memory_analysis().temp_size_in_bytes
    assert temp < 10 * w.nbytes  # (T copies would be 100)

    def masked(h0, w):
        h, _ = jax.lax.scan(lambda h, _: (layer(h, w), None), h0, length=100)
        return jnp.sum(h**2)

    close(grad(h0, w), jax.grad(masked, argnums=(0, 1))(h0, w))


def test_linearizations_over_the_budget_store_carries(monkeypatch):
    """Where the ``length`` rows of stored linearizations would exceed the
    budget, the gradient stores carries and recomputes each step (the body runs
    once more per step taken), with the same values."""
    from scanax import _until_grad

    monkeypatch.setattr(_until_grad, "BUDGET", 64)
    (h, s), (a, w) = inputs(30)
    calls = []

    def counted(c, x):  # (nonlinear: its linearization has residuals to store)
        jax.debug.callback(lambda: calls.append(1))
        (h, s), (_, y) = step(c, x)
        return (jnp.sin(h), s), (jnp.sum(h), y)

    def value(init):
        carry, ys, _ = scanax.scan_until(
            counted, init, (a, w), until=until, in_axes=(0, None)
        )
        return jnp.sum(carry[0]) + jnp.sum(ys[1])

    jax.block_until_ready(jax.jit(value)((h, s)))  # forward only: one call a step
    jax.effects_barrier()  # (a debug callback may run after its program: a TPU's do)
    steps = len(calls)
    assert 1 < steps < 30
    calls.clear()
    g = jax.block_until_ready(jax.jit(jax.grad(value))((h, s)))
    jax.effects_barrier()
    assert len(calls) == 2 * steps
    monkeypatch.undo()
    calls.clear()
    close(g, jax.jit(jax.grad(value))((h, s)))
    jax.effects_barrier()
    assert len(calls) == steps


@pytest.mark.parametrize(
    "order",
    ["hessian", "grad of grad", "jacfwd of jacfwd", "jvp of grad", "vmap hessian"],
)
def test_second_order_derivatives_raise_a_named_error(order):
    """Derivatives are first order: a derivative of a derivative gets scanax's
    TypeError, before compiling, instead of custom_linear_solve's."""

    def value(h):
        carry, _, _ = ours((h, jnp.float32(0.0)), inputs(10)[1])
        return jnp.sum(carry[0] ** 2)

    h = inputs(10)[0][0]
    run = {
        "hessian": lambda: jax.hessian(value)(h),
        "grad of grad": lambda: jax.grad(lambda x: jnp.sum(jax.grad(value)(x)))(h),
        "jacfwd of jacfwd": lambda: jax.jacfwd(jax.jacfwd(value))(h),
        "jvp of grad": lambda: jax.jvp(jax.grad(value), (h,), (h,)),
        "vmap hessian": lambda: jax.vmap(jax.hessian(value))(jnp.stack([h, h])),
    }[order]
    with pytest.raises(TypeError, match=r"^scanax\.scan_until: its derivatives are"):
        run()


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
    jax.effects_barrier()  # (a debug callback may run after its program: a TPU's do)
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


# ---------------------------------------------------------------- issue 27: the
# gradient at the cost of the steps taken, against a masked lax.scan


def masked_scan(init, xs, reverse=False, f=step, stop=until, axes=()):
    """The reference: a lax.scan over every step, each step after the stop
    computed and discarded by a jnp.where (its outputs zeros). ``axes``: inside
    shard_map, the manual axes the stop flag and the count vary over."""

    def body(state, x):
        carry, done, steps = state
        new, y = f(carry, x)
        carry = jax.tree.map(lambda a, b: jnp.where(done, a, b), carry, new)
        y = jax.tree.map(lambda v: jnp.where(done, jnp.zeros_like(v), v), y)
        return (carry, done | stop(carry), steps + (~done).astype(jnp.int32)), y

    a, w = xs
    flags = (jnp.zeros((), bool), jnp.zeros((), jnp.int32))
    state = (init, *jax.lax.pcast(flags, axes, to="varying"))
    (carry, _, steps), ys = jax.lax.scan(
        lambda s, a_: body(s, (a_, w)), state, a, reverse=reverse
    )
    return carry, ys, steps


def loss_of(fn):
    def value(init, a, w):
        carry, ys, _ = fn(init, (a, w))
        return jnp.sum(carry[0] ** 2) + carry[1] + jnp.sum(ys[0]) + jnp.sum(ys[1] ** 2)

    return value


exact = ft.partial(helpers.close, rtol=1e-6, atol=1e-6, structure=False)


@pytest.mark.parametrize(
    "x64, remat, reverse",
    [
        (False, False, False),
        (False, "sqrt", True),
        (True, False, True),
        (True, "sqrt", False),
        (True, True, False),
    ],
)
def test_gradients_equal_the_masked_scan(x64, remat, reverse):
    """Values and gradients (init, xs, a broadcast input) equal the masked
    lax.scan's, under jit, in float32 and float64, with and without remat."""
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        (h, s), (a, w) = inputs(30)
        init = (h.astype(dtype), s.astype(dtype))
        a, w = a.astype(dtype), w.astype(dtype)
        fn = ft.partial(ours, reverse=reverse, remat=remat)
        got = jax.jit(jax.value_and_grad(loss_of(fn), argnums=(0, 1, 2)))(init, a, w)
        ref = ft.partial(masked_scan, reverse=reverse)
        want = jax.value_and_grad(loss_of(ref), argnums=(0, 1, 2))(init, a, w)
        exact(got, want)
        assert jax.tree.leaves(got)[0].dtype == dtype
        steps = int(ours(init, (a, w), reverse)[2])
        assert 1 < steps < 30
        # the rows of xs after the stop get no gradient, those before one
        d_a = got[1][1]
        taken = slice(30 - steps, 30) if reverse else slice(0, steps)
        assert jnp.all(jnp.delete(d_a, jnp.arange(30)[taken], axis=0) == 0)
        assert jnp.all(jnp.abs(d_a[taken]).sum(axis=1) > 0)


@pytest.mark.parametrize(
    "order, remat",
    [("vmap(grad)", False), ("grad(vmap)", "sqrt"), ("vmap(jit(grad))", False)],
)
def test_gradients_under_vmap_with_different_stops(remat, order):
    """A batch whose examples stop at different steps: each gradient is its own
    masked scan's."""
    (h, s), (a, w) = inputs(30)
    scale = jnp.array([0.5, 2.0, 3.0])
    fn = ft.partial(ours, remat=remat)
    one = lambda k, init, a: loss_of(fn)(init, a * k, w)
    grad = jax.grad(one, argnums=(1, 2))
    init = (h, s)
    fns = {
        "vmap(grad)": jax.vmap(grad, in_axes=(0, None, None)),
        "grad(vmap)": lambda k, i, a: jax.grad(
            lambda i, a: jax.vmap(one, in_axes=(0, None, None))(k, i, a).sum(),
            argnums=(0, 1),
        )(i, a),
        "vmap(jit(grad))": jax.vmap(jax.jit(grad), in_axes=(0, None, None)),
    }
    got = fns[order](scale, init, a)
    steps = [int(ours(init, (a * k, w))[2]) for k in scale]
    assert len(set(steps)) > 1
    ref_grad = jax.jit(
        jax.grad(lambda i, a, k: loss_of(masked_scan)(i, a * k, w), argnums=(0, 1))
    )
    ref = [ref_grad(init, a, k) for k in scale]
    if order == "grad(vmap)":
        ref = jax.tree.map(lambda *r: sum(r), *ref)
    else:
        ref = jax.tree.map(lambda *r: jnp.stack(r), *ref)
    exact(got, ref)


def test_forward_mode_equals_the_masked_scan():
    (h, s), (a, w) = inputs(30)
    init = (h, s)
    tangents = ((jnp.ones(2), jnp.float32(0.5)), jnp.sin(a), jnp.float32(1.0))
    got = jax.jit(lambda *p: jax.jvp(loss_of(ours), p, tangents))(init, a, w)
    want = jax.jvp(loss_of(masked_scan), (init, a, w), tangents)
    exact(got, want)


@pytest.mark.parametrize("remat, passes", [(False, 1), (True, 2), ("sqrt", 3)])
def test_gradient_runs_only_the_steps_taken(remat, passes):
    """The body runs once per step taken forward (remat=False: its linearization
    stored, so the backward pass does not run it again), with remat=True once
    more per step taken backward (recomputed from the stored carry), twice with
    remat="sqrt" (the segment's recomputation, then its VJP); never for the steps
    after the stop."""
    (h, s), (a, w) = inputs(30)
    calls = []

    def counted(c, x):
        jax.debug.callback(lambda: calls.append(1))
        return step(c, x)

    def value(init):
        carry, ys, steps = scanax.scan_until(
            counted, init, (a, w), until=until, in_axes=(0, None), remat=remat
        )
        return jnp.sum(carry[0]) + jnp.sum(ys[1])

    steps = int(ours((h, s), (a, w))[2])
    g = jax.jit(jax.grad(value))((h, s))
    jax.block_until_ready(g)
    jax.effects_barrier()
    assert steps < 30 and len(calls) == passes * steps


def test_gradient_memory_is_below_the_masked_full_scan():
    """Compiled temp memory of the gradient: the stored carries, below the masked
    lax.scan's residuals of all steps."""
    h0, xs = jnp.zeros((8, 64)), jnp.ones((1000, 64)) * 1e-3
    w = jnp.eye(64) * 0.5

    def body(h, x):
        return jnp.tanh(h @ w + x), None

    def ours_(h0, xs):
        return scanax.scan_until(body, h0, xs, until=lambda h: jnp.mean(h) > 10.0)

    def ref(h0, xs):
        f = lambda c, x: body(c, x[0])
        return masked_scan(h0, (xs, None), f=f, stop=lambda h: jnp.mean(h) > 10.0)

    def temp(fn):
        grad = jax.jit(jax.grad(lambda h, x: jnp.sum(fn(h, x)[0]), argnums=(0, 1)))
        return grad.lower(h0, xs).compile().memory_analysis().temp_size_in_bytes

    assert temp(ours_) <= temp(ref)


# ---------------------------------------------------------------- keep_every, keep


@pytest.mark.parametrize("keep_every, reverse", [(2, False), (4, True)])
def test_keep_every(keep_every, reverse):
    """ys[k - 1::k] of the full outputs (zeros after the stop), gradients too."""
    init, xs = inputs(30)

    def thinned(init, a, w):
        full = ours(init, (a, w), reverse)
        return full[0], jax.tree.map(lambda y: y[keep_every - 1 :: keep_every], full[1])

    def kept(init, a, w):
        return ours(init, (a, w), reverse, keep_every=keep_every)[:2]

    def value(fn):
        return lambda i, a, w: jnp.sum(fn(i, a, w)[1][1] ** 2) + fn(i, a, w)[0][1]

    exact(kept(init, *xs), thinned(init, *xs))
    exact(
        jax.jit(jax.grad(value(kept), argnums=(0, 1)))(init, *xs),
        jax.grad(value(thinned), argnums=(0, 1))(init, *xs),
    )


@pytest.mark.parametrize("keep", ["last", "sum", "mean", jnp.maximum])
@pytest.mark.parametrize("keep_every, remat", [(1, False), (3, "sqrt")])
def test_keep_reductions_equal_scan_of_the_steps_taken(keep, keep_every, remat):
    """A reduction over the steps run equals scanax.scan's over those steps:
    values and gradients."""
    init, (a, w) = inputs(30)
    steps = int(ours(init, (a, w))[2])

    def got(init, a):
        out = ours(init, (a, w), keep_every=keep_every, keep=keep, remat=remat)
        return out[0], out[1]

    def want(init, a):
        return scanax.scan(
            step,
            init,
            (a[:steps], w),
            in_axes=(0, None),
            keep_every=keep_every,
            keep=keep,
        )

    exact(jax.jit(got)(init, a), want(init, a))

    def value(fn):
        return lambda i, a: jnp.sum(fn(i, a)[1][1] ** 2) + jnp.sum(fn(i, a)[1][0])

    exact(
        jax.jit(jax.grad(value(got), argnums=(0, 1)))(init, a),
        jax.jit(jax.grad(value(want), argnums=(0, 1)))(init, a),
    )


def test_keep_reduction_before_any_kept_step_is_zeros():
    out = scanax.scan_until(
        lambda c, x: (c + x, c),
        0.0,
        jnp.ones(10),
        until=lambda c: c > 1.5,
        keep_every=5,
        keep="mean",
    )
    assert int(out[2]) == 2 and float(out[1]) == 0.0


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"keep_every": 0}, ValueError, r"^scanax\.scan_until: `keep_every` must be"),
        ({"keep_every": 1.5}, TypeError, r"^scanax\.scan_until: `keep_every` must"),
        ({"keep": "max"}, ValueError, r"^scanax\.scan_until: `keep` must be"),
        ({"keep": "mean", "out_axes": 1}, ValueError, r"`out_axes` places the step"),
        ({"keep_every": 40, "keep": "last"}, ValueError, r"needs at least one kept"),
        ({"progress": "yes"}, TypeError, r"^scanax\.scan_until: `progress` must be"),
        ({"progress": 0}, ValueError, r"the progress bar's `every` must be"),
    ],
)
def test_bad_options(kw, err, match):
    with pytest.raises(err, match=match):
        ours(*inputs(30), **kw)


# ---------------------------------------------------------------- progress


class FakeBar:
    def __init__(self, total):
        self.total, self.n, self.closed = total, 0, False

    def update(self, k):
        self.n += k

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    from scanax import _progress

    made = []

    def open_bar(spec, total, call, **kw):
        made.append(FakeBar(total))
        return made[-1]

    pytest.importorskip("tqdm")
    monkeypatch.setattr(_progress, "open_bar", open_bar)
    return made


@pytest.mark.parametrize(
    "how, every",
    [("plain", None), ("plain", 1), ("plain", 4)]
    + [(how, 4) for how in ["jit", "grad", "reverse", "remat", "keep", "vmap"]],
)
def test_progress_ends_at_the_stop(bars, every, how):
    init, xs = inputs(30)
    steps = int(ours(init, xs)[2])
    progress = scanax.Progress(every=every)
    run = ft.partial(ours, progress=progress)
    calls = {
        "plain": lambda: run(init, xs),
        "jit": lambda: jax.jit(run)(init, xs),
        "grad": lambda: jax.grad(lambda i: run(i, xs)[0][1])(init),
        "reverse": lambda: run(init, xs, reverse=True),
        "remat": lambda: jax.grad(lambda i: run(i, xs, remat="sqrt")[0][1])(init),
        "keep": lambda: run(init, xs, keep="mean"),
        "vmap": lambda: jax.vmap(lambda k: run(init, (xs[0] * k, xs[1])))(
            jnp.array([1.0, 1.0])
        ),
    }
    out = calls[how]()
    jax.block_until_ready(out)
    want = int(ours(init, xs, reverse=True)[2]) if how == "reverse" else steps
    assert len(bars) == 1 and bars[0].total == 30
    assert bars[0].n == want and bars[0].closed
    if how == "plain":
        helpers.close(out, ours(init, xs), rtol=0, atol=0)


def test_integer_leaves_in_carry_and_xs():
    """Integer leaves (a counter in the carry, indices in xs) have no tangents;
    the float leaves' gradients equal the masked scan's, forward and reverse."""

    def f(c, x):
        h, n = c
        i, a = x
        h = h * 0.9 + a * i.astype(h.dtype)
        return (h, n + i), h

    stop = lambda c: c[1] > 10
    xs = (jnp.arange(12, dtype=jnp.int32), jnp.linspace(0.1, 1.0, 12))
    init = (jnp.float32(0.5), jnp.int32(0))

    def value(fn):
        def v(h0, a):
            (h, _), ys, _ = fn((h0, init[1]), (xs[0], a))
            return h + jnp.sum(ys**2)

        return v

    ours_ = lambda i, x: scanax.scan_until(f, i, x, until=stop)

    def ref(i, x):
        return masked_scan(i, (x, None), f=lambda c, x_: f(c, x_[0]), stop=stop)

    got = jax.jit(jax.value_and_grad(value(ours_), argnums=(0, 1)))(init[0], xs[1])
    want = jax.value_and_grad(value(ref), argnums=(0, 1))(init[0], xs[1])
    exact(got, want)
    tangents = (jnp.float32(1.0), jnp.ones(12))
    exact(
        jax.jvp(value(ours_), (init[0], xs[1]), tangents),
        jax.jvp(value(ref), (init[0], xs[1]), tangents),
    )


def test_length_zero_with_options(bars):
    out = scanax.scan_until(
        lambda c, x: (c + 1.0, c),
        0.0,
        length=0,
        until=lambda c: c > 1,
        keep="sum",
        progress=True,
    )
    assert float(out[0]) == 0.0 and float(out[1]) == 0.0 and int(out[2]) == 0
    assert bars == []


# ---------------------------------------------------------------- weak types


def kind(a):
    return jnp.dtype(a.dtype).name, jax.typeof(a).weak_type


@pytest.mark.parametrize("jit", [False, True])
def test_python_float_init_with_bfloat16_xs(jit):
    """init=0.0 (a weakly typed float32) with bfloat16 xs: the carry becomes
    bfloat16, as lax.scan promotes a weakly typed init (the step was traced at
    float32 and replayed at bfloat16: `lax.mul requires arguments to have the
    same dtypes, got bfloat16, float32`, with or without grad). Values and
    gradients equal the masked scan's; init's gradient is a weak float32, as
    jax.grad gives it."""
    a = jnp.linspace(0.1, 1.0, 8).astype(jnp.bfloat16)
    f = lambda c, x: (c * 0.9 + x, c * 2.0)
    stop = lambda c: c > 2.0

    def value(fn):
        def v(init, a):
            carry, ys, steps = fn(init, a)
            return carry + jnp.sum(ys), steps

        return v

    ours_ = lambda i, a: scanax.scan_until(f, i, a, until=stop)
    ref = lambda i, a: masked_scan(i, (a, None), f=lambda c, x: f(c, x[0]), stop=stop)
    grad = jax.value_and_grad(value(ours_), argnums=(0, 1), has_aux=True)
    got = (jax.jit(grad) if jit else grad)(0.0, a)
    want = jax.value_and_grad(value(ref), argnums=(0, 1), has_aux=True)(0.0, a)
    helpers.close(got, want, rtol=2**-7, atol=0)  # (bfloat16: 8 bits)
    assert 1 < int(got[0][1]) < 8
    types = [kind(g) for g in jax.tree.leaves(got)]  # value, steps, d_init, d_a
    assert types == [kind(w) for w in jax.tree.leaves(want)]
    assert types == [("bfloat16", False), ("int32", False)] + [
        ("float32", True),
        ("bfloat16", False),
    ]
    assert ours_(0.0, a)[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("wrt", ["init", "closed over"])
def test_gradient_of_a_python_float_is_weakly_typed(wrt, jit):
    """The gradient with respect to a Python float (init, or a value the step
    closes over, with a weakly typed carry) is a weak float32, as jax.grad of the
    masked scan (and of a Python loop) gives it, with or without jit. (Without
    jit it was a strong float32: the transpose returned the type it computed,
    not the type the linear solve declares for it.)"""
    a = jnp.zeros(8)
    stop = lambda c: c > 2.0

    def value(fn):
        def v(p):
            init, q = (p, 0.9) if wrt == "init" else (0.5, p)
            f = lambda c, x: (c * q + 1.0, c)
            carry, ys, _ = fn(init, f)
            return carry + jnp.sum(ys)

        return v

    ours_ = lambda i, f: scanax.scan_until(f, i, a, until=stop)
    ref = lambda i, f: masked_scan(i, (a, None), f=lambda c, x: f(c, x[0]), stop=stop)
    p = 0.5 if wrt == "init" else 0.9
    grad = jax.grad(value(ours_))
    got = (jax.jit(grad) if jit else grad)(p)
    want = jax.grad(value(ref))(p)
    exact(got, want)
    assert kind(got) == kind(want) == ("float32", True)


# ---------------------------------------------------------------- shard_map

needs_4 = pytest.mark.skipif(
    jax.device_count() < 4, reason="needs 4 devices (XLA_FLAGS in conftest.py)"
)
AXES = ("b",)
VARY = ft.partial(jax.lax.pcast, axis_name=AXES, to="varying")
SHARD_STOP = lambda c: jnp.sum(c) > 2.15


def shard_step(w):
    def f(c, x):
        c = jnp.tanh(c * w + x) + 0.3
        return c, c * 2.0

    return f


def sharded(fn, init_spec):
    """``fn(init, a, w)`` on 4 shards of the rows of ``a`` (and of ``init``
    unless replicated); ``w`` replicated."""
    mesh = jax.make_mesh((4,), AXES, axis_types=(jax.sharding.AxisType.Auto,))

    def one(init, a, w):
        carry, ys, steps = fn(init, a, w)
        return carry, ys, steps[None]

    specs = (init_spec, P(None, "b"), P())
    out = (P("b"), P(None, "b"), P("b"))
    return jax.shard_map(one, mesh=mesh, in_specs=specs, out_specs=out)


def shard_inputs(init_spec):
    rows = 4 if init_spec == P("b") else 1
    init = jnp.linspace(0.0, 1.2, 2 * rows).reshape(rows, 2)
    a = jnp.cos(jnp.arange(12 * 8, dtype=jnp.float32)).reshape(12, 4, 2) * 0.3 + 0.5
    return init, a, jnp.float32(0.7)


def shard_value(fn, init_spec):
    """A loss of ``fn``'s outputs inside shard_map, and the outputs."""

    def value(init, a, w):
        carry, ys, steps = out = sharded(fn, init_spec)(init, a, w)
        return jnp.sum(carry**2) + jnp.sum(ys * 0.1), out

    return value


@needs_4
@pytest.mark.parametrize(
    "remat, init_spec", [(False, P("b")), ("sqrt", P("b")), (False, P())]
)
def test_inside_shard_map_each_shard_stops_at_its_own_step(remat, init_spec):
    """Inside jax.shard_map (4 shards, each stopping at its own step): values and
    gradients (init, xs, a weight the step closes over, cast to vary) equal the
    masked scan's, under jit. A replicated init is cast to vary (lax.scan asks
    for the jax.lax.pcast). (The step was traced with an invariant slice of xs,
    and the loop's own state was invariant: `pvary is a invariant->variant
    collective`.)"""

    def ours_(init, a, w):
        return scanax.scan_until(
            shard_step(VARY(w)), init, a, until=SHARD_STOP, remat=remat
        )

    def ref(init, a, w):
        init = VARY(init) if init_spec == P() else init
        f = lambda c, x: shard_step(VARY(w))(c, x[0])
        return masked_scan(init, (a, None), f=f, stop=SHARD_STOP, axes=AXES)

    args = shard_inputs(init_spec)
    grad = ft.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    got = jax.jit(grad(shard_value(ours_, init_spec)))(*args)
    want = jax.jit(grad(shard_value(ref, init_spec)))(*args)
    exact(got, want)  # the loss, (carry, ys, steps), the gradients
    steps = got[0][1][2]
    assert len(set(steps.tolist())) > 1 and int(steps.max()) < 12


@needs_4
def test_inside_shard_map_a_closed_over_invariant_value_is_refused():
    """The derivative with respect to a value the step closes over that does not
    vary over the shards (a replicated weight) would need a psum at each step of
    the loop back, which shards that stopped earlier do not run: a named
    TypeError before compiling, saying to cast it; without that derivative it
    runs."""

    def ours_(init, a, w):
        return scanax.scan_until(shard_step(w), init, a, until=SHARD_STOP)

    value = shard_value(ours_, P("b"))
    args = shard_inputs(P("b"))
    with pytest.raises(
        TypeError,
        match=r"^scanax\.scan_until: inside jax\.shard_map each shard stops at its "
        r"own step(?s:.*)float32\[\]  invariant(?s:.*)Fix: .*jax\.lax\.pcast\(w, "
        r"\('b',\), to='varying'\)",
    ):
        jax.grad(value, argnums=2, has_aux=True)(*args)
    got = jax.jit(jax.grad(value, has_aux=True))(*args)

    def ref(init, a, w):
        f = lambda c, x: shard_step(w)(c, x[0])
        return masked_scan(init, (a, None), f=f, stop=SHARD_STOP, axes=AXES)

    exact(got, jax.jit(jax.grad(shard_value(ref, P("b")), has_aux=True))(*args))


@needs_4
@pytest.mark.parametrize("where", ["f", "until"])
def test_inside_shard_map_a_collective_over_the_loop_axes_is_refused(where):
    """Each shard stops at its own step, so a psum in the step (or in `until`)
    would wait for shards that stopped: XLA hung, then aborted the process. A
    named TypeError before compiling instead."""

    def ours_(init, a, w):
        f, stop = shard_step(w), SHARD_STOP
        if where == "f":
            inner = f
            f = lambda c, x: (lambda c, y: (c + 0.01 * jax.lax.psum(c, AXES), y))(
                *inner(c, x)
            )
        else:
            stop = lambda c: jax.lax.psum(jnp.sum(c), AXES) > 8.0
        return scanax.scan_until(f, init, a, until=stop)

    with pytest.raises(
        TypeError,
        match=r"uses a collective over the loop's manual axes \('b',\) \(psum",
    ):
        shard_value(ours_, P("b"))(*shard_inputs(P("b")))


def test_an_until_taking_other_arguments_is_named():
    """``until`` is called with the carry alone: one taking the step's input
    too is named with its signature before anything is traced (it was
    Python's bare TypeError)."""
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.scan_until: `until` is called with the carry alone, "
        r"until\(carry\), but it is until\(c, x\)\.\nFix: take the carry only",
    ):
        scanax.scan_until(
            lambda c, x: (c + 1, c), 0.0, None, length=5, until=lambda c, x: c > 2
        )
