"""The digits CNN script end to end (issues 26 and 28): a Keras 3 user's whole
training script against the same script written with scanax, each run in a fresh
Python process and timed from the parent, imports included.

The script, on both sides: sklearn's ``load_digits`` (8x8x1 images scaled to
[0, 1]), a train / validation / test split (1,088 / 349 / 360: the training set
a multiple of the batch, so both sides take the same 34 steps per epoch), a CNN
Conv 3x3 16 -> ReLU -> Conv 3x3 32 -> ReLU -> Flatten -> Dense 10 ("same"
padding), Adam 1e-3, batch 32, 20 epochs with shuffling, validation every
epoch, early stopping on ``val_loss`` (patience 10) restoring the best weights,
TensorBoard scalars every epoch, the best model saved to disk, then the test
split evaluated and its accuracy printed.

* **Keras 3** (``KERAS_BACKEND=jax``): ``keras.Sequential``, ``compile(Adam(1e-3),
  "sparse_categorical_crossentropy", metrics=["accuracy"])`` (the default
  ``steps_per_execution=1``, and one epoch's worth, 34: the faster is the
  baseline), ``fit(validation_data=..., callbacks=[EarlyStopping(...,
  restore_best_weights=True), ModelCheckpoint("best.keras",
  save_best_only=True), TensorBoard])``, ``model.evaluate``. Keras's own
  ``keras.callbacks.TensorBoard`` needs TensorFlow; without it the script uses
  ``bench_features``'s callback writing the same scalars with tensorboardX.
* **scanax**: an ``nnx.Module`` of ``nnx.Conv``/``nnx.Linear``,
  ``nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)``, ``scanax.fit(...,
  epochs=20, eval_data=, eval_every=<steps per epoch>, stop=scanax.EarlyStop(
  "val_loss", patience=10), log=scanax.TensorBoard(...), best_dir=...)``,
  ``scanax.evaluate``.
* **every feature**: both scripts again with a moving average of the weights
  (``ema=0.99, ema_eval=True``; Keras: ``Adam(use_ema=True,
  ema_momentum=0.99)``) and bfloat16 compute (``precision="bfloat16"``; Keras:
  the ``mixed_bfloat16`` policy), the test split evaluated on the average.

Every process writes its logs and checkpoints in a new temporary directory, and
prints one JSON line: its phases (imports, data, construction, fit, evaluate,
with the backend compile time and program count of each, from
``jax.monitoring``), the epochs run, the test accuracy, and how long its
training thread spent keeping the best model (Keras: ``ModelCheckpoint``'s
``_save_model``; scanax: the ``best_dir`` hook, ``_fit_hooks.BestSaver``,
whose saves run on a thread of their own). The processes run round
robin (Keras, scanax, Keras, scanax, ...), several rounds; ``XLA_FLAGS`` is the
same for all. Rows: each variant's median wall time (parent-side: interpreter
start to exit) ÷ Keras's, with the range of the per-round ratios, and the fit
call alone. Target ≤ 1.0 end to end (issue 28).

Keras and scikit-learn are benchmark dependencies: without Keras the rows
compare the scanax variants with each other, with a note; without scikit-learn
(``load_digits``) the benchmark is skipped. Run alone with
``python -m benchmarks.bench_digits`` (``--quick``: two rounds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

try:
    from benchmarks import _timing
    from benchmarks.bench_features import _KERAS_CODE
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_features import _KERAS_CODE  # type: ignore[no-redef]

EPOCHS = 20
# Neither side stops within 20 epochs, so both do the same work (with patience 5
# Keras stopped after 17 epochs and scanax ran all 20); the best is restored.
PATIENCE = 10
PER_EPOCH = 34  # 1,088 training examples / batch 32
MARK = "DIGITS_JSON "
BENCH = "  # bench"  # harness lines: not part of the user's script (not counted)

# The timing harness, the same in every script: phases since the process's
# first line, and JAX's backend compile events per phase (registered once jax
# is imported, which the imports phase does on both sides).
_HARNESS = f"""
import json, os, sys, tempfile, time{BENCH}
_t = [time.perf_counter()]{BENCH}
_out = {{"phases": {{}}, "compile": {{}}}}{BENCH}
_ev = [0.0, 0]{BENCH}
def _compile(event, secs, **kw):{BENCH}
    if event == "/jax/core/compile/backend_compile_duration":{BENCH}
        _ev[0] += secs; _ev[1] += 1{BENCH}
def _phase(name):{BENCH}
    now = time.perf_counter(){BENCH}
    _out["phases"][name] = now - _t[0]; _t[0] = now{BENCH}
    _out["compile"][name] = list(_ev); _ev[:] = [0.0, 0]{BENCH}
    if name == "imports":{BENCH}
        import jax.monitoring{BENCH}
        jax.monitoring.register_event_duration_secs_listener(_compile){BENCH}
