"""Compile once per structure: fit reuses its compiled loop when the model, the
optimizer and ``loss_fn`` are rebuilt, recompiles (or traces new values) when
anything that changes the result changes, and keeps programs on disk across
processes with ``scanax.compile_cache``."""

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scanax
from scanax import _fingerprint

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

sys.path.insert(0, os.path.dirname(__file__))
from fit_helpers import BS, KEY, MLP, X, Y, batch_at  # noqa: E402
from helpers import count_compiles, count_traces, leaves_equal, traced  # noqa: E402

STEPS = 13


def build(lr=1e-2, seed=0):
    """What a notebook cell or a sweep iteration rebuilds: model, optimizer with a
    new optax transform, and a new loss function object with the same code."""
    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    def loss_fn(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    return model, optimizer, loss_fn


def train(model, optimizer, loss_fn, steps=STEPS, **kwargs):
    return scanax.fit(
        model,
        optimizer,
        loss_fn,
        (X, Y),
        steps=steps,
        batch_size=BS,
        key=KEY,
        progress=False,
        **kwargs,
    )


def reference(lr, loss_fn, steps=STEPS, seed=0):
    """A Python loop of nnx.jit steps on fit's documented batches."""
    model = MLP(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [step(model, optimizer, batch_at(t)) for t in range(steps)]
    return np.asarray(losses), model


def test_rebuilt_objects_do_not_compile():
    """Everything rebuilt with the same structure and code: no backend compile,
    the same result bit for bit."""
    first = train(*build())
    model, optimizer, loss_fn = build()
    with count_compiles() as c:
        second = train(model, optimizer, loss_fn)
    assert c.n == 0
    np.testing.assert_array_equal(second.history["loss"], first.history["loss"])
    leaves_equal(nnx.state(second.model), nnx.state(first.model))


def test_a_first_call_compiles_one_program_and_traces_the_loss_twice():
    """A structure never seen: one backend compile (the loop; nothing eager
    around it), and ``loss_fn`` traced twice: once in the step (its jaxpr
    replayed in the loop body, not traced again for the output shapes), once
    alone, for the check that it reads the trained parameters
    (``test_loss_reads.py``; its forward pass only, nothing added to the
    program)."""
    traced = []

    def loss_fn(model, batch):
        traced.append(1)
        x, y = batch
        return jnp.mean(jnp.abs(model(x) - y) ** 3)  # a body no other test has

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with count_compiles() as c:
        result = train(model, optimizer, loss_fn)
    assert (c.n, len(traced)) == (1, 2)
    ref, _ = reference(1e-2, loss_fn)
    np.testing.assert_allclose(result.history["loss"], ref, rtol=1e-6)


def test_rebuilt_objects_with_a_progress_bar_share_the_program(capsys):
    """A bar does not make another program: the silent call compiled it."""
    train(*build(seed=1))
    with count_compiles() as c:
        scanax.fit(*build(seed=2), (X, Y), steps=STEPS, batch_size=BS, key=KEY)
    assert c.n == 0
    assert f"{STEPS}/{STEPS}" in capsys.readouterr().err


@pytest.mark.parametrize("lr", [3e-2, 1e-3])
def test_changed_learning_rate_gives_its_own_result(lr):
    """A new hyperparameter value is never answered by a stale program."""
    train(*build())
    model, optimizer, loss_fn = build(lr=lr)
    result = train(model, optimizer, loss_fn)
    losses, ref = reference(lr, loss_fn)
    np.testing.assert_allclose(result.history["loss"], losses, rtol=1e-5)
    np.testing.assert_allclose(
        model.l1.kernel[...], ref.l1.kernel[...], rtol=1e-5, atol=1e-6
    )


def test_changed_loss_body_gives_its_own_result():
    train(*build())
    model, optimizer, _ = build()

    def loss_fn(model, batch):  # same name, another body
        x, y = batch
        return jnp.mean(jnp.abs(model(x) - y))

    result = train(model, optimizer, loss_fn)
    losses, _ = reference(1e-2, loss_fn)
    np.testing.assert_allclose(result.history["loss"], losses, rtol=1e-5)


def test_changed_closure_value_gives_its_own_result():
    """A loss that closes over a number (or a small array) is fingerprinted by
    value: a new value is a new program, the same value is the old one."""

    def make(scale):
        def loss_fn(model, batch):
            x, y = batch
            return jnp.mean((model(x) - scale * y) ** 2)

        return loss_fn

    for scale in (1.0, jnp.array(2.0), 3.0):
        model, optimizer, _ = build()
        result = train(model, optimizer, make(scale))
        losses, _ = reference(1e-2, make(scale))
        np.testing.assert_allclose(result.history["loss"], losses, rtol=1e-5)
    model, optimizer, _ = build()
    with count_compiles() as c:
        train(model, optimizer, make(3.0))
    assert c.n == 0


def test_other_steps_values_do_not_compile():
    """An epoch loop with a short last call, or any other steps value, runs the
    compiled loop it has."""
    train(*build(), steps=5)
    with count_compiles() as c:
        for steps in (1, 17, 9):
            train(*build(), steps=steps)
    assert c.n == 0


def test_equinox_rebuilt_does_not_compile():
    def make(seed):
        model = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(seed))

        def loss_fn(model, batch):
            x, y = batch
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        return model, optax.adamw(1e-2, weight_decay=1e-4), loss_fn

    first = train(*make(0))
    with count_compiles() as c:
        second = train(*make(0))
    assert c.n == 0
    np.testing.assert_array_equal(second.history["loss"], first.history["loss"])


def test_fingerprints():
    """What counts as the same: equal code, equal closed-over values, equal
    optax hyperparameters; what does not: any of those changed."""
    of = _fingerprint.of
    assert of(optax.adam(1e-3)) == of(optax.adam(1e-3))
    assert of(optax.adam(1e-3)) != of(optax.adam(2e-3))
    assert of(optax.adam(1e-3)) != of(optax.sgd(1e-3))
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    again = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    assert of(optax.adamw(sched)) == of(optax.adamw(again))
    assert of(optax.chain(optax.clip(1.0), optax.sgd(0.1))) != of(
        optax.chain(optax.clip(2.0), optax.sgd(0.1))
    )

    def closing_over(value):
        return lambda: value

    big = jnp.zeros(10_000)
    assert of(closing_over(big)) == of(closing_over(big))  # large: by identity
    assert of(closing_over(big)) != of(closing_over(jnp.zeros(10_000)))
    assert of(closing_over(jnp.ones(3))) == of(closing_over(jnp.ones(3)))  # small
    assert of(closing_over(jnp.ones(3))) != of(closing_over(jnp.zeros(3)))
    assert of([1, 1.0, True]) != of([1, 1, 1])  # types count

    # a helper of the user's under jax.jit, read as a global: by identity (it
    # made every population build and Rollout init recompile on each fit)
    def using_jitted():
        return _JITTED_HELPER(1.0)

    assert of(using_jitted) is not None and of(using_jitted) == of(using_jitted)
    assert of(_JITTED_HELPER) != of(jax.jit(lambda x: x * 2.0))


_JITTED_HELPER = jax.jit(lambda x: x * 2.0)


@pytest.mark.parametrize("where", ["target", "first", "project", "cwd"])
def test_libraries_installed_outside_site_packages(tmp_path, monkeypatch, where):
    """A package installed with ``pip install --target DIR`` and found through
    ``PYTHONPATH`` (as the TPU machine's flax was: every population build there
    recompiled, its model's fingerprint None) is a library, fingerprinted by
    identity, wherever ``DIR`` is on ``sys.path`` (first under ``python -P``).
    A directory of the user's code is not: one with no wheel's metadata (a
    setuptools project's root holds only its ``.egg-info``), or the current
    directory (the script's), whatever it holds: a module-level value there may
    change between calls, so the function is fingerprinted by the module's
    attributes it reads (a reassigned one is a new fingerprint). A
    ``sys.path`` entry that is not a string (imports skip it) does not break
    fingerprints."""
    name = f"fp_pkg_{where}"  # (``_library`` is cached by name)
    home = tmp_path / "dir"
    (home / name).mkdir(parents=True)
    (home / name / "__init__.py").write_text("SCALE = 2.0\n")
    if where == "project":
        (home / f"{name}.egg-info").mkdir()
    else:
        (home / f"{name}-1.0.dist-info").mkdir()
    if where == "cwd":
        monkeypatch.chdir(home)
    first = where == "first"
    rest = [*sys.path, pathlib.Path(tmp_path)]
    monkeypatch.setattr(
        sys, "path", [str(home), *rest] if first else [*rest, str(home)]
    )
    importlib.invalidate_caches()
    module = importlib.import_module(name)

    def uses_it(x):
        return module.SCALE * x

    installed = where in ("target", "first")
    assert _fingerprint._library(name) is installed
    found = _fingerprint.of(uses_it)
    assert found is not None and found == _fingerprint.of(uses_it)
    module.SCALE = 3.0  # a library's module is by identity; the user's is read
    assert (_fingerprint.of(uses_it) == found) is installed


def test_a_user_module_is_fingerprinted_by_what_the_function_reads(
    tmp_path, monkeypatch
):
    """A module of the user's code that a function names or closes over is
    fingerprinted by the attributes the function may read, by name or by a
    string (``getattr(mod, "x")``): reassigning one is a new fingerprint. One
    with a ``__getattr__`` (computed attributes) has none: the function is
    traced again at every call, and fingerprinting runs none of its code."""
    (tmp_path / "fp_user_mod.py").write_text("X = 1.0\nY = 2.0\n")
    (tmp_path / "fp_lazy_mod.py").write_text(
        "_C = {'X': 1.0}\n\ndef __getattr__(name):\n    return _C[name]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("fp_user_mod")
    lazy = importlib.import_module("fp_lazy_mod")

    def by_name(x):
        return mod.X * x

    def by_string(x):
        return getattr(mod, "X") * x  # noqa: B009

    for fn in (by_name, by_string):
        found = _fingerprint.of(fn)
        assert found is not None and found == _fingerprint.of(fn)
        mod.Y = 5.0  # not read: the same fingerprint
        assert _fingerprint.of(fn) == found
        mod.X = 3.0
        assert _fingerprint.of(fn) != found
        mod.X = 1.0

    def reads_lazy(x):
        return lazy.X * x

    assert _fingerprint.of(reads_lazy) is None


def test_a_function_attribute_is_part_of_its_fingerprint():
    """``f.c = value`` read by ``f``'s code through its own name: two
    functions alike but for it are other programs (fit gave the second the
    first one's program, review 2026-12-06)."""

    def make(c):
        def f(p, batch):
            x, y = batch
            return jnp.mean((x @ p["w"] - y) ** 2) + f.c

        f.c = c
        return f

    assert _fingerprint.of(make(1.0)) == _fingerprint.of(make(1.0))
    assert _fingerprint.of(make(1.0)) != _fingerprint.of(make(2.0))
    p = {"w": jnp.zeros((3, 1))}
    opt = optax.sgd(0.0)
    first, second = (
        scanax.fit(p, opt, make(c), (X, Y), steps=1, batch_size=BS, progress=False)
        for c in (1.0, 2.0)
    )
    np.testing.assert_allclose(
        second.history["loss"], first.history["loss"] + 1.0, rtol=1e-6
    )


def test_a_named_tuple_class_of_the_users_has_a_fingerprint():
    """A ``typing.NamedTuple`` of the user's code (an environment's state) is
    described by its fields (C-level accessors, immutable): a function that
    builds one has a fingerprint, the same for a re-defined class, so fit
    keeps its program (the PPO benchmark's ``collect`` had none)."""
    from typing import NamedTuple

    def make():
        class State(NamedTuple):
            x: jax.Array
            t: jax.Array

        def step(x):
            return State(x, x + 1)

        return step

    found = _fingerprint.of(make())
    assert found is not None and found == _fingerprint.of(make())


# ---------------------------------------------------------------- across processes

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import scanax

    compiles = []  # backend compiles, less those loaded from the disk cache
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **k: compiles.append(1) if e.endswith("backend_compile_duration")
        else None
    )
    jax.monitoring.register_event_listener(
        lambda e, **k: compiles.append(-1) if e.endswith("cache_hits") else None
    )
    used = scanax.compile_cache(sys.argv[1])

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (64, 3))
    y = jnp.sin(x)
    before = len(compiles)

    def loss_fn(model, batch):
        return jnp.mean((model(batch[0]) - batch[1]) ** 2)

    r = scanax.fit(model, optimizer, loss_fn, (x, y), steps=50,
                   batch_size=8, key=jax.random.key(1), progress=False)
    print(json.dumps({"used": used, "fit_compiles": sum(compiles[before:]),
                      "loss": float(r.history["loss"][-1])}))
    """
)


def _run_script(tmp_path, cache):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMP")}
    out = subprocess.run(
        [sys.executable, str(script), str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_loads_fit_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    cold = _run_script(tmp_path, cache)
    warm = _run_script(tmp_path, cache)
    assert cold["used"] == warm["used"] == str(cache)
    assert cold["fit_compiles"] >= 1
    assert warm["fit_compiles"] < cold["fit_compiles"]
    assert warm["loss"] == cold["loss"]
    assert any(cache.iterdir())


@pytest.fixture
def no_cache_chosen():
    """A process where no compilation cache directory is chosen yet (conftest.py
    chooses one for the suite's processes on CPU): restored after the test."""
    suites = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", suites)


def test_unwritable_cache_directory_warns_and_runs(tmp_path, no_cache_chosen):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match=r"scanax.compile_cache: cannot use"):
        assert scanax.compile_cache(blocker / "cache") is None
    assert jax.config.jax_compilation_cache_dir in (None, "")
    train(*build())  # and training goes on


