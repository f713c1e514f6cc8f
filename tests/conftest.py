import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# float16 and bfloat16 as written: XLA may otherwise keep a fusion's low-precision
# intermediates in float32 ("excess precision"), where it fuses, so that two
# programs computing the same thing (fit's and a reference loop's) round
# differently, and overflow (the loss scale's signal) where the other does not.
# XLA:CPU rounds alike either way; XLA:TPU did not (1-ulp float16 differences
# and a member's loss scale halving apart in tests/test_precision.py, 2026-12-06).
# Set before JAX reads its flags; a flag given already is kept.
if "xla_allow_excess_precision" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"


# On a machine with no accelerator, XLA:CPU compiles the suite's programs without
# LLVM's optimisations: the suite's shapes are small, so its time is the
# compiles' (about a third less time for the whole suite, 2026-12-07), and the
# results are the same (no fast-math either way: the float arithmetic and its
# order are the program's). The HLO passes, which the structural tests read,
# run as always. The benchmarks keep XLA's defaults. tests/test_rnn.py and
# others asked for the same per program before.
def _accelerator_installed() -> bool:
    import importlib.metadata
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return bool(plugins) or importlib.util.find_spec("libtpu") is not None


FAST_CPU_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
NO_ACCELERATOR = not _accelerator_installed()
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and NO_ACCELERATOR:
    os.environ["XLA_FLAGS"] += " " + FAST_CPU_COMPILE
# On an accelerator the suite's processes (xdist workers, the jobs tests start)
# share one device: none may take most of its memory up front, as JAX does by
# default.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import functools as ft  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Many tests build the same program anew (new functions and models of the same
# structure, which jit's in-memory caches cannot match): on the CPU machine each
# test process keeps JAX's persistent compilation cache, keyed by the program
# itself, in a directory of its own that lives as long as the process (about a
# fifth less time, 2026-12-07). Set in this process's config, not in the
# environment: the jobs tests start (kill -9 and resume) compile as a user's
# fresh process does, and no two processes share the files. Tests that count
# compiles count a program loaded from it as one (helpers.count_compiles); tests
# of scanax.compile_cache set the option themselves. A user's own
# JAX_COMPILATION_CACHE_DIR is kept.
if NO_ACCELERATOR and not jax.config.jax_compilation_cache_dir:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    _PROGRAMS = tempfile.mkdtemp(prefix="scanax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _PROGRAMS, True)
    jax.config.update("jax_compilation_cache_dir", _PROGRAMS)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

# Every test compares scanax with a reference (a Python loop, the hand-written
# JAX it replaces) at the tolerances of exact float32 arithmetic, which CPU
# matmuls and convolutions give. A GPU's default float32 matmul is TF32 (10-bit
# mantissa), differently rounded in the two programs; TPUs' is bfloat16 passes.
# Off CPU the whole suite therefore runs at "highest" precision, so that it
# proves there what it proves on CPU: the same values, not the same rounding of
# a cheaper product. Set globally (not a context manager, which is per thread:
# fit compiles on threads of its own) and in the environment, for the jobs
# tests start in processes of their own. On CPU nothing changes.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# A TPU admits one process at a time (libtpu's lock file): this one holds it, so
# the jobs tests start (kill -9 and resume, a fresh process's import) run on the
# CPU, where what they prove is the same program. jax read JAX_PLATFORMS when it
# was imported, so this reaches the children only. For the same reason the suite
# runs in one process on a TPU (no pytest -n).
if jax.default_backend() == "tpu":
    os.environ["JAX_PLATFORMS"] = "cpu"

# JAX's strict dtype promotion, as Equinox's tests run: no implicit mixing of dtypes
# (an int32 times 0.5, float32 with bfloat16, a bool mask times floats), so that
# scanax's own code never relies on it. On for the files below; a test there that
# calls code mixing dtypes on purpose or outside scanax is marked
# `standard_promotion`. One allowance covers every file: optax's Adam bias
# correction (`_optax_bias_correction` below).
#
# Still standard, and why:
# - test_docs: its pages and docstring examples are users' programs, run as users
#   run them, under JAX's default promotion (docs/rnn.md multiplies a loss by a bool
#   mask, as one writes it).
# - test_multiprocess: its jobs run in their own processes, which this file does
#   not reach.
STRICT_PROMOTION = {
    "test_architecture.py",
    "test_linear_scan.py",
    "test_rnn_linear.py",
    "test_bench.py",
    "test_checkpoint.py",
    "test_compile.py",
    "test_demo.py",
    "test_fit.py",
    "test_fit_continue.py",
    "test_fit_features.py",
    "test_log.py",
    "test_mesh.py",
    "test_nnx_refs.py",
    "test_once.py",
    "test_plot.py",
    "test_population.py",
    "test_progress.py",
    "test_reliability.py",
    "test_remat.py",
    "test_rnn.py",
    "test_scan.py",
    "test_scan_nnx.py",
    "test_scan_property.py",
    "test_stack.py",
    "test_stop.py",
    "test_thin.py",
    "test_until.py",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion(reason): run with JAX's standard dtype promotion in a "
        "file that is otherwise strict",
    )


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    strict = request.path.name in STRICT_PROMOTION and not (
        request.node.get_closest_marker("standard_promotion")
    )
    with jax.numpy_dtype_promotion("strict" if strict else "standard"):
        yield


@pytest.fixture(autouse=True, scope="session")
def _optax_bias_correction():
    """optax's bias correction (Adam, AdamW, ...) computes ``decay ** count``: a
    Python float to the power of the int32 step count, which strict promotion
    refuses (optax/tree_utils/_tree_math.py, ``tree_bias_correction``). It alone
    runs with standard promotion, in tests only: scanax never changes the
    promotion mode its user chose, and the rest of a step stays strict."""
    try:
        import optax
    except ImportError:
        yield
        return
    correct = optax.tree.bias_correction

    @ft.wraps(correct)
    def standard(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return correct(*args, **kwargs)

    optax.tree.bias_correction = standard
    yield
    optax.tree.bias_correction = correct
