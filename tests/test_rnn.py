"""scanax.rnn / scanax.birnn against plain Python loops over time and layers."""

import functools as ft

import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scanax

eqx = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")

T, B, D = 4, 3, 2
TOL = dict(rtol=1e-5, atol=1e-5)

# Tiny programs: skip XLA's expensive CPU optimisations, so that tests compile fast.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
jit = ft.partial(jax.jit, compiler_options=FAST)
filter_jit = ft.partial(eqx.filter_jit, compiler_options=FAST)


close = ft.partial(helpers.close, **TOL)


# ---------------------------------------------------------------------------- cells


class Rnn(eqx.Module):
    """A plain `cell(h, x) -> h` cell (an Equinox module), with an input width of its own."""

    dim: int = eqx.field(static=True)
    w_x: jax.Array
    w_h: jax.Array
    b: jax.Array

    def __init__(self, d_in, dim, key):
        k1, k2 = jr.split(key)
        self.dim = dim
        self.w_x = jr.normal(k1, (d_in, dim)) * 0.5
        self.w_h = jr.normal(k2, (dim, dim)) * 0.5
        self.b = jnp.full((dim,), 0.1)

    def __call__(self, h, x):
        return jnp.tanh(x @ self.w_x + h @ self.w_h + self.b)


def state_cells():
    k = jr.split(jr.key(0), 3)
    return (Rnn(D, 4, k[0]), Rnn(4, 3, k[1]), Rnn(3, 5, k[2]))


def eqx_cells():
    k = jr.split(jr.key(1), 2)
    return (eqx.nn.GRUCell(D, 4, key=k[0]), eqx.nn.LSTMCell(4, 3, key=k[1]))


def nnx_cells(optimized=False):
    lstm = nnx.OptimizedLSTMCell if optimized else nnx.LSTMCell
    return (
        nnx.GRUCell(D, 4, rngs=nnx.Rngs(0)),
        lstm(4, 3, rngs=nnx.Rngs(1)),
        nnx.SimpleCell(3, 5, rngs=nnx.Rngs(2)),
    )


def xs_tbd(shape=(T, B, D), seed=2):
    return jr.normal(jr.key(seed), shape)


# ---------------------------------------------------------------------------- references


def ref_step(cell, state, x):
    """Each protocol written out by hand, independent of scanax._cells."""
    if isinstance(cell, eqx.nn.GRUCell):
        f = lambda s, v: cell(v, s)
        for _ in range(x.ndim - 1):
            f = jax.vmap(f)
        h = f(state, x)
        return h, h
    if isinstance(cell, eqx.nn.LSTMCell):
        f = lambda s, v: cell(v, s)
        for _ in range(x.ndim - 1):
            f = jax.vmap(f)
        hc = f(state, x)
        return hc, hc[0]
    if isinstance(cell, nnx.Module):
        return cell(state, x)
    h = cell(state, x)
    return h, h


def ref_init(cell, batch):
    if isinstance(cell, eqx.nn.GRUCell):
        return jnp.zeros((*batch, cell.hidden_size))
    if isinstance(cell, eqx.nn.LSTMCell):
        z = jnp.zeros((*batch, cell.hidden_size))
        return (z, z)
    if isinstance(cell, nnx.Module):
        return cell.initialize_carry((*batch, cell.in_features), rngs=nnx.Rngs(0))
    return jnp.zeros((*batch, cell.dim))


def ref_rnn(cells, xs, init=None, reverse=False):
    """Plain loops over time and layers; xs is time-major."""
    states = (
        list(init) if init is not None else [ref_init(c, xs.shape[1:-1]) for c in cells]
    )
    ys = [None] * xs.shape[0]
    steps = range(xs.shape[0])
    for t in reversed(steps) if reverse else steps:
        x = xs[t]
        for i, cell in enumerate(cells):
            states[i], x = ref_step(cell, states[i], x)
        ys[t] = x
    if not ys:
        return tuple(states), jnp.zeros((0, *xs.shape[1:-1], cells[-1].dim))
    return tuple(states), jnp.stack(ys)


