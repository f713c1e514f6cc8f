"""scanax.linear_scan against plain Python loops: values and gradients, every method."""

import collections
import functools as ft
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scanax._linear_scan import linear_scan, resolve_method

T, B, D = 7, 2, 3
METHODS = ["sequential", "associative", "chunked"]
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
jit = ft.partial(jax.jit, compiler_options=FAST)


@pytest.fixture(autouse=True)
def _strict():
    """scanax's own code never relies on implicit dtype promotion."""
    with jax.numpy_dtype_promotion("strict"):
        yield


def close(a, b, tol):
    helpers.close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------- reference


def ref(a, b, h0=None, *, axis=0, reverse=False, reset=None, seq_lengths=None):
    """The recurrence one step at a time (works on NumPy and jnp arrays alike)."""
    xp = jnp if isinstance(b, jax.Array) else np
    b = xp.moveaxis(b, axis, 0)
    shape = b.shape
    a = xp.moveaxis(xp.broadcast_to(a, xp.moveaxis(b, 0, axis).shape), axis, 0)
    h = xp.zeros(shape[1:], b.dtype) if h0 is None else h0
    if reset is not None:
        reset = np.moveaxis(
            np.broadcast_to(
                np.reshape(reset, reset.shape + (1,) * (len(shape) - reset.ndim)),
                np.moveaxis(np.zeros(shape), 0, axis).shape,
            ),
            axis,
            0,
        )
    lengths = None
    if seq_lengths is not None:
        lengths = np.broadcast_to(
            np.reshape(
                seq_lengths, seq_lengths.shape + (1,) * (b.ndim - 1 - seq_lengths.ndim)
            ),
            shape[1:],
        )
    hs = [None] * shape[0]
    for t in reversed(range(shape[0])) if reverse else range(shape[0]):
        new = a[t] * h + b[t]
        if reset is not None:
            new = xp.where(reset[t], b[t], new)
        h = new if lengths is None else xp.where(t < lengths, new, h)
        hs[t] = h
    hs = xp.stack(hs) if hs else xp.zeros(shape, b.dtype)
    return xp.moveaxis(hs, 0, axis), h


def data(dtype=np.float32, shape=(T, B, D), a_shape=None, seed=0, axis=0):
    rng = np.random.default_rng(seed)
    a_shape = shape if a_shape is None else a_shape
    a = rng.uniform(0.5, 1.0, a_shape)
    b = rng.normal(size=shape)
    h0 = rng.normal(size=shape[:axis] + shape[axis + 1 :])
    if np.issubdtype(dtype, np.complexfloating):
        a = a * np.exp(1j * rng.uniform(-1, 1, a_shape))
        b = b + 1j * rng.normal(size=shape)
        h0 = h0 + 1j * rng.normal(size=h0.shape)
    return a.astype(dtype), b.astype(dtype), h0.astype(dtype)


def loss(out):
    h, last = out
    return jnp.sum(jnp.abs(h) ** 2) + jnp.sum(jnp.real(last) + jnp.imag(last))


def grads(fn, a, b, h0):
    return jit(jax.value_and_grad(lambda *x: loss(fn(*x)), argnums=(0, 1, 2)))(a, b, h0)


# ---------------------------------------------------------------------------- values


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.complex64])
@pytest.mark.parametrize("method", METHODS)
def test_float32_matches_float64_loop(method, dtype, reverse):
    a, b, h0 = data(dtype)
    h, last = jit(ft.partial(linear_scan, method=method, reverse=reverse))(a, b, h0)
    wide = np.complex128 if dtype == np.complex64 else np.float64
    want = ref(a.astype(wide), b.astype(wide), h0.astype(wide), reverse=reverse)
    assert h.dtype == dtype and last.dtype == dtype
    np.testing.assert_allclose(h, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, want[1], rtol=1e-5, atol=1e-6)


# XLA:TPU has no complex128 arithmetic: its compiler stops on an internal layout
# check (seen on a TPU v5e, jax 0.10.2), for any program of complex128 values,
# ours and the reference loop's alike. float64 runs there.
_COMPLEX128 = pytest.param(
    np.complex128,
    marks=pytest.mark.skipif(
        jax.default_backend() == "tpu", reason="XLA:TPU compiles no complex128"
    ),
)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, _COMPLEX128])
@pytest.mark.parametrize("method", METHODS)
def test_values_and_gradients_in_float64(method, dtype, reverse):
    with jax.enable_x64(True):
        a, b, h0 = (jnp.asarray(x) for x in data(dtype))
        ours = grads(ft.partial(linear_scan, method=method, reverse=reverse), a, b, h0)
        want = grads(ft.partial(ref, reverse=reverse), a, b, h0)
        assert ours[1][0].dtype == dtype
        close(ours, want, 1e-10)


