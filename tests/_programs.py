"""Fits of every feature combination, and the programs they compile, as text:
what ``tests/test_golden.py`` holds against the programs and checkpoints that the
fit wing wrote before its features became objects (``tests/golden/``).

``python tests/_programs.py`` (from the repository root) writes them again: the
jaxpr of each combination's compiled call and a checkpoint directory each;
``python tests/_programs.py programs`` the programs alone.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402

import scanax  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
N, BS = 32, 8
X = jr.normal(jr.key(0), (N, 3))
Y = jnp.sin(X @ jnp.array([[1.0], [-2.0], [0.5]]))
KEY = jr.key(7)
EVAL = (X[:16], Y[:16])


def params0():
    return {"w": jr.normal(jr.key(1), (3, 4)) * 0.5, "v": jnp.zeros((4, 1))}


def loss(p, batch):
    x, y = batch
    err = jnp.tanh(x @ p["w"]) @ p["v"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def member(key, lr):
    p = {"w": jr.normal(key, (3, 4)) * 0.5, "v": jnp.zeros((4, 1))}
    return p, optax.adam(lr)


def nnx_pair():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 4, rngs=rngs)
            self.b = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def nnx_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def ts_state():
    from flax.training import train_state

    def apply(p, x):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    return train_state.TrainState.create(
        apply_fn=apply, params=params0(), tx=optax.sgd(0.05)
    )


def ts_loss(state, batch):
    x, y = batch
    return jnp.mean((state.apply_fn(state.params, x) - y) ** 2)


def rollout():
    import _rollout_job as job

    return scanax.Rollout(job.collect, job.env_reset, epochs=2, minibatches=2)


def pop(n=3):
    return scanax.population(
        member, n, key=jr.key(3), lr=jnp.array([1e-2, 3e-2, 1e-1][:n])
    )


STOP = scanax.EarlyStop("val_loss", patience=2)
PLATEAU = scanax.Plateau("mae", patience=1, factor=0.5)


def _opts(**kw):
    return {"steps": 24, "batch_size": BS, "key": KEY, "progress": False, **kw}


# name -> (model, optimizer, loss, data) maker, fit's keywords
COMBOS = {
    "plain": (lambda: (params0(), optax.adam(1e-2), loss, (X, Y)), _opts()),
    "eval_stop": (
        lambda: (params0(), optax.adam(1e-2), loss, (X, Y)),
        _opts(eval_data=EVAL, eval_every=6, stop=STOP),
    ),
    "plateau_stop_train": (
        lambda: (params0(), optax.adam(1e-2), loss, (X, Y)),
        _opts(eval_every=5, plateau=PLATEAU, stop=scanax.EarlyStop("loss", patience=3)),
    ),
    "ema_eval_float16": (
        lambda: (params0(), optax.adam(1e-2), loss, (X, Y)),
        _opts(
            eval_data=EVAL, eval_every=6, ema=0.9, ema_eval=True, precision="float16"
        ),
    ),
    "bfloat16_accumulate": (
        lambda: (params0(), optax.adam(1e-2), loss, (X, Y)),
        _opts(precision="bfloat16", accumulate=2),
    ),
    "everything": (
        lambda: (params0(), optax.adam(1e-2), loss, (X, Y)),
        _opts(
            eval_data=EVAL,
            eval_every=4,
            stop=scanax.EarlyStop("val_mae", patience=5),
            plateau=scanax.Plateau("val_loss", patience=1),
            ema=0.8,
            precision="float16",
        ),
    ),
    "nnx_ema_plateau": (
        lambda: (*nnx_pair(), nnx_loss, (X, Y)),
        _opts(eval_every=4, plateau=scanax.Plateau("loss", patience=1), ema=0.9),
    ),
    "trainstate_float16": (
        lambda: (ts_state(), None, ts_loss, (X, Y)),
        _opts(precision="float16"),
    ),
    "rollout_ema": (
        lambda: (
            __import__("_rollout_job").params0(),
            optax.adam(1e-2),
            __import__("_rollout_job").loss_fn,
            rollout(),
        ),
        {"steps": 16, "key": KEY, "progress": False, "ema": 0.9},
    ),  # fmt: skip
    "population": (lambda: (pop(), None, loss, (X, Y)), _opts()),
    "population_everything": (
        lambda: (pop(), None, loss, (X, Y)),
        _opts(
            eval_data=EVAL,
            eval_every=4,
            stop=scanax.EarlyStop("val_loss", patience=2),
            plateau=scanax.Plateau("mae", patience=1),
            ema=0.9,
            ema_eval=True,
            precision="float16",
        ),
    ),
    "population_rollout": (
        lambda: (
            scanax.population(
                lambda key, lr: (
                    __import__("_rollout_job").params0(key),
                    optax.adam(lr),
                ),
                2,
                key=jr.key(3),
                lr=jnp.array([1e-2, 3e-2]),
            ),
            None,
            __import__("_rollout_job").loss_fn,
            rollout(),
        ),
        {"steps": 16, "key": KEY, "progress": False},
    ),  # fmt: skip
}


_NAMES = re.compile(r"\bname=[\w<>.\-]+")


def text(jaxpr) -> str:
    """A jaxpr's text without the names of the functions it calls (a renamed
    helper is the same program)."""
    return _NAMES.sub("name=_", str(jaxpr))


def programs(name: str, **extra) -> list[str]:
    """Run combination ``name`` (``extra``: more of fit's keywords) and return
    the text of each program its calls compiled (in order)."""
    from scanax._fit import program as _fit_program

    make, kw = COMBOS[name]
    seen = []
    executable = _fit_program.Program.executable

    def record(program, args):
        seen.append(text(jax.make_jaxpr(program.chunks.fused)(*args)))
        return executable(program, args)

    _fit_program.Program.executable = record
    _fit_program.PROGRAMS.clear()
    try:
        scanax.fit(*make(), **kw, **extra)
    finally:
        _fit_program.Program.executable = executable
    return seen


def checkpoint(name: str, directory: Path, steps: int) -> object:
    """Run combination ``name`` for ``steps`` steps, checkpointing into
    ``directory`` every 8 steps; the result."""
    make, kw = COMBOS[name]
    kw = {**kw, "steps": steps, "checkpoint_dir": directory, "checkpoint_every": 8}
    return scanax.fit(*make(), **kw)


CHECKPOINTED = ["plain", "eval_stop", "ema_eval_float16", "everything",
                "nnx_ema_plateau", "rollout_ema", "population_everything"]  # fmt: skip


def main() -> None:
    """Write the programs and the checkpoints; with the argument ``programs``,
    the programs alone (the checkpoints are an on-disk format from before:
    an old one must still resume)."""
    import shutil

    out = GOLDEN / "programs"
    out.mkdir(parents=True, exist_ok=True)
    (GOLDEN / "VERSION").write_text(jax.__version__ + "\n")
    for name in COMBOS:
        found = programs(name)
        (out / f"{name}.txt").write_text("\n\n".join(found))
        print(name, len(found), "programs", sum(len(t) for t in found), "chars")
    if sys.argv[1:] == ["programs"]:
        return
    for name in CHECKPOINTED:
        directory = GOLDEN / "checkpoints" / name
        shutil.rmtree(directory, ignore_errors=True)
        checkpoint(name, directory, 16)
        print(name, sorted(os.listdir(directory)))


if __name__ == "__main__":
    main()
