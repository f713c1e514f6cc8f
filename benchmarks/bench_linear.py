"""``scanax.linear_scan``: ``method="auto"`` against the best of its three methods.

``h_t = a * h_{t-1} + b_t`` with a time-invariant diagonal ``a`` of shape ``[D]``,
``b`` of shape ``[T, B, D]`` (B=8, D=64), float32 and complex64, T in {1k, 4k, 16k};
forward (``h``) and gradient (``jax.grad`` of ``sum(|h|^2)`` w.r.t. ``a`` and
``b``), under ``jax.jit``, interleaved medians. The baseline is the fastest of
``method="sequential"``, ``"associative"`` and ``"chunked"`` timed side by side (all
three in the notes), then timed again in a pair with ``"auto"``. Target:
``"auto"`` ≤ 1.10× the best. Then the compile time of ``"auto"`` against a
hand-written ``lax.scan`` of the same recurrence (fresh functions, median of 3
compiles of new lengths), target ≤ 1.5×. Then ``method="associative"`` against
the hand-written ``jax.lax.associative_scan`` it replaces, at the minimal LRU's
shapes (complex64 ``b`` of batch 32, T 1k and 4k, state 64 and 256, a ``[N]``
decay; forward and gradient in one ``value_and_grad``): time-major, against
``associative_scan`` over axis 0; batch-major (``axis=1``), against the minimal
LRU's ``vmap`` over the batch of a per-sequence scan. Target ≤ 1.05×, values
equal. On CPU ``"auto"`` is
``"sequential"``, so the speed rows compare a program with itself: they show the
noise of the machine as much as anything.

Run alone with ``python -m benchmarks.bench_linear``.
"""

from __future__ import annotations

import collections
import re
import statistics

import jax
import jax.numpy as jnp
import jax.random as jr

import scanax
from scanax._linear_scan import resolve_method

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

try:
    linear_scan = scanax.linear_scan
except AttributeError:  # before the export lands
    from scanax._linear_scan import linear_scan

B, D = 8, 64
LENGTHS = (1024, 4096, 16384)
METHODS = ("sequential", "associative", "chunked")
TARGET, COMPILE_TARGET = 1.10, 1.5


def _inputs(t: int, dtype):
    k1, k2, k3 = jr.split(jr.key(0), 3)
    a = jr.uniform(k1, (D,), minval=0.9, maxval=0.999)
    b = jr.normal(k2, (t, B, D))
    if dtype == jnp.complex64:
        a = a * jnp.exp(1j * jr.uniform(k3, (D,)))
        b = b.astype(jnp.complex64)
    return a, b


def _loss(h):
    return jnp.sum(jnp.abs(h) ** 2)


def _fn(run, grad: bool):
    """jit of the forward ``h``, or of the gradient w.r.t. ``a`` and ``b``."""
    if grad:
        return jax.jit(jax.grad(lambda a, b: _loss(run(a, b)), argnums=(0, 1)))
    return jax.jit(run)


def _ours(method):
    return lambda a, b: linear_scan(a, b, method=method)[0]


def _lax_scan(a, b):
    def step(h, b_t):
        h = a * h + b_t
        return h, h

    return jax.lax.scan(step, jnp.zeros(b.shape[1:], b.dtype), b)[1]


def _medians(fns, a, b, repeats):
    """Interleaved medians, with enough rounds for ~``repeats * 50 ms`` of the
    fastest (at least ``repeats``, at most ``25 * repeats``)."""
    calls = {k: (lambda fn=fn: _timing.block(fn(a, b))) for k, fn in fns.items()}
    for call in calls.values():  # compile outside the timing
        call()
    fastest = min(_timing.timed(call) for call in calls.values())
    rounds = min(max(repeats, int(repeats * 0.05 / fastest)), 25 * repeats)
    return _timing.interleaved(calls, repeats=rounds)


def _speed_rows(t, dtype, grad, repeats) -> list[dict]:
    """The three methods side by side pick the best; then ``"auto"`` against the
    best alone, as a pair: in a round robin of all four, whichever ran right after
    the associative scan (the most memory traffic) was up to 1.5x slower."""
    a, b = _inputs(t, dtype)
    fns = {m: _fn(_ours(m), grad) for m in METHODS}
    times = _medians(fns, a, b, repeats)
    best = min(METHODS, key=times.__getitem__)
    pair = _medians({"auto": _fn(_ours("auto"), grad), best: fns[best]}, a, b, repeats)
    others = ", ".join(f"{m}: {times[m]:.4g} s" for m in METHODS)
    name = jnp.dtype(dtype).name
    case = f"T={t}, B={B}, D={D}, {name}, " + ("grad" if grad else "fwd")
    return [
        _timing.row(
            "linear_scan",
            case,
            pair["auto"],
            f"best method ({best})",
            pair[best],
            target=TARGET,
            notes=f"auto = {resolve_method('auto', t)}; the three: {others}",
        )
    ]