os.chdir(tempfile.mkdtemp(prefix="scanax-bench-digits-")){BENCH}
_out["workdir"] = os.getcwd(){BENCH}
_out["best_s"] = 0.0{BENCH}
def _timed(cls, *names):{BENCH}
    for name in [n for n in names if hasattr(cls, n)]:{BENCH}
        def timed(*a, _f=getattr(cls, name), **k):{BENCH}
            t = time.perf_counter(){BENCH}
            try:{BENCH}
                return _f(*a, **k){BENCH}
            finally:{BENCH}
                _out["best_s"] += time.perf_counter() - t{BENCH}
        setattr(cls, name, timed){BENCH}
"""

_DATA = """
digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]  # (1797, 8, 8, 1) in [0, 1]
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=360, random_state=0)
x_train, x_val, y_train, y_val = train_test_split(
    x_train, y_train, train_size=34 * 32, random_state=0
)
"""

KERAS_SCRIPT = (
    _HARNESS
    + """
import keras
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
_phase("imports")  # bench
_timed(keras.callbacks.ModelCheckpoint, "_save_model")  # bench
__POLICY__
"""
    + _DATA
    + """
_phase("data")  # bench
keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
    keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
    keras.layers.Flatten(),
    keras.layers.Dense(10, activation="softmax"__DENSE_DTYPE__),
])
model.compile(
    optimizer=keras.optimizers.Adam(1e-3__ADAM_EMA__),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
    steps_per_execution=__SPE__,  # bench
)
_phase("build")  # bench
history = model.fit(
    x_train, y_train, batch_size=32, epochs=__EPOCHS__,
    validation_data=(x_val, y_val),
    callbacks=[
        keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=__PATIENCE__, restore_best_weights=True
        ),
        keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True),
        keras_tensorboard(keras, "logs", __PER_EPOCH__),  # TensorBoard("logs")
    ],
    verbose=0,
)
_phase("fit")  # bench
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
print(f"test accuracy {accuracy:.4f}")
_phase("evaluate")  # bench
_out["epochs"] = len(history.history["loss"])  # bench
_out["accuracy"] = float(accuracy)  # bench
print(MARK + json.dumps(_out), flush=True)  # bench
"""
)

SCANAX_SCRIPT = (
    _HARNESS
    + """
import jax
import jax.numpy as jnp
import optax
from flax import nnx
import scanax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
_phase("imports")  # bench
from scanax._fit import hooks as _fit_hooks  # bench
_timed(_fit_hooks.BestSaver, "start", "after_call", "end", "close")  # bench
"""
    + _DATA
    + """
