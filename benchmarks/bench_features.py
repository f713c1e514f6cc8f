"""Validation, early stopping and logging inside ``scanax.fit`` (issue 16), side by
side with the same ``fit`` without them and with Keras 3.

The training: 1000 steps of Adam 1e-3 on shuffled random data of 100 batches (one
epoch = 100 steps), 1,000 validation examples evaluated every 100 steps (the
default batch: the training batch size), metrics logged to TensorBoard every 10
steps. Two networks:

* tiny MLP 32→32→1, batch 8, MSE (800 training examples);
* small MLP 784→256→10, batch 64, softmax cross-entropy (6,400 examples).

scanax: ``fit(..., eval_data=(xv, yv), eval_every=100,
log=scanax.TensorBoard(tmpdir), log_every=10)`` (and, against Keras,
``stop=scanax.EarlyStop("val_loss", patience=1000)``, which never stops and keeps
the best state on device, as ``restore_best=True`` does by default). Keras 3
(``KERAS_BACKEND=jax``): ``keras.Sequential``, ``compile(steps_per_execution=...)``,
``model.fit(x, y, epochs=10, steps_per_epoch=100, validation_data=(xv, yv),
callbacks=[EarlyStopping("val_loss", patience=1000), TensorBoard-like callback])``.
Keras's own ``keras.callbacks.TensorBoard`` writes through ``tf.summary`` and
needs TensorFlow; where TensorFlow is not installed (a JAX-only environment) the
Keras runs use a ``keras.callbacks.Callback`` writing the same scalars with
``tensorboardX`` (the library scanax's sink uses) at every callback Keras makes
(every ``steps_per_execution`` steps) and every epoch; the rows say which.
The faster of ``steps_per_execution`` 1 and 100 (one epoch) is the baseline.

Every measurement is end to end: the call returns with the last loss read onto
the host and the trained weights ready, the event files closed.

Rows:

1. **overhead** (compiled, interleaved in one process, each call continuing
   the same model): fit with evaluation + TensorBoard ÷ the same fit without
   them. Target ≤ 1.10 on the small MLP (the tiny one: no target, reported).
   The notes split the overhead into evaluation alone and TensorBoard alone
   (full mode).
2. **steady state against Keras** (a second call, everything compiled): scanax
   with evaluation, early stopping and TensorBoard ÷ Keras's ``model.fit`` with
   the same. Targets: ≤ 0.33 (≥ 3× faster) on the tiny MLP, ≤ 1.0 on the small.
3. **first run** (fresh Python processes, as ``bench_first_run``: imports, data
   and model construction outside the timed call; each process's first fit
   call, compile included, with its sinks/callbacks made inside the timed part),
   scanax and Keras interleaved, several processes each. Target ≤ 1.0 on both.

Keras is an optional benchmark dependency: without it the Keras rows are skipped
with a note (row 1 still runs). Run alone with ``python -m benchmarks.bench_features``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import sys
import tempfile

import jax
import numpy as np
import optax
from flax import nnx

import scanax

try:
    from benchmarks import _timing
    from benchmarks.bench_first_run import MLP_SOURCE, _fresh
    from benchmarks.bench_fit import MLP, mse, xent
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_first_run import MLP_SOURCE, _fresh  # type: ignore[no-redef]
    from bench_fit import MLP, mse, xent  # type: ignore[no-redef]

STEPS = 1000
PER_EPOCH = 100  # steps per epoch = evaluation period
LOG_EVERY = 10
N_VAL = 1000
PATIENCE = 1000  # never stops within a run
SPES = (1, PER_EPOCH)  # Keras steps_per_execution candidates
NETWORKS = {
    # name: (layer sizes, batch size)
    "tiny": ((32, 32, 1), 8),
    "small": ((784, 256, 10), 64),
}
MARK = "FIRST_RUN_JSON "  # what bench_first_run._fresh looks for


def _desc(name: str) -> str:
    sizes, batch = NETWORKS[name]
    return (
        f"{name} MLP {'→'.join(map(str, sizes))}, batch {batch}, {STEPS} steps, "
        f"eval every {PER_EPOCH} on {N_VAL:,} examples, TensorBoard every {LOG_EVERY}"
    )


def _data(sizes, batch):
    """Host arrays (NumPy): training set of one epoch, validation set."""
    n = batch * PER_EPOCH
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n + N_VAL, sizes[0]), dtype=np.float32)
    if sizes[-1] == 1:
        y = np.sin(x[:, :1])
    else:
        y = rng.integers(0, sizes[-1], n + N_VAL).astype(np.int32)
    return (x[:n], y[:n]), (x[n:], y[n:])


class _Dirs:
    """Fresh temporary directories for event files, removed at the end."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="scanax-bench-features-")
        self.count = 0

    def new(self) -> str:
        self.count += 1
        return os.path.join(self.root, str(self.count))

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def _scanax_fns(name: str, dirs: _Dirs) -> dict:
    """Zero-argument callables, one fit call of ``STEPS`` each (continuing)."""
    sizes, batch = NETWORKS[name]
    loss_fn = mse if sizes[-1] == 1 else xent
    train, val = _data(sizes, batch)
    train, val = jax.device_put(train), jax.device_put(val)

    def make(eval_=False, log=False, stop=False):
        model = MLP(sizes, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        key = [jax.random.key(0)]

        def call():
            kw = {}
            if eval_:
                kw.update(eval_data=val, eval_every=PER_EPOCH)
            if log:
                kw.update(log=scanax.TensorBoard(dirs.new()), log_every=LOG_EVERY)
            if stop:
                kw.update(stop=scanax.EarlyStop("val_loss", patience=PATIENCE))
            key[0], k = jax.random.split(key[0])
            r = scanax.fit(
                model,
                optimizer,
                loss_fn,
                train,
                steps=STEPS,
                batch_size=batch,
                key=k,
                progress=False,
                **kw,
            )
            float(r.history["loss"][-1])
            if eval_:
                float(r.history["val_loss"][-1])
            _timing.block(r.model.layers[0].kernel[...])

        return call

    return {
        "plain": make(),
        "eval": make(eval_=True),
        "log": make(log=True),
        "features": make(eval_=True, log=True),
        "stop": make(eval_=True, log=True, stop=True),
    }


# -- Keras ------------------------------------------------------------------------

# Shared by the in-process runs and the fresh-process script: the Keras model and
# its fit with validation, early stopping and TensorBoard-like logging.
_KERAS_CODE = '''
def keras_tensorboard(keras, logdir, update_freq):
    """keras.callbacks.TensorBoard where TensorFlow is installed, else the same
    scalars written with tensorboardX (Keras's own callback needs tf.summary)."""
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        pass
    else:
        return keras.callbacks.TensorBoard(logdir, update_freq=update_freq)

    class TensorBoardX(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(logdir)
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            # Keras calls this once per execution (steps_per_execution steps)
            step = self.params["steps"] * self.epoch + batch + 1
            if step // update_freq > self.seen // update_freq:
                for k, v in (logs or {}).items():
                    self.writer.add_scalar("batch_" + k, float(v), step)
            self.seen = step

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            for k, v in (logs or {}).items():
                self.writer.add_scalar("epoch_" + k, float(v), epoch)
            self.writer.flush()

        def on_train_end(self, logs=None):
            self.writer.close()

    return TensorBoardX()


def keras_model(keras, sizes, spe):
    model = keras.Sequential(
        [keras.Input((sizes[0],))]
        + [keras.layers.Dense(s, activation="relu") for s in sizes[1:-1]]
        + [keras.layers.Dense(sizes[-1])]
    )
    if sizes[-1] == 1:
        loss = keras.losses.MeanSquaredError()
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=loss, steps_per_execution=spe
    )
    return model


def keras_fit(keras, model, train, val, batch, steps, per_epoch, patience,
              logdir, log_every):
    callbacks = [
        keras.callbacks.EarlyStopping("val_loss", patience=patience),
        keras_tensorboard(keras, logdir, log_every),
    ]
    history = model.fit(
        train[0], train[1], batch_size=batch, epochs=steps // per_epoch,
        steps_per_epoch=per_epoch, validation_data=val, callbacks=callbacks,
        verbose=0, shuffle=True,
    )
    assert len(history.history["val_loss"]) == steps // per_epoch
    float(history.history["loss"][-1])
    float(history.history["val_loss"][-1])
    return history
'''


def _keras_module():
    """Keras 3 on JAX in this process, or None (with the reason) when it is not
    installed or already imported with another backend."""
    if importlib.util.find_spec("keras") is None:
        return None, "Keras 3 not installed (pip install 'keras>=3')"
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"
    import keras

    if not keras.__version__.startswith("3") or keras.backend.backend() != "jax":
        return None, f"keras {keras.__version__} on {keras.backend.backend()}"
    return keras, ""


def _tb_note() -> str:
    if importlib.util.find_spec("tensorflow") is not None:
        return "Keras logs with keras.callbacks.TensorBoard"
    return (
        "TensorFlow not installed: Keras logs with a tensorboardX Callback "
        "(keras.callbacks.TensorBoard needs tf.summary)"
    )


def _keras_fns(keras, name: str, dirs: _Dirs) -> dict:
    ns: dict = {}
    exec(_KERAS_CODE, ns)
    sizes, batch = NETWORKS[name]
    train, val = _data(sizes, batch)
    keras.utils.set_random_seed(0)
    fns = {}
    for spe in SPES:
        model = ns["keras_model"](keras, sizes, spe)

        def call(model=model):
            ns["keras_fit"](
                keras,
                model,
                train,
                val,
                batch,
                STEPS,
                PER_EPOCH,
                PATIENCE,
                dirs.new(),
                LOG_EVERY,
            )
            _timing.block(model.trainable_variables[0].value)

        fns[f"keras{spe}"] = call
    return fns


# -- fresh processes -----------------------------------------------------------------

_PRELUDE = """
import json, os, sys, time

cfg = json.loads(sys.argv[1])
sizes, batch = cfg["sizes"], cfg["batch"]
STEPS, PER_EPOCH, N_VAL = cfg["steps"], cfg["per_epoch"], cfg["n_val"]
import numpy as np

n = batch * PER_EPOCH
rng = np.random.default_rng(0)
x = rng.standard_normal((n + N_VAL, sizes[0]), dtype=np.float32)
if sizes[-1] == 1:
    y = np.sin(x[:, :1])
else:
    y = rng.integers(0, sizes[-1], n + N_VAL).astype(np.int32)
train, val = (x[:n], y[:n]), (x[n:], y[n:])

t0 = time.perf_counter()
IMPORTS
out = {"import_s": time.perf_counter() - t0}

import jax.monitoring

events = {}

def _duration(event, secs, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        total, count = events.get(event, (0.0, 0))
        events[event] = (total + secs, count + 1)

jax.monitoring.register_event_duration_secs_listener(_duration)

def done():
    out["compile_s"], out["programs"] = events.get(
        "/jax/core/compile/backend_compile_duration", (0.0, 0))
    print(MARK + json.dumps(out), flush=True)
"""

_SCANAX_BODY = """
import jax.numpy as jnp

MLP_SOURCE

if sizes[-1] == 1:
    def loss_fn(model, batch):
        xb, yb = batch
        return jnp.mean((model(xb) - yb) ** 2)
else:
    def loss_fn(model, batch):
        xb, yb = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

t0 = time.perf_counter()
model = MLP(sizes, nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
out["build_s"] = time.perf_counter() - t0
events.clear()

t0 = time.perf_counter()
result = scanax.fit(
    model, optimizer, loss_fn, train, steps=STEPS, batch_size=batch,
    key=jax.random.key(0), progress=False,
    eval_data=val, eval_every=PER_EPOCH,
    stop=scanax.EarlyStop("val_loss", patience=cfg["patience"]),
    log=scanax.TensorBoard(cfg["logdir"]), log_every=cfg["log_every"],
)
out["loss"] = float(result.history["loss"][-1])
out["val_loss"] = float(result.history["val_loss"][-1])
jax.block_until_ready(model.layers[0].kernel[...])
out["fit_s"] = time.perf_counter() - t0
done()
"""

_KERAS_BODY = """
keras.utils.set_random_seed(0)
t0 = time.perf_counter()
model = keras_model(keras, sizes, cfg["spe"])
out["build_s"] = time.perf_counter() - t0
events.clear()

t0 = time.perf_counter()
history = keras_fit(keras, model, train, val, batch, STEPS, PER_EPOCH,
                    cfg["patience"], cfg["logdir"], cfg["log_every"])
out["loss"] = float(history.history["loss"][-1])
out["val_loss"] = float(history.history["val_loss"][-1])
jax.block_until_ready(model.trainable_variables[0].value)
out["fit_s"] = time.perf_counter() - t0
done()
"""


def _script(imports: str, body: str) -> str:
    return f"MARK = {MARK!r}\n" + _PRELUDE.replace("IMPORTS", imports) + body


SCANAX_SCRIPT = _script(
    "import jax, optax\nfrom flax import nnx\nimport scanax",
    _SCANAX_BODY.replace("MLP_SOURCE", MLP_SOURCE),
)
KERAS_SCRIPT = _script("import jax, keras\n" + _KERAS_CODE.strip() + "\n", _KERAS_BODY)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _first_run(name: str, repeats: int, dirs: _Dirs) -> list[dict]:
    sizes, batch = NETWORKS[name]
    cfg = dict(
        sizes=sizes,
        batch=batch,
        steps=STEPS,
        per_epoch=PER_EPOCH,
        n_val=N_VAL,
        patience=PATIENCE,
        log_every=LOG_EVERY,
    )
    runs: dict = {"scanax": [], **{spe: [] for spe in SPES}}
    for _ in range(repeats):
        runs["scanax"].append(_fresh(SCANAX_SCRIPT, logdir=dirs.new(), **cfg))
        for spe in SPES:
            runs[spe].append(_fresh(KERAS_SCRIPT, spe=spe, logdir=dirs.new(), **cfg))
    keras_fit = {spe: _median(runs[spe], "fit_s") for spe in SPES}
    best = min(keras_fit, key=keras_fit.get)
    s = runs["scanax"]
    by_spe = ", ".join(f"spe={spe}: {t:.2f} s" for spe, t in keras_fit.items())
    return [
        _timing.row(
            "features",
            f"{_desc(name)}: first fit call (compile included), fresh process",
            _median(s, "fit_s"),
            f"Keras 3 first model.fit with validation_data, EarlyStopping, "
            f"TensorBoard (JAX, steps_per_execution={best})",
            keras_fit[best],
            1.0,
            notes=f"medians of {repeats} processes each; Keras {by_spe}; backend "
            f"compile in the call: scanax {_median(s, 'compile_s'):.2f} s "
            f"({statistics.median(r['programs'] for r in s):g} programs), Keras "
            f"{_median(runs[best], 'compile_s'):.2f} s "
            f"({statistics.median(r['programs'] for r in runs[best]):g} programs); "
            f"construction: NNX {_median(s, 'build_s'):.2f} s, Keras "
            f"{_median(runs[best], 'build_s'):.2f} s (not timed); " + _tb_note(),
        )
    ]


# -- the rows --------------------------------------------------------------------


def _in_process(name: str, keras, repeats: int, dirs: _Dirs, split: bool) -> list[dict]:
    fns = _scanax_fns(name, dirs)
    if not split:
        fns = {k: fns[k] for k in ("plain", "features", "stop")}
    if keras is not None:
        fns.update(_keras_fns(keras, name, dirs))
    t = _timing.interleaved(fns, repeats=repeats)
    desc = _desc(name)
    split_note = ""
    if split:
        split_note = (
            f"; evaluation alone {t['eval'] / t['plain']:.3f}x, TensorBoard alone "
            f"{t['log'] / t['plain']:.3f}x"
        )
    rows = [
        _timing.row(
            "features",
            f"{desc}: steady state (compiled)",
            t["features"],
            "the same scanax.fit without eval_data/log",
            t["plain"],
            1.10 if name == "small" else None,
            notes=f"medians of {repeats} interleaved calls{split_note}; with "
            f"EarlyStop too: {t['stop'] / t['plain']:.3f}x",
        )
    ]
    if keras is None:
        return rows
    keras_t = {spe: t[f"keras{spe}"] for spe in SPES}
    best = min(keras_t, key=keras_t.get)
    by_spe = ", ".join(f"spe={spe}: {v:.3g} s" for spe, v in keras_t.items())
    rows.append(
        _timing.row(
            "features",
            f"{desc}, early stopping: steady state (second call, compiled)",
            t["stop"],
            f"Keras 3 model.fit with validation_data, EarlyStopping, TensorBoard "
            f"(JAX, steps_per_execution={best})",
            keras_t[best],
            0.33 if name == "tiny" else 1.0,
            notes=f"{keras_t[best] / t['stop']:.1f}x faster; Keras {by_spe}; "
            + _tb_note(),
        )
    )
    return rows


def run(quick: bool = False) -> list[dict]:
    keras, why = _keras_module()
    if keras is None:
        print(f"bench_features: {why}; skipping the Keras rows", file=sys.stderr)
    dirs = _Dirs()
    try:
        rows = []
        for name in NETWORKS:
            rows += _in_process(name, keras, 2 if quick else 5, dirs, not quick)
        if keras is None:
            for r in rows:
                r["notes"] += f"; the Keras comparisons were skipped: {why}"
            return rows
        for name in NETWORKS:
            rows += _first_run(name, 1 if quick else 3, dirs)
        return rows
    finally:
        dirs.close()


if __name__ == "__main__":
    print(_timing.markdown(run()))
