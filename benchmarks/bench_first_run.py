"""What a user waits for in a fresh process (issue 13): the first ``scanax.fit``
against Keras 3's first ``model.fit``, and a cold against a warm process with
``scanax.compile_cache``.

Every measurement runs in its own fresh Python process (``python -c``), so each
pays the imports, the model construction and every compile, as a re-run script
does. Two networks, softmax cross-entropy on integer labels, Adam 1e-3, 1000
steps, shuffled random data:

* tiny classifier 32→32→10, batch 8, 1000 examples;
* small MLP 784→256→10, batch 64, 8000 examples.

First run: scanax (an ``nnx.Module`` and ``nnx.Optimizer``, then ``scanax.fit``)
and Keras 3 (``KERAS_BACKEND=jax``: ``keras.Sequential``, ``compile`` with
``steps_per_execution`` 1 and one epoch's worth, ``model.fit``) run interleaved, a
fresh process each, several times. Each process ends its fit by reading the last
loss onto the host. Rows: scanax's first fit call ÷ Keras's (target ≤ 1.0; the
faster ``steps_per_execution`` is the baseline) and model construction + first
fit call (no target; NNX construction is flax's cost). Keras is an optional
benchmark dependency: without it the Keras rows are replaced by scanax's first
fit call against its own construction, with a note.

Cold vs warm: the small-MLP scanax script with ``scanax.compile_cache(dir)``, run
twice on one new temporary directory (cold, then warm), a few pairs. Row: the warm
process's construction + first fit ÷ the cold one's.

Every process also sums JAX's compile events (``jax.monitoring``) during its fit
call; the notes say how much of the first call is backend compile.

Run alone with ``python -m benchmarks.bench_first_run``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

try:
    from benchmarks import _timing
    from benchmarks.bench_fit import MLP
except ImportError:  # run as a script from inside benchmarks/
    import _timing  # type: ignore[no-redef]
    from bench_fit import MLP  # type: ignore[no-redef]

STEPS = 1000
NETWORKS = {
    # name: (layer sizes, batch size, examples)
    "tiny classifier": ((32, 32, 10), 8, 1000),
    "small MLP": ((784, 256, 10), 64, 8000),
}
MARK = "FIRST_RUN_JSON "

# Shared by both child scripts: the config (argv[1]), host data made with NumPy
# before any timing, and a listener summing JAX's compile events per phase.
_PRELUDE = """
import json, sys, time

cfg = json.loads(sys.argv[1])
sizes, batch, n = cfg["sizes"], cfg["batch"], cfg["n"]

import numpy as np

rng = np.random.default_rng(0)
x = rng.standard_normal((n, sizes[0]), dtype=np.float32)
y = rng.integers(0, sizes[-1], n).astype(np.int32)

t0 = time.perf_counter()
IMPORTS
out = {"import_s": time.perf_counter() - t0}

import jax.monitoring

events = {}

def _duration(event, secs, **kwargs):
    total, count = events.get(event, (0.0, 0))
    events[event] = (total + secs, count + 1)

def _event(event, **kwargs):
    _duration(event, 0.0)

jax.monitoring.register_event_duration_secs_listener(_duration)
jax.monitoring.register_event_listener(_event)

