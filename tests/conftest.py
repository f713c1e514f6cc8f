import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import pytest  # noqa: E402

# JAX's strict dtype promotion, as Equinox's tests run: no implicit mixing of dtypes
# (an int32 times 0.5, float32 with bfloat16, a bool mask times floats). On for the
# files below; a test there that calls code mixing dtypes on purpose or outside
# scanax (optax's Adam: `decay ** count`) is marked `standard_promotion`. Still to
# do: fit's files, test_docs (its pages run fit and optax), test_demo, test_bench;
# with all of them in, this becomes one `jax.config.update` here.
STRICT_PROMOTION = {
    "test_architecture.py",
    "test_progress.py",
    "test_remat.py",
    "test_rnn.py",
    "test_scan.py",
    "test_scan_property.py",
    "test_stack.py",
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
