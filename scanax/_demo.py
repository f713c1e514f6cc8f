"""``scanax demo``: train a heterogeneous 3-layer recurrent model, fused, and report.

The task is built in code (nothing is downloaded): forecast the next value of noisy
sine waves with random frequencies, phases and amplitudes, one step ahead at every
step. The model is a Flax NNX module: a GRU (24 units) → an LSTM (16) → a simple RNN
cell (8) (``WIDTHS``), run over time by ``scanax.rnn``, and a linear head.
``scanax.fit`` trains it with all steps fused into compiled loops; the same training
step is then timed as a Python loop of ``nnx.jit`` calls, for the speed-up.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

WIDTHS = (24, 16, 8)
SEQ_LEN = 16
BATCH = 16
N_TRAIN, N_VAL = 2048, 512
NOISE = 0.05


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scanax demo",
        description="Train a 3-layer heterogeneous recurrent model (GRU → LSTM → "
        "simple RNN, NNX) on noisy sine waves with scanax.fit, compare its speed with "
        "a Python loop of nnx.jit steps, and plot the loss curve.",
    )
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (1500)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument(
        "--out", default="scanax-demo", help="directory for the plot (./scanax-demo)"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    return p


def make_data(seed: int, n: int):
    """``n`` noisy sine waves of ``SEQ_LEN + 1`` steps: ``(inputs, next values)``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(SEQ_LEN + 1, dtype=np.float32)
    freq = rng.uniform(0.15, 0.6, (n, 1)).astype(np.float32)
    phase = rng.uniform(0.0, 2 * np.pi, (n, 1)).astype(np.float32)
    amp = rng.uniform(0.5, 1.5, (n, 1)).astype(np.float32)
    waves = amp * np.sin(freq * t + phase)
    waves += NOISE * rng.standard_normal(waves.shape).astype(np.float32)
    waves = waves[..., None]  # (n, SEQ_LEN + 1, 1): batch-major, one feature
    return waves[:, :-1], waves[:, 1:]


_CACHE: dict = {}  # per process: the model class and jitted functions, built once


def _forecaster_class():
    if "Forecaster" in _CACHE:
        return _CACHE["Forecaster"]
    from flax import nnx

    import scanax

    class Forecaster(nnx.Module):
        """GRU → LSTM → simple RNN over time (``scanax.rnn``), then a linear head."""

        def __init__(self, rngs: nnx.Rngs):
            a, b, c = WIDTHS
            self.gru = nnx.GRUCell(1, a, rngs=rngs)
            self.lstm = nnx.LSTMCell(a, b, rngs=rngs)
            self.simple = nnx.SimpleCell(b, c, rngs=rngs)
            self.head = nnx.Linear(c, 1, rngs=rngs)

        def __call__(self, x):  # x: (batch, time, 1)
            cells = [self.gru, self.lstm, self.simple]
            _, ys = scanax.rnn(cells, x, time_axis=1)
            return self.head(ys)

    _CACHE["Forecaster"] = Forecaster
    return Forecaster


def make_model(seed: int):
    """The demo's model, initialised in one compiled call (not op by op).

    Copies of one prototype per seed: Flax cells hold initialiser functions created
    per instance, so only copies share compiled code across calls of ``main``.
    """
    from flax import nnx

    if ("model", seed) not in _CACHE:
        cls = _forecaster_class()
        _CACHE["model", seed] = _jitted("init", lambda rngs: cls(rngs))(nnx.Rngs(seed))
    return nnx.clone(_CACHE["model", seed])


def mse(model, batch):
    import jax.numpy as jnp

    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _loop_step(model, optimizer, batch):
    from flax import nnx

    loss, grads = nnx.value_and_grad(mse)(model, batch)
    optimizer.update(model, grads)
    return loss


def _jitted(name: str, fn):
    from flax import nnx

    if name not in _CACHE:
        _CACHE[name] = nnx.jit(fn)
    return _CACHE[name]


def _python_loop_rate(model, optimizer, batches) -> float:
    """Steps/s of the same training step as a Python loop of ``nnx.jit`` calls."""
    import jax

    train_step = _jitted("train_step", _loop_step)
    jax.block_until_ready(train_step(model, optimizer, batches[0]))  # compile
    t0 = time.perf_counter()
    for batch in batches[1:]:
        loss = train_step(model, optimizer, batch)
    jax.block_until_ready(loss)
    return (len(batches) - 1) / (time.perf_counter() - t0)