def phase(name):
    compile_s, programs = events.get("/jax/core/compile/backend_compile_duration",
                                     (0.0, 0))
    trace_s = sum(events.get(e, (0.0, 0))[0] for e in (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration"))
    out[name + "_compile_s"] = compile_s
    out[name + "_programs"] = programs
    out[name + "_trace_s"] = trace_s
    out[name + "_cache_hits"] = events.get("/jax/compilation_cache/cache_hits",
                                           (0.0, 0))[1]
    events.clear()
"""

# The child scripts' model: bench_fit.MLP's own source (a fresh process defines it).
MLP_SOURCE = inspect.getsource(MLP)

_SCANAX = """
if cfg["cache"]:
    scanax.compile_cache(cfg["cache"])
events.clear()

MLP_SOURCE

def loss_fn(model, batch):
    xb, yb = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

t0 = time.perf_counter()
model = MLP(sizes, nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
out["build_s"] = time.perf_counter() - t0
phase("build")

t0 = time.perf_counter()
result = scanax.fit(model, optimizer, loss_fn, (x, y), steps=cfg["steps"],
                    batch_size=batch, key=jax.random.key(0), progress=False)
out["loss"] = float(result.history["loss"][-1])
out["fit_s"] = time.perf_counter() - t0
phase("fit")
print(MARK + json.dumps(out), flush=True)
"""

_KERAS = """
keras.utils.set_random_seed(0)
events.clear()
per_epoch = n // batch
assert cfg["steps"] % per_epoch == 0, (cfg["steps"], per_epoch)

t0 = time.perf_counter()
model = keras.Sequential(
    [keras.Input((sizes[0],))]
    + [keras.layers.Dense(s, activation="relu") for s in sizes[1:-1]]
    + [keras.layers.Dense(sizes[-1])]
)
model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    steps_per_execution=cfg["spe"],
)
out["build_s"] = time.perf_counter() - t0
phase("build")

t0 = time.perf_counter()
history = model.fit(x, y, batch_size=batch, epochs=cfg["steps"] // per_epoch,
                    steps_per_epoch=per_epoch, verbose=0, shuffle=True)
out["loss"] = float(history.history["loss"][-1])
out["fit_s"] = time.perf_counter() - t0
phase("fit")
print(MARK + json.dumps(out), flush=True)
"""


def _script(imports: str, body: str) -> str:
    prelude = _PRELUDE.replace("IMPORTS", textwrap.dedent(imports).strip())
    return f"MARK = {MARK!r}\n" + prelude + body


SCANAX_SCRIPT = _script(
    """
    import jax, optax
    from flax import nnx
    import scanax
    """,
    _SCANAX.replace("MLP_SOURCE", MLP_SOURCE),
)
KERAS_SCRIPT = _script("import keras", _KERAS)


def _env() -> dict[str, str]:
    """This process's environment without any compilation cache: a first run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SCANAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")
    }
    env["KERAS_BACKEND"] = "jax"
    return env


def _fresh(script: str, **cfg) -> dict:
    """Run ``script`` in a new Python process; its timings."""
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cfg)],
        env=_env(),
        capture_output=True,
        text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    raise RuntimeError(
        f"bench_first_run: a child process exited with code {proc.returncode}\n"
        f"{proc.stderr[-3000:]}"
    )


def _median(runs: list[dict], *keys: str) -> float:
    return statistics.median(sum(r[k] for k in keys) for r in runs)


def _compile_note(runs: list[dict]) -> str:
    return (
        f"scanax's fit call: {_median(runs, 'fit_compile_s'):.2f} s backend "
        f"compile in {statistics.median(r['fit_programs'] for r in runs):g} "
        f"programs, {_median(runs, 'fit_trace_s'):.2f} s tracing/lowering"
    )