_phase("data")  # bench


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        self.dense = nnx.Linear(8 * 8 * 32, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
        return self.dense(x.reshape(x.shape[0], -1))


def loss_fn(model, batch):
    x, y = batch
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


model = CNN(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
_phase("build")  # bench
per_epoch = len(x_train) // 32
result = scanax.fit(
    model, optimizer, loss_fn, (x_train, y_train), batch_size=32,
    epochs=__EPOCHS__, key=jax.random.key(0),
    eval_data=(x_val, y_val), eval_every=per_epoch,
    stop=scanax.EarlyStop("val_loss", patience=__PATIENCE__),
    log=scanax.TensorBoard("logs"), log_every=per_epoch,
    best_dir="best",__EXTRA__
    progress=False,
)
_phase("fit")  # bench
test = scanax.evaluate(__TEST_MODEL__, loss_fn, (x_test, y_test))
print(f"test accuracy {test['accuracy']:.4f}")
_phase("evaluate")  # bench
_out["epochs"] = int(result.history["epoch"][-1])  # bench
_out["accuracy"] = float(test["accuracy"])  # bench
print(MARK + json.dumps(_out), flush=True)  # bench
"""
)

# What the Keras script needs without TensorFlow: bench_features's callback.
_TB_SHIM = _KERAS_CODE.split("\ndef keras_model")[0]
assert "def keras_tensorboard" in _TB_SHIM


def _tag(code: str) -> str:
    """Every line of ``code`` marked as harness (not counted)."""
    return "\n".join(
        line + BENCH if line.strip() else line for line in code.split("\n")
    )


def keras_script(spe: int = 1, full: bool = False) -> str:
    s = KERAS_SCRIPT.replace(
        "\nimport keras\n", "\nimport keras\n" + _tag(_TB_SHIM) + "\n", 1
    )
    subs = {
        "__POLICY__": 'keras.mixed_precision.set_global_policy("mixed_bfloat16")'
        if full
        else "",
        "__DENSE_DTYPE__": ', dtype="float32"' if full else "",
        "__ADAM_EMA__": ", use_ema=True, ema_momentum=0.99" if full else "",
        "__SPE__": str(spe),
        "__EPOCHS__": str(EPOCHS),
        "__PATIENCE__": str(PATIENCE),
        "__PER_EPOCH__": str(PER_EPOCH),
    }
    for k, v in subs.items():
        s = s.replace(k, v)
    if spe == 1:  # the default: a user writes nothing
        s = s.replace(f"    steps_per_execution=1,{BENCH}\n", "")
    return f"MARK = {MARK!r}{BENCH}\n" + s


def scanax_script(full: bool = False) -> str:
    extra = '\n    ema=0.99, ema_eval=True, precision="bfloat16",' if full else ""
    subs = {
        "__EXTRA__": extra,
        "__TEST_MODEL__": "result.ema" if full else "model",
        "__EPOCHS__": str(EPOCHS),
        "__PATIENCE__": str(PATIENCE),
    }
    s = SCANAX_SCRIPT
    for k, v in subs.items():
        s = s.replace(k, v)
    return f"MARK = {MARK!r}{BENCH}\n" + s


def user_lines(script: str) -> int:
    """Lines a user writes: not blank, not comments, not the timing harness."""
    return sum(
        1
        for line in script.splitlines()
        if line.strip()
        and not line.strip().startswith("#")
        and not line.endswith(BENCH)
    )


def _env() -> dict[str, str]:
    """The same environment for every process: no compilation cache, the same
    ``XLA_FLAGS``, Keras on JAX."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SCANAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")
    }
    env["KERAS_BACKEND"] = "jax"
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def _fresh(script: str) -> dict:
    """Run ``script`` in a new Python process: its JSON line, plus ``wall_s``
    (the parent's clock, interpreter start to exit) and the load average."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_env(), capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            out = json.loads(line[len(MARK) :])
            out["wall_s"] = wall
            out["load"] = os.getloadavg()[0]
            _cleanup(out)
            return out
    raise RuntimeError(
        f"bench_digits: a child process exited with code {proc.returncode}\n"
        f"{proc.stderr[-3000:]}"
    )


def _cleanup(out: dict) -> None:
    """The child's temporary directory (its logs and checkpoints)."""
    workdir = out.pop("workdir", "")
    if os.path.basename(workdir).startswith("scanax-bench-digits-"):
        shutil.rmtree(workdir, ignore_errors=True)


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _phase_med(runs: list[dict], phase: str) -> float:
    return statistics.median(r["phases"][phase] for r in runs)


def _compile_med(runs: list[dict], phase: str) -> tuple[float, float]:
    return (
        statistics.median(r["compile"][phase][0] for r in runs),
        statistics.median(r["compile"][phase][1] for r in runs),
    )


PHASES = ("imports", "data", "build", "fit", "evaluate")


def breakdown(name: str, runs: list[dict]) -> str:
    """One line: the median of each phase (and its backend compile)."""
    parts = []
    for p in PHASES:
        c, n = _compile_med(runs, p)
        parts.append(
            f"{p} {_phase_med(runs, p):.2f} s"
            + (f" ({c:.2f} s compile, {n:g} programs)" if n else "")
        )
    return (
        f"{name}: wall {_med(runs, 'wall_s'):.2f} s = "
        + ", ".join(parts)
        + f"; epochs {statistics.median(r['epochs'] for r in runs):g} "
        f"({statistics.median(r['phases']['fit'] / r['epochs'] for r in runs):.3f}"
        " s of fit each), best-model saving on the training thread "
        f"{_med(runs, 'best_s'):.2f} s, "
        f"test accuracy {statistics.median(r['accuracy'] for r in runs):.4f}"
    )


def _ratios(a: list[dict], b: list[dict], key: str = "wall_s") -> list[float]:
    return [x[key] / y[key] for x, y in zip(a, b)]


def _fit_ratios(a: list[dict], b: list[dict]) -> list[float]:
    return [x["phases"]["fit"] / y["phases"]["fit"] for x, y in zip(a, b)]


def _row(case, ours, base, baseline, ratios, target, notes, loads):
    r = _timing.row(
        "digits",
        case,
        statistics.median(ours),
        baseline,
        statistics.median(base),
        target,
        notes=f"per-round ratios: median {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f}–{max(ratios):.3f}; load {min(loads):.1f}–"
        f"{max(loads):.1f}; " + notes,
    )
    r["range"] = [min(ratios), max(ratios)]
    r["ratio_median"] = statistics.median(ratios)
    r["load_average"] = [min(loads), max(loads)]
    return r


