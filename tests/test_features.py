"""Every feature of ``fit(callbacks=[...])`` holds one contract, checked here
for all of them with one scaffolding:

- **a value**: made twice, it is the same feature (the same compiled program,
  no recompile, the same result), and its place in the list does not matter
  (the engine orders the parts by phase);
- **one class for a single model and a population**: a population's member
  trains as the solo fit of the same member does;
- **resume equals uninterrupted**: a run stopped at a checkpoint and started
  again equals the run that was not;
- **refusal leaves everything as it was**: a fit refused before its first
  step leaves the model and every file (checkpoints, best model, logs)
  byte-identical;
- **its fields are its part of the compiled program**: changing a field that
  shapes the program recompiles; continued state (``state=``), paths and log
  windows do not;

and the old keywords are shorthand for the objects: the same program, the
same result, a keyword and its object refused together.
"""

import dataclasses
import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from helpers import count_compiles

import scanax
from scanax._fit import program as _fit_program

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

N, BS, STEPS = 32, 8, 16
X = jr.normal(jr.key(0), (N, 3))
Y = jnp.sin(X @ jnp.array([[1.0], [-2.0], [0.5]]))
EVAL = (X[:16], Y[:16])
KEY = jr.key(7)


def params0(key=None):
    key = jr.key(1) if key is None else key
    return {"w": jr.normal(key, (3, 4)) * 0.5, "v": jnp.zeros((4, 1))}


def loss_fn(p, batch):
    x, y = batch
    err = jnp.tanh(x @ p["w"]) @ p["v"] - y
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def member(key, lr):
    """One population member: the solo model of ``key``, Adam at ``lr``."""
    return params0(key), optax.adam(lr)


def sink(step, metrics):
    """A log sink of one's own (what ``scanax.Log`` wraps)."""


# name -> features(tmp directory): each feature alone (with what it needs)
FEATURES = {
    "Eval": lambda d: [scanax.Eval(EVAL, every=4)],
    "EarlyStop": lambda d: [
        scanax.Eval(EVAL, every=4),
        scanax.EarlyStop("val_loss", patience=2, best_dir=d / "best"),
    ],
    "Plateau": lambda d: [
        scanax.Eval(every=4),
        scanax.Plateau("mae", patience=1, factor=0.5),
    ],
    "Ema": lambda d: [scanax.Ema(0.9, on_eval=True), scanax.Eval(EVAL, every=4)],
    "Precision bfloat16": lambda d: [scanax.Precision("bfloat16")],
    "Precision float16": lambda d: [scanax.Precision("float16")],
    "Checkpoint": lambda d: [scanax.Checkpoint(d / "ckpt", every=8)],
    "CSV": lambda d: [scanax.CSV(d / "log.csv", every=4)],
    "TensorBoard": lambda d: [scanax.TensorBoard(d / "tb", every=4)],
    "Log": lambda d: [scanax.Log(sink, every=4)],
}


