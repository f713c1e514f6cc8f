"""``scanax demo`` end to end: exit 0, the report, the plot, and that it learns."""

from __future__ import annotations

import importlib.util
import re

import numpy as np

from scanax import _demo
from scanax.__main__ import main

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "40", "--seed", "1", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    m = re.search(r"validation loss: ([\d.]+) before training → ([\d.]+) after", report)
    assert m, report
    before, after = float(m[1]), float(m[2])
    assert after < 0.5 * before  # it learns, even in 40 steps
    assert re.search(r"final train loss: [\d.]+", report)
    assert re.search(r"scanax.fit: 40 steps in [\d.]+ s = [\d,]+ steps/s", report)
    assert re.search(r"Python loop of nnx.jit steps: [\d,]+ steps/s", report)
    assert re.search(r"speed-up of scanax.fit: [\d.]+x", report)
    if HAS_MPL:
        png = out / "loss.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"loss curve: {png}" in report
    else:
        assert "matplotlib is not installed" in report

    # Again without the plot (compiled functions are reused: this run is quick).
    out2 = tmp_path / "no-plot"
    assert _demo.main(["--steps", "40", "--no-plot", "--out", str(out2)]) == 0
    report = capsys.readouterr().out
    assert "speed-up of scanax.fit" in report and "loss curve" not in report
    assert not out2.exists()


def test_bad_steps(capsys):
    assert _demo.main(["--steps", "0"]) == 2
    assert "--steps must be a positive int" in capsys.readouterr().err


def test_missing_framework(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "optax" else real(n, *a)
    )
    assert _demo.main(["--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "scanax demo: needs optax" in err and "pip install 'scanax[all]'" in err


def test_data_is_deterministic():
    x1, y1 = _demo.make_data(3, 4)
    x2, y2 = _demo.make_data(3, 4)
    assert x1.shape == (4, _demo.SEQ_LEN, 1) and y1.shape == x1.shape
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # targets: the next value
