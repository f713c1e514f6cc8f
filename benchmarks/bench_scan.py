"""``scanax.scan`` against ``jax.lax.scan`` (issue 2), side by side in one process.

Three comparisons under ``jax.jit``, timed as interleaved medians:

* a cheap body (``carry + 1`` on a small vector, 100k steps): the
  per-step overhead of the loop itself;
* a matmul body (``tanh(h @ w + x)`` on 128×128 matrices);
* a 128×128 weight broadcast with ``in_axes=None`` against the same weight reached
  through the body's closure with ``lax.scan``.

With no new option, ``scanax.scan`` lowers to one plain ``lax.scan``: the notes of
each row say whether the two jaxprs print identically. Target: every ratio ≤ 1.03.

And un-jitted calls (issue 18): an eager ``scanax.scan`` with a new closure per call
(as typed at a REPL) and with the same function, against an eager ``lax.scan`` of the
same body. Target: ≤ 3× ``lax.scan`` with the same function (its best case).

Run alone with ``python -m benchmarks.bench_scan``, or with every benchmark through
``python -m benchmarks``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import jax.random as jr

import scanax
from scanax._eager import _trace as _eager_trace  # the floor of an eager call

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

TARGET = 1.03


def _same_jaxpr(f, g, *args) -> str:
    """Whether the two programs are the same, as jaxprs and as lowered StableHLO."""
    same = str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))

    def hlo(fn):
        text = jax.jit(fn).lower(*args).as_text()
        return re.sub(r"module @\S+", "module", text)

    notes = "jaxprs identical" if same else "jaxprs differ"
    if hlo(f) == hlo(g):
        notes += ", StableHLO identical (any difference in time is noise)"
    return notes


def _assert_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    assert all(jnp.array_equal(u, v) for u, v in zip(la, lb, strict=True))


def _compare(case, fa, fb, args, baseline, budget, extra=""):
    """Check both give equal results, note whether they are the same program, and
    time them side by side."""
    ja, jb = jax.jit(fa), jax.jit(fb)
    _assert_equal(ja(*args), jb(*args))  # compiles both outside the timing
    notes = _same_jaxpr(fa, fb, *args) + extra
    # Short samples (a few calls, >= 2 ms), many of them, alternating: on a shared,
    # busy machine, bursts of load then hit both sides alike and the medians hold.
    one = _timing.timed(lambda: _timing.block(ja(*args)))
    k = max(1, round(0.002 / one))
    repeats = int(min(401, max(21, budget / (2 * k * one))))

    def sample(fn):
        def go():
            for _ in range(k):  # each call waited for: no overlap of async calls
                _timing.block(fn(*args))

        return go

    t = _timing.interleaved({"scanax": sample(ja), "base": sample(jb)}, repeats=repeats)
    return _timing.row(
        "scan",
        case,
        t["scanax"] / k,
        baseline,
        t["base"] / k,
        target=TARGET,
        notes=f"{notes}; median of {repeats} alternating samples of {k} calls",
    )


def _cheap(quick: bool, budget: float) -> dict:
    n = 100_000

    def body(c, _):
        return c + 1.0, None

    def ours(c):
        return scanax.scan(body, c, length=n)[0]

    def theirs(c):
        return jax.lax.scan(body, c, length=n)[0]

    return _compare(
        f"cheap body (c + 1, float32[4]), {n} steps",
        ours,
        theirs,
        (jnp.zeros(4),),
        "lax.scan",
        budget,
    )


def _matmul(quick: bool, budget: float) -> dict:
    n, d = (100, 128) if quick else (500, 128)
    k1, k2, k3 = jr.split(jr.key(0), 3)
    w = jr.normal(k1, (d, d)) / d**0.5
    h0 = jr.normal(k2, (d, d))
    xs = jr.normal(k3, (n, d, d))

    def ours(w, h0, xs):
        return scanax.scan(lambda h, x: (jnp.tanh(h @ w + x), h[0, 0]), h0, xs)

    def theirs(w, h0, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h[0, 0]), h0, xs)

    return _compare(
        f"matmul body (tanh(h @ w + x), {d}x{d}), {n} steps",
        ours,
        theirs,
        (w, h0, xs),
        "lax.scan",
        budget,
    )


def _broadcast(quick: bool, budget: float) -> dict:
    n, d = (100, 128) if quick else (500, 128)
    k1, k2, k3 = jr.split(jr.key(1), 3)
    w = jr.normal(k1, (d, d)) / d**0.5
    h0 = jr.normal(k2, (d, d))
    xs = jr.normal(k3, (n, d, d))

    def step(h, xw):
        x, w = xw
        return jnp.tanh(h @ w + x), h[0, 0]

    def ours(w, h0, xs):
        return scanax.scan(step, h0, (xs, w), in_axes=(0, None))

    def theirs(w, h0, xs):
        return jax.lax.scan(lambda h, x: step(h, (x, w)), h0, xs)

    return _compare(
        f"broadcast {d}x{d} weight (in_axes=None), {n} steps",
        ours,
        theirs,
        (w, h0, xs),
        "lax.scan + closure",
        budget,
        " (weight as a scan operand in both)",
    )


def _eager(quick: bool, budget: float) -> list[dict]:
    """Un-jitted calls, as typed at a REPL: per-call wall time (trace, dispatch and
    run; compile only when the program is new). ``lax.scan`` caches its trace on the
    body function's identity, so it is timed with the same function every call,
    which is its best case; scanax traces every call (a closure may read new
    values) and reuses the compiled program."""
    n, d = 10, 4
    xs = jr.normal(jr.key(3), (n, d))
    c0 = jnp.zeros(d)
    w = jnp.full((d,), 0.5)

    def body(c, x):
        return jnp.tanh(c * w + x), c.sum()

    def new_closure():  # what a REPL user writes: a new function every call
        return lambda c, x: (jnp.tanh(c * w + x), c.sum())

    def ours_new():
        return _timing.block(scanax.scan(new_closure(), c0, xs))

    def ours_same():
        return _timing.block(scanax.scan(body, c0, xs))

    def lax_same():
        return _timing.block(jax.lax.scan(body, c0, xs))

    def lax_new():
        return _timing.block(jax.lax.scan(new_closure(), c0, xs))

    def trace_only():  # the floor of a call traced every time: its trace, alone
        call = lambda c, x: jax.tree.leaves(scanax.scan(new_closure(), c, x))
        return _eager_trace(call, [c0, xs])

    _assert_equal(ours_new(), lax_same())
    repeats = int(min(301, max(21, budget / 0.003)))
    t = _timing.interleaved(
        {"new": ours_new, "same": ours_same, "lax": lax_same, "trace": trace_only},
        repeats=repeats,
    )
    t_lax_new = _timing.interleaved({"lax_new": lax_new}, repeats=3 if quick else 7)
    case = f"eager call, small body (tanh(c * w + x), float32[{d}]), {n} steps"
    notes = (
        f"median of {repeats} alternating calls; tracing the call alone (no "
        f"dispatch, no run): {t['trace'] / t['lax']:.2f}x lax.scan"
    )
    return [
        _timing.row(
            "scan",
            f"{case}: a new closure per call",
            t["new"],
            "eager lax.scan, same function",
            t["lax"],
            target=3.0,
            notes=notes,
        ),
        _timing.row(
            "scan",
            f"{case}: the same function",
            t["same"],
            "eager lax.scan, same function",
            t["lax"],
            target=3.0,
            notes=notes,
        ),
        _timing.row(
            "scan",
            f"{case}: a new closure per call",
            t["new"],
            "eager lax.scan, a new closure per call (compiles every call)",
            t_lax_new["lax_new"],
            notes=f"lax.scan: median of {3 if quick else 7} calls",
        ),
    ]


def run(quick: bool = False) -> list[dict]:
    budget = (
        0.5 if quick else 6.0
    )  # seconds of timing per comparison (quick: a smoke run)
    return [
        _cheap(quick, budget),
        _matmul(quick, budget),
        _broadcast(quick, budget),
        *_eager(quick, budget),
    ]


if __name__ == "__main__":
    print(_timing.markdown(run()))
