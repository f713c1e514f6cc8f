"""``scanax.scan`` against ``jax.lax.scan`` (issue 2), side by side in one process.

Three comparisons, all under ``jax.jit``, timed as interleaved medians:

* a cheap body (``carry + 1`` on a small vector, 100k steps): the
  per-step overhead of the loop itself;
* a matmul body (``tanh(h @ w + x)`` on 128×128 matrices);
* a 128×128 weight broadcast with ``in_axes=None`` against the same weight reached
  through the body's closure with ``lax.scan``.

With no new option, ``scanax.scan`` lowers to one plain ``lax.scan``: the notes of
each row say whether the two jaxprs print identically. Target: every ratio ≤ 1.03.

Run alone with ``python -m benchmarks.bench_scan``, or with every benchmark through
``scanax bench``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

TARGET = 1.03


def _same_jaxpr(f, g, *args) -> str:
    same = str(jax.make_jaxpr(f)(*args)) == str(jax.make_jaxpr(g)(*args))
    return "jaxprs identical" if same else "jaxprs differ"


def _assert_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    assert all(jnp.array_equal(u, v) for u, v in zip(la, lb, strict=True))


def _compare(case, fa, fb, args, baseline, repeats, notes=""):
    ja, jb = jax.jit(fa), jax.jit(fb)
    _timing.block(ja(*args))  # compile both outside the timing
    _timing.block(jb(*args))
    # Several calls per sample, so that one sample lasts ~20 ms and timer and
    # dispatch noise do not dominate short loops; the ratio is unaffected.
    k = max(1, round(0.02 / _timing.timed(lambda: _timing.block(ja(*args)))))

    def sample(fn):
        def go():
            for _ in range(k):
                out = fn(*args)
            _timing.block(out)

        return go

    t = _timing.interleaved({"scanax": sample(ja), "base": sample(jb)}, repeats=repeats)
    return _timing.row(
        "scan",
        case,
        t["scanax"] / k,
        baseline,
        t["base"] / k,
        target=TARGET,
        notes=notes,
    )


def _cheap(quick: bool, repeats: int) -> dict:
    n = 100_000

    def body(c, _):
        return c + 1.0, None

    def ours(c):
        return scanax.scan(body, c, length=n)[0]

    def theirs(c):
        return jax.lax.scan(body, c, length=n)[0]

    c0 = jnp.zeros(4)
    _assert_equal(jax.jit(ours)(c0), jax.jit(theirs)(c0))
    notes = _same_jaxpr(ours, theirs, c0)
    return _compare(
        f"cheap body (c + 1, float32[4]), {n} steps",
        ours,
        theirs,
        (c0,),
        "lax.scan",
        repeats,
        notes,
    )


def _matmul(quick: bool, repeats: int) -> dict:
    n, d = (100, 128) if quick else (500, 128)
    k1, k2, k3 = jr.split(jr.key(0), 3)
    w = jr.normal(k1, (d, d)) / d**0.5
    h0 = jr.normal(k2, (d, d))
    xs = jr.normal(k3, (n, d, d))

    def ours(w, h0, xs):
        return scanax.scan(lambda h, x: (jnp.tanh(h @ w + x), h[0, 0]), h0, xs)

    def theirs(w, h0, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h[0, 0]), h0, xs)

    args = (w, h0, xs)
    a, b = jax.jit(ours)(*args), jax.jit(theirs)(*args)
    _assert_equal(a, b)
    notes = _same_jaxpr(ours, theirs, *args)
    return _compare(
        f"matmul body (tanh(h @ w + x), {d}x{d}), {n} steps",
        ours,
        theirs,
        args,
        "lax.scan",
        repeats,
        notes,
    )


def _broadcast(quick: bool, repeats: int) -> dict:
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

    args = (w, h0, xs)
    a, b = jax.jit(ours)(*args), jax.jit(theirs)(*args)
    _assert_equal(a, b)
    notes = _same_jaxpr(ours, theirs, *args) + " (weight as a scan operand in both)"
    return _compare(
        f"broadcast {d}x{d} weight (in_axes=None), {n} steps",
        ours,
        theirs,
        args,
        "lax.scan + closure",
        repeats,
        notes,
    )


def run(quick: bool = False) -> list[dict]:
    repeats = 7 if quick else 21
    return [_cheap(quick, repeats), _matmul(quick, repeats), _broadcast(quick, repeats)]


if __name__ == "__main__":
    print(_timing.markdown(run()))