def ref_rnn_lengths(cells, xs, lengths, reverse=False):
    """Each sequence run alone over its own valid steps; zeros past its length."""
    finals, ys = [], []
    for b in range(xs.shape[1]):
        n = int(np.asarray(lengths)[b])
        st, y = ref_rnn(cells, xs[:n, b : b + 1], reverse=reverse)
        finals.append(st)
        pad = jnp.zeros((xs.shape[0] - n, *y.shape[1:]))
        ys.append(jnp.concatenate([y, pad]))
    finals = jax.tree.map(lambda *a: jnp.concatenate(a), *finals)
    return finals, jnp.concatenate(ys, axis=1)


def loss_of(out):
    finals, ys = out
    return jnp.sum(ys**2) + sum(jnp.sum(jnp.sin(h)) for h in jax.tree.leaves(finals))


# ---------------------------------------------------------------------------- values + grads


def value_and_grad(fn):
    """jit(value_and_grad) of a function returning (final_states, ys), w.r.t. arg 0.

    One compile per implementation gives values and gradients together.
    """

    def f(params, *args):
        out = fn(params, *args)
        return loss_of(out), out

    return jit(jax.value_and_grad(f, has_aux=True))


def eqx_value_and_grad(fn):
    def f(params, static, *args):
        return fn(eqx.combine(params, static), *args)

    vg = value_and_grad(f)
    return lambda cells, *args: vg(*eqx.partition(cells, eqx.is_array), *args)


@pytest.mark.parametrize("make", [state_cells, eqx_cells], ids=["state", "eqx"])
def test_equinox_cells_match_loops(make):
    cells, xs = make(), xs_tbd()
    ours = eqx_value_and_grad(lambda c, x: scanax.rnn(c, x))(cells, xs)
    close(ours, eqx_value_and_grad(ref_rnn)(cells, xs))
    if make is eqx_cells:
        return  # both orders for NNX cells: test_orders_identical_with_lengths
    # both orders give the same values and gradients as the default
    for order in ("time", "layer"):
        close(
            eqx_value_and_grad(lambda c, x, o=order: scanax.rnn(c, x, order=o))(
                cells, xs
            ),
            ours,
        )


def test_unbatched_composes_with_vmap():
    cells, xs = eqx_cells(), xs_tbd()
    one = lambda x: scanax.rnn(cells, x)  # x: [T, D]
    batched = jit(jax.vmap(one, in_axes=1, out_axes=(0, 1)))(xs)
    close(batched, jit(lambda x: scanax.rnn(cells, x))(xs))
    close(batched, jit(jax.vmap(lambda x: ref_rnn(cells, x), 1, (0, 1)))(xs))


def nnx_chain(cells, xs, time_major, reverse=False, seq_lengths=None):
    """Chained nnx.RNN, one per layer: the NNX reference."""
    carries = []
    for cell in cells:
        rnn = nnx.RNN(cell, time_major=time_major, return_carry=True)
        carry, xs = rnn(xs, reverse=reverse, keep_order=True, seq_lengths=seq_lengths)
        carries.append(carry)
    return tuple(carries), xs


def nnx_jit(fn, cells):
    """jit of fn(cells, *args), the cells passed in as NNX state (not closed over)."""
    graphdef, state = nnx.split(cells)
    f = jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))
    return lambda *args: f(state, *args)


def nnx_value_and_grad(fn, cells):
    graphdef, state = nnx.split(cells)
    vg = value_and_grad(lambda st, *a: fn(nnx.merge(graphdef, st), *a))
    return lambda *args: vg(state, *args)


@pytest.mark.parametrize(
    "time_axis, optimized", [(0, False), (1, True)], ids=["time-major", "batch-major"]
)
def test_nnx_cells_match_chained_nnx_rnn(time_axis, optimized):
    cells = nnx_cells(optimized)
    xs = xs_tbd() if time_axis == 0 else xs_tbd((B, T, D))
    ours = nnx_value_and_grad(lambda c, x: scanax.rnn(c, x, time_axis=time_axis), cells)
    ref = nnx_value_and_grad(lambda c, x: nnx_chain(c, x, time_axis == 0), cells)
    close(ours(xs), ref(xs))


