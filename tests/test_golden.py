"""What fit wrote before its features became objects, held against what it does
now (``tests/golden/``, written by ``python tests/_programs.py`` before that
change):

- each feature combination compiles the same program, text for text (the jaxpr
  of its compiled call, function names aside): the same arithmetic, so the same
  results bit for bit;
- checkpoints written then resume now, exactly as an uninterrupted run: their
  leaf names are an on-disk format.
"""

import shutil

import _programs as programs
import jax
import numpy as np
import pytest

from scanax import _backend

GOLDEN = programs.GOLDEN
SAME_JAX = (GOLDEN / "VERSION").read_text().strip() == jax.__version__

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.skipif(
    not SAME_JAX,
    reason="the golden programs were traced by another JAX version, whose "
    "jaxprs print differently",
)
@pytest.mark.parametrize("name", programs.COMBOS)
def test_the_same_program(name, monkeypatch):
    # The golden programs are fit's plan for a CPU (a step per chunk): the plan
    # a CPU gets is compared on every backend (elsewhere fit runs chunks of
    # steps, another program by design: tests/test_chunks.py).
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    # (and JAX's default matmul precision, which a jaxpr names: conftest raises
    # it off CPU)
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)
    try:
        found = "\n\n".join(programs.programs(name))
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    golden = (GOLDEN / "programs" / f"{name}.txt").read_text()
    assert found == golden


def _leaves(result):
    models = result.model
    if np.ndim(result.steps):  # a population: every member's
        models = [models[i] for i in range(len(models))]
    return [np.asarray(x) for x in jax.tree.leaves(models)]


@pytest.mark.parametrize("name", programs.CHECKPOINTED)
def test_an_old_checkpoint_resumes_exactly(tmp_path, monkeypatch, name):
    from scanax._fit import checkpoint as _checkpoint

    found = []
    restore = _checkpoint.Checkpoints.restore

    def spy(self, *args, **kwargs):
        out = restore(self, *args, **kwargs)
        found.append(None if out is None else out[0])
        return out

    directory = tmp_path / "old"
    shutil.copytree(GOLDEN / "checkpoints" / name, directory)
    monkeypatch.setattr(_checkpoint.Checkpoints, "restore", spy)
    resumed = programs.checkpoint(name, directory, 24)
    monkeypatch.undo()
    assert found == [16]  # (the old checkpoint's newest step)
    whole = programs.checkpoint(name, tmp_path / "new", 24)
    np.testing.assert_array_equal(resumed.history["step"], whole.history["step"])
    # The old checkpoints were written on another machine: XLA:CPU compiles for
    # the host's vector instructions, and the float16 and EMA combinations came
    # out 2e-6 apart (1e-5 relative) on a machine with AVX-512, though a resume
    # from a checkpoint written on this machine is the uninterrupted run bit for
    # bit (tests/test_features.py). So: the same values to the rounding of the
    # arithmetic these runs use, float16's (an epsilon of 1e-3, at the scale of
    # the parameters, about 1; float32 runs agree far closer), for the losses and
    # the parameters alike (seen: 1.3e-4 apart, a parameter of 0.01).
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-3)
    close(resumed.history["loss"], whole.history["loss"])
    for a, b in zip(_leaves(resumed), _leaves(whole), strict=True):
        close(a, b)
    # ... and from a checkpoint written here, the same combination resumes as the
    # uninterrupted run bit for bit.
    programs.checkpoint(name, tmp_path / "here", 16)
    here = programs.checkpoint(name, tmp_path / "here", 24)
    np.testing.assert_array_equal(here.history["loss"], whole.history["loss"])
    for a, b in zip(_leaves(here), _leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)
