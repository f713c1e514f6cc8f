import functools as ft
import math
import sys

import helpers
import jax
import jax.numpy as jnp
import pytest

import scanax
from scanax import _progress


class Reports(list):
    """The reports seen, read once every callback has run: off CPU a program's
    host callbacks may run after it returns (a TPU's did), so each read waits
    for them (``jax.effects_barrier``)."""

    def __eq__(self, other):
        jax.effects_barrier()
        return list(self) == other

    def __iter__(self):
        jax.effects_barrier()
        return super().__iter__()

    def __len__(self):
        jax.effects_barrier()
        return super().__len__()


@pytest.fixture
def reports(monkeypatch):
    """Every host callback, as (steps done, closing), without drawing a bar."""
    jax.effects_barrier()  # (an earlier test's callbacks: before the patch)
    seen = Reports()
    monkeypatch.setattr(
        _progress.Bar,
        "report",
        lambda bar, done, closing: seen.append((int(done), closing)),
    )
    return seen


def per_step(length, every):
    """(count, last) of each report when ticking per step (with thinned outputs):
    every `every` steps, and the last step."""
    return [
        (i, i == length - 1) for i in range(length) if i % every == 0 or i == length - 1
    ]


def expected(length, every, reverse=False):
    """(count, last) of each report: the steps run in chunks of `every` (the odd
    chunk first when reversed), one report before each, the last one closing."""
    n_full, rest = divmod(length, every)
    sizes = [every] * n_full
    sizes = ([rest] + sizes if reverse else sizes + [rest]) if rest else sizes
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(c, i == len(starts) - 1) for i, c in enumerate(starts)]


def step(c, x):
    a, b = x
    c = 0.9 * c + jnp.sin(a) * b
    return c, (c * 2.0, a)


def xs(n):
    return (jnp.linspace(0.0, 1.0, n), jnp.arange(n, dtype=jnp.float32))


assert_same = ft.partial(helpers.close, rtol=1e-6, atol=1e-6, structure=False)


CASES = {
    "xs": lambda **kw: scanax.scan(step, jnp.float32(1.0), xs(23), **kw),
    "reverse": lambda **kw: scanax.scan(
        step, jnp.float32(1.0), xs(23), reverse=True, **kw
    ),
    "length": lambda **kw: scanax.scan(
        lambda c, _: (c * 0.5 + 1.0, c), 1.0, length=23, **kw
    ),
    "broadcast": lambda **kw: scanax.scan(
        step, jnp.float32(1.0), (xs(23)[0], jnp.float32(2.0)), in_axes=(0, None), **kw
    ),
    "unroll": lambda **kw: scanax.scan(step, jnp.float32(1.0), xs(23), unroll=4, **kw),
    "jit": lambda **kw: jax.jit(lambda c: scanax.scan(step, c, xs(23), **kw))(1.0),
    "grad": lambda **kw: jax.grad(
        lambda c: scanax.scan(step, c, xs(23), **kw)[1][0].sum()
    )(1.0),
    "grad_jit": lambda **kw: jax.grad(
        jax.jit(lambda c: scanax.scan(step, c, xs(23), **kw)[0])
    )(1.0),
    "vmap": lambda **kw: jax.vmap(lambda c: scanax.scan(step, c, xs(23), **kw))(
        jnp.arange(4.0)
    ),
    "vmap_xs": lambda **kw: jax.vmap(
        lambda a: scanax.scan(step, jnp.float32(0.0), (a, a), **kw), in_axes=1
    )(jnp.ones((23, 3))),
    "remat": lambda **kw: jax.grad(
        lambda c: scanax.scan(step, c, xs(23), remat=True, **kw)[0]
    )(1.0),
    "remat_sqrt": lambda **kw: jax.grad(
        lambda c: scanax.scan(step, c, xs(23), remat="sqrt", **kw)[0]
    )(1.0),
    "keep_every": lambda **kw: scanax.scan(
        step, jnp.float32(1.0), xs(23), keep_every=3, **kw
    ),
}