@pytest.mark.parametrize(
    "method, a_shape",
    [("sequential", s) for s in [(), (D,), (1, 1, D), (T, 1, D), (B, D)]]
    + [(m, s) for m in METHODS[1:] for s in [(D,), (T, 1, D)]],
)
def test_broadcast_a(method, a_shape):
    a, b, h0 = data(a_shape=a_shape)
    fn = ft.partial(linear_scan, method=method)
    ref_fn = lambda a, b, h0: ref(jnp.broadcast_to(a, b.shape), b, h0)
    close(grads(fn, a, b, h0), grads(ref_fn, a, b, h0), 1e-5)


def test_python_number_a_and_default_h0():
    _, b, _ = data()
    h, last = linear_scan(0.9, b)
    close((h, last), ref(np.float32(0.9), b), 1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_python_number_a_keeps_its_precision_with_16_bit_b(dtype):
    """A decay of 0.999 is float32 as the accumulation is (before: rounded to
    b's bfloat16, where 0.999 is 1.0: a sum instead of a decay)."""
    b = jnp.ones((1000, 2), dtype)
    _, last = linear_scan(0.999, b)
    want = ref(np.float32(0.999), np.ones((1000, 2), np.float32))[1]
    # (b's dtype's output rounding: 1/256 and 1/2048 of the value)
    close(last.astype(jnp.float32), want, 5e-3 if dtype == jnp.bfloat16 else 1e-3)
    assert last.dtype == dtype


@pytest.mark.parametrize("method", METHODS)
def test_batch_major_axis(method):
    a, b, h0 = data(shape=(B, T, D), a_shape=(T, D), axis=1)
    h, last = jit(ft.partial(linear_scan, axis=1, method=method))(a, b, h0)
    close((h, last), ref(a, b, h0, axis=1), 1e-5)
    # the same as time-major
    h_tm, _ = linear_scan(a[:, None], jnp.swapaxes(b, 0, 1), h0, method=method)
    close(h, jnp.swapaxes(h_tm, 0, 1), 1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
def test_chunk_sizes(chunk):
    a, b, h0 = data()
    fn = ft.partial(linear_scan, method="chunked", chunk=chunk)
    close(grads(fn, a, b, h0), grads(ref, a, b, h0), 1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_length_zero(method):
    a, b, h0 = data(shape=(0, B, D), a_shape=(D,))
    h, last = linear_scan(a, b, h0, method=method)
    assert h.shape == (0, B, D)
    close(last, h0, 0)


# ---------------------------------------------------------------------------- reset, lengths


@pytest.mark.parametrize(
    "reset_shape, reverse",
    [((T,), False), ((T, B), True), ((T, 1), False), ((T, B, D), True)],
    ids=["[T]", "[T, B]-reverse", "[T, 1]", "[T, B, D]-reverse"],
)
@pytest.mark.parametrize("method", METHODS)
def test_reset(method, reverse, reset_shape):
    a, b, h0 = data()
    reset = np.random.default_rng(1).uniform(size=reset_shape) < 0.3
    fn = ft.partial(linear_scan, method=method, reverse=reverse, reset=reset)
    ref_fn = ft.partial(ref, reverse=reverse, reset=reset)
    close(grads(fn, a, b, h0), grads(ref_fn, a, b, h0), 1e-5)


def test_reset_batch_major_restarts_at_the_flag():
    a, b, _ = data(shape=(B, T, D), a_shape=(D,))
    reset = np.zeros((B, T), bool)
    reset[1, 4] = True
    h, _ = linear_scan(a, b, axis=1, reset=reset)
    alone, _ = linear_scan(a, b[1, 4:])  # sequence 1 restarted at step 4
    close(h[1, 4:], alone, 1e-6)
    close(h[0], linear_scan(a, b[0])[0], 1e-6)  # sequence 0 not reset


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_seq_lengths_each_sequence_alone(method, reverse):
    a, b, h0 = data(a_shape=(D,))
    lengths = np.array([T, 4], np.int32)
    h, last = jit(
        ft.partial(linear_scan, method=method, reverse=reverse, seq_lengths=lengths)
    )(a, b, h0)
    for i, n in enumerate(lengths):
        h_i, last_i = ref(a, b[:n, i], h0[i], reverse=reverse)
        close(last[i], last_i, 1e-5)
        close(h[:n, i], h_i, 1e-5)
        held = h_i[-1] if not reverse else h0[i]  # padding holds the state
        close(h[n:, i], np.broadcast_to(held, h[n:, i].shape), 1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_seq_lengths_with_reset_gradients(method):
    a, b, h0 = data()
    lengths = np.array([6, 0], np.int32)
    reset = np.zeros(T, bool)
    reset[3] = True
    kw = dict(reset=reset, seq_lengths=lengths)
    fn = ft.partial(linear_scan, method=method, **kw)
    close(grads(fn, a, b, h0), grads(ft.partial(ref, **kw), a, b, h0), 1e-5)
    assert np.allclose(linear_scan(a, b, h0, **kw)[1][1], h0[1])  # length 0: h0


def test_seq_lengths_batch_major():
    a, b, h0 = data(shape=(B, T, D), a_shape=(D,), axis=1)
    lengths = np.array([3, T], np.int32)
    h, last = linear_scan(a, b, h0, axis=1, seq_lengths=lengths)
    close((h, last), ref(a, b, h0, axis=1, seq_lengths=lengths), 1e-5)


# ---------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("method", METHODS)
def test_vmap_matches_batched_call(method):
    a, b, h0 = data(np.complex64)
    lengths = np.array([5, 7, 3], np.int32)
    fn = lambda a, b, h0, n: linear_scan(a, b, h0, method=method, seq_lengths=n)
    # vmap over D (an axis linear_scan does not see) and over a stack of calls
    mapped = jit(jax.vmap(fn, in_axes=(2, 2, 1, None), out_axes=(2, 1)))
    close(mapped(a, b, h0, lengths[:B]), fn(a, b, h0, lengths[:B]), 1e-6)
    calls = jit(jax.vmap(fn, in_axes=(None, None, None, 0)))(a, b, h0, lengths)
    for i, n in enumerate(lengths):
        close(jax.tree.map(lambda x: x[i], calls), fn(a, b, h0, n), 1e-6)


def test_grad_of_vmap():
    a, b, h0 = data()
    fn = lambda a, b, h0: jax.vmap(ft.partial(linear_scan, method="associative"))(
        a, b, h0
    )
    ref_fn = lambda a, b, h0: jax.vmap(ref)(a, b, h0)
    a, h0 = np.broadcast_to(a, (4,) + a.shape), np.broadcast_to(h0, (4,) + h0.shape)
    b = np.stack([b * (i + 1) for i in range(4)])
    close(grads(fn, a, b, h0), grads(ref_fn, a, b, h0), 1e-5)


def test_eager_calls_compile_once():
    a, b, h0 = data()
    linear_scan(a, b, h0)
    with helpers.count_compiles() as c:
        h, _ = linear_scan(a * 0.5, b + 1, h0)
    assert c.n == 0
    close(h, ref(a * 0.5, b + 1, h0)[0], 1e-5)


# ---------------------------------------------------------------------------- dtypes


def test_dtype_rules():
    a, b, h0 = data()
    ca, _, _ = data(np.complex64)
    h, last = linear_scan(ca, b)  # complex a, real b: complex h
    assert h.dtype == last.dtype == jnp.complex64
    close(h, ref(ca.astype(np.complex128), b.astype(np.complex128))[0], 1e-5)
    h, _ = linear_scan(a, b.astype(jnp.bfloat16))  # accumulated in float32
    assert h.dtype == jnp.bfloat16
    want = ref(a.astype(np.float64), b.astype(jnp.bfloat16).astype(np.float64))[0]
    np.testing.assert_allclose(np.asarray(h, np.float32), want, rtol=1e-2, atol=1e-2)


def test_float64_numpy_input_without_x64_is_float32_quietly():
    """NumPy float64 data with x64 off (the default): float32 as JAX makes
    it, without JAX's "float64 not available" warnings (it had warned twice:
    review 2026-12-07; the suite's warnings are errors)."""
    a, b = np.full(3, 0.5), np.ones((4, 3))
    h, last = linear_scan(a, b)
    assert h.dtype == last.dtype == jnp.float32
    close(h, ref(a, b)[0], 1e-6)


def test_acc_dtype_float64():
    with jax.enable_x64(True):
        a, b, _ = data()
        b = np.concatenate(
            [np.full((1, B, D), 1e8, np.float32), np.ones((T, B, D), np.float32)]
        )
        a = np.ones(D, np.float32)
        _, wide = linear_scan(a, b, acc_dtype=jnp.float64)
        assert wide.dtype == jnp.float32
        np.testing.assert_allclose(wide, np.float32(1e8 + T), rtol=0)


# ---------------------------------------------------------------------------- auto


def test_auto_rule(monkeypatch):
    from scanax import _linear_scan

    monkeypatch.setattr(_linear_scan, "device_bytes", lambda: 4 * 2**30)
    assert resolve_method("auto", 16384, "cpu") == "sequential"
    assert resolve_method("auto", 4096, "gpu", nbytes=2**20) == "associative"
    assert resolve_method("auto", 2, "gpu", nbytes=8) == "associative"
    assert resolve_method("auto", 1, "gpu", nbytes=8) == "sequential"
    # 11 arrays of b's size must fit in a quarter of the device: 1 GiB here
    assert resolve_method("auto", 4096, "gpu", nbytes=2**30 // 11) == "associative"
    assert resolve_method("auto", 4096, "gpu", nbytes=2**30 // 11 + 1) == "chunked"
    assert resolve_method("auto", 4096, "tpu") == "chunked"
    assert resolve_method("auto", 255, "tpu") == "sequential"
    assert resolve_method("associative", 10, "cpu") == "associative"
    monkeypatch.setattr(_linear_scan._backend, "platform", lambda: "gpu")
    assert resolve_method("auto", 4096, nbytes=2**20) == "associative"


def _program(method, *args, **kw):
    fn = jax.jit(lambda a, b: linear_scan(a, b, method=method, **kw))
    return fn.lower(*args).as_text()


def test_auto_is_the_sequential_program_on_cpu(monkeypatch):
    from scanax import _backend

    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    a, b, h0 = data()
    close(linear_scan(a, b, h0), linear_scan(a, b, h0, method="sequential"), 0)
    assert _program("auto", a, b) == _program("sequential", a, b)


@pytest.mark.parametrize("axis", [0, 1])
def test_auto_on_a_gpu_is_the_associative_program_then_chunked(monkeypatch, axis):
    """A GPU's decisions, asked for on any machine: the associative scan, on
    ``b``'s own time axis (no transpose of ``b``), while it fits in memory; the
    chunked scan past that. Values and gradients as the loop's."""
    from scanax import _backend, _linear_scan

    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    a, b, h0 = data(np.float64, shape=(B, T, D) if axis else (T, B, D), axis=axis)
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    assert _program("auto", a, b, axis=axis) == _program("associative", a, b, axis=axis)
    jaxpr = jax.make_jaxpr(lambda a, b: linear_scan(a, b, axis=axis))(a, b)
    names = {e.primitive.name for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns}
    assert "scan" not in names and "transpose" not in names, names
    want = ref(np.float64(a), np.float64(b), axis=axis)
    close(linear_scan(a, b, axis=axis), want, 2e-5)
    g = lambda m: jax.grad(
        lambda a, b: jnp.sum(linear_scan(a, b, axis=axis, method=m)[0] ** 2), (0, 1)
    )(a, b)
    close(g("auto"), g("sequential"), 2e-5)
    monkeypatch.setattr(_linear_scan, "device_bytes", lambda: b.nbytes)
    assert _program("auto", a, b, axis=axis) == _program("chunked", a, b, axis=axis)


def _count(compiled):
    """The compiled program's operations, by name."""
    return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", compiled.as_text()))


@pytest.mark.parametrize("grad", [False, True])
def test_associative_is_the_hand_written_program(grad):
    """``method="associative"`` compiles to the program of the hand-written
    ``lax.associative_scan`` it replaces (the same operations, counted), time
    major, forward and gradient: no copies, casts or transposes of its own."""

    def monoid(earlier, later):
        return later[0] * earlier[0], later[0] * earlier[1] + later[1]

    def hand(a, b):
        return jax.lax.associative_scan(monoid, (jnp.broadcast_to(a, b.shape), b))[1]

    def ours(a, b):
        return linear_scan(a, b, method="associative")[0]

    lam = jnp.full(D, 0.9 + 0.1j, jnp.complex64)
    b = jax.lax.complex(*jax.random.normal(jax.random.key(0), (2, 64, B, D)))
    if grad:
        hand, ours = (
            jax.value_and_grad(lambda a, b, f=f: jnp.sum(jnp.abs(f(a, b)) ** 2), (0, 1))
            for f in (hand, ours)
        )
    ours, hand = (jax.jit(f).lower(lam, b).compile() for f in (ours, hand))
    assert _count(ours) == _count(hand)
    close(ours(lam, b), hand(lam, b), 1e-5)  # (compiled: not op by op)


def test_time_major_on_cpu_only():
    from scanax._linear_scan import time_major

    assert time_major("associative", "cpu") and not time_major("associative", "gpu")
    assert time_major("sequential", "gpu") and time_major("chunked", "tpu")


# ---------------------------------------------------------------------------- errors


def x(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(a=x(D), b=x(T, B, D, dtype=jnp.int32)),
            TypeError,
            r"scanax.linear_scan: `b` must be a floating or complex array .* int32\[7, 2, 3\]",
        ),
        (
            dict(a=x(D, dtype=jnp.int32), b=x(T, D)),
            TypeError,
            r"`a` must be a floating or complex .* int32\[3\]",
        ),
        (
            dict(a=x(4), b=x(T, B, D)),
            ValueError,
            r"(?s)`a` float32\[4\] does not broadcast to b float32\[7, 2, 3\] \(time on axis 0\)"
            r".*time-invariant \[2, 3\] or per-step \[7, 2, 3\].*Fix: reshape a",
        ),
        (
            dict(a=x(T, D, D), b=x(T, D)),
            ValueError,
            r"(?s)`a` float32\[7, 3, 3\] looks like a \[3, 3\] matrix per state, but b is "
            r"float32\[7, 3\]: linear_scan only runs diagonal .*Fix: diagonalise",
        ),
        (dict(a=x(D, D), b=x(T, D)), ValueError, r"looks like a \[3, 3\] matrix"),
        (
            dict(a=x(D), b=x(T, B, D), h0=x(T, D)),
            ValueError,
            r"(?s)`h0` float32\[7, 3\] must have the shape of b float32\[7, 2, 3\] without its "
            r"time axis 0, \[2, 3\].*Fix: pass h0 of shape \[2, 3\]",
        ),
        (
            dict(a=x(D), b=x(T, D), h0=x(D, dtype=jnp.int32)),
            TypeError,
            r"`h0` must be a floating or complex array, got int32\[3\]",
        ),
        (
            dict(a=x(D), b=x(T, B, D), reset=x(T)),
            TypeError,
            r"`reset` must be a bool array, got float32\[7\]",
        ),
        (
            dict(a=x(D), b=x(T, B, D), reset=x(B, T, dtype=bool)),
            ValueError,
            r"(?s)`reset` bool\[2, 7\] does not fit b float32\[7, 2, 3\] \(time on axis 0\)"
            r".*up to and including time, \[7\].*Fix: pass reset of shape \[7\]",
        ),
        (
            dict(a=x(D), b=x(B, T, D), axis=1, reset=x(B, dtype=bool)),
            ValueError,
            r"`reset` bool\[2\] does not fit .* \[2, 7\]",
        ),
        (
            dict(a=x(D), b=x(T, B, D), seq_lengths=x(B)),
            TypeError,
            r"`seq_lengths` must be an integer array, got float32\[2\]",
        ),
        (
            dict(a=x(D), b=x(T, B, D), seq_lengths=x(T, dtype=jnp.int32)),
            ValueError,
            r"`seq_lengths` int32\[7\] must have one length per sequence: .* a leading "
            r"part of \[2, 3\]",
        ),
        (
            dict(a=x(D), b=x(T, D), method="parallel"),
            ValueError,
            r"`method` must be one of \('auto', 'sequential', 'associative', 'chunked'\), "
            r"got 'parallel'",
        ),
        (
            dict(a=x(D), b=x(T, D), method="chunked", chunk=0),
            ValueError,
            r"`chunk` must be positive, got 0",
        ),
        (
            dict(a=x(D), b=x(T, D), method="chunked", chunk=2.0),
            TypeError,
            r"`chunk` must be a positive Python int or None, got float 2.0",
        ),
        (
            dict(a=x(D), b=x(T, D), method="sequential", chunk=4),
            ValueError,
            r"`chunk` only applies to method='chunked'",
        ),
        (
            dict(a=x(D), b=x(T, D), axis=2),
            ValueError,
            r"axis=2 is not an axis of b float32\[7, 3\]",
        ),
        (
            dict(a=x(D), b=x(T, D), acc_dtype=jnp.int32),
            TypeError,
            r"`acc_dtype` must be a floating dtype",
        ),
    ],
)
def test_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        linear_scan(**kwargs)


def test_errors_before_tracing():
    """Shapes are checked on the arguments: no trace of the recurrence starts."""
    a, b = x(4), x(T, D)
    with helpers.count_compiles() as c, pytest.raises(ValueError, match="broadcast"):
        jax.jit(lambda a, b: linear_scan(a, b))(a, b)
    assert c.n == 0


def test_seq_lengths_out_of_range_are_refused():
    b = jnp.ones((5, 3, 4))
    with pytest.raises(
        ValueError, match=r"(?s)linear_scan: seq_lengths\[2\] is 6, outside 0..5"
    ):
        linear_scan(jnp.full((4,), 0.5), b, seq_lengths=jnp.array([1, 2, 6]))


def test_a_per_batch_decay_as_long_as_time_is_refused_as_ambiguous():
    """b [T, B, D] with T == B: an a of [T, D] is aligned as [1, B, D] (a decay
    per batch row) where [T, 1, D] (per step) may be meant: refused, naming
    both (review 2026-12-06: read silently as per batch)."""
    t = d = 4
    b = jax.random.normal(jax.random.key(0), (t, t, 3))
    a = jax.nn.sigmoid(jax.random.normal(jax.random.key(1), (t, 3)))
    with pytest.raises(
        ValueError,
        match=r"(?s)is ambiguous.*Fix: per step, `a\[:, None\]` \(\[4, 1, 3\]\); the "
        r"same at every step, `a\[None\]` \(\[1, 4, 3\]\)",
    ):
        linear_scan(a, b)
    step, _ = linear_scan(a[:, None], b, method="sequential")
    h = jnp.zeros((t, 3))
    for i in range(t):  # the per-step reading, by a loop
        h = a[i] * h + b[i]
        np.testing.assert_allclose(step[i], h, rtol=1e-5, atol=1e-6)
    linear_scan(a[None], b)  # (per batch row, said so)
    linear_scan(a, jnp.swapaxes(b, 0, 1)[:3], axis=1)  # (batch-major, B != T: per step)
    del d


def test_a_per_sequence_decay_on_batch_major_b_as_long_as_time_is_refused():
    """b [B, T, D] with B == T: an a of [B, D] meant per sequence lines up
    with [T, D] (per step) on the last axis: refused, naming both; each fix
    equals its loop. B != T keeps [T, D] per step (review 2026-12-07: read
    silently as per step)."""
    t, d = 4, 3
    b = jax.random.normal(jax.random.key(0), (t, t, d))
    a = jax.nn.sigmoid(jax.random.normal(jax.random.key(1), (t, d)))
    with pytest.raises(
        ValueError,
        match=r"(?s)is ambiguous.*may be meant per sequence.*Fix: per step, "
        r"`a\[None\]` \(\[1, 4, 3\]\); the same at every step, `a\[:, None\]` "
        r"\(\[4, 1, 3\]\)",
    ):
        linear_scan(a, b, axis=1)
    step, _ = linear_scan(a[None], b, axis=1, method="sequential")
    per_seq, _ = linear_scan(a[:, None], b, axis=1, method="sequential")
    h_step = h_seq = jnp.zeros((t, d))
    for i in range(t):  # both readings, by a loop
        h_step = a[i] * h_step + b[:, i]
        h_seq = a * h_seq + b[:, i]
        np.testing.assert_allclose(step[:, i], h_step, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(per_seq[:, i], h_seq, rtol=1e-5, atol=1e-6)
    other, _ = linear_scan(a, b[:3], axis=1, method="sequential")  # B != T
    np.testing.assert_allclose(other, step[:3], rtol=1e-6)