def test_compile_cache_keeps_the_users_directory(tmp_path, no_cache_chosen):
    theirs = str(tmp_path / "theirs")
    jax.config.update("jax_compilation_cache_dir", theirs)
    assert scanax.compile_cache(tmp_path / "ours") == theirs
    assert jax.config.jax_compilation_cache_dir == theirs
    assert not (tmp_path / "ours").exists()


# ------------------------------------------- no stale program (adversarial review)


def _fresh(fn):
    """``fn()`` with every cache of compiled programs emptied first: what a new
    process computes."""
    from scanax._fit import program as _fit_program

    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()
    jax.clear_caches()
    return fn()


def test_loss_closing_over_a_model_trained_elsewhere():
    """A GAN/distillation-style loop: loss_a reads model b, which another fit
    trains in place between rounds. b's new weights must be read (an NNX object
    is not described by identity: the program is traced again)."""

    def rounds():
        a, b = nnx.Linear(3, 1, rngs=nnx.Rngs(0)), nnx.Linear(3, 1, rngs=nnx.Rngs(1))
        opt_a = nnx.Optimizer(a, optax.sgd(0.1), wrt=nnx.Param)
        opt_b = nnx.Optimizer(b, optax.sgd(0.1), wrt=nnx.Param)
        for _ in range(3):

            def loss_a(m, batch):
                return jnp.mean((m(batch[0]) - b(batch[0])) ** 2)

            def loss_b(m, batch):
                return jnp.mean((m(batch[0]) - batch[1]) ** 2)

            train(a, opt_a, loss_a, steps=4)
            train(b, opt_b, loss_b, steps=4)
        return np.asarray(a.kernel[...])

    cached = rounds()
    np.testing.assert_array_equal(cached, _fresh(rounds))