def test_nnx_cells_direct_objects_and_init():
    cells, xs = nnx_cells(), xs_tbd()
    init = tuple(jax.tree.map(lambda z: z + 0.3, ref_init(c, (B,))) for c in cells)
    f = nnx_jit(  # cells as an nnx.List, as a model would hold them
        lambda c, x, i: (scanax.rnn(nnx.List(list(c)), x, i), ref_rnn(c, x, i)), cells
    )
    close(*f(xs, init))


@pytest.mark.parametrize("reverse", [False, True])
def test_orders_identical_with_lengths(reverse):
    cells, xs = nnx_cells(), xs_tbd()
    lengths = jnp.array([4, 2, 0])

    def run(order):
        return nnx_value_and_grad(
            lambda c, x: scanax.rnn(
                c, x, seq_lengths=lengths, reverse=reverse, order=order
            ),
            cells,
        )(xs)

    runs = {order: run(order) for order in ("time", "layer", "auto")}
    close(runs["time"], runs["layer"], rtol=1e-6, atol=1e-6)
    close(runs["auto"], runs["layer" if jax.default_backend() == "cpu" else "time"])


# ---------------------------------------------------------------------------- seq_lengths, reverse


@pytest.mark.parametrize("reverse", [False, True])
def test_seq_lengths_freeze_state_and_zero_outputs(reverse):
    cells, xs = state_cells(), xs_tbd()
    lengths = jnp.array([4, 2, 0], jnp.int32)
    ours = eqx_value_and_grad(
        lambda c, x: scanax.rnn(c, x, seq_lengths=lengths, reverse=reverse)
    )(cells, xs)
    ref = eqx_value_and_grad(lambda c, x: ref_rnn_lengths(c, x, lengths, reverse))(
        cells, xs
    )
    close(ours, ref)


@pytest.mark.standard_promotion("compares outputs times a bool mask")
def test_seq_lengths_match_nnx_rnn_final_carry():
    cells = nnx_cells()
    xs = xs_tbd((B, T, D))
    lengths = jnp.array([4, 2, 1])
    f = nnx_jit(
        lambda c, x: (
            scanax.rnn(c, x, seq_lengths=lengths, time_axis=1),
            nnx_chain(c, x, time_major=False, seq_lengths=lengths),
        ),
        cells,
    )
    (finals, ys), (ref_finals, ref_ys) = f(xs)
    close(finals, ref_finals)
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    close(ys * valid[..., None], ref_ys * valid[..., None])
    assert not jnp.any(ys[~valid])


@pytest.mark.parametrize("order", ["time", "layer"])
def test_seq_lengths_memory_does_not_grow_with_T(order):
    """Every scan keeps states as a carry only: its only stacked output is ys."""
    cells = state_cells()
    lengths = jnp.ones(B, int)
    jaxpr = jax.make_jaxpr(
        lambda x: scanax.rnn(cells, x, seq_lengths=lengths, order=order)
    )(xs_tbd())
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    stacked = [
        [v.aval.shape for v in e.outvars[helpers.scan_counts(e)[1] :]] for e in scans
    ]
    if order == "time":  # one scan, the last layer's outputs
        assert stacked == [[(T, B, 5)]]
    else:  # one scan per layer, each layer's outputs
        assert stacked == [[(T, B, 4)], [(T, B, 3)], [(T, B, 5)]]


