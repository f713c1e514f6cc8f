"""``scanax.evaluate`` of a test split (issue 26) against Keras 3's
``model.evaluate`` of the same-shaped model and the hand-written eager
``eval_fn(model, test)``.

The test split: 10,000 random examples (2,000 with ``quick``), 10 classes,
evaluated in batches of 256 (an uneven last batch), softmax cross-entropy and
accuracy. Two networks:

* MLP 64→128→10 (an NNX module);
* small CNN on 8×8×1 images (sklearn digits-sized): conv 3×3×16, ReLU, conv
  3×3×32, ReLU, global mean pool, dense 10.

Rows, per network:

1. **warm** (everything compiled, interleaved medians in one process, both
   called once before timing): ``scanax.evaluate`` ÷ Keras's ``model.evaluate``
   (``KERAS_BACKEND=jax``, ``verbose=0``; the faster of ``steps_per_execution``
   1 and 32 is the baseline). Target ≤ 1.0.
2. **first call** (compile included): a new model structure each repeat (hidden
   width +1), scanax's first ``evaluate`` ÷ a new Keras model's first
   ``evaluate`` (its compiles included), interleaved. No target, reported.
3. **eager**: ``scanax.evaluate`` (warm) ÷ ``eval_fn(model, test)`` called
   eagerly on the whole split (NNX in eval mode, op by op), interleaved apart
   from the Keras runs. No target.

Both sides end with the metrics on the host as Python floats. Keras is an
optional benchmark dependency: without it the Keras rows are skipped with a note.
Run alone with ``python -m benchmarks.bench_evaluate``.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]

BATCH = 256
CLASSES = 10
SPES = (1, 32)  # Keras steps_per_execution candidates


class MLP(nnx.Module):
    def __init__(self, hidden, rngs):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


class CNN(nnx.Module):
    def __init__(self, hidden, rngs):
        self.c1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(16, hidden, (3, 3), rngs=rngs)
        self.out = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))
        return self.out(jnp.mean(x, axis=(1, 2)))


NETWORKS = {
    # name: (module, input shape, hidden width)
    "MLP 64→128→10": (MLP, (64,), 128),
    "CNN 8×8×1 conv16-conv32": (CNN, (8, 8, 1), 32),
}


def eval_fn(model, batch):
    x, y = batch
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


def _data(shape, n):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, *shape), dtype=np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int32)
    return x, y


def _keras_module():
    """Keras 3 on JAX in this process, or None (with the reason)."""
    if importlib.util.find_spec("keras") is None:
        return None, "Keras 3 not installed (pip install 'keras>=3')"
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if not keras.__version__.startswith("3") or keras.backend.backend() != "jax":
        return None, f"keras {keras.__version__} on {keras.backend.backend()}"
    return keras, ""


def _keras_model(keras, name, hidden, spe):
    _, shape, _ = NETWORKS[name]
    if len(shape) == 1:
        layers = [
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    else:
        layers = [
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(hidden, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(CLASSES),
        ]
    model = keras.Sequential([keras.Input(shape), *layers])
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=spe,
    )
    return model


def _scanax_call(model, test):
    def call():
        out = scanax.evaluate(model, eval_fn, test, batch_size=BATCH)
        assert isinstance(out["loss"], float)

    return call


def _keras_call(model, test):
    def call():
        loss, acc = model.evaluate(*test, batch_size=BATCH, verbose=0)
        assert isinstance(loss, float)

    return call


def _eager_call(model, test):
    ref = nnx.clone(model)
    ref.eval()
    test = jax.device_put(test)

    def call():
        loss, extra = eval_fn(ref, test)
        float(loss), float(extra["accuracy"])

    return call


def _case(name, n, repeats, keras, why) -> list[dict]:
    module, shape, hidden = NETWORKS[name]
    test = _data(shape, n)
    desc = f"{name}, {n:,} examples, batch {BATCH}"
    model = module(hidden, nnx.Rngs(0))
    ours = _scanax_call(model, test)
    fns = {"scanax": ours}
    if keras is not None:
        for spe in SPES:
            fns[f"keras{spe}"] = _keras_call(
                _keras_model(keras, name, hidden, spe), test
            )
    t = _timing.interleaved(fns, repeats=repeats, warmup=1)
    # (apart: the eager call's large intermediates slowed the calls after it)
    eager = {"scanax": ours, "eager": _eager_call(model, test)}
    t_eager = _timing.interleaved(eager, repeats=max(3, repeats // 3), warmup=1)
    rows = []
    if keras is not None:
        best = min(SPES, key=lambda s: t[f"keras{s}"])
        rows.append(
            _timing.row(
                "evaluate",
                f"warm: {desc}",
                t["scanax"],
                f"keras model.evaluate (steps_per_execution={best})",
                t[f"keras{best}"],
                target=1.0,
                notes=", ".join(f"spe {s}: {t[f'keras{s}']:.4g} s" for s in SPES),
            )
        )
        rows.append(_first_calls(name, test, desc, keras, max(3, repeats // 2)))
    rows.append(
        _timing.row(
            "evaluate",
            f"vs eager: {desc}",
            t_eager["scanax"],
            "eval_fn(model, test) eager",
            t_eager["eager"],
            notes="" if keras is not None else f"Keras rows skipped: {why}",
        )
    )
    return rows


def _first_calls(name, test, desc, keras, repeats) -> dict:
    """New structures each repeat (one more hidden unit): first calls, compile
    included, interleaved."""
    module, _, hidden = NETWORKS[name]
    ours, theirs = [], []
    for i in range(repeats):
        width = hidden + 1 + i
        model = module(width, nnx.Rngs(i))
        ours.append(_timing.timed(_scanax_call(model, test)))
        kmodel = _keras_model(keras, name, width, 1)
        theirs.append(_timing.timed(_keras_call(kmodel, test)))
    return _timing.row(
        "evaluate",
        f"first call: {desc}",
        statistics.median(ours),
        "keras model.evaluate first call (steps_per_execution=1)",
        statistics.median(theirs),
        notes=f"compile included, median of {repeats} new structures",
    )


def run(quick: bool = False) -> list[dict]:
    keras, why = _keras_module()
    n = 2000 if quick else 10_000
    repeats = 5 if quick else 15
    rows = []
    for name in NETWORKS:
        rows += _case(name, n, repeats, keras, why)
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run(quick="--quick" in sys.argv)))
