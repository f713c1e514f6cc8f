"""scanax.LRU / scanax.MinGRU in scanax.rnn against Python loops of their steps."""

import functools as ft
import math

import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scanax
from scanax import _cells

nnx = pytest.importorskip("flax.nnx")
from scanax._cells_linear import LRU, MinGRU  # noqa: E402

T, B, D = 5, 2, 2
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
jit = ft.partial(jax.jit, compiler_options=FAST)
# On a TPU even "highest" float32 matmuls are bfloat16 passes, and its float32
# transcendentals (the LRU's exp, cos, sin) differ from a CPU's in the fifth
# digit: the whole-sequence scan and the step-by-step loop, rounded in another
# order, differed by 8e-5 relative there (a TPU v5e). CPU and GPU: 1e-5.
TOL = 2e-4 if jax.default_backend() == "tpu" else 1e-5
close = ft.partial(helpers.close, rtol=TOL, atol=TOL)


@pytest.fixture(autouse=True)
def _strict():
    with jax.numpy_dtype_promotion("strict"):
        yield


def lru(d_in=D, n=5, seed=0):
    return LRU(d_in, n, rngs=nnx.Rngs(seed), r_min=0.5, r_max=0.99)


def mingru(d_in=D, n=4, seed=1):
    return MinGRU(d_in, n, rngs=nnx.Rngs(seed))


def mixed():
    """GRU -> LRU -> MinGRU, widths 2 -> 4 -> 4 (an LRU keeps its width) -> 3."""
    return (
        nnx.GRUCell(D, 4, rngs=nnx.Rngs(0)),
        LRU(4, 6, rngs=nnx.Rngs(1), r_min=0.5, r_max=0.99),
        MinGRU(4, 3, rngs=nnx.Rngs(2)),
    )


def xs_tbd(seed=2):
    return jr.normal(jr.key(seed), (T, B, D))


def ref_rnn(cells, xs, reverse=False):
    """The cells' own steps, a Python loop over time and layers (time-major)."""
    states = [
        c.initialize_carry(xs.shape[1:-1] + (c.in_features,), rngs=nnx.Rngs(0))
        for c in cells
    ]
    ys = [None] * xs.shape[0]
    for t in reversed(range(xs.shape[0])) if reverse else range(xs.shape[0]):
        x = xs[t]
        for i, cell in enumerate(cells):
            states[i], x = cell(states[i], x)
        ys[t] = x
    return tuple(states), jnp.stack(ys)


def ref_lengths(cells, xs, lengths, reverse=False):
    """Each sequence alone over its valid steps; zero outputs past its length."""
    finals, ys = [], []
    for b, n in enumerate(np.asarray(lengths)):
        st, y = ref_rnn(cells, xs[:n, b : b + 1], reverse=reverse)
        finals.append(st)
        ys.append(jnp.concatenate([y, jnp.zeros((T - n,) + y.shape[1:], y.dtype)]))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *finals), jnp.concatenate(ys, 1)


def loss(out):
    finals, ys = out
    leaves = jax.tree.leaves(finals)
    return jnp.sum(ys**2) + sum(jnp.sum(jnp.abs(jnp.sin(h))) for h in leaves)


def value_and_grad(fn, cells, xs):
    """jit(value_and_grad) w.r.t. the cells' parameters and the inputs."""
    graphdef, params = nnx.split(cells)

    def f(params, xs):
        out = fn(nnx.merge(graphdef, params), xs)
        return loss(out), out

    return jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, xs)


# ---------------------------------------------------------------------------- values + grads


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("make", [lru, mingru], ids=["LRU", "MinGRU"])
def test_cell_matches_its_steps(make, reverse):
    cells, xs = (make(),), xs_tbd()
    ours = value_and_grad(lambda c, x: scanax.rnn(c, x, reverse=reverse), cells, xs)
    close(ours, value_and_grad(lambda c, x: ref_rnn(c, x, reverse), cells, xs))