def test_reverse_matches_loop_and_nnx():
    cells, xs = nnx_cells(), xs_tbd()
    f = nnx_jit(
        lambda c, x: (
            scanax.rnn(c, x, reverse=True),
            ref_rnn(c, x, reverse=True),
            nnx_chain(c, x, time_major=True, reverse=True),
        ),
        cells,
    )
    ours, ref, ref_nnx = f(xs)
    close(ours, ref)
    close(ours, ref_nnx)


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.standard_promotion("compares outputs times a bool mask")
def test_birnn_matches_nnx_bidirectional(with_lengths):
    fwd = nnx.GRUCell(D, 4, rngs=nnx.Rngs(0))
    bwd = nnx.LSTMCell(D, 3, rngs=nnx.Rngs(1))
    xs = xs_tbd((B, T, D))
    lengths = jnp.array([4, 3, 1]) if with_lengths else None

    def f(cells, x):
        fwd, bwd = cells
        bi = nnx.Bidirectional(nnx.RNN(fwd), nnx.RNN(bwd), return_carry=True)
        ours = scanax.birnn(fwd, bwd, x, seq_lengths=lengths, time_axis=1)
        return ours, bi(x, seq_lengths=lengths)

    ((sf, sb), ys), ((cf, cb), ref_ys) = nnx_jit(f, (fwd, bwd))(xs)
    close((sf, sb), ((cf,), (cb,)))
    if with_lengths:  # nnx leaves values past the length; scanax zeros them
        valid = (jnp.arange(T)[None, :] < lengths[:, None])[..., None]
        close(ys * valid, ref_ys * valid)
    else:
        close(ys, ref_ys)


def test_no_retrace_on_new_values():
    traces = []

    @jit
    def f(cells, xs, lengths):
        traces.append(1)
        return scanax.rnn(cells, xs, seq_lengths=lengths)

    cells = state_cells()
    f(cells, xs_tbd(), jnp.array([4, 2, 0]))
    f(jax.tree.map(lambda a: a + 1, cells), xs_tbd(seed=3), jnp.array([1, 2, 3]))
    assert len(traces) == 1


def test_eager_calls_reuse_the_compiled_program():
    """Un-jitted calls are traced every time (new cell values are read) and
    compiled once per program."""
    cells = nnx_cells()
    ref = nnx_jit(lambda c, x: nnx_chain(c, x, time_major=False), cells)
    for seed in (2, 3, 4):
        xs = xs_tbd((B, T, D), seed=seed)
        with helpers.count_compiles() as c:
            got = scanax.rnn(cells, xs, time_axis=1)
        close(got, ref(xs))
        assert seed == 2 or c.n == 0
    cells[0].dense_i.bias[...] = cells[0].dense_i.bias[...] + 1.0  # a new value
    ref = nnx_jit(lambda c, x: nnx_chain(c, x, time_major=False), cells)
    with helpers.count_compiles() as c:
        got = scanax.rnn(cells, xs, time_axis=1)
    close(got, ref(xs))
    assert c.n == 0
    lengths = jnp.array([4, 2, 0])
    cells = state_cells()
    for _ in range(2):
        with helpers.count_compiles() as c:
            got = scanax.birnn(cells, cells, xs_tbd(), seq_lengths=lengths)
    assert c.n == 0


def test_zero_length_sequence():
    cells = state_cells()
    finals, ys = scanax.rnn(cells, jnp.zeros((0, B, D)))
    assert ys.shape == (0, B, 5)
    close(finals, tuple(ref_init(c, (B,)) for c in cells))


def _f32_state_cell(h, x):  # no width attribute: its protocol is probed
    return jnp.tanh(0.5 * h.astype(x.dtype) + x)


def _f32_pair_cell(c, x):
    h = _f32_state_cell(c, x)
    return h, 2 * h


@pytest.mark.parametrize("cell", [_f32_state_cell, _f32_pair_cell])
@pytest.mark.parametrize("x64", [False, True], ids=["x64_off", "x64_on"])
def test_numpy_float64_init_taken_as_lax_scan_takes_it(cell, x64):
    """A NumPy float64 state (closed over under jit: rnn sees it unconverted) is
    what ``lax.scan`` makes of it: float32 with x64 off, so it runs and gives the
    hand-written scan's result; float64 with x64 on, which a cell returning float32
    cannot carry, and both refuse it."""
    xs = xs_tbd()
    init = np.linspace(-1.0, 1.0, B * D).reshape(B, D)  # float64
    assert init.dtype == np.float64

    def body(h, x):
        out = cell(h, x)
        return (out, out) if cell is _f32_state_cell else out

    ours = jit(lambda xs: scanax.rnn([cell], xs, init=(init,)))
    ref = jit(lambda xs: jax.lax.scan(body, init, xs))
    with jax.enable_x64(x64):
        if x64:
            with pytest.raises(TypeError, match=r"carry"):
                ref(xs)
            with pytest.raises(
                TypeError,
                match=r"cells\[0\] \(function\) returns its state in another dtype: "
                r"given h float64\[3, 2\], it returned float32\[3, 2\]",
            ):
                ours(xs)
            return
        (final,), ys = ours(xs)
        ref_final, ref_ys = ref(xs)
    helpers.close((final, ys), (ref_final, ref_ys), types=True, **TOL)
    # the state as the scan carried it: float32, not the caller's float64
    assert final.dtype == jnp.float32