def measure(rounds: int, with_keras: bool) -> dict[str, list[dict]]:
    """Interleaved fresh processes, ``rounds`` of each variant."""
    scripts = {"scanax": scanax_script(), "scanax full": scanax_script(full=True)}
    if with_keras:
        scripts = {
            "keras": keras_script(),
            "scanax": scripts["scanax"],
            f"keras spe={PER_EPOCH}": keras_script(spe=PER_EPOCH),
            "keras full": keras_script(full=True),
            "scanax full": scripts["scanax full"],
        }
    runs: dict[str, list[dict]] = {k: [] for k in scripts}
    for i in range(rounds):
        for name, script in scripts.items():
            runs[name].append(_fresh(script))
        print(
            f"bench_digits: round {i + 1}/{rounds}: "
            + ", ".join(f"{k} {v[-1]['wall_s']:.2f} s" for k, v in runs.items())
            + f" (load {os.getloadavg()[0]:.1f})",
            file=sys.stderr,
            flush=True,
        )
    return runs


def run(quick: bool = False) -> list[dict]:
    if importlib.util.find_spec("sklearn") is None:
        print(
            "bench_digits: scikit-learn is not installed (load_digits); skipping "
            "(pip install scikit-learn)",
            file=sys.stderr,
        )
        return []
    with_keras = importlib.util.find_spec("keras") is not None
    rounds = 2 if quick else 5
    runs = measure(rounds, with_keras)
    for name, r in runs.items():
        print("bench_digits: " + breakdown(name, r), file=sys.stderr)
    loads = [r["load"] for v in runs.values() for r in v]
    lines = (
        f"script lines: scanax {user_lines(scanax_script())}, Keras "
        f"{user_lines(keras_script())}"
    )
    desc = (
        f"digits CNN script (load_digits, conv16-conv32-dense10, Adam, batch 32, "
        f"{EPOCHS} epochs, val every epoch, early stopping, TensorBoard, best "
        f"checkpoint, test evaluate)"
    )
    s = runs["scanax"]
    if not with_keras:
        full = runs["scanax full"]
        return [
            _row(
                desc + " + ema + bfloat16: end to end, fresh process",
                [r["wall_s"] for r in full],
                [r["wall_s"] for r in s],
                "the same scanax script without ema/precision",
                _ratios(full, s),
                None,
                "Keras 3 not installed: the Keras comparisons were skipped "
                "(pip install 'keras>=3'); " + breakdown("scanax", s),
                loads,
            )
        ]
    spe_name = f"keras spe={PER_EPOCH}"
    walls = {k: _med(runs[k], "wall_s") for k in ("keras", spe_name)}
    best = min(walls, key=walls.get)
    k = runs[best]
    spe = 1 if best == "keras" else PER_EPOCH
    tb = (
        "Keras logs with keras.callbacks.TensorBoard"
        if importlib.util.find_spec("tensorflow") is not None
        else "TensorFlow not installed: Keras logs with a tensorboardX Callback"
    )
    kf, sf = runs["keras full"], runs["scanax full"]
    return [
        _row(
            desc + ": end to end, fresh process",
            [r["wall_s"] for r in s],
            [r["wall_s"] for r in k],
            f"the same Keras 3 script (JAX, steps_per_execution={spe})",
            _ratios(s, k),
            1.0,
            f"{rounds} rounds; Keras spe=1 {walls['keras']:.2f} s, spe="
            f"{PER_EPOCH} {walls[spe_name]:.2f} s; {breakdown('scanax', s)}; "
            f"{breakdown('Keras', k)}; {lines}; {tb}",
            loads,
        ),
        _row(
            desc + ": the fit call (compile included), fresh process",
            [r["phases"]["fit"] for r in s],
            [r["phases"]["fit"] for r in k],
            f"Keras 3 model.fit with the same callbacks (steps_per_execution={spe})",
            _fit_ratios(s, k),
            None,
            f"{rounds} rounds",
            loads,
        ),
        _row(
            desc + " + ema=0.99 (ema_eval) + precision='bfloat16': end to end",
            [r["wall_s"] for r in sf],
            [r["wall_s"] for r in kf],
            "the same Keras 3 script with Adam(use_ema=True, ema_momentum=0.99) "
            "and the mixed_bfloat16 policy",
            _ratios(sf, kf),
            None,
            f"{rounds} rounds; {breakdown('scanax', sf)}; {breakdown('Keras', kf)}",
            loads,
        ),
    ]


if __name__ == "__main__":
    print(_timing.markdown(run(quick="--quick" in sys.argv)))