def _compile_s(run, t, dtype, grad) -> float:
    """The median of 3 compiles (trace, lower, compile) of programs never compiled
    before: lengths ``t``, ``t + 1``, ``t + 2`` (else JAX's caches answer)."""
    times = []
    for i in range(3):
        a, b = _inputs(t + i, dtype)
        compile_ = lambda a=a, b=b: _fn(run, grad).lower(a, b).compile()
        times.append(_timing.timed(compile_))
    return statistics.median(times)


def _compile_rows(t, dtype, grad) -> list[dict]:
    ours = _compile_s(_ours("auto"), t, dtype, grad)
    base = _compile_s(_lax_scan, t, dtype, grad)
    case = f"compile, T={t}, {jnp.dtype(dtype).name}, " + ("grad" if grad else "fwd")
    return [
        _timing.row(
            "linear_scan", case, ours, "hand-written lax.scan", base, COMPILE_TARGET
        )
    ]


LRU_BATCH = 32
LRU_SHAPES = ((1024, 64), (4096, 64), (1024, 256), (4096, 256))
HAND_TARGET = 1.05


def _monoid(earlier, later):
    a1, b1 = earlier
    a2, b2 = later
    return a2 * a1, a2 * b1 + b2


def _hand_time_major(lam, bu):
    return jax.lax.associative_scan(_monoid, (jnp.broadcast_to(lam, bu.shape), bu))[1]


def _hand_batch_major(lam, bu):  # the minimal LRU: one sequence, vmapped
    def one(bu):
        return jax.lax.associative_scan(
            _monoid, (jnp.repeat(lam[None], bu.shape[0], axis=0), bu)
        )[1]

    return jax.vmap(one)(bu)


def _hand_rows(t, n, repeats) -> list[dict]:
    k1, k2, k3 = jr.split(jr.key(1), 3)
    r = jr.uniform(k1, (n,), minval=0.9, maxval=0.999)
    lam = (r * jnp.exp(1j * jr.uniform(k2, (n,)))).astype(jnp.complex64)
    bu = jax.lax.complex(*jr.normal(k3, (2, LRU_BATCH, t, n)))
    rows = []
    for layout, axis, hand in (
        ("time-major", 0, _hand_time_major),
        ("batch-major", 1, _hand_batch_major),
    ):
        x = jnp.swapaxes(bu, 0, 1) if axis == 0 else bu

        def ours(lam, bu, axis=axis):
            return linear_scan(lam, bu, axis=axis, method="associative")[0]

        fns = {
            k: jax.jit(jax.value_and_grad(lambda lam, b, f=f: _loss(f(lam, b)), (0, 1)))
            for k, f in (("ours", ours), ("hand", hand))
        }
        got, want = (jax.tree.leaves(fns[k](lam, x)) for k in ("ours", "hand"))
        for g, w in zip(got, want, strict=True):  # values equal (to rounding)
            scale = float(jnp.max(jnp.abs(w)))
            assert float(jnp.max(jnp.abs(g - w))) <= 1e-4 * scale, layout
        times = _medians(fns, lam, x, repeats)
        ops = [_ops(fns[k], lam, x) for k in ("ours", "hand")]
        same = "the same" if ops[0] == ops[1] else "not the same"
        case = f"associative, B={LRU_BATCH}, T={t}, N={n}, complex64, {layout}"
        rows.append(
            _timing.row(
                "linear_scan",
                case + ", fwd+grad",
                times["ours"],
                "hand-written lax.associative_scan",
                times["hand"],
                target=HAND_TARGET,
                notes=f"{same} optimized program (operations counted)",
            )
        )
    return rows


def _ops(fn, *args) -> collections.Counter:
    """The operations of ``fn``'s optimized program, counted by kind."""
    text = fn.lower(*args).compile().as_text()
    return collections.Counter(re.findall(r"= \S+ ([\w-]+)\(", text))


def run(quick: bool = False) -> list[dict]:
    lengths = LENGTHS[:1] if quick else LENGTHS
    repeats = 3 if quick else 7
    rows = []
    for dtype in (jnp.float32, jnp.complex64):
        for t in lengths:
            for grad in (False, True):
                rows += _speed_rows(t, dtype, grad, repeats)
    for dtype in (jnp.float32, jnp.complex64):
        for grad in (False, True):
            rows += _compile_rows(lengths[-1] if quick else 4096, dtype, grad)
    for t, n in LRU_SHAPES[:1] if quick else LRU_SHAPES:
        rows += _hand_rows(t, n, repeats)
    return rows


if __name__ == "__main__":
    import sys

    print(_timing.markdown(run(quick="--quick" in sys.argv[1:])))