def test_python_number_init_taken_as_lax_scan_takes_it():
    cell = lambda h, x: h + jnp.sum(x)  # noqa: E731
    xs = xs_tbd((T, D))
    (final,), ys = scanax.rnn([cell], xs, init=(0.0,))
    ref_final, ref_ys = jax.lax.scan(lambda h, x: (cell(h, x),) * 2, 0.0, xs)
    helpers.close((final, ys), (ref_final, ref_ys), types=True, **TOL)


# ---------------------------------------------------------------------------- errors


def test_error_width_mismatch_names_layer_and_widths():
    cells = (
        nnx.GRUCell(D, 4, rngs=nnx.Rngs(0)),
        nnx.SimpleCell(3, 5, rngs=nnx.Rngs(1)),
    )
    with pytest.raises(
        ValueError,
        match=r"^scanax\.rnn: cells\[1\] \(SimpleCell\) expects inputs of width 3, but "
        r"the output of cells\[0\] \(GRUCell\) has width 4",
    ):
        scanax.rnn(cells, xs_tbd())
    with pytest.raises(
        ValueError, match=r"cells\[0\].*width 7, but xs float32\[4, 3, 2\]"
    ):
        scanax.rnn(eqx.nn.GRUCell(7, 4, key=jr.key(0)), xs_tbd())


def test_error_generic_cell_fails_on_width():
    k = jr.split(jr.key(0), 2)
    with pytest.raises(
        ValueError,
        match=r"cells\[1\] \(Rnn\) failed on an input float32\[3, 4\] \(width 4",
    ) as info:
        scanax.rnn((Rnn(D, 4, k[0]), Rnn(3, 5, k[1])), xs_tbd())
    assert info.value.__cause__ is not None


@pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")
def test_error_cell_that_mutates_itself():
    class Sowing(nnx.GRUCell):
        def __call__(self, carry, x):
            carry, y = super().__call__(carry, x)
            self.sow(nnx.Intermediate, "y", y)
            return carry, y

    cell = Sowing(D, 4, rngs=nnx.Rngs(0))
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.rnn: cells\[0\] \(Sowing\) changes its own attributes or "
        r"Variables while running \(flax says: Cannot mutate.*Fix: return the value",
    ):
        scanax.rnn([cell], xs_tbd())
    assert not nnx.state(cell, nnx.Intermediate)


def test_error_cell_that_draws_dropout_masks():
    """nnx.Dropout in a cell advances its key count: refused, with a fix that
    applies (review 2026-12-06: the generic one said to return the value),
    nothing run or changed."""

    class DropCell(nnx.Module):
        def __init__(self, rngs):
            self.cell = nnx.GRUCell(D, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, carry, x):
            carry, y = self.cell(carry, x)
            return carry, self.drop(y)

    cell = DropCell(nnx.Rngs(0, dropout=1))
    count = int(cell.drop.rngs.count[...])
    init = (jnp.zeros((B, 4)),)
    with pytest.raises(
        TypeError,
        match=r"(?s)cells\[0\] \(DropCell\) changes its own.*Fix: draw no random "
        r"numbers in the cell.*`nnx.Dropout` to the outputs `ys`.*`nnx.RNN`",
    ):
        scanax.rnn([cell], xs_tbd(), init)
    assert int(cell.drop.rngs.count[...]) == count