@pytest.mark.parametrize("order", ["layer", "time"])
def test_mixed_stack_with_gru(order):
    cells, xs = mixed(), xs_tbd()
    ours = value_and_grad(lambda c, x: scanax.rnn(c, x, order=order), cells, xs)
    close(ours, value_and_grad(ref_rnn, cells, xs))


@pytest.mark.parametrize("order, reverse", [("layer", False), ("time", True)])
def test_mixed_stack_seq_lengths(order, reverse):
    cells, xs = mixed(), xs_tbd()
    lengths = jnp.array([T, 2], jnp.int32)
    kw = dict(order=order, reverse=reverse, seq_lengths=lengths)
    ours = value_and_grad(lambda c, x: scanax.rnn(c, x, **kw), cells, xs)
    close(
        ours,
        value_and_grad(lambda c, x: ref_lengths(c, x, lengths, reverse), cells, xs),
    )


def test_batch_major_and_birnn():
    cells, xs = mixed(), xs_tbd()
    finals, ys = jit(lambda x: scanax.rnn(cells, x, time_axis=1))(
        jnp.swapaxes(xs, 0, 1)
    )
    want = ref_rnn(cells, xs)
    close((finals, jnp.swapaxes(ys, 0, 1)), want)
    fwd, bwd = lru(), lru(seed=5)
    (f_states, b_states), ys = jit(lambda x: scanax.birnn(fwd, bwd, x))(xs)
    f_ref, b_ref = ref_rnn((fwd,), xs), ref_rnn((bwd,), xs, reverse=True)
    close((f_states, b_states), (f_ref[0], b_ref[0]))
    close(ys, jnp.concatenate([f_ref[1], b_ref[1]], -1))


@pytest.mark.parametrize("make", [lru, mingru])
def test_flax_rnn_and_bidirectional_take_the_cells(make):
    """``nnx.RNN`` and ``nnx.Bidirectional`` run an LRU or MinGRU as any Flax
    cell (review: AttributeError, no ``num_feature_axes``), equal to
    ``scanax.rnn``/``birnn`` over the same cells, with ``seq_lengths``."""
    xs = jnp.swapaxes(xs_tbd(), 0, 1)  # (batch, time, features): Flax's layout
    lengths = jnp.array([T, T - 2, 1])[:B]
    valid = (jnp.arange(T)[None, :] < lengths[:, None])[..., None]  # (flax's
    fwd, bwd = make(), make(seed=5)  # outputs past a length are not zeroed)
    flax_ys = nnx.RNN(fwd)(xs, seq_lengths=lengths)
    _, ys = scanax.rnn([fwd], xs, time_axis=1, seq_lengths=lengths)
    close(jnp.where(valid, flax_ys, 0), ys)
    both = nnx.Bidirectional(nnx.RNN(fwd), nnx.RNN(bwd))(xs, seq_lengths=lengths)
    _, ys = scanax.birnn(fwd, bwd, xs, time_axis=1, seq_lengths=lengths)
    close(jnp.where(valid, both, 0), ys)


def test_vmap_over_sequences():
    cell, xs = mingru(), xs_tbd()
    one = lambda x: scanax.rnn([cell], x)  # x: [T, D]
    close(jit(jax.vmap(one, 1, (0, 1)))(xs), jit(lambda x: ref_rnn((cell,), x))(xs))


# ---------------------------------------------------------------------------- whole sequences


@pytest.mark.parametrize("order", ["layer", "time"])
def test_runs_the_whole_sequence_not_steps(monkeypatch, order):
    """rnn calls run_sequence: the one-step __call__ is traced only by rnn's
    abstract check of the layer, never as the body of a loop over time."""
    calls = []
    step = MinGRU.__call__
    monkeypatch.setattr(
        MinGRU, "__call__", lambda s, h, x: calls.append(1) or step(s, h, x)
    )
    cells = (nnx.GRUCell(D, 4, rngs=nnx.Rngs(0)), mingru(4))
    assert [_cells.detect(c).whole for c in cells] == [False, True]
    jax.make_jaxpr(lambda x: scanax.rnn(cells, x, order=order))(xs_tbd())
    assert len(calls) == 1


