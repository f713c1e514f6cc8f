"""``python -m benchmarks`` (``benchmarks/runner.py``): discovery, the results
schema, failures recorded, errors; ``scanax bench`` points there."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from benchmarks import runner as _bench
from scanax.__main__ import main

TINY = """
from benchmarks import _timing

def run(quick: bool = False) -> list[dict]:
    return [
        _timing.row("tiny", "fast", 1.0, "ref", 2.0, target=1.03),
        _timing.row("tiny", "slow", 3.0, "ref", 2.0, target=1.03,
                    notes="quick" if quick else "full"),
    ]
"""

BROKEN = """
def run(quick: bool = False) -> list[dict]:
    raise RuntimeError("boom")
"""


@pytest.fixture
def bench_dir(tmp_path):
    d = tmp_path / "suite"
    d.mkdir()
    (d / "bench_tiny.py").write_text(textwrap.dedent(TINY))
    (d / "bench_broken.py").write_text(textwrap.dedent(BROKEN))
    (d / "helper.py").write_text("raise AssertionError('not a benchmark')\n")
    return d


def _check_schema(result: dict, quick: bool) -> None:
    assert set(result) == {
        "machine",
        "date",
        "quick",
        "load_average",
        "rows",
        "errors",
        "modules",
    }
    assert len(result["load_average"]) == 2
    assert result["quick"] is quick
    assert {"platform", "python", "jax", "backend", "devices", "cpus"} <= set(
        result["machine"]
    )
    assert result["date"].endswith("UTC")
    for row in result["rows"]:
        for key in ("benchmark", "case", "baseline", "unit"):
            assert isinstance(row[key], str)
        for key in ("scanax", "baseline_value", "ratio"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key])
        assert row["ratio"] == pytest.approx(row["scanax"] / row["baseline_value"])


def test_runs_every_module_and_records_failures(bench_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = _bench.main(["--quick", "--dir", str(bench_dir), "--out", str(out)])
    assert rc == 1  # one module failed; the other still ran
    result = json.loads((out / "results.json").read_text())
    _check_schema(result, quick=True)
    assert [(r["case"], r["ratio"]) for r in result["rows"]] == [
        ("fast", 0.5),
        ("slow", 1.5),
    ]
    assert result["rows"][1]["notes"] == "quick"
    assert result["rows"][1]["meets_target"] is False
    [error] = result["errors"]
    assert error["module"] == "broken"
    assert error["error"] == "RuntimeError: boom"
    assert [m["name"] for m in result["modules"]] == ["broken", "tiny"]
    md = (out / "results.md").read_text()
    assert "| tiny | fast | 1 s | ref | 2 s | 0.500 | ≤ 1.03 |" in md
    assert "**broken failed**: `RuntimeError: boom`" in md
    assert "| tiny | fast |" in capsys.readouterr().out


def test_only(bench_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--only", "tiny", "--dir", str(bench_dir), "--out", str(out)]
    assert _bench.main(args) == 0
    result = json.loads((out / "results.json").read_text())
    _check_schema(result, quick=False)
    assert result["errors"] == []
    assert [r["notes"] for r in result["rows"]] == ["", "full"]


def test_unknown_name(bench_dir, tmp_path, capsys):
    args = ["--only", "nope", "--dir", str(bench_dir), "--out", str(tmp_path)]
    assert _bench.main(args) == 2
    err = capsys.readouterr().err
    assert "no benchmark named nope" in err
    assert "available: broken, tiny" in err
    assert not (tmp_path / "results.json").exists()


def test_bad_rows_are_errors(tmp_path):
    d = tmp_path / "suite"
    d.mkdir()
    (d / "bench_bad.py").write_text(
        "def run(quick=False):\n    return [{'benchmark': 'x', 'ratio': 'fast'}]\n"
    )
    assert _bench.main(["--dir", str(d), "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["rows"] == []
    assert result["errors"][0]["error"].startswith("TypeError: row 0:")


def test_without_a_source_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_bench, "repo_root", lambda: tmp_path)
    assert _bench.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "python -m benchmarks: no benchmarks/ directory" in err
    assert "clone the repository" in err


def test_bench_scan_quick(tmp_path):
    """The core's benchmark runs and gives a finite ratio per comparison."""
    assert _bench.main(["--quick", "--only", "scan", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    _check_schema(result, quick=True)
    jitted = [r for r in result["rows"] if not r["case"].startswith("eager")]
    assert len(jitted) == 3 and len(result["rows"]) == 6  # + 3 eager calls
    assert all("jaxprs identical" in r["notes"] for r in jitted)
    assert all(math.isfinite(r["ratio"]) for r in result["rows"])


def test_a_benchmark_that_kills_its_process(tmp_path):
    """Each benchmark runs in its own process: one that dies is recorded with its
    exit code, and the others still run."""
    d = tmp_path / "suite"
    d.mkdir()
    (d / "bench_tiny.py").write_text(textwrap.dedent(TINY))
    (d / "bench_dies.py").write_text(
        "import os\n\ndef run(quick=False):\n    os._exit(3)\n"
    )
    out = tmp_path / "out"
    rc = _bench.main(["--quick", "--dir", str(d), "--out", str(out)])
    assert rc == 1
    result = json.loads((out / "results.json").read_text())
    assert [e["module"] for e in result["errors"]] == ["dies"]
    assert result["errors"][0]["error"] == "the benchmark's process exited with code 3"
    assert [r["case"] for r in result["rows"]] == ["fast", "slow"]


def test_scanax_bench_says_where_the_benchmarks_are(capsys):
    assert main(["bench"]) == 2
    assert "python -m benchmarks" in capsys.readouterr().err