def test_error_init_count_and_type_and_shapes():
    cells, xs = state_cells(), xs_tbd()
    with pytest.raises(ValueError, match=r"`init` has 2 states for 3 cells"):
        scanax.rnn(cells, xs, init=(jnp.zeros((B, 4)), jnp.zeros((B, 3))))
    with pytest.raises(TypeError, match=r"`init` must be a tuple"):
        scanax.rnn(cells, xs, init=jnp.zeros((B, 4)))
    bad = (jnp.zeros((B, 4)), jnp.zeros((B, 4)), jnp.zeros((B, 5)))
    with pytest.raises(
        TypeError,
        match=r"init\[1\] does not match the state of cells\[1\] \(Rnn\):\n"
        r"  init\[1\]  float32\[3, 4\]\n  expected  float32\[3, 3\]",
    ):
        scanax.rnn(cells, xs, init=bad)
    lstm = eqx.nn.LSTMCell(D, 3, key=jr.key(0))
    with pytest.raises(
        TypeError, match=r"(?s)init\[0\].*expected  \(float32\[3, 3\], float32"
    ):
        scanax.rnn(lstm, xs, init=(jnp.zeros((B, 3)),))


def test_a_cell_with_its_own_initialize_carry_runs_given_init():
    """An NNX cell whose initialize_carry is not flax's (no rngs=): with `init`
    it runs as the loop does (before: a bare TypeError from calling it with
    rngs=); without, the refusal names the cell and `init=`."""

    class MyCell(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D + 4, 4, rngs=rngs)

        def initialize_carry(self, batch_size):
            return jnp.zeros((batch_size, 4))

        def __call__(self, h, x):
            h = jnp.tanh(self.lin(jnp.concatenate([h, x], -1)))
            return h, h

    cell, xs = MyCell(nnx.Rngs(0)), xs_tbd()
    h = h0 = jnp.full((B, 4), 0.5)
    want = []
    for t in range(xs.shape[0]):
        h, y = cell(h, xs[t])
        want.append(y)
    (final,), ys = scanax.rnn(cell, xs, init=(h0,))
    helpers.close((final, ys), (h, jnp.stack(want)), rtol=1e-5, atol=1e-6)
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax.rnn: cells\[0\] \(MyCell\) has an `initialize_carry` "
        r"method, read as flax's.*unexpected keyword argument 'rngs'.*Fix: pass `init=`",
    ):
        scanax.rnn(cell, xs)
    with pytest.raises(ValueError, match=r"^scanax.rnn: `unroll` must be a bool"):
        scanax.rnn(cell, xs, init=(h0,), unroll=-1)


def test_error_seq_lengths():
    cells, xs = state_cells(), xs_tbd()
    with pytest.raises(
        TypeError,
        match=r"`seq_lengths` must be an integer array, got "
        r"float32\[3\]",
    ):
        scanax.rnn(cells, xs, seq_lengths=jnp.ones(B))
    with pytest.raises(
        ValueError,
        match=r"`seq_lengths` must have one entry per "
        r"sequence, shape \(3,\).*got int32\[4\]",
    ):
        scanax.rnn(cells, xs, seq_lengths=jnp.ones(4, jnp.int32))