@pytest.mark.parametrize("execution", ["fused", "stepwise"])
def test_the_same_loss_object_reading_a_changed_object(execution):
    """The same ``loss_fn`` object, passed to each call, reads a setting
    changed between calls and a teacher model changed in place (a
    distillation loop): each call, and ``evaluate``, reads their current
    values, as with every cache emptied (the program was cached on the
    function object: later calls trained on the first call's values).
    Unchanged, a call traces again and compiles nothing."""
    import types

    setting = types.SimpleNamespace(scale=1.0)

    def rounds(fresh_each):
        teacher = nnx.Linear(3, 1, rngs=nnx.Rngs(7))

        def loss_fn(model, batch):
            x, _ = batch
            return setting.scale * jnp.mean((model(x) - teacher(x)) ** 2)

        model, optimizer, _ = build()
        out = []
        for scale, shift in (
            (1.0, 0.0),
            (1.0, 0.0),
            (1.0, 0.0),
            (3.0, 0.0),
            (3.0, 1.0),
        ):
            setting.scale = scale
            teacher.kernel[...] = teacher.kernel[...] + shift
            if fresh_each:
                _fresh(lambda: None)
            with count_compiles() as c:
                result = train(model, optimizer, loss_fn, steps=4, execution=execution)
            out.append((result.history["loss"], c.n))
            got = scanax.evaluate(model, loss_fn, (X, Y), batch_size=len(X))["loss"]
            np.testing.assert_allclose(got, loss_fn(model, (X, Y)), rtol=1e-5)
        return out

    try:
        cached, fresh = rounds(False), rounds(True)
    finally:
        setting.scale = 1.0
    for (a, _), (b, _) in zip(cached, fresh):
        np.testing.assert_array_equal(a, b)
    # The same values: traced again, nothing compiled (the second call may
    # compile stepwise's first program once: its arguments now committed).
    assert cached[2][1] == 0


