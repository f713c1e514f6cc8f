"""FitResult.plot's drawing (scanax._fit.plot.plot): the lines it draws for one model
and for a population, saving, and its errors."""

import sys

import numpy as np
import pytest

from scanax._fit.plot import ema, plot

pytest.importorskip("matplotlib")


def history(members=None, steps=200):
    rng = np.random.default_rng(0)
    shape = (steps,) if members is None else (members, steps)
    t = np.arange(1, steps + 1)
    h = {
        "step": t,
        "loss": 2.0 / np.sqrt(t) + 0.05 * rng.random(shape),
        "acc": 1 - 1 / np.sqrt(t) + 0 * rng.random(shape),
        "val_step": np.arange(20, steps + 1, 20),
    }
    n_val = len(h["val_step"])
    vshape = (n_val,) if members is None else (members, n_val)
    h["val_loss"] = 2.0 / np.sqrt(h["val_step"]) + 0.1 * rng.random(vshape)
    h["val_acc"] = 1 - 1 / np.sqrt(h["val_step"]) + 0 * rng.random(vshape)
    return h


def labels(ax):
    return [line.get_label() for line in ax.get_lines()]


def test_one_model():
    from matplotlib.figure import Figure

    h = history()
    fig = plot(h)
    assert isinstance(fig, Figure)
    loss_ax, acc_ax = [ax for ax in fig.axes if ax.get_visible()]
    assert labels(loss_ax) == ["loss", "loss (smoothed)", "val_loss"]
    raw, smooth, val = loss_ax.get_lines()
    np.testing.assert_array_equal(raw.get_xdata(), h["step"])
    np.testing.assert_array_equal(raw.get_ydata(), h["loss"])
    np.testing.assert_allclose(smooth.get_ydata(), ema(h["loss"]))
    np.testing.assert_array_equal(val.get_xdata(), h["val_step"])
    np.testing.assert_array_equal(val.get_ydata(), h["val_loss"])
    assert loss_ax.get_title() == "loss" and loss_ax.get_xlabel() == "step"
    assert labels(acc_ax) == ["acc (smoothed)", "val_acc"]
    assert loss_ax.get_yscale() == "linear"


def test_population_one_thin_line_per_member():
    fig = plot(history(members=3))
    loss_ax = fig.axes[0]
    lines = loss_ax.get_lines()
    assert len(lines) == 9  # raw, smoothed and validation, for each of 3 members
    assert labels(loss_ax)[::3] == [
        "loss (3 members)",
        "loss (smoothed) (3 members)",
        "val_loss (3 members)",
    ]
    assert all(line.get_linewidth() <= 0.8 for line in lines)
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert legend == [
        "loss (3 members)",
        "loss (smoothed) (3 members)",
        "val_loss (3 members)",
    ]


@pytest.mark.parametrize("members", [None, 3])
def test_array_metrics_are_left_out(members):
    """A metric of more than one number per step (here 2 per step, as fit's
    history keeps it: ``[T, 2]``, a population's ``[members, T, 2]``) has no
    curve: left out, the other panels as without it (it had failed, saying
    to pass the history unchanged: review 2026-12-07)."""
    h = history(members)
    per_class = np.stack([h["acc"], 1 - h["acc"]], -1)
    val_per_class = np.stack([h["val_acc"], 1 - h["val_acc"]], -1)
    drawn = plot({**h, "per_class": per_class, "val_per_class": val_per_class})
    plain = plot(h)
    got = [labels(ax) for ax in drawn.axes if ax.get_visible()]
    assert got == [labels(ax) for ax in plain.axes if ax.get_visible()]
    assert len(got) == 2  # loss and acc


def test_saves_to_path(tmp_path):
    path = tmp_path / "curves.png"
    plot({"step": np.arange(1, 11), "loss": np.linspace(1, 0.1, 10)}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validation_only_and_log_scale():
    h = {"step": np.arange(1, 101), "loss": np.logspace(1, -3, 100)}
    fig = plot(h)
    assert fig.axes[0].get_yscale() == "log"  # positive, four decades
    fig = plot({"val_step": np.array([10, 20]), "val_mse": np.array([2.0, 1.0])})
    assert [labels(ax) for ax in fig.axes if ax.get_visible()] == [["val_mse"]]


def test_ema():
    x = np.full(100, 3.0)
    np.testing.assert_allclose(ema(x), x)  # bias-corrected: no ramp from 0
    y = np.r_[1.0, np.nan, np.full(98, 3.0)]  # span 2
    out = ema(y)
    assert out[0] == 1.0 and out[1] == 1.0 and 1.0 < out[2] < 3.0


def test_missing_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(
        ImportError,
        match=r"(?s)^FitResult.plot: plotting needs the `matplotlib` package.*"
        r"pip install scanax\[plot\]",
    ):
        plot({"loss": np.ones(3)})


@pytest.mark.parametrize(
    ("h", "error", "match"),
    [
        ([1.0, 2.0], TypeError, r"`history` must be a dict of arrays.*got list"),
        (
            {"step": np.arange(3), "acc": np.ones(3)},
            ValueError,
            r"neither 'loss' nor any 'val_\*'.*keys are: acc, step",
        ),
        (
            {"step": np.arange(3), "loss": np.ones(4)},
            ValueError,
            r"history\['loss'\] has shape \(4,\), but history\['step'\] has 3 entries",
        ),
    ],
)
def test_bad_history(h, error, match):
    with pytest.raises(error, match=r"(?s)^FitResult.plot: .*" + match):
        plot(h)