def test_error_batch_major_data_with_the_default_time_axis_names_time_axis():
    """(B, T, D) data with NNX cells and the default time_axis=0: a shape that fits
    with time on the other axis gets the time_axis fix."""
    cells = nnx_cells()[:1]
    xs = xs_tbd((B, T + 1, D))  # batch-major: 3 sequences of 5 steps
    with pytest.raises(
        ValueError,
        match=r"^scanax\.rnn: `seq_lengths` must have one entry per sequence, shape "
        r"\(5,\) \(the batch axes of xs float32\[3, 5, 2\] with time_axis=0\), got "
        r"int32\[3\]\.\nFix: `seq_lengths` fits xs with time on axis 1 \(batch-major "
        r"\[B, T, D\], as nnx\.RNN\): if that is your layout, pass time_axis=1\. "
        r"Otherwise pass an int array of the batch shape\.$",
    ):
        scanax.rnn(cells, xs, seq_lengths=jnp.array([5, 2, 1]))
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax\.rnn: init\[0\] does not match the state of cells\[0\] "
        r"\(GRUCell\).*expected  float32\[5, 4\]\nFix: init\[0\] fits xs with time "
        r"on axis 1 \(batch-major \[B, T, D\], as nnx\.RNN\): if that is your layout, "
        r"pass time_axis=1\. Otherwise pass init\[0\] with",
    ):
        scanax.rnn(cells, xs, init=(jnp.zeros((B, 4)),))
    # The fix: the same as nnx.RNN on the batch-major data.
    lengths = jnp.array([5, 2, 1])
    got = scanax.rnn(cells, xs, seq_lengths=lengths, time_axis=1)
    ref = nnx_jit(
        lambda c, x: nnx_chain(c, x, time_major=False, seq_lengths=lengths), cells
    )(xs)
    close(got[0], ref[0])
    # Time-major data given time_axis=1: the other way round.
    with pytest.raises(
        ValueError,
        match=r"with time_axis=1\), got int32\[3\]\.\nFix: `seq_lengths` fits xs "
        r"with time on axis 0: if that is your layout, pass time_axis=0\.",
    ):
        scanax.rnn(cells, xs_tbd(), seq_lengths=jnp.array([4, 2, 1]), time_axis=1)
    # A size that fits no axis: no time_axis advice.
    with pytest.raises(
        ValueError, match=r"got int32\[7\]\.\nFix: pass an int array of the batch"
    ):
        scanax.rnn(cells, xs, seq_lengths=jnp.ones(7, jnp.int32))


def test_error_unknown_protocol_lists_supported():
    xs = xs_tbd()
    with pytest.raises(
        TypeError,
        match=r"(?s)^scanax\.rnn: cannot tell how to call cells\[0\] \(int\): it is not "
        r"callable.*Supported cell protocols:.*cell\(h, x\) -> h.*eqx\.nn\.GRUCell",
    ):
        scanax.rnn([3], xs)
    with pytest.raises(
        TypeError, match=r"returned \(float32\[3, 2\], float32\[3, 2\], "
    ):
        scanax.rnn([lambda h, x: (h, h, x)], xs, init=(jnp.zeros((B, D)),))


class ShrinkingCell(nnx.Module):
    """An NNX-style cell (it has initialize_carry) whose state shrinks."""

    def initialize_carry(self, input_shape, rngs=None):
        return jnp.zeros((*input_shape[:-1], D))

    def __call__(self, carry, x):
        return carry[:, :1], x


def tuple_state_cell(h, x):
    """The cell(h, x) -> h protocol with a pytree state: the output is h."""
    a, b = h
    return jnp.tanh(a + x), b + a


def test_tuple_state_output_on_time_axis_1():
    xs = xs_tbd()
    init = ((jnp.zeros((B, D)), jnp.ones((B, D))),)
    finals, ys = scanax.rnn([tuple_state_cell], xs, init=init)
    finals_1, ys_1 = scanax.rnn(
        [tuple_state_cell], jnp.swapaxes(xs, 0, 1), init=init, time_axis=1
    )
    close(finals_1, finals)
    close(ys_1, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys))
    h = init[0]
    for t in range(T):  # the reference: a Python loop
        h = tuple_state_cell(h, xs[t])
    close(finals[0], h)


def test_error_output_read_by_the_next_layer_is_not_an_array():
    init = ((jnp.zeros((B, D)), jnp.ones((B, D))), jnp.zeros((B, D)))
    with pytest.raises(
        TypeError,
        match=r"(?s)scanax.rnn: the output of cells\[0\] \(function\) is "
        r"\(float32\[3, 2\], float32\[3, 2\]\), but cells\[1\] \(function\) reads it "
        r"as its input, which must be one array.*\(new_state, y\)",
    ):
        scanax.rnn([tuple_state_cell, lambda h, x: h + x], xs_tbd(), init=init)