def _plot(path: Path, losses, val_loss: float, naive: float) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install 'scanax[plot]')"
    import numpy as np

    steps = np.arange(1, len(losses) + 1)
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="0.8", lw=0.8, label="train loss (per step)")
    ax.plot(steps[window - 1 :], smooth, color="C0", label="train loss (smoothed)")
    ax.axhline(val_loss, color="C1", ls="--", label=f"validation loss {val_loss:.4f}")
    ax.axhline(naive, color="C3", ls=":", label=f"repeat last value {naive:.4f}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean squared error")
    a, b, c = WIDTHS
    ax.set_title(f"scanax demo: GRU({a}) → LSTM({b}) → RNN({c}) on noisy sines")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"loss curve: {path}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 1:
        print("scanax demo: --steps must be a positive int", file=sys.stderr)
        return 2

    missing = [
        m for m in ("flax", "optax", "tqdm") if importlib.util.find_spec(m) is None
    ]
    if missing:
        print(
            f"scanax demo: needs {', '.join(missing)}, which is not installed.\n"
            "Fix: pip install 'scanax[all]'",
            file=sys.stderr,
        )
        return 2

    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np
    import optax
    from flax import nnx

    import scanax

    x_train, y_train = (jnp.asarray(a) for a in make_data(args.seed, N_TRAIN))
    x_val, y_val = (jnp.asarray(a) for a in make_data(args.seed + 1, N_VAL))
    model = make_model(args.seed)
    # One optax transform per process: a new one would be new static structure, so
    # every compiled function would be compiled again.
    tx = _CACHE.setdefault("tx", optax.adam(3e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    loop_model, loop_optimizer = nnx.clone((model, optimizer))
    evaluate = _jitted("mse", mse)
    naive = float(jnp.mean((x_val - y_val) ** 2))  # forecast: the last value seen
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"scanax demo: forecasting noisy sine waves ({N_TRAIN} training and {N_VAL} "
        f"validation sequences of {SEQ_LEN} steps)\nmodel: GRU({WIDTHS[0]}) → "
        f"LSTM({WIDTHS[1]}) → simple RNN({WIDTHS[2]}) → linear, {n_params} "
        f"parameters, NNX, run over time by scanax.rnn\ntraining: {args.steps} Adam "
        f"steps, batch {BATCH}, fused by scanax.fit"
    )
    val_before = float(evaluate(model, (x_val, y_val)))

    key = jr.key(args.seed)
    steps_per_call = min(args.steps, 100)
    fit_kwargs = dict(batch_size=BATCH, key=key, steps_per_call=steps_per_call)
    # Compile first, on a copy, so that steps/s below measures training alone (with
    # a bar too: a loop that reports to a bar is another program than a silent one).
    t0 = time.perf_counter()
    warm_model, warm_optimizer = nnx.clone((model, optimizer))
    scanax.fit(
        warm_model,
        warm_optimizer,
        mse,
        (x_train, y_train),
        steps=steps_per_call,
        progress=scanax.Progress(desc="compiling", leave=False),
        **fit_kwargs,
    )
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = scanax.fit(
        model, optimizer, mse, (x_train, y_train), steps=args.steps, **fit_kwargs
    )
    fit_s = time.perf_counter() - t0
    fit_rate = result.steps / fit_s
    losses = np.asarray(result.history["loss"])
    # (the first N_VAL training sequences: one shape, so one compile for both)
    train_loss = float(evaluate(model, (x_train[:N_VAL], y_train[:N_VAL])))
    val_loss = float(evaluate(model, (x_val, y_val)))

    # The same step as a Python loop of nnx.jit calls, on the same kind of batches.
    n_loop = min(args.steps, 200) + 1
    idx = np.random.default_rng(args.seed).integers(0, N_TRAIN, (n_loop, BATCH))
    batches = [(x_train[i], y_train[i]) for i in idx]
    loop_rate = _python_loop_rate(loop_model, loop_optimizer, batches)

    print(
        f"\nvalidation loss: {val_before:.4f} before training → {val_loss:.4f} "
        f"after (repeating the last value scores {naive:.4f})\n"
        f"final train loss: {train_loss:.4f} (last step: {losses[-1]:.4f})\n"
        f"scanax.fit: {result.steps} steps in {fit_s:.2f} s = {fit_rate:,.0f} "
        f"steps/s (compiled first, in {compile_s:.1f} s)\n"
        f"Python loop of nnx.jit steps: {loop_rate:,.0f} steps/s "
        f"(over {n_loop - 1} steps)\n"
        f"speed-up of scanax.fit: {fit_rate / loop_rate:.1f}x"
    )
    if not args.no_plot:
        print(_plot(Path(args.out) / "loss.png", losses, val_loss, naive))
    return 0
