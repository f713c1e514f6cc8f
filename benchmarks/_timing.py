"""Side-by-side timing: interleaved runs, medians, ratios, and a machine description.

Machines are noisy, so every comparison runs its candidates in one process, round
robin, and reports medians and their ratio rather than single absolute times.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax


def block(x):
    return jax.block_until_ready(x)


def interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 1
) -> dict[str, float]:
    """Median wall time (s) of each zero-argument callable, run round robin.

    Each callable must do its whole job, including ``block_until_ready``.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn: Callable[[], object]) -> float:
    """Wall time of one call (for compile times: call on a fresh function)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def row(
    benchmark: str,
    case: str,
    scanax_s: float,
    baseline: str,
    baseline_s: float,
    target: float | None = None,
    unit: str = "s",
    notes: str = "",
) -> dict:
    """One result row: ``ratio`` is scanax / baseline (lower is better for scanax)."""
    ratio = scanax_s / baseline_s if baseline_s else float("nan")
    return {
        "benchmark": benchmark,
        "case": case,
        "scanax": scanax_s,
        "baseline": baseline,
        "baseline_value": baseline_s,
        "ratio": ratio,
        "target": target,
        "meets_target": None if target is None else bool(ratio <= target),
        "unit": unit,
        "notes": notes,
    }


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpus": os.cpu_count(),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| benchmark | case | scanax | baseline | baseline value | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tgt = "" if r["target"] is None else f"≤ {r['target']:g}"
        if r["meets_target"] is False:
            tgt += " (missed)"
        lines.append(
            f"| {r['benchmark']} | {r['case']} | {r['scanax']:.4g} {r['unit']} | "
            f"{r['baseline']} | {r['baseline_value']:.4g} {r['unit']} | "
            f"{r['ratio']:.3f} | {tgt} |"
        )
    return "\n".join(lines)