@pytest.mark.standard_promotion(
    "the cell mixes bfloat16 and float32: what the test is about"
)
def test_error_default_state_in_xs_dtype_but_cell_computes_in_another():
    cell = Rnn(D, 4, jr.key(0))  # float32 weights
    with pytest.raises(
        TypeError,
        match=r"(?s)cells\[0\] \(Rnn\) returns its state in another dtype: given h "
        r"bfloat16\[3, 4\], it returned float32\[3, 4\]. With init=None the state "
        r"starts in the dtype of `xs` \(bfloat16\).*Fix: give `xs` the dtype",
    ):
        scanax.rnn([cell], xs_tbd().astype(jnp.bfloat16))


def test_error_state_changes_type():
    with pytest.raises(
        TypeError,
        match=r"cells\[0\] \(ShrinkingCell\) changes the type of its state:\n"
        r"  state in   float32\[3, 2\]\n  state out  float32\[3, 1\]",
    ):
        scanax.rnn([ShrinkingCell()], xs_tbd())


def test_error_no_state_width_and_misc():
    xs = xs_tbd()
    with pytest.raises(ValueError, match=r"cannot tell the state shape of cells\[0\]"):
        scanax.rnn(lambda h, x: h + x, xs)
    with pytest.raises(ValueError, match=r"time_axis=2 is not a valid time axis"):
        scanax.rnn(state_cells(), xs, time_axis=2)
    with pytest.raises(ValueError, match=r"`order` must be one of"):
        scanax.rnn(state_cells(), xs, order="diagonal")
    with pytest.raises(ValueError, match=r"`cells` is empty"):
        scanax.rnn([], xs)
    with pytest.raises(TypeError, match=r"`xs` must be an array"):
        scanax.rnn(state_cells(), [1.0, 2.0])
    with pytest.raises(
        TypeError, match=r"scanax\.birnn: `init` must be None or a pair"
    ):
        scanax.birnn(state_cells(), state_cells(), xs, init=(None,))


def test_auto_order_by_backend(monkeypatch):
    from scanax import _backend, _rnn

    assert _rnn.resolve_order("time") == "time"
    assert _rnn.resolve_order("layer") == "layer"
    for backend, order in [("cpu", "layer"), ("gpu", "time"), ("tpu", "time")]:
        monkeypatch.setattr(_backend, "platform", lambda b=backend: b)
        assert _rnn.resolve_order("auto") == order


@pytest.mark.parametrize(
    "lengths, bad", [([7, 3, 0], r"\[0\] is 7"), ([2, -1, 2], r"\[1\] is -1")]
)
def test_seq_lengths_out_of_range_are_refused_where_known(lengths, bad):
    """A length above T ran as T, a negative one as 0, silently (review
    2026-12-06): refused where the values are known (an un-jitted call, rnn and
    birnn); under jit they are not known, and clamp as before."""

    def cell(h, x):
        return jnp.tanh(h + x)

    xs = jnp.ones((5, 3, 4))
    init = (jnp.zeros((3, 4)),)
    match = rf"(?s)scanax.rnn: seq_lengths{bad}, outside 0..5.*jnp.clip"
    with pytest.raises(ValueError, match=match):
        scanax.rnn([cell], xs, init, seq_lengths=jnp.array(lengths))
    with pytest.raises(ValueError, match=match):
        scanax.birnn(cell, cell, xs, (init, init), seq_lengths=jnp.array(lengths))
    run = jax.jit(lambda n: scanax.rnn([cell], xs, init, seq_lengths=n)[1])
    clipped = scanax.rnn(
        [cell], xs, init, seq_lengths=jnp.clip(jnp.array(lengths), 0, 5)
    )
    np.testing.assert_array_equal(run(jnp.array(lengths)), clipped[1])


def test_birnn_errors_name_the_direction():
    """Both directions' cells are ``cells[0]``: the message says which
    (review 2026-12-06: a backward cell of the wrong width read as the
    forward one's)."""
    forward = eqx.nn.GRUCell(D, 4, key=jr.key(0))
    backward = eqx.nn.GRUCell(D + 1, 4, key=jr.key(1))
    with pytest.raises(
        ValueError,
        match=rf"scanax\.birnn, the backward cells: cells\[0\] \(GRUCell\) expects "
        rf"inputs of width {D + 1}",
    ):
        scanax.birnn(forward, backward, jnp.ones((5, D)))
