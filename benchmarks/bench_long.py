"""Long scans (issue 6): the cost of ``progress=``, and ``remat="sqrt"`` under grad.

* progress overhead: ``scanax.scan(..., progress=True)`` (about 20 updates) against
  the same scan without a bar, on a 10,000-step scan with a 128×128 matmul body
  (target ≤ 1.05) and on a cheap body; ``jax_tqdm.scan_tqdm`` (its default, 20
  updates) measured the same way against plain ``lax.scan``, when installed.
* ``remat="sqrt"`` against the plain scan under ``jax.grad``: compiled temp memory
  (``memory_analysis().temp_size_in_bytes``, target ≤ 0.3 at T = 1000) and time,
  at T ∈ {1000, 10000}.
* ``scanax.scan_until``'s gradient (issue 27): an ODE event (a damped pendulum,
  RK4, dt = 1e-3, until theta < 0, at most 10,000 steps), the gradient of
  |y(t_stop)|² with respect to y0 and the damping, against a masked ``lax.scan``
  of the steps taken (target ≤ 2; with ``remat=True``/``"sqrt"``, against the same
  scan with a ``jax.checkpoint`` body, the recomputation ``lax.scan`` does), the
  masked ``lax.scan`` of all 10,000 steps, and ``diffrax.diffeqsolve`` with an
  ``Event`` (when installed); compiled temp memory against the masked full scan
  (target ≤ 1); float32 and float64.

Timings are interleaved medians under ``jax.jit``. Bars draw to stderr.
Run alone with ``python -m benchmarks.bench_long``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]


def _time_all(fns, args, repeats):
    """Interleaved medians (s) of jitted ``fns``, with calls batched to ~50 ms."""
    jitted = {name: jax.jit(fn) for name, fn in fns.items()}
    for fn in jitted.values():  # compile outside the timing
        _timing.block(fn(*args))
    slowest = max(
        _timing.timed(lambda f=f: _timing.block(f(*args))) for f in jitted.values()
    )
    k = max(1, round(0.05 / slowest))

    def sample(fn):
        def go():
            for _ in range(k):
                out = fn(*args)
            _timing.block(out)

        return go

    t = _timing.interleaved({n: sample(f) for n, f in jitted.items()}, repeats=repeats)
    return {n: v / k for n, v in t.items()}


def _time_pair(fa, fb, args, repeats):
    t = _time_all({"a": fa, "b": fb}, args, repeats)
    return t["a"], t["b"]


def _progress_rows(name, body, init, n, repeats):
    """No bar, scanax's bar and jax_tqdm's, interleaved: they share the noise."""
    xs = jnp.arange(n)
    fns = {
        "none": lambda c: jax.lax.scan(body, c, xs)[0],
        "scanax": lambda c: scanax.scan(
            body, c, xs, progress=scanax.Progress(leave=False)
        )[0],
    }
    try:
        from jax_tqdm import scan_tqdm
    except ImportError:
        scan_tqdm = None
    if scan_tqdm is not None:
        tqdm_body = scan_tqdm(n, leave=False)(body)
        fns["jax_tqdm"] = lambda c: jax.lax.scan(tqdm_body, c, xs)[0]
    # Twice the repeats: the target (5%) is within this machine's run-to-run noise.
    t = _time_all(fns, (init,), 2 * repeats)
    rows = [
        _timing.row(
            "long: progress overhead",
            f"{name}, {n} steps, progress=True (~20 updates)",
            t["scanax"],
            "lax.scan, no bar",
            t["none"],
            target=1.05 if "matmul" in name else None,
        )
    ]
    if "jax_tqdm" in t:
        rows.append(
            _timing.row(
                "long: progress overhead",
                f"{name}, {n} steps, jax_tqdm.scan_tqdm (default, 20 updates)",
                t["jax_tqdm"],
                "lax.scan, no bar",
                t["none"],
                notes="reference point, not scanax",
            )
        )
    return rows


def _progress(quick: bool, repeats: int) -> list[dict]:
    n = 10_000  # the target is set for 10,000 steps; quick only repeats less
    d = 128
    w = jr.normal(jr.key(0), (d, d)) / d**0.5

    def matmul(h, i):
        return jnp.tanh(h @ w + i.astype(h.dtype) * 1e-4), None

    def cheap(c, i):
        return c + i.astype(c.dtype), None

    h0 = jr.normal(jr.key(1), (d, d))
    rows = _progress_rows(f"matmul body ({d}x{d})", matmul, h0, n, repeats)
    rows += _progress_rows(
        "cheap body (c + i, float32[4])", cheap, jnp.zeros(4), n, repeats
    )
    return rows


def _remat(quick: bool, repeats: int) -> list[dict]:
    rows = []
    b, d = 8, 128
    w = jr.normal(jr.key(2), (d, d)) / d**0.5
    for n in (1_000,) if quick else (1_000, 10_000):
        xs = jr.normal(jr.key(3), (n, b, d))
        h0 = jnp.zeros((b, d))

        def loss(w, h0, xs, remat):
            def body(h, x):
                h = jnp.tanh(h @ w + x)
                return h, jnp.mean(h**2)

            h, ys = scanax.scan(body, h0, xs, remat=remat)
            return jnp.sum(h) + jnp.sum(ys)

        grad = jax.grad(loss)
        args = (w, h0, xs)
        mem = {}
        for remat in (False, "sqrt"):
            lowered = jax.jit(grad, static_argnums=3).lower(*args, remat)
            mem[remat] = lowered.compile().memory_analysis().temp_size_in_bytes
        rows.append(
            _timing.row(
                "long: remat gradient memory",
                f'remat="sqrt", T={n}, h float32[{b}, {d}]',
                mem["sqrt"] / 2**20,
                "plain scan",
                mem[False] / 2**20,
                target=0.3 if n == 1_000 else None,
                unit="MiB",
                notes="compiled temp_size_in_bytes of jit(grad)",
            )
        )
        a, t = _time_pair(
            lambda *a, g=grad: g(*a, "sqrt"),
            lambda *a, g=grad: g(*a, False),
            args,
            repeats,
        )
        rows.append(
            _timing.row(
                "long: remat gradient time",
                f'remat="sqrt", T={n}, h float32[{b}, {d}]',
                a,
                "plain scan",
                t,
                notes="one extra forward pass: expect below 2x",
            )
        )
    return rows


_DT, _T = 1e-3, 10_000


def _pendulum(y, damping):
    theta, omega = y[0], y[1]
    return jnp.stack([omega, -9.81 * jnp.sin(theta) - damping * omega])


def _rk4(y, damping):
    dt = jnp.asarray(_DT, y.dtype)
    k1 = _pendulum(y, damping)
    k2 = _pendulum(y + dt / 2 * k1, damping)
    k3 = _pendulum(y + dt / 2 * k2, damping)
    k4 = _pendulum(y + dt * k3, damping)
    return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _event_losses(dtype):
    """The event's loss by scan_until, masked lax.scans (all steps, the steps
    taken) and diffrax (or None); the steps taken."""

    def until_loss(y0, damping, remat=False):
        y, _, _ = scanax.scan_until(
            lambda y, _: (_rk4(y, damping), None),
            y0,
            length=_T,
            until=lambda y: y[0] < 0,
            remat=remat,
        )
        return jnp.sum(y**2)

    def masked_loss(y0, damping, length, checkpoint=False):
        def body(state, _):
            y, done = state
            new = _rk4(y, damping)
            y = jnp.where(done, y, new)
            return (y, done | (y[0] < 0)), None

        body = jax.checkpoint(body) if checkpoint else body
        (y, _), _ = jax.lax.scan(body, (y0, jnp.zeros((), bool)), length=length)
        return jnp.sum(y**2)

    def plain_loss(y0, damping, length):
        y, _ = jax.lax.scan(lambda y, _: (_rk4(y, damping), None), y0, length=length)
        return jnp.sum(y**2)

    y0 = jnp.array([1.0, 0.0], dtype)
    damping = jnp.asarray(0.3, dtype)
    steps = int(
        scanax.scan_until(
            lambda y, _: (_rk4(y, damping), None),
            y0,
            length=_T,
            until=lambda y: y[0] < 0,
        )[2]
    )
    losses = {
        "scan_until": until_loss,
        'scan_until, remat="sqrt"': lambda y, d: until_loss(y, d, "sqrt"),
        "scan_until, remat=True": lambda y, d: until_loss(y, d, True),
        "masked lax.scan, steps taken": lambda y, d: masked_loss(y, d, steps),
        "masked lax.scan, steps taken, jax.checkpoint body": lambda y, d: masked_loss(
            y, d, steps, checkpoint=True
        ),
        "lax.scan, steps taken (no mask)": lambda y, d: plain_loss(y, d, steps),
        f"masked lax.scan, {_T} steps": lambda y, d: masked_loss(y, d, _T),
    }
    try:
        import diffrax
    except ImportError:
        diffrax = None
    if diffrax is not None:

        class RK4(diffrax.AbstractERK):  # the classical tableau (diffrax has none)
            tableau = diffrax.ButcherTableau(
                a_lower=(np.array([0.5]), np.array([0.0, 0.5]), np.array([0, 0, 1.0])),
                b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
                b_error=np.zeros(4),
                c=np.array([0.5, 0.5, 1.0]),
            )
            interpolation_cls = diffrax.ThirdOrderHermitePolynomialInterpolation.from_k

            def order(self, terms):
                return 4

        def diffrax_loss(y0, damping):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, d: _pendulum(y, d)),
                RK4(),
                t0=0.0,
                t1=_T * _DT,
                dt0=_DT,
                y0=y0,
                args=damping,
                event=diffrax.Event(lambda t, y, args, **kw: y[0] < 0),
                max_steps=_T,
            )
            return jnp.sum(sol.ys[-1] ** 2)

        losses["diffrax.Event"] = diffrax_loss
    return losses, (y0, damping), steps


def _event(quick: bool, repeats: int) -> list[dict]:
    rows = []
    for dtype in ("float32",) if quick else ("float32", "float64"):
        with jax.enable_x64(dtype == "float64"):
            losses, args, steps = _event_losses(getattr(jnp, dtype))
            grads = {k: jax.grad(fn, argnums=(0, 1)) for k, fn in losses.items()}
            t = _time_all(grads, args, repeats)
            mem = {
                k: jax.jit(g).lower(*args).compile().memory_analysis()
                for k, g in grads.items()
            }
        case = f"pendulum event, RK4, {dtype}, stops at step {steps} of {_T}"
        checkpointed = "masked lax.scan, steps taken, jax.checkpoint body"
        for ours in (
            "scan_until",
            "scan_until, remat=True",
            'scan_until, remat="sqrt"',
        ):
            label = f"{case}, {ours}"
            remat = ours != "scan_until"
            for base, target in (
                ("masked lax.scan, steps taken", None if remat else 2.0),
                # remat against the same recomputation done by lax.scan
                (checkpointed, 2.0 if remat else None),
                ("lax.scan, steps taken (no mask)", None),
                (f"masked lax.scan, {_T} steps", None),
                ("diffrax.Event", None),
            ):
                if base in t:
                    rows.append(
                        _timing.row(
                            "long: scan_until gradient time",
                            label,
                            t[ours],
                            base,
                            t[base],
                            target=target,
                        )
                    )
            full = f"masked lax.scan, {_T} steps"
            rows.append(
                _timing.row(
                    "long: scan_until gradient memory",
                    label,
                    mem[ours].temp_size_in_bytes / 2**10,
                    full,
                    mem[full].temp_size_in_bytes / 2**10,
                    target=1.0,
                    unit="KiB",
                    notes="compiled temp_size_in_bytes of jit(grad)",
                )
            )
    return rows


def run(quick: bool = False) -> list[dict]:
    repeats = 5 if quick else 15
    return _progress(quick, repeats) + _remat(quick, repeats) + _event(quick, repeats)


if __name__ == "__main__":
    import sys

    if "--event" in sys.argv:  # only the scan_until rows
        print(_timing.markdown(_event("--quick" in sys.argv, 15)))
    else:
        print(_timing.markdown(run()))
