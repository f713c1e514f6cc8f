"""``python -m benchmarks``: run the benchmark suite and write its results.

It lives in the source checkout (the benchmarks are not part of the installed
package). Every ``benchmarks/bench_<name>.py`` exposes
``run(quick: bool = False) -> list[dict]``, rows made by ``benchmarks/_timing.row``
(scanax and its baseline measured side by side in one process, interleaved medians).
The runner runs each of them, one after the other, each in a fresh Python
process (what one benchmark leaves behind, allocations and compiled programs, slowed
the next by up to 10% when they shared one), and writes

* ``results.json``: ``{"machine", "date", "quick", "load_average", "rows",
  "errors", "modules"}`` (the load average before and after: other processes
  make timings noisy);
* ``results.md``: the same rows as a Markdown table, with the machine and date.

A benchmark module that fails is recorded under ``errors`` and the others still run;
the exit code is then 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

_PROG = "python -m benchmarks"
_REQUIRED = {
    "benchmark": str,
    "case": str,
    "scanax": (int, float),
    "baseline": str,
    "baseline_value": (int, float),
    "ratio": (int, float),
    "unit": str,
}


def repo_root() -> Path:
    """The source checkout this runner lives in."""
    return Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Run scanax's benchmarks (scanax vs its baselines, side by side) "
        "and write results.json and results.md.",
    )
    p.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repeats"
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only benchmarks/bench_NAME.py (repeatable)",
    )
    p.add_argument(
        "--out", metavar="DIR", help="where to write the results (default: benchmarks/)"
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help="the directory of bench_*.py files (default: the checkout's benchmarks/)",
    )
    return p


def _load(path: Path, bench_dir: Path, root: Path) -> ModuleType:
    if bench_dir == root / "benchmarks":
        return importlib.import_module(f"benchmarks.{path.stem}")
    name = f"_scanax_bench_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_module(path: Path, bench_dir: Path, root: Path, quick: bool) -> dict:
    """``{"rows": [...], "error": {...} or None}`` of one benchmark module, run in a
    fresh Python process (``_worker``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        code = (
            "import sys; sys.path.insert(0, sys.argv[3]); "
            "from benchmarks.runner import _worker; _worker(*sys.argv[1:])"
        )
        args = [str(path), str(bench_dir), str(root), "1" if quick else "0", str(out)]
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], stderr=subprocess.PIPE, text=True
        )
        if out.is_file():
            return json.loads(out.read_text())
    return {
        "rows": [],
        "error": {
            "error": f"the benchmark's process exited with code {proc.returncode}",
            "traceback": proc.stderr[-4000:],
        },
    }


def _worker(path: str, bench_dir: str, root: str, quick: str, out: str) -> None:
    """In the benchmark's own process: run it, write its rows or its error."""
    root_path = Path(root)
    for p in (str(root_path), str(root_path / "benchmarks")):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        module = _load(Path(path), Path(bench_dir), root_path)
        result = {"rows": _check_rows(module.run(quick=quick == "1")), "error": None}
    except Exception as err:  # a failing benchmark must not stop the others
        error = {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
        result = {"rows": [], "error": error}
    Path(out).write_text(json.dumps(_jsonable(result), allow_nan=False))


def _check_rows(rows: Any) -> list[dict]:
    if not isinstance(rows, list):
        raise TypeError(f"run() must return a list of rows, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise TypeError(f"row {i} is a {type(r).__name__}, not a dict")
        for key, kind in _REQUIRED.items():
            if not isinstance(r.get(key), kind) or isinstance(r.get(key), bool):
                raise TypeError(f"row {i}: {key!r} missing or not {kind}: {r!r}")
        if not math.isfinite(r["ratio"]):
            raise ValueError(f"row {i}: ratio is not finite: {r!r}")
    return rows


def _jsonable(x: Any) -> Any:
    """Non-finite floats become null so that the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy/jax scalars
        return _jsonable(x.item())
    return x


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS does not tell)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _load_note(loads: list[float | None]) -> str:
    if None in loads:
        return ""
    return f", load average {loads[0]:g} → {loads[1]:g} (other processes)"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = repo_root()
    if not (root / "benchmarks" / "_timing.py").is_file():
        print(
            f"{_PROG}: no benchmarks/ directory next to the scanax package "
            f"(looked in {root / 'benchmarks'}). The benchmarks ship with the source "
            "only.\nFix: clone the repository and `pip install -e .` from it, then "
            "run `python -m benchmarks` again.",
            file=sys.stderr,
        )
        return 2
    for p in (str(root), str(root / "benchmarks")):
        if p not in sys.path:
            sys.path.insert(0, p)
    from benchmarks import _timing

    bench_dir = Path(args.dir).resolve() if args.dir else root / "benchmarks"
    found = {p.stem.removeprefix("bench_"): p for p in bench_dir.glob("bench_*.py")}
    if args.only:
        wanted = [n.removeprefix("bench_").removesuffix(".py") for n in args.only]
        unknown = [n for n in wanted if n not in found]
        if unknown:
            print(
                f"{_PROG}: no benchmark named {', '.join(unknown)} in "
                f"{bench_dir}; available: {', '.join(sorted(found)) or 'none'}.",
                file=sys.stderr,
            )
            return 2
        found = {n: found[n] for n in wanted}
    if not found:
        print(
            f"{_PROG}: no bench_*.py files in {bench_dir}.",
            file=sys.stderr,
        )
        return 2

    load_before = _load_average()
    rows, errors, modules = [], [], []
    for name, path in sorted(found.items()):
        print(f"{_PROG}: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        result = _run_module(path, bench_dir, root, args.quick)
        got = result["rows"]
        if result["error"] is not None:
            errors.append({"module": name, **result["error"]})
            print(
                f"{_PROG}: {name} FAILED: {errors[-1]['error']}",
                file=sys.stderr,
            )
        seconds = time.perf_counter() - t0
        modules.append({"name": name, "seconds": seconds, "rows": len(got)})
        rows.extend(got)
        print(
            f"{_PROG}: {name}: {len(got)} rows in {seconds:.1f} s",
            file=sys.stderr,
        )

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = _timing.machine()
    result = {
        "machine": machine,
        "date": date,
        "quick": args.quick,
        "load_average": [load_before, _load_average()],
        "rows": rows,
        "errors": errors,
        "modules": modules,
    }
    out = Path(args.out) if args.out else root / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(_jsonable(result), indent=1, allow_nan=False) + "\n"
    )
    table = _timing.markdown(rows)
    devices = ", ".join(machine["devices"])
    md = [
        f"Measured {date} on {machine['platform']}, {machine['cpus']} CPUs, "
        f"JAX {machine['jax']} ({machine['backend']}: {devices})"
        + (", quick mode" if args.quick else "")
        + _load_note(result["load_average"])
        + ". Ratio = scanax / baseline, medians of interleaved runs in one process "
        "per benchmark file; lower is better for scanax.",
        "",
        table,
    ]
    for e in errors:
        md += ["", f"**{e['module']} failed**: `{e['error']}`"]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(table)
    print(f"{_PROG}: wrote {out / 'results.json'} and {out / 'results.md'}")
    return 1 if errors else 0