def test_run_sequence_matches_steps_with_carry():
    cell, xs = lru(), xs_tbd()
    h0 = jax.lax.complex(*jr.normal(jr.key(3), (2, B, 5)))
    h, ys = jit(lambda h0, xs: cell.run_sequence(h0, xs))(h0, xs)
    state, want = h0, []
    for t in range(T):
        state, y = cell(state, xs[t])
        want.append(y)
    close((h, ys), (state, jnp.stack(want)))


# ---------------------------------------------------------------------------- parameters


def test_lru_initialisation():
    n, r_min, r_max, max_phase = 4096, 0.4, 0.9, 1.5
    cell = LRU(3, n, rngs=nnx.Rngs(0), r_min=r_min, r_max=r_max, max_phase=max_phase)
    lam = np.asarray(cell.lam())
    radius, phase = np.abs(lam), np.angle(lam)
    assert r_min - 1e-6 <= radius.min() and radius.max() <= r_max + 1e-6
    assert phase.min() >= 0 and phase.max() <= max_phase + 1e-6
    # uniform on the ring: |lam|^2 uniform on [r_min^2, r_max^2]
    np.testing.assert_allclose(np.mean(radius**2), (r_min**2 + r_max**2) / 2, atol=0.01)
    np.testing.assert_allclose(np.mean(phase), max_phase / 2, atol=0.03)
    gamma = np.exp(np.asarray(cell.gamma_log[...]))
    np.testing.assert_allclose(gamma, np.sqrt(1 - radius**2), rtol=1e-4)
    np.testing.assert_allclose(np.var(np.asarray(cell.B_re[...])), 1 / 6, rtol=0.05)
    np.testing.assert_allclose(np.var(np.asarray(cell.C_im[...])), 1 / n, rtol=0.05)
    assert cell.initialize_carry((2, 3)).dtype == jnp.complex64


def test_mingru_step_is_the_papers():
    cell, x = mingru(), xs_tbd()[0]
    h = jr.normal(jr.key(4), (B, 4))
    z = jax.nn.sigmoid(x @ cell.gate.kernel[...] + cell.gate.bias[...])
    h_tilde = x @ cell.candidate.kernel[...] + cell.candidate.bias[...]
    close(cell(h, x), ((1 - z) * h + z * h_tilde,) * 2)
    assert math.isclose(float(jnp.sum(cell.initialize_carry((B, D)))), 0.0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_lru_with_16_bit_parameters(dtype):
    """16-bit floats have no complex type (``jax.lax.complex`` refused them and
    ``scanax.rnn`` blamed the input's width): the state is complex64, the
    output the input's dtype, equal to the float32 cell's on the same values
    to the 16-bit rounding."""
    low = LRU(D, 5, rngs=nnx.Rngs(0), r_min=0.5, r_max=0.99, param_dtype=dtype)
    ref = lru()  # (the same draws in float32)
    nnx.update(ref, jax.tree.map(lambda p: p.astype(jnp.float32), nnx.state(low)))
    xs = xs_tbd().astype(dtype)
    (h,), ys = jit(lambda x: scanax.rnn([low], x))(xs)
    (h_ref,), ys_ref = jit(lambda x: scanax.rnn([ref], x))(xs.astype(jnp.float32))
    assert h.dtype == jnp.complex64 and ys.dtype == dtype
    helpers.close(ys.astype(jnp.float32), ys_ref, rtol=3e-2, atol=3e-2)
    helpers.close(h, h_ref, rtol=3e-2, atol=3e-2)


def test_lru_float32_with_a_bfloat16_input_keeps_float32():
    """float32 parameters and a bfloat16 input (JAX's standard promotion): the
    readout stays float32, equal to the input upcast first (a review found it
    rounded to bfloat16 by the 16-bit change)."""
    cell, xs = lru(), xs_tbd().astype(jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        got = jit(lambda x: scanax.rnn([cell], x))(xs)
        want = jit(lambda x: scanax.rnn([cell], x))(xs.astype(jnp.float32))
    assert got[1].dtype == jnp.float32
    helpers.close(got, want, rtol=1e-6, atol=1e-6)