SETTING = None  # (a SimpleNamespace while the test below runs)


class ReadsSetting(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return SETTING.scale * self.lin(x)  # an object read by the model's method


def test_a_model_method_or_a_schedule_reading_a_changed_object():
    """The same model and optimizer objects, fitted again after the object
    their own code reads changed (a model method reading a SimpleNamespace; an
    optax schedule closing over one): each call reads its current value, as
    with every cache emptied (the program was keyed on their structure, so
    the second call kept the first call's values)."""
    import types

    global SETTING

    def rounds(fresh_each):
        global SETTING
        SETTING = types.SimpleNamespace(scale=1.0)
        cfg = types.SimpleNamespace(lr=0.1)
        model = ReadsSetting(nnx.Rngs(0))
        tx = optax.sgd(lambda step: cfg.lr)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        out = []
        for scale, lr in ((1.0, 0.1), (3.0, 0.1), (3.0, 0.0)):
            SETTING.scale, cfg.lr = scale, lr
            if fresh_each:
                _fresh(lambda: None)
            result = train(model, optimizer, build()[2], steps=3)
            out.append((result.history["loss"], np.asarray(model.lin.kernel[...])))
        return out

    try:
        cached, fresh = rounds(False), rounds(True)
    finally:
        SETTING = None
    for (a, ka), (b, kb) in zip(cached, fresh):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(cached[2][1], cached[1][1])  # lr 0: unchanged


def test_a_rebuilt_equinox_model_reuses_its_program():
    """Equinox's modules hold its ``Missing`` sentinel in their static data: a
    library's object with no state of its own, by identity, so a rebuilt
    model has a fingerprint and its second fit traces nothing."""

    def loss(m, batch):
        traced("loss")
        return jnp.mean((jax.vmap(m)(batch[0]) - batch[1]) ** 2)

    def run():
        model = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))
        return scanax.fit(model, optax.adam(1e-2), loss, (X, Y), steps=3,
                          batch_size=BS, key=KEY, progress=False)  # fmt: skip

    with count_traces() as traces:
        run()
        first = traces["loss"]
        with count_compiles() as c:
            run()
        assert (traces["loss"], c.n) == (first, 0) and first > 0
    model = eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))
    assert _fingerprint.of(jax.tree_util.tree_structure(model)) is not None