def fit(model, optimizer, callbacks=(), **kw):
    kw = {"steps": STEPS, "batch_size": BS, "key": KEY, "progress": False, **kw}
    return scanax.fit(model, optimizer, loss_fn, (X, Y), callbacks=callbacks, **kw)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same(a, b, exact=True):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def files(directory: Path) -> dict:
    """Every file under ``directory`` and a hash of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------------------- a value


@pytest.mark.parametrize("name", FEATURES)
def test_made_twice_is_the_same_feature(tmp_path, name):
    first = fit(params0(), optax.adam(1e-2), FEATURES[name](tmp_path / "a"))
    with count_compiles() as c:
        again = fit(params0(), optax.adam(1e-2), FEATURES[name](tmp_path / "b"))
    assert c.n == 0
    same(first.model, again.model)
    for k, v in first.history.items():
        np.testing.assert_array_equal(again.history[k], v)


def test_list_order_does_not_matter():
    """The engine orders the parts by phase: two orders, one program."""
    made = [
        scanax.Precision("float16"),
        scanax.Eval(EVAL, every=4),
        scanax.Ema(0.8),
        scanax.Plateau("val_loss", patience=1),
        scanax.EarlyStop("val_mae", patience=3),
    ]
    _fit_program.PROGRAMS.clear()
    one = fit(params0(), optax.adam(1e-2), made)
    with count_compiles() as c:
        other = fit(params0(), optax.adam(1e-2), made[::-1])
    assert c.n == 0 and len(_fit_program.PROGRAMS) == 1
    same(one.model, other.model)
    same(one.ema, other.ema)


# ---------------------------------------------------------------------------- population


@pytest.mark.parametrize("name", FEATURES)
def test_a_member_trains_as_its_solo_fit(tmp_path, name):
    lrs = jnp.array([1e-2, 3e-2])
    pop = scanax.population(member, 2, key=jr.key(3), lr=lrs)
    together = fit(pop, None, FEATURES[name](tmp_path / "pop"))
    keys, fit_keys = jr.split(jr.key(3), 2), jr.split(KEY, 2)
    for i in range(2):  # (member i: make's key i, fit's key i: its own data order)
        made = member(keys[i], lrs[i])
        solo = fit(*made, FEATURES[name](tmp_path / f"solo{i}"), key=fit_keys[i])
        same(together.model[i], solo.model, exact=False)
        np.testing.assert_allclose(
            together.history["loss"][i], solo.history["loss"], rtol=1e-5, atol=1e-6
        )


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("name", FEATURES)
def test_resume_equals_uninterrupted(tmp_path, name):
    def run(directory, steps):
        saving = scanax.Checkpoint(directory / "resume", every=8)
        features = [
            f for f in FEATURES[name](directory) if not isinstance(f, scanax.Checkpoint)
        ]
        return fit(params0(), optax.adam(1e-2), [*features, saving], steps=steps)

    run(tmp_path / "a", 8)  # (as if killed after its checkpoint at step 8)
    resumed = run(tmp_path / "a", STEPS)
    whole = run(tmp_path / "b", STEPS)
    same(resumed.model, whole.model)
    np.testing.assert_array_equal(resumed.history["loss"], whole.history["loss"])


# ---------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("name", FEATURES)
def test_a_refusal_leaves_the_model_and_files_as_they_were(tmp_path, name):
    features = FEATURES[name](tmp_path)
    done = fit(params0(), optax.adam(1e-2), features, steps=8)
    before = files(tmp_path)

    def vector_loss(p, batch):  # refused while tracing, before the first step
        return jnp.tanh(batch[0] @ p["w"]).sum(axis=1)

    model = done.model
    with pytest.raises(TypeError, match="scalar"):
        scanax.fit(model, optax.adam(1e-2), vector_loss, (X, Y), steps=8,
                   batch_size=BS, key=KEY, progress=False, callbacks=features,
                   opt_state=done.optimizer)  # fmt: skip
    assert files(tmp_path) == before
    same(model, done.model)


# ---------------------------------------------------------------------------- identity


# (feature, a field changed: recompiles?)
FIELDS = [
    (scanax.Ema(0.9), {"decay": 0.8}, True),
    (scanax.Ema(0.9), {"on_eval": True}, True),
    (scanax.Plateau("loss", patience=1), {"factor": 0.5}, True),
    (scanax.Plateau("loss", patience=1), {"patience": 2}, True),
    (scanax.Precision("float16"), {"dtype": "bfloat16"}, True),
    (scanax.EarlyStop("loss", patience=2), {"patience": 3}, True),
    (scanax.EarlyStop("loss", patience=2), {"monitor": "mae"}, True),
    (scanax.Eval(EVAL, every=4), {"every": 8}, True),
    (scanax.Eval(EVAL, every=4), {"batch_size": 8}, True),
]


def _with_checks(f):
    if isinstance(f, (scanax.EarlyStop, scanax.Plateau, scanax.Ema)):
        return [scanax.Eval(EVAL, every=4), f]
    return [f]


@pytest.mark.parametrize(("feature", "change", "recompiles"), FIELDS)
def test_a_field_is_part_of_the_program(feature, change, recompiles):
    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()
    fit(params0(), optax.adam(1e-2), _with_checks(feature))
    changed = dataclasses.replace(feature, **change)
    with count_compiles() as c:
        fit(params0(), optax.adam(1e-2), _with_checks(changed))
    assert (c.n > 0) == recompiles
    assert len(_fit_program.PROGRAMS) == 2


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_continued_state_paths_and_windows_do_not_recompile(
    platform, tmp_path, monkeypatch
):
    """A continued call with the first's states given back and other log and
    checkpoint windows compiles nothing. On CPU (k = 1) the windows are not
    part of the program; off CPU they are periods that size its chunks, part
    of its identity (docs/compile.md): these windows keep k at the evaluation's
    4, so the call traces anew and finds the same executable."""
    from scanax import _backend

    monkeypatch.setattr(_backend, "platform", lambda: platform)
    features = [
        scanax.Ema(0.9),
        scanax.Plateau("loss", patience=1),
        scanax.Precision("float16"),
        scanax.Eval(every=4),
        scanax.Checkpoint(tmp_path / "a", every=8),
        scanax.CSV(tmp_path / "a.csv", every=4),
    ]
    first = fit(params0(), optax.adam(1e-2), features)
    continued = [
        scanax.Ema(0.9, state=first.ema),
        scanax.Plateau("loss", patience=1, state=first.plateau),
        scanax.Precision("float16", state=first.loss_scale),
        scanax.Eval(every=4),
        scanax.Checkpoint(tmp_path / "b", every=16),
        scanax.CSV(tmp_path / "b.csv", every=8),
    ]
    programs = set(_fit_program.PROGRAMS)  # (by key: the cache may be full)
    with count_compiles() as c:
        fit(first.model, optax.adam(1e-2), continued)
    assert c.n == 0
    assert len(set(_fit_program.PROGRAMS) - programs) == (platform != "cpu")


# ---------------------------------------------------------------------------- shorthand


SHORTHAND = [
    (dict(eval_data=EVAL, eval_every=4), [scanax.Eval(EVAL, every=4)]),
    (
        dict(eval_every=4, stop=scanax.EarlyStop("loss", patience=2)),
        [scanax.Eval(every=4), scanax.EarlyStop("loss", patience=2)],
    ),
    (
        dict(eval_every=4, plateau=scanax.Plateau("mae", patience=1)),
        [scanax.Eval(every=4), scanax.Plateau("mae", patience=1)],
    ),
    (dict(ema=0.9, ema_eval=False), [scanax.Ema(0.9)]),
    (dict(precision="float16"), [scanax.Precision("float16")]),
]


@pytest.mark.parametrize(("keywords", "objects"), SHORTHAND)
def test_a_keyword_is_shorthand_for_its_object(keywords, objects):
    _fit_program.PROGRAMS.clear()
    short = fit(params0(), optax.adam(1e-2), **keywords)
    with count_compiles() as c:
        long = fit(params0(), optax.adam(1e-2), objects)
    assert c.n == 0
    same(short.model, long.model)
    for k, v in short.history.items():
        np.testing.assert_array_equal(long.history[k], v)


def test_a_keyword_with_its_object_is_refused():
    with pytest.raises(TypeError, match=r"`ema=` and a scanax.Ema in callbacks="):
        fit(params0(), optax.adam(1e-2), [scanax.Ema(0.9)], ema=0.8)
    with pytest.raises(TypeError, match=r"`eval_every=` and a scanax.Eval"):
        fit(params0(), optax.adam(1e-2), [scanax.Eval(EVAL, every=4)], eval_every=2)


def test_an_unknown_keyword_names_the_nearest():
    with pytest.raises(TypeError, match=r"keyword argument 'eval_evry'.*`eval_every`"):
        fit(params0(), optax.adam(1e-2), eval_evry=5)


@pytest.mark.parametrize(
    "name, answer",
    [
        ("shuffle", r"key=jax\.random\.key\(seed\)"),
        ("verbose", r"progress=False"),
        ("validation_data", r"callbacks=\[scanax\.Eval\(\(x_val, y_val\), every=N\)\]"),
        ("max_epochs", r"epochs=N"),
    ],
)
def test_a_keras_or_lightning_keyword_names_fits_own(name, answer):
    """Keras's and Lightning's keywords get fit's own for what they do (the
    nearest spelling had sent `validation_data` to the old `eval_data`)."""
    with pytest.raises(
        TypeError, match=rf"keyword argument '{name}'\. In scanax\.fit that is {answer}"
    ):
        fit(params0(), optax.adam(1e-2), **{name: 1})


def test_callbacks_hold_features_once_each():
    with pytest.raises(TypeError, match=r"callbacks\[0\] is .*scanax.Log\(fn"):
        fit(params0(), optax.adam(1e-2), [sink])
    with pytest.raises(ValueError, match="two scanax.Ema objects"):
        fit(params0(), optax.adam(1e-2), [scanax.Ema(0.9), scanax.Ema(0.8)])
    with pytest.raises(TypeError, match="must be a list of features"):
        fit(params0(), optax.adam(1e-2), scanax.Ema(0.9))


def test_sinks_with_their_own_windows(tmp_path):
    rows = {2: [], 8: []}
    callbacks = [
        scanax.Log(lambda s, m: rows[2].append(s), every=2),
        scanax.Log(lambda s, m: rows[8].append(s), every=8),
    ]
    fit(params0(), optax.adam(1e-2), callbacks)
    assert rows[2] == list(range(2, STEPS + 1, 2))
    assert rows[8] == [8, 16]