@pytest.mark.parametrize(
    "case, every",
    [(case, 7) for case in CASES]
    + [(case, 1) for case in ("xs", "reverse", "unroll", "remat_sqrt")],
)
def test_same_results_and_counted_updates(case, every, reports):
    off = CASES[case]()
    assert reports == []
    on = CASES[case](progress=every)
    assert_same(on, off)
    if case == "remat_sqrt":  # ticks once per chunk of ceil(sqrt(23)) = 5 steps
        hits = [i for i in range(0, 20, 5) if (i + 4) // every * every >= i]
        assert sorted(reports) == [(i, False) for i in hits] + [(20, True)]
    elif case == "keep_every":  # thinned: ticks per step
        assert sorted(reports) == per_step(23, every)
    else:  # unordered callbacks may come permuted within an unrolled group
        assert sorted(reports) == expected(23, every, reverse=case == "reverse")


def test_nnx_module_carry(reports):
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(()))

    def body(model, x):
        model.total.value = model.total.value + x
        return model, model.total.value

    a, b = Counter(), Counter()
    _, ys_off = scanax.scan(body, a, jnp.arange(10.0))
    _, ys_on = scanax.scan(body, b, jnp.arange(10.0), progress=3)
    assert_same(ys_on, ys_off)
    assert float(b.total.value) == float(a.total.value) == 45.0
    assert reports == expected(10, 3)


def test_off_is_the_same_program():
    def run(**kw):
        return scanax.scan(step, jnp.float32(1.0), xs(9), **kw)

    plain = str(jax.make_jaxpr(run)())
    assert str(jax.make_jaxpr(lambda: run(progress=False))()) == plain
    off = dict(progress=False, remat=False, keep_every=1, keep="all")
    assert str(jax.make_jaxpr(lambda: run(**off))()) == plain


def test_update_stays_in_the_forward_loop_under_grad(reports):
    # If the update were hoisted out of the loop it would fire once, not per tick.
    jax.grad(lambda c: scanax.scan(step, c, xs(40), progress=10)[0])(1.0)
    assert reports == expected(40, 10)


def test_jit_runs_twice_reports_twice(reports):
    fn = jax.jit(lambda c: scanax.scan(step, c, xs(12), progress=6)[0])
    fn(1.0)
    fn(2.0)
    assert reports == expected(12, 6) * 2


@pytest.mark.parametrize(
    "length, every", [(1, 2), (2, 2), (49, 3), (58, 3), (66, 6), (1000, 50)]
)
def test_default_every(length, every, reports):
    """About 20 updates; a divisor of the length when one gives 10 to 20."""
    scanax.scan(lambda c, _: (c + 1, None), 0, length=length, progress=True)
    assert every >= math.ceil(length / 20)
    assert reports == expected(length, every)
    assert len(reports) <= 21
    if length > 2:
        assert len(reports) < length  # never every step


def test_length_zero_reports_nothing(reports):
    scanax.scan(lambda c, _: (c + 1, None), 0, length=0, progress=True)
    assert reports == []


@pytest.mark.parametrize("unroll", [1, 4])
def test_real_bar(capsys, unroll):
    spec = scanax.Progress(every=1, desc="simulate", unit="step")
    fn = jax.jit(
        lambda: scanax.scan(
            lambda c, _: (c + 1, None), 0, length=30, unroll=unroll, progress=spec
        )
    )
    fn()
    fn()
    jax.effects_barrier()  # (the bar's callbacks may run after the call returns)
    err = capsys.readouterr().err
    assert err.count("simulate") >= 2 and err.count("30/30") == 2


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (
            "yes",
            TypeError,
            r"scanax.scan: `progress` must be False, True, a positive int",
        ),
        (1.5, TypeError, r"scanax.scan: `progress` must be"),
        (0, ValueError, r"scanax.scan: the progress bar's `every` must be a positive"),
        (-3, ValueError, r"`every` must be a positive int"),
        (scanax.Progress(every=0), ValueError, r"`every` must be a positive int"),
        (scanax.Progress(every=2.0), TypeError, r"`every` must be a positive int"),
    ],
)
def test_bad_progress(bad, err, match):
    with pytest.raises(err, match=match):
        scanax.scan(lambda c, _: (c, None), 0.0, length=3, progress=bad)


def test_missing_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(
        ImportError,
        match=r"(?s)scanax.scan: `progress=` needs tqdm, which is not installed.*"
        r"Fix: `pip install tqdm`.*or pass progress=False",
    ):
        scanax.scan(lambda c, _: (c, None), 0.0, length=3, progress=True)