def _first_run(name: str, repeats: int, with_keras: bool) -> list[dict]:
    sizes, batch, n = NETWORKS[name]
    cfg = dict(sizes=sizes, batch=batch, n=n, steps=STEPS)
    spes = (1, n // batch) if with_keras else ()
    scanax_runs: list[dict] = []
    keras_runs: dict[int, list[dict]] = {spe: [] for spe in spes}
    for _ in range(repeats):
        scanax_runs.append(_fresh(SCANAX_SCRIPT, cache=None, **cfg))
        for spe in spes:
            keras_runs[spe].append(_fresh(KERAS_SCRIPT, spe=spe, **cfg))

    desc = f"{name} {'→'.join(map(str, sizes))}, batch {batch}, {STEPS} steps"
    fit_s = _median(scanax_runs, "fit_s")
    total_s = _median(scanax_runs, "build_s", "fit_s")
    imports = f"imports: scanax+flax {_median(scanax_runs, 'import_s'):.2f} s"
    if not with_keras:
        print(
            "bench_first_run: keras is not installed; skipping the Keras 3 rows "
            "(pip install 'keras>=3')",
            file=sys.stderr,
        )
        return [
            _timing.row(
                "first_run",
                f"{desc}: first fit call, fresh process",
                fit_s,
                "scanax model construction (NNX), same process",
                _median(scanax_runs, "build_s"),
                notes="Keras 3 not installed: the comparison with Keras was "
                "skipped (pip install 'keras>=3'); " + _compile_note(scanax_runs),
            )
        ]

    keras_fit = {spe: _median(r, "fit_s") for spe, r in keras_runs.items()}
    keras_total = {spe: _median(r, "build_s", "fit_s") for spe, r in keras_runs.items()}
    best_fit = min(keras_fit, key=keras_fit.get)
    best_total = min(keras_total, key=keras_total.get)
    by_spe = ", ".join(
        f"steps_per_execution={spe}: {keras_fit[spe]:.2f} s" for spe in spes
    )
    imports += f", keras {_median(keras_runs[best_total], 'import_s'):.2f} s"
    builds = (
        f"construction: NNX {_median(scanax_runs, 'build_s'):.2f} s, "
        f"Keras {_median(keras_runs[best_total], 'build_s'):.2f} s"
    )
    return [
        _timing.row(
            "first_run",
            f"{desc}: first fit call, fresh process",
            fit_s,
            f"Keras 3 first model.fit (JAX, steps_per_execution={best_fit})",
            keras_fit[best_fit],
            1.0,
            notes=f"medians of {repeats} processes each; Keras {by_spe}; "
            + _compile_note(scanax_runs),
        ),
        _timing.row(
            "first_run",
            f"{desc}: model construction + first fit call, fresh process",
            total_s,
            f"Keras 3 Sequential + compile + fit (steps_per_execution={best_total})",
            keras_total[best_total],
            notes=f"{builds}; {imports} (not in the totals)",
        ),
    ]


def _cold_warm(pairs: int) -> dict:
    sizes, batch, n = NETWORKS["small MLP"]
    cfg = dict(sizes=sizes, batch=batch, n=n, steps=STEPS)
    cold: list[dict] = []
    warm: list[dict] = []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory(prefix="scanax-bench-cache-") as d:
            cold.append(_fresh(SCANAX_SCRIPT, cache=d, **cfg))
            warm.append(_fresh(SCANAX_SCRIPT, cache=d, **cfg))
    desc = f"small MLP {'→'.join(map(str, sizes))}, batch {batch}, {STEPS} steps"
    hits = statistics.median(r["build_cache_hits"] + r["fit_cache_hits"] for r in warm)
    return _timing.row(
        "first_run",
        f"{desc}: warm process with scanax.compile_cache (construction + first fit)",
        _median(warm, "build_s", "fit_s"),
        "cold process (same script, empty cache directory)",
        _median(cold, "build_s", "fit_s"),
        notes=f"medians of {pairs} pairs; first fit call alone: warm "
        f"{_median(warm, 'fit_s'):.2f} s, cold {_median(cold, 'fit_s'):.2f} s; "
        f"backend compile in fit: warm {_median(warm, 'fit_compile_s'):.2f} s, "
        f"cold {_median(cold, 'fit_compile_s'):.2f} s; {hits:g} cache hits warm",
    )


def run(quick: bool = False) -> list[dict]:
    repeats = 3 if quick else 5
    with_keras = importlib.util.find_spec("keras") is not None
    rows = []
    for name in NETWORKS:
        rows += _first_run(name, repeats, with_keras)
    rows.append(_cold_warm(2 if quick else 3))
    return rows


if __name__ == "__main__":
    print(_timing.markdown(run()))