def test_scanax_is_a_library_also_from_a_checkout():
    """scanax's own modules are a library's (fingerprinted by identity) also
    when it is installed editable, as the README installs it: its modules
    live in the checkout, not in site-packages, and were walked as the user's
    code, where ``scanax.rnn``, ``scanax.Stack`` and a Stack instance had no
    fingerprint, so every fit of a model using them traced again (review:
    0.35-0.46 s a call against 0.01 for flax's own RNN)."""
    assert _fingerprint._library("scanax._rnn") and _fingerprint._library("scanax")
    assert _fingerprint.of(scanax.rnn) is not None
    assert _fingerprint.of(scanax.Stack) is not None


_SCALE = 1.0  # read by the layers below (changed by the test)


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x)) * _SCALE


class _Recurrent(nnx.Module):
    def __init__(self, rngs):
        self.cell = nnx.SimpleCell(1, 3, rngs=rngs)
        self.head = _Layer(rngs)
        self.out = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):  # x: [3] features, read as 3 steps of 1
        _, ys = scanax.rnn([self.cell], x[:, None])
        return self.out(self.head(ys[-1]))


class _EqxLayer(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return jnp.tanh(self.lin(x)) * _SCALE


class _EqxNet(eqx.Module):
    blocks: scanax.Stack
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.blocks = scanax.Stack(
            [_EqxLayer(eqx.nn.Linear(3, 3, key=k)) for k in keys[:3]]
        )
        self.out = eqx.nn.Linear(3, 1, key=keys[3])

    def __call__(self, x):
        return self.out(self.blocks(x))


@pytest.mark.parametrize("kind", ["stack", "rnn", "equinox"])
def test_a_model_using_scanax_keeps_its_program(kind, monkeypatch):
    """A model holding a ``scanax.Stack`` (NNX, Equinox) or calling
    ``scanax.rnn``: rebuilt alike, its second fit traces nothing and compiles
    nothing; a layer whose code reads a global that changed traces again and
    trains to the new value's result (no stale program)."""

    def loss(m, batch):
        traced("loss")
        return jnp.mean((jax.vmap(m)(batch[0]) - batch[1]) ** 2)

    def run():
        if kind == "equinox":
            out = scanax.fit(_EqxNet(jax.random.key(0)), optax.adam(1e-2), loss, (X, Y),
                             steps=3, batch_size=BS, key=KEY, progress=False)  # fmt: skip
            return np.concatenate([np.ravel(x) for x in jax.tree.leaves(
                eqx.filter(out.model, eqx.is_array))])  # fmt: skip
        rngs = nnx.Rngs(0)
        if kind == "stack":
            model = nnx.Sequential(
                scanax.Stack([_Layer(rngs) for _ in range(3)]),
                nnx.Linear(3, 1, rngs=rngs),
            )
        else:
            model = _Recurrent(rngs)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        scanax.fit(model, opt, loss, (X, Y), steps=3, batch_size=BS, key=KEY,
                   progress=False)  # fmt: skip
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.state(model))])

    with count_traces() as traces:
        first = run()
        n = traces["loss"]
        with count_compiles() as c:
            again = run()
        assert (traces["loss"], c.n) == (n, 0) and n > 0
        monkeypatch.setattr(sys.modules[__name__], "_SCALE", 2.0)
        other = run()
        assert traces["loss"] > n
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


def test_a_users_equinox_module_class_has_a_fingerprint():
    """A class of the user's (an ``eqx.Module`` dataclass) is fingerprinted by
    its code and its fields: re-defined alike, the same (a rebuilt model keeps
    its program: such classes had none, so each fit traced again, ~80 ms for a
    small BatchNorm MLP, review 2026-12-06); a field or a method changed, not."""

    def define(width_default=8, scale=1.0):
        class Net(eqx.Module):
            lin: eqx.nn.Linear
            width: int = eqx.field(static=True, default=width_default)

            def __init__(self, key):
                self.lin = eqx.nn.Linear(3, 1, key=key)

            def __call__(self, x):
                return self.lin(x) * scale

        return Net

    def fp(cls):
        return _fingerprint.of(jax.tree_util.tree_structure(cls(jax.random.key(0))))

    first = fp(define())
    assert first is not None and first == fp(define())
    assert fp(define(width_default=16)) != first
    assert fp(define(scale=2.0)) != first

    def loss(m, batch):
        traced("user-class loss")
        return jnp.mean((jax.vmap(m)(batch[0]) - batch[1]) ** 2)

    def run():
        model = define()(jax.random.key(0))
        return scanax.fit(model, optax.adam(1e-2), loss, (X, Y), steps=3,
                          batch_size=BS, key=KEY, progress=False)  # fmt: skip

    with count_traces() as traces:
        run()
        once = traces["user-class loss"]
        run()
        assert traces["user-class loss"] == once > 0


SCALE = 1.0


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return SCALE * self.lin(x)  # a global read by the model's own method


def test_model_method_reading_a_global():
    global SCALE

    def run():
        model = Scaled(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        return train(model, optimizer, build()[2]).history["loss"]

    try:
        first = run()
        SCALE = 3.0
        second = run()
        np.testing.assert_array_equal(second, _fresh(run))
        assert not np.array_equal(first, second)
    finally:
        SCALE = 1.0


def test_losses_with_other_host_callbacks_are_not_shared():
    """Two losses that differ only in their callback lower to the same text: the
    executable must not be shared (it would call the first callback)."""

    def make(offset):
        def callback(x):
            return np.asarray(x + offset, np.float32)

        def loss_fn(model, batch):
            x, y = batch
            loss = jnp.mean((model(x) - y) ** 2)
            shape = jax.ShapeDtypeStruct((), jnp.float32)
            metric = jax.pure_callback(callback, shape, jax.lax.stop_gradient(loss))
            return loss, {"cb": metric}

        return loss_fn

    model, optimizer, _ = build()
    first = train(model, optimizer, make(0.0), steps=2)
    model, optimizer, _ = build()
    second = train(model, optimizer, make(100.0), steps=2)
    np.testing.assert_allclose(second.history["cb"], first.history["cb"] + 100.0)


def bar_fit(model, optimizer, loss_fn, steps=8):
    """A fit whose bar reports from inside the loop (steps_per_call=4)."""
    return scanax.fit(
        model, optimizer, loss_fn, (X, Y), steps=steps, batch_size=BS, key=KEY,
        steps_per_call=4, progress=scanax.Progress(every=2),
    )  # fmt: skip


@pytest.mark.skipif(
    jax.default_backend() == "tpu",
    reason="a TPU's host sends and receives are not told apart from a loss's own "
    "callback: the program is not shared there (docs/compile.md)",
)
def test_a_bar_reporting_from_the_loop_compiles_once(capsys):
    """The bar's in-loop reports are one host function for every program: an
    NNX model's calls (traced again each call) share the compiled program
    with them (before: compiled again at every call, 0.7-1 s each for a
    1024-wide MLP, with any steps_per_call= or iterable data), and train as
    without a bar."""
    import types

    setting = types.SimpleNamespace(scale=1.0)  # (read by the loss: traced again)

    def loss_fn(model, batch):
        x, y = batch
        return setting.scale * jnp.mean((model(x) - y) ** 2)

    model, optimizer, _ = build()
    bar_fit(model, optimizer, loss_fn)
    with count_compiles() as c:
        second = bar_fit(model, optimizer, loss_fn)
        third = bar_fit(model, optimizer, loss_fn)
    assert c.n == 0
    model, optimizer, _ = build()
    plain = scanax.fit(
        model, optimizer, loss_fn, (X, Y), steps=24, batch_size=BS, key=KEY,
        progress=False,
    )  # fmt: skip
    got = np.concatenate([second.history["loss"], third.history["loss"]])
    np.testing.assert_array_equal(got, plain.history["loss"][8:])
    assert "8/8" in capsys.readouterr().err


def test_a_bar_and_other_host_callbacks_are_not_shared(capsys):
    """With the bar's reports, a loss's own callback still keeps its program
    apart: the second loss's callback is called, not the first's."""

    def make(offset):
        def loss_fn(model, batch):
            x, y = batch
            loss = jnp.mean((model(x) - y) ** 2)
            shape = jax.ShapeDtypeStruct((), jnp.float32)
            seen = jax.lax.stop_gradient(loss)
            metric = jax.pure_callback(
                lambda v: np.asarray(v + offset, np.float32), shape, seen
            )
            return loss, {"cb": metric}

        return loss_fn

    model, optimizer, _ = build()
    first = bar_fit(model, optimizer, make(0.0))
    model, optimizer, _ = build()
    second = bar_fit(model, optimizer, make(100.0))
    np.testing.assert_allclose(second.history["cb"], first.history["cb"] + 100.0)


# A host callback as a TPU lowers it (jax 0.10.2 on a TPU v5e, 2026-12-06: a
# pure_callback, jax.debug.print and io_callback alike): host sends and
# receives, with no custom call naming a callback.
_TPU_CALLBACK = """
    %1 = "stablehlo.send"(%arg0, %0) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 2>, is_host_transfer = true}> {mhlo.frontend_attributes = {_xla_host_transfer_handler_name = "pjrt_rendezvous", _xla_host_transfer_rendezvous = "2"}} : (tensor<f32>, !stablehlo.token) -> !stablehlo.token
    %2:2 = "stablehlo.recv"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 3, type = 3>, is_host_transfer = true}> {mhlo.frontend_attributes = {_xla_host_transfer_handler_name = "pjrt_rendezvous", _xla_host_transfer_rendezvous = "3"}} : (!stablehlo.token) -> (tensor<f32>, !stablehlo.token)
"""  # noqa: E501


def test_programs_that_call_the_host_are_recognised_on_every_backend():
    """An executable holding a host callback is never shared by its text
    (``program.compiled``): the text must say it calls the host, on CPU and
    GPU (a custom call) as on a TPU (sends and receives; a TPU shared the first
    callback's executable before, test above)."""
    from jax.experimental import io_callback

    from scanax._fit.program import calls_the_host

    shape = jax.ShapeDtypeStruct((), jnp.float32)

    def pure(x):
        return jax.pure_callback(lambda v: np.asarray(v, np.float32), shape, x)

    def printed(x):
        jax.debug.print("{}", x)
        return x + 1

    def io(x):
        return io_callback(lambda v: np.asarray(v, np.float32), shape, x)

    for fn in (pure, printed, io):
        assert calls_the_host(jax.jit(fn).lower(jnp.float32(1)).as_text())
    assert not calls_the_host(jax.jit(lambda x: x * 2).lower(1.0).as_text())
    assert calls_the_host(_TPU_CALLBACK)


def test_jax_settings_are_part_of_the_key():
    """A fit under another matmul precision is another program (jax.jit keys on
    the same settings). (Off CPU the suite runs at "highest": conftest.)"""
    train(*build())
    now = jax.config.jax_default_matmul_precision
    other = "bfloat16" if now == "highest" else "highest"
    with count_compiles() as c, jax.default_matmul_precision(other):
        train(*build())
    assert c.n >= 1


def test_equinox_static_fields_compare_by_type():
    """0, 0.0 and False are equal in Python but trace to different programs."""

    class Power(eqx.Module):
        w: jax.Array
        p: object = eqx.field(static=True)

        def __call__(self, x):
            return self.w * x + (x * self.w) ** self.p

    def loss(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    x, y = jnp.zeros((8, 1)), jnp.ones((8, 1))

    def run(p):
        return scanax.fit(
            Power(jnp.ones((1,)), p),
            optax.sgd(0.1),
            loss,
            (x, y),
            steps=3,
            batch_size=8,
            progress=False,
        )

    assert run(0).steps == 3
    with pytest.warns(RuntimeWarning, match="non-finite gradients"):
        assert run(0.0).steps == 0  # 0.0 ** 0.0 has a NaN gradient; 0 ** 0 not


# Classes, instances and constants that a second fit changes while the objects
# it passes look alike (review 2026-12-06, after a user's class got a
# fingerprint): each second fit must equal a fresh process's.
_CHANGED = {"scale": 1.0}


def _pytree_loss(model, batch):
    x, y = batch
    return jnp.mean((x @ model["w"] - y) ** 2)


def _linen_global():
    import flax.linen as linen
    from flax.training.train_state import TrainState

    class Net(linen.Module):  # reads a module global through the dict below
        @linen.compact
        def __call__(self, x):
            return _CHANGED["scale"] * linen.Dense(1)(x)

    net = Net()

    def make():
        params = net.init(jax.random.key(0), X[:1])
        state = TrainState.create(apply_fn=net.apply, params=params, tx=optax.sgd(0.1))

        def loss(s, batch):
            return jnp.mean((s.apply_fn(s.params, batch[0]) - batch[1]) ** 2)

        return state, None, loss

    return make


def _dataclass_class_attribute():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        k: float = 1.0

    cfg = Cfg()

    def make():
        def loss(model, batch):
            return cfg.K * _pytree_loss(model, batch) + cfg.k  # (K: the class's)

        Cfg.K = _CHANGED["scale"]
        return {"w": jnp.zeros((3, 1))}, optax.sgd(0.1), loss

    return make


def _dataclass_attribute_not_a_field(slots=False):
    import dataclasses

    if slots:  # (the attribute in a slot, not in __dict__)

        @dataclasses.dataclass
        class Cfg:
            __slots__ = ("k", "weight")
            k: float
    else:

        @dataclasses.dataclass
        class Cfg:
            k: float

    cfg = Cfg(1.0)

    def make():
        cfg.weight = _CHANGED["scale"]

        def loss(model, batch):
            return cfg.weight * _pytree_loss(model, batch)

        return {"w": jnp.zeros((3, 1))}, optax.sgd(0.1), loss

    return make


def _weak_constant():
    def make():
        c = (
            jnp.asarray(1.1)
            if _CHANGED["scale"] == 1.0
            else jnp.array(1.1, dtype=jnp.float32)
        )

        def loss(model, batch):
            x = batch[0].astype(jnp.bfloat16)
            y = batch[1].astype(jnp.bfloat16)
            return (c * jnp.mean((x @ model["w"] - y) ** 2)).astype(jnp.float32)

        return {"w": jnp.zeros((3, 1), jnp.bfloat16)}, optax.sgd(0.1), loss

    return make


def _registered_with_free_functions(as_dataclass=False):
    import dataclasses

    def make():
        k = _CHANGED["scale"]

        class Box:
            def __init__(self, w):
                self.w = w

        if as_dataclass:  # (a plain dataclass: no fields of its own made it)
            Box = dataclasses.dataclass(Box)  # noqa: F811

        jax.tree_util.register_pytree_node(
            Box, lambda b: ((b.w,), None), lambda aux, kids: Box(kids[0] * k)
        )

        def loss(model, batch):
            return jnp.mean((batch[0] @ model.w - batch[1]) ** 2)

        return Box(jnp.ones((3, 1))), optax.sgd(0.1), loss

    return make


def _config_classes():
    import enum
    from typing import NamedTuple

    class Tuple(NamedTuple):
        k: float = 1.0

        def scale(self):
            return self.k * _CHANGED["scale"]

    class Mode(str, enum.Enum):
        A = "a"

        def scale(self):
            return _CHANGED["scale"]

    class Table(dict):
        def scale(self):
            return self["k"] * _CHANGED["scale"]

    configs = (Tuple(), Mode.A, Table(k=1.0))

    def make():
        def loss(model, batch):
            total = sum(c.scale() for c in configs)
            return total * _pytree_loss(model, batch)

        return {"w": jnp.zeros((3, 1))}, optax.sgd(0.1), loss

    return make


def _dataclass_registered_with_free_functions():
    return _registered_with_free_functions(as_dataclass=True)


def _dataclass_slot_not_a_field():
    return _dataclass_attribute_not_a_field(slots=True)


@pytest.mark.parametrize(
    "case",
    [
        _linen_global,
        _dataclass_class_attribute,
        _dataclass_attribute_not_a_field,
        _weak_constant,
        _registered_with_free_functions,
        _config_classes,
        _dataclass_registered_with_free_functions,
        _dataclass_slot_not_a_field,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_second_fit_of_changed_classes_equals_a_fresh_one(case):
    make = case()

    def second():
        model, tx, loss = make()
        result = scanax.fit(
            model, tx, loss, (X, Y), steps=3, batch_size=BS, progress=False
        )
        return np.asarray(result.history["loss"])

    # (standard promotion: a weak constant then keeps bfloat16, a strong one
    # promotes to float32; the suite runs strict)
    promotion = jax.numpy_dtype_promotion("standard")
    try:
        with promotion:
            _CHANGED["scale"] = 1.0
            second()  # (the first fit, cached)
            _CHANGED["scale"] = 3.0
            np.testing.assert_array_equal(second(), _fresh(second))
    finally:
        _CHANGED["scale"] = 1.0


def test_an_object_whose_attributes_fail_to_read_has_no_fingerprint():
    """``__getattr__`` raising KeyError (an attribute-dict config): fit ran
    into it (review 2026-12-06); now such an object has no fingerprint and
    fit traces again."""

    class Cfg:
        def __init__(self, d):
            self.__dict__["d"] = d

        def __getattr__(self, k):
            return self.d[k]

    cfg = Cfg({"scale": 2.0})

    def loss(model, batch):
        return cfg.scale * _pytree_loss(model, batch)

    assert _fingerprint.of(loss) is None
    result = scanax.fit({"w": jnp.zeros((3, 1))}, optax.sgd(0.1), loss, (X, Y),
                        steps=2, batch_size=BS, progress=False)  # fmt: skip
    assert np.isfinite(result.history["loss"]).all()


def test_config_dataclasses_of_every_make_keep_a_fingerprint():
    """Slots, ``Generic``, ``cached_property``, a logger class attribute, an
    ``lru_cache`` static helper: a config class of any of these keeps its
    fingerprint (each fit traced again when a class walk first met them)."""
    import dataclasses
    import functools
    import logging
    from typing import ClassVar, Generic, TypeVar

    T = TypeVar("T")

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slots:
        k: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class Typed(Generic[T]):
        k: float = 1.0

    @dataclasses.dataclass
    class Cached:
        k: float = 1.0
        log: ClassVar = logging.getLogger("scanax-tests.config")

        @functools.cached_property
        def double(self):
            return 2 * self.k

        @staticmethod
        @functools.lru_cache
        def table(n):
            return n * 2

    for config in (Slots(), Typed(), Cached()):
        assert _fingerprint.of(config) is not None, type(config)
        assert _fingerprint.of(config) == _fingerprint.of(type(config)())


def test_enum_configs_and_vmapped_helpers_keep_a_fingerprint():
    """A config with an Enum field and a module-level ``jax.vmap`` helper (the
    JAX tutorials' ``batched_predict``) had no fingerprint: fit traced again
    at every call. Now they have one, which sees what changes: a member's
    value, a global an Enum method reads, the vmap's axes."""
    import dataclasses
    import enum

    def define(value="relu"):
        class Act(enum.Enum):
            RELU = value
            GELU = "gelu"

            def scale(self):
                return _CHANGED["scale"]

        @dataclasses.dataclass(frozen=True)
        class Cfg:
            act: Act = Act.RELU

        return Cfg()

    first = _fingerprint.of(define())
    assert first is not None and first == _fingerprint.of(define())
    assert _fingerprint.of(define("elu")) != first
    try:
        _CHANGED["scale"] = 3.0
        assert _fingerprint.of(define()) != first
    finally:
        _CHANGED["scale"] = 1.0

    def predict(w, x):
        return x @ w * _CHANGED["scale"]

    batched = _fingerprint.of(jax.vmap(predict, in_axes=(None, 0)))
    assert batched is not None
    assert batched == _fingerprint.of(jax.vmap(predict, in_axes=(None, 0)))
    assert batched != _fingerprint.of(jax.vmap(predict, in_axes=(0, 0)))
