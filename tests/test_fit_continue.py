"""Repeated fit calls continue where the last stopped (data order, optimizer
schedule, per-step keys, step numbers), for every model kind; checkpoint
directories in such loops; per-step keys for ``loss_fn(model, batch, key)``."""

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scanax

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

sys.path.insert(0, os.path.dirname(__file__))
from fit_helpers import (  # noqa: E402
    BS,
    KEY,
    TX,
    X,
    Y,
    batch_at,
    eqx_loss,
    eqx_model,
    nnx_loss,
    nnx_pair,
    ts_loss,
    ts_make,
)
from helpers import count_compiles, leaves_equal  # noqa: E402

TOTAL = 23  # 6 batches per epoch: crosses 3 epoch boundaries
PIECES = (5, 5, 7, 6)  # calls that end inside epochs


def _fit(model, opt, loss, steps, **kwargs):
    return scanax.fit(
        model,
        opt,
        loss,
        (X, Y),
        steps=steps,
        batch_size=BS,
        key=KEY,
        progress=False,
        **kwargs,
    )


def _in_pieces(kind, pieces):
    """(history, final state) of fit called once per piece, each call continuing
    from the last one's result."""
    if kind == "nnx":
        model, opt = nnx_pair()
        results = [_fit(model, opt, nnx_loss, n) for n in pieces]
        state = (nnx.state(model), nnx.state(opt))
    elif kind == "eqx":
        model, opt_state, results = eqx_model(), None, []
        for n in pieces:
            r = _fit(model, TX, eqx_loss, n, opt_state=opt_state)
            model, opt_state = r.model, r.optimizer
            results.append(r)
        state = (eqx.filter(model, eqx.is_array), opt_state)
    else:
        state, results = ts_make(), []
        for n in pieces:
            r = _fit(state, None, ts_loss, n)
            state = r.model
            results.append(r)
    history = {
        k: np.concatenate([r.history[k] for r in results]) for k in results[0].history
    }
    return history, state, results


@pytest.mark.parametrize("kind", ["nnx", "eqx", "ts"])
def test_repeated_calls_equal_one_long_call(kind):
    """fit(steps=5) four times == fit(steps=23) once, bit for bit: the shuffle
    continues its epochs, Adam its moments and count, the steps their numbers."""
    one, state_one, _ = _in_pieces(kind, (TOTAL,))
    many, state_many, results = _in_pieces(kind, PIECES)
    np.testing.assert_array_equal(many["step"], np.arange(1, TOTAL + 1))
    np.testing.assert_array_equal(many["loss"], one["loss"])
    leaves_equal(state_many, state_one)
    assert [r.steps for r in results] == list(PIECES)


def test_continuing_calls_use_the_documented_batches():
    """Each continuing call's first batch is the one step t of a single run uses."""
    model, opt = nnx_pair()
    _fit(model, opt, nnx_loss, 4)
    ref_model, _ = nnx_pair()
    ref_opt = nnx.Optimizer(ref_model, TX, wrt=nnx.Param)
    for t in range(4):
        (_, _), grads = nnx.value_and_grad(nnx_loss, has_aux=True)(
            ref_model, batch_at(t)
        )
        ref_opt.update(ref_model, grads)
    loss_at_4 = float(nnx_loss(ref_model, batch_at(4))[0])
    r = _fit(model, opt, nnx_loss, 1)
    np.testing.assert_allclose(r.history["loss"][0], loss_at_4, rtol=1e-5)
    assert r.history["step"].tolist() == [5]


def test_optax_state_without_a_count_gets_fits_count():
    """A transform without a step count (plain SGD) continues exactly from the
    state fit returns; a state made by tx.init warns that it starts at step 0."""
    params = {"w": jnp.zeros((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    sgd = optax.sgd(0.1)
    one = _fit(params, sgd, loss, 8)
    a = _fit(params, sgd, loss, 3)
    b = _fit(a.model, sgd, loss, 5, opt_state=a.optimizer)
    np.testing.assert_array_equal(
        np.concatenate([a.history["loss"], b.history["loss"]]), one.history["loss"]
    )
    assert b.history["step"].tolist() == [4, 5, 6, 7, 8]
    with pytest.warns(RuntimeWarning, match=r"made by tx.init.*result.optimizer"):
        c = _fit(a.model, sgd, loss, 2, opt_state=sgd.init(a.model))
    assert c.history["step"].tolist() == [1, 2]
    # The state is the documented chain's: it continues that chain by hand too.
    tx = optax.chain(sgd, optax.scale_by_schedule(lambda step: 1.0))
    assert jax.tree.structure(a.optimizer) == jax.tree.structure(tx.init(params))


_COUNTED = {
    "adam": lambda: optax.adam(1e-3),
    "adamw schedule": lambda: optax.adamw(optax.linear_schedule(1e-3, 0.0, 10)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(1e-3),
    "chain, clip + lion": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.lion(1e-4)
    ),
    "sgd momentum schedule": lambda: optax.sgd(
        optax.linear_schedule(0.1, 0.0, 10), momentum=0.9
    ),
    "adam + ema": lambda: optax.chain(optax.adam(1e-3), optax.ema(0.9)),
}


@pytest.mark.parametrize("name", list(_COUNTED))
def test_a_state_fit_makes_starts_at_step_zero_without_a_read(name, monkeypatch):
    """fit makes the optimizer state with ``tx.init`` and starts it at step 0
    without reading its counts (a read waits for the init's device work):
    every step count of such a state is 0, as the read found; the history
    starts at step 1, and a given state continues from its count."""
    from scanax._fit.models import optax as adapters

    params = {"w": jnp.zeros((3, 1))}
    tx = _COUNTED[name]()
    counts = adapters._step_counts(tx.init(params))
    assert counts and [int(c) for c in counts] == [0] * len(counts)
    read = []
    real = adapters._step_count
    monkeypatch.setattr(adapters, "_step_count", lambda s: read.append(1) or real(s))
    adapter = adapters.OptaxAdapter(params, tx)
    assert adapter.made and adapter.start_step() == 0

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    a = _fit(params, tx, loss, 3)
    assert a.history["step"].tolist() == [1, 2, 3]
    assert read == []  # (the state fit made: no count read)
    given = adapters.OptaxAdapter(a.model, tx, a.optimizer)
    assert not given.made and given.start_step() == 3
    assert read  # (a given state: its count read)


def test_a_given_state_is_checked_without_making_one(monkeypatch):
    """With ``opt_state`` given, fit checks it against ``tx.init``'s structure
    and shapes without running the init (``jax.eval_shape``), and a stateful
    transform without a count (SGD with momentum) is initialised once."""
    from scanax._fit.models.optax import OptaxAdapter

    params = {"w": jnp.zeros((3, 1))}
    sgd = optax.sgd(0.1, momentum=0.9)
    made = []
    real = sgd.init

    def init(p):
        made.append(any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(p)))
        return real(p)

    tx = optax.GradientTransformation(init, sgd.update)
    fresh = OptaxAdapter(params, tx)
    assert made == [False] and fresh.counted  # (eager: arrays)
    assert jax.tree.structure(fresh.state["opt_state"]) == jax.tree.structure(
        optax.chain(sgd, optax.scale_by_schedule(lambda step: 1.0)).init(params)
    )
    made.clear()
    OptaxAdapter(params, tx, fresh.state["opt_state"])
    assert (
        False not in made
    )  # (traced by eval_shape, or its trace reused: no arrays made)
    with pytest.raises(TypeError, match=r"opt_state.*is float32\[2, 1\], expected"):
        OptaxAdapter(params, tx, real({"w": jnp.zeros((2, 1))}))


def _same_state(made, eager):
    """``made`` equals the eager state: structure, values, dtypes, weak types;
    each leaf the eager init commits to a device (Adam's moments: the
    parameters') on that device, committed (a leaf it leaves uncommitted, as
    Adam's count, may be made on the parameters' device)."""
    assert jax.tree.structure(made) == jax.tree.structure(eager)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(eager), strict=True):
        assert type(a) is type(b)
        if jax.dtypes.issubdtype(getattr(b, "dtype", None), jax.dtypes.prng_key):
            assert a.dtype == b.dtype  # (the same PRNG implementation)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(a, jax.Array):
            assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
            if b.committed:
                assert a.committed and a.sharding == b.sharding


def test_the_state_fit_makes_is_one_compiled_call(monkeypatch):
    """fit makes the optax state with one compiled call of ``tx.init`` (not a
    dispatch per array), compiled once per transform, parameter shapes and
    devices and JAX settings: a rebuilt ``optax.adam(1e-3)`` reuses it, another
    learning rate, other shapes, another device or PRNG compile anew. Each
    state equals the eager ``tx.init`` (``_same_state``)."""
    from scanax._fit.models import optax as adapters, optax_init as inits

    monkeypatch.setattr(inits, "_INITS", type(inits._INITS)())
    compiled = []  # (an ``_Init`` traces and compiles once)

    class Counted(inits._Init):
        def __init__(self, *args):
            compiled.append(1)
            super().__init__(*args)

    monkeypatch.setattr(inits, "_Init", Counted)
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2), "i": jnp.arange(3), "n": None}
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 50)
    injected = optax.inject_hyperparams(optax.adam)
    cases = [
        (optax.adam(1e-3), 1),
        (optax.adam(1e-3), 0),  # (rebuilt: the same program)
        (optax.adamw(schedule, weight_decay=1e-2), 1),
        (injected(learning_rate=1e-3), 1),
        (injected(learning_rate=3e-3), 1),  # (its state holds the rate)
        (optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)), 1),
        (optax.add_noise(0.1, 0.5, 3), 1),  # (its state holds a key)
    ]
    places = [params]
    if jax.device_count() >= 2:  # (on another device than the default one)
        places.append(jax.device_put(params, jax.devices()[1]))
    for p in places:
        for tx, compiles in cases:
            before = len(compiled)
            # (twice: the key's first call compiles, the second reuses it)
            for _ in range(2):
                adapter = adapters.OptaxAdapter(p, tx, compiled_init=True)
                eager = tx.init(adapter.layout.filtered(adapter.state["params"]))
                _same_state(adapter.state["opt_state"], eager)
            assert len(compiled) - before == compiles
    assert all(init.traced is not None for init in inits._INITS.values())
    adapters.OptaxAdapter({"w": jnp.ones((4, 2))}, optax.adam(1e-3), compiled_init=True)
    assert len(compiled) == 6 * len(places) + 1  # (other shapes: another program)
    # Another PRNG implementation: the key it makes is of that one.
    impl = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        tx = optax.add_noise(0.1, 0.5, 3)
        for _ in range(2):
            adapter = adapters.OptaxAdapter(params, tx, compiled_init=True)
            _same_state(adapter.state["opt_state"], tx.init(params))
    finally:
        jax.config.update("jax_default_prng_impl", impl)
    assert len(compiled) == 6 * len(places) + 2

    # A given state is checked against the same trace (none per call).
    n = len(compiled)
    made = adapters.OptaxAdapter(params, optax.adam(1e-3), compiled_init=True)
    adapters.OptaxAdapter(params, optax.adam(1e-3), made.state["opt_state"])
    assert len(compiled) == n

    # fit's own run makes its state so; a population's members and a
    # checkpoint's layout (structures looked at, their arrays replaced) eagerly.
    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    n = len(compiled)
    _fit({"w": jnp.ones((3, 1))}, optax.adam(2e-3), loss, 2)
    assert len(compiled) == n + 1
    pop = scanax.population(
        lambda key, lr: ({"w": jnp.ones((3, 1))}, optax.adam(lr)), 3,
        key=jax.random.key(0), lr=np.float32([1e-3, 2e-3, 3e-3]),
    )  # fmt: skip
    out = _fit(pop, None, loss, 2)
    [out.model[i] for i in range(3)]
    assert len(compiled) == n + 1


@pytest.mark.parametrize("on_mesh", [False, True], ids=["no_mesh", "mesh"])
def test_a_state_fit_gives_back_unchanged_is_the_users_to_donate(on_mesh):
    """A fit that runs no step (an empty iterable) gives back the state it
    made. Were that the kept state of constants, a fit that had already taken
    it (here: one whose batches run the empty fit, then donate what it gave
    back) would read deleted arrays; it gets a copy. On a mesh, where placing
    the state may alias its arrays, no state is kept."""
    p = {"w": jnp.ones(3)}
    mesh = {"mesh": jax.make_mesh((1,), ("data",))} if on_mesh else {}

    def loss(p, b):
        return jnp.sum((p["w"] - b) ** 2)

    def batches():
        with pytest.warns(RuntimeWarning, match="`data` gave no batch"):
            given = scanax.fit(
                p, optax.adam(0.1), loss, iter([]), steps=5, progress=False, **mesh
            )
        assert given.steps == 0
        _same_state(given.optimizer, optax.adam(0.1).init(p))
        for x in jax.tree.leaves(given.optimizer):
            x.delete()  # (donated by the user)
        yield from (jnp.full(3, float(i)) for i in range(5))

    run = scanax.fit(
        p, optax.adam(0.1), loss, batches(), steps=5, progress=False, **mesh
    )
    want, opt = p, optax.adam(0.1).init(p)
    for i in range(5):
        g = jax.grad(loss)(want, jnp.full(3, float(i)))
        u, opt = optax.adam(0.1).update(g, opt, want)
        want = optax.apply_updates(want, u)
    np.testing.assert_allclose(run.model["w"], want["w"], rtol=1e-6)


def test_a_state_of_constants_is_made_on_the_host_without_a_program(monkeypatch):
    """A small state whose every leaf is a constant (Adam's zeros and count,
    RMSprop's ones, a schedule's count) is filled on the host and moved where
    the parameters are: no program compiled (each one is ~70 ms of a first
    call on a TPU v5e). It equals the eager init, also for parameters on
    another device (committed there). A state that reads the parameters, or
    one past the size bound, is the compiled init's."""
    from scanax._fit.models import optax as adapters, optax_init as inits

    monkeypatch.setattr(inits, "_INITS", type(inits._INITS)())
    params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2, jnp.bfloat16), "n": None}
    places = [params]
    if jax.device_count() >= 2:
        places.append(jax.device_put(params, jax.devices()[1]))

    def counted(tx):  # (fit keeps a count for a transform that keeps none)
        return optax.chain(tx, optax.scale_by_schedule(lambda step: 1.0))

    constant = [
        (optax.adam(1e-3), False),
        (optax.rmsprop(1e-3, initial_scale=1.0), True),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False),
        (optax.sgd(0.1), True),  # (an empty state, and fit's count)
    ]
    for p in places:
        for tx, uncounted in constant:
            eager = (counted(tx) if uncounted else tx).init(p)
            with count_compiles() as c:
                adapter = adapters.OptaxAdapter(p, tx, compiled_init=True, keep=True)
            assert c.n == 0, tx
            _same_state(adapter.state["opt_state"], eager)
    assert all(i.fills is not None for i in inits._INITS.values())
    # Kept on the device for the next fit, never given back (a user may
    # donate what fit gives back, while another fit starts from the kept
    # state): a fit that runs no step gives back a copy.
    state = adapters.OptaxAdapter(
        params, optax.adam(1e-3), compiled_init=True, keep=True
    )
    again = adapters.OptaxAdapter(
        params, optax.adam(1e-3), compiled_init=True, keep=True
    )
    kept = jax.tree.leaves(state.state["opt_state"])
    same = zip(jax.tree.leaves(again.state["opt_state"]), kept)
    assert all(a is b for a, b in same)
    _, given = again.finish(again.state)
    assert not any(a is b for a, b in zip(jax.tree.leaves(given), kept))
    _same_state(given, optax.adam(1e-3).init(params))
    for x in jax.tree.leaves(given):
        x.delete()  # (donated by the user)
    anew = adapters.OptaxAdapter(
        params, optax.adam(1e-3), compiled_init=True, keep=True
    )
    same = zip(jax.tree.leaves(anew.state["opt_state"]), kept)
    assert all(a is b for a, b in same)
    kept[1].delete()  # (deleted by a sweep of `jax.live_arrays()`)
    made = adapters.OptaxAdapter(
        params, optax.adam(1e-3), compiled_init=True, keep=True
    )
    _same_state(made.state["opt_state"], optax.adam(1e-3).init(params))
    # The most recently used kept, up to ``_KEPT_BYTES`` in all (Adam's: 60
    # bytes for ``params``, 132 for a 4x4 matrix).
    monkeypatch.setattr(inits, "_KEPT_BYTES", 140)
    square = {"w": jnp.ones((4, 4))}
    adapters.OptaxAdapter(params, optax.adam(1e-3), compiled_init=True, keep=True)
    adapters.OptaxAdapter(square, optax.adam(1e-3), compiled_init=True, keep=True)
    kept = [i for i in inits._INITS.values() if i.made is not None]
    assert [{s for s, _, _ in i.fills} for i in kept] == [{(), (4, 4)}]
    # Reads the parameters (it keeps a copy of them): compiled.
    reads, p = optax.contrib.schedule_free_adamw(1e-3), {"w": jnp.ones((3, 2))}
    with count_compiles() as c:
        adapter = adapters.OptaxAdapter(p, reads, compiled_init=True, keep=True)
    assert c.n == 1
    _same_state(adapter.state["opt_state"], reads.init(p))
    # A jaxpr this reading does not know (another JAX): compiled.
    other = {"v": jnp.ones(3)}
    monkeypatch.setattr(inits, "_fills", lambda traced: {}["unknown"])
    with count_compiles() as c:
        made = adapters.OptaxAdapter(
            other, optax.adam(1e-3), compiled_init=True, keep=True
        )
    assert c.n == 1
    _same_state(made.state["opt_state"], optax.adam(1e-3).init(other))
    monkeypatch.undo()
    monkeypatch.setattr(inits, "_INITS", type(inits._INITS)())
    # Past the bound: compiled, the same state.
    monkeypatch.setattr(inits, "_FILLED_BYTES", 8)
    other = {"w": jnp.ones((5, 2))}
    with count_compiles() as c:
        adapter = adapters.OptaxAdapter(
            other, optax.adam(1e-3), compiled_init=True, keep=True
        )
    assert c.n == 1
    _same_state(adapter.state["opt_state"], optax.adam(1e-3).init(other))


def test_the_state_fit_makes_eagerly_where_a_compiled_init_would_differ(monkeypatch):
    """The eager ``tx.init``, as a user's script calls it, where one compiled
    call would not make the same state or could not be reused: an init that
    reads values, one that keeps Python numbers or NumPy arrays, parameters
    that are NumPy arrays or sharded over devices, a transform with no
    fingerprint."""
    from typing import Any, NamedTuple

    from scanax._fit.models import optax as adapters, optax_init as inits

    class State(NamedTuple):
        count: Any
        scale: Any

    def update(u, s, p=None):
        return u, s

    def reads(p):  # (a value on the host: no trace can make it)
        return State(jnp.zeros((), jnp.int32), jnp.float32(float(jnp.sum(p["w"]))))

    class Box:  # (a mutable instance: no fingerprint)
        lr = 1e-3

    box = Box()
    unknown = optax.GradientTransformation(
        lambda p: optax.adam(box.lr).init(p), optax.adam(1e-3).update
    )
    params = {"w": jnp.ones((3, 1))}
    cases = [
        (optax.GradientTransformation(reads, update), params),
        (
            optax.GradientTransformation(lambda p: (0, 1.0), lambda u, s, p: (u, s)),
            params,
        ),
        (  # (NumPy and Python values, which a compiled init cannot return:
            # seen while tracing)
            optax.GradientTransformation(
                lambda p: (np.zeros(3), True), lambda u, s, p: (u, s)
            ),
            params,
        ),
        (optax.adam(1e-3), {"w": np.ones((3, 1), np.float32)}),
        (unknown, params),
    ]
    if jax.device_count() >= 2:  # (the suite's CPU has 4; a TPU v5e machine one)
        mesh = jax.make_mesh((2,), ("data",))
        sharding = jax.NamedSharding(mesh, jax.P("data"))
        cases.append(
            (optax.adam(1e-3), {"w": jax.device_put(jnp.ones((4, 1)), sharding)})
        )
    monkeypatch.setattr(inits, "_INITS", type(inits._INITS)())
    traced = []

    class Counted(inits._Init):
        def __init__(self, *args):
            traced.append(1)
            super().__init__(*args)

    monkeypatch.setattr(inits, "_Init", Counted)
    for tx, p in cases:
        adapter = adapters.OptaxAdapter(p, tx, compiled_init=True)
        state = adapter.state["opt_state"]
        if adapter.counted:
            state = state[0]
        eager = tx.init(p)
        assert jax.tree.structure(state) == jax.tree.structure(eager)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(eager)):
            assert type(a) is type(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            if isinstance(a, jax.Array):
                assert (a.dtype, a.weak_type, a.sharding) == (
                    b.dtype, b.weak_type, b.sharding
                )  # fmt: skip
    # none kept compiled: the three that trace differently found out, the rest
    # (NumPy or sharded parameters, no fingerprint) without a trace
    assert all(init.traced is None for init in inits._INITS.values())
    assert len(traced) == len(inits._INITS) <= 3


_INIT_CONFIG = {"scale": 1.0}


def _configured_init(p):  # (reads a global: its fingerprint sees the value)
    return (
        jnp.full((3,), _INIT_CONFIG["scale"], jnp.float32),
        jnp.zeros((), jnp.int32),
    )


@jax.tree_util.register_pytree_node_class
class _NumpyAux:
    """An optax-like state whose pytree metadata is a NumPy array (treedefs
    then refuse to compare)."""

    def __init__(self, count, aux):
        self.count, self.aux = count, aux

    def tree_flatten(self):
        return (self.count,), self.aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], aux)


def test_the_compiled_init_makes_what_the_eager_one_makes_now(monkeypatch):
    """An init reading a value that changed between fits makes the new value
    (a fresh trace, not one ``jax.jit`` kept of ``tx.init``), and a state whose
    metadata cannot be compared stays eager instead of failing."""
    from scanax._fit.models import optax as adapters, optax_init as inits

    monkeypatch.setattr(inits, "_INITS", type(inits._INITS)())
    monkeypatch.setitem(_INIT_CONFIG, "scale", 1.0)
    keep = lambda u, s, p=None: (u, s)
    tx = optax.GradientTransformation(_configured_init, keep)
    params = {"w": jnp.ones((3, 1))}
    for scale in (1.0, 1.0, 5.0, 5.0):  # (each second: the compiled init)
        _INIT_CONFIG["scale"] = scale
        state = adapters.OptaxAdapter(params, tx, compiled_init=True).state
        np.testing.assert_array_equal(state["opt_state"][0][0], [scale] * 3)
    aux = optax.GradientTransformation(
        lambda p: _NumpyAux(jnp.zeros((), jnp.int32), np.arange(3)), keep
    )
    for _ in range(2):
        state = adapters.OptaxAdapter(params, aux, compiled_init=True).state
        assert isinstance(state["opt_state"][0], _NumpyAux)  # (with fit's count)


def test_a_given_state_of_an_init_that_tracing_cannot_tell():
    """A custom transform whose state holds Python numbers (weakly typed when
    traced), or whose ``init`` reads the parameters' values: the state it made
    is accepted as given, checked against the eager ``tx.init``, and trains
    as without it."""
    from contextlib import nullcontext
    from typing import Any, NamedTuple

    class State(NamedTuple):
        count: Any
        scale: Any

    def update(u, s, p=None):
        return jax.tree.map(lambda g: -1e-2 * s.scale * g, u), State(
            s.count + 1, s.scale
        )

    def reads(p):  # (a value on the host: no trace can make it)
        scale = 1 / (1 + float(jnp.sum(p["w"] ** 2)))
        return State(jnp.zeros((), jnp.int32), jnp.float32(scale))

    params = {"w": jnp.ones((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    # (a Python int is no step count: fit counts, and says a given state
    # starts at step 0)
    uncounted = pytest.warns(RuntimeWarning, match="made by tx.init")
    for init, warns in ((lambda p: State(0, 1.0), uncounted), (reads, nullcontext())):
        tx = optax.GradientTransformation(init, update)
        with warns:
            given = _fit(params, tx, loss, 3, opt_state=tx.init(params))
        made = _fit(params, tx, loss, 3)
        np.testing.assert_array_equal(given.history["loss"], made.history["loss"])


VAL = (X[:16], Y[:16])
CHECKS = {
    "bare": [],
    "eval + stop": [
        scanax.Eval(VAL, every=3),
        scanax.EarlyStop("val_loss", patience=5),
    ],
    "eval + plateau": [
        scanax.Eval(VAL, every=3),
        scanax.Plateau("val_loss", patience=2),
    ],
}


@pytest.mark.parametrize("execution", ["fused", "stepwise"])
@pytest.mark.parametrize("checks", list(CHECKS))
@pytest.mark.parametrize("kind", ["optax", "eqx", "ts"])
def test_a_repeated_call_moves_nothing_to_the_device(kind, checks, execution):
    """fit passes its step numbers, and starts its early-stop and plateau
    carries, as device scalars kept by value (``_fit.scalars``): a call that
    repeats one before (the same model, steps and features) transfers nothing
    from the host, explicitly or not (on a TPU v5e a scalar's transfer cost
    0.17 ms a call). It trains as the first did. (A ``TrainState`` made by
    ``create`` has a Python ``step``: one transfer a call, a fresh array,
    since fit may give it back; here it is an array, as fit returns it.)"""
    if kind == "optax":
        model, tx, loss = {"w": jnp.zeros((3, 1))}, TX, _linear_loss
    elif kind == "eqx":
        model, tx, loss = eqx_model(), TX, eqx_loss
    else:
        model, tx, loss = ts_make(), None, ts_loss
        model = model.replace(step=jnp.asarray(model.step, jnp.int32))

    def call():
        return scanax.fit(
            model, tx, loss, (X, Y), steps=7, batch_size=BS, progress=False,
            callbacks=CHECKS[checks], execution=execution,
        )  # fmt: skip

    first = call()
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        again = call()
    for name in first.history:
        np.testing.assert_array_equal(again.history[name], first.history[name])
    arrays = lambda m: [x for x in jax.tree.leaves(m) if isinstance(x, jax.Array)]
    leaves_equal(arrays(again.model), arrays(first.model))


def _linear_loss(p, b):
    return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)


def test_device_scalars_are_kept_by_value_and_made_anew_when_deleted():
    """One array per value's bytes (``-0.0`` is not ``0.0``), dtype (``int4``
    and ``uint4`` share a ``dtype.str``) and default device; a kept scalar a
    user's code deleted (a donation) is made anew; one first asked for inside a
    trace is not kept (a tracer would outlive it)."""
    from scanax._fit import scalars

    traced = jax.jit(lambda: scalars.device_scalar(np.int32(12345)) + 0)
    assert int(traced()) == 12345
    assert not isinstance(scalars.device_scalar(np.int32(12345)), jax.core.Tracer)
    jax.eval_shape(lambda: scalars.constant(54321, jnp.int32))
    assert int(scalars.constant(54321, jnp.int32)) == 54321
    assert scalars.constant(1, jnp.int4).dtype == jnp.int4
    assert scalars.constant(1, jnp.uint4).dtype == jnp.uint4

    a, b = (
        scalars.device_scalar(np.float32(0.0)),
        scalars.device_scalar(np.float32(-0.0)),
    )
    assert a is not b and np.signbit(np.asarray(b)) and not np.signbit(np.asarray(a))
    assert scalars.device_scalar(np.int32(3)) is scalars.device_scalar(np.int32(3))
    assert scalars.device_scalar(np.int32(3)) is not scalars.device_scalar(np.int64(3))
    assert scalars.constant(5, None).dtype == jnp.asarray(5).dtype
    x = scalars.device_scalar(np.int32(11))
    x.delete()
    y = scalars.device_scalar(np.int32(11))
    assert y is not x and int(y) == 11
    if jax.device_count() >= 2:
        with jax.default_device(jax.devices()[1]):
            z = scalars.device_scalar(np.int32(11))
        assert z.devices() == {jax.devices()[1]} and z is not y


def test_what_fit_gives_back_shares_no_kept_scalar():
    """Kept device scalars are shared, so none leaves fit: a rule's ``init()``
    (which a user may donate to a jitted update, as the rules' docstrings do)
    and a ``TrainState`` fit gives back without training (an iterable already
    exhausted) hold fresh arrays of their own, ``init(None)`` weakly typed as
    ``jnp.asarray`` makes it."""
    rule = scanax.Plateau("val_loss", factor=0.5, patience=1)
    update = jax.jit(lambda s, v: rule.update(s, v)[0], donate_argnums=0)
    assert float(update(rule.init(), jnp.float32(3.0)).scale) == 1.0  # (no alias)
    a = scanax.EarlyStop("val_loss", patience=1)
    b = scanax.EarlyStop("val_acc", patience=1)
    sa, sb = a.init(), b.init()
    jax.jit(lambda s: a.update(s, jnp.float32(1.0), 1)[0], donate_argnums=0)(sa)
    assert float(b.update(sb, jnp.float32(0.5), 1)[0].best) == 0.5
    for init in (a.init, rule.init):
        leaves = jax.tree.leaves(init(None))
        assert len({id(x) for x in leaves}) == len(leaves)
        assert leaves[0].weak_type == jnp.asarray(jnp.inf).weak_type
    with pytest.warns(RuntimeWarning, match="`data` gave no batch"):
        empty = [scanax.fit(ts_make(), None, ts_loss, iter([]), steps=3,
                            progress=False) for _ in range(2)]  # fmt: skip
    assert [r.steps for r in empty] == [0, 0]
    empty = [r.model for r in empty]
    assert empty[0].step is not empty[1].step
    jax.jit(lambda s: s.replace(step=s.step + 1), donate_argnums=0)(empty[0])
    assert int(empty[1].step) == 0


class _StoppedAtStart(scanax.EarlyStop):
    def init(self, dtype=jnp.float32):
        return super().init(dtype)._replace(stopped=jnp.asarray(True))


class _NothingImproves(scanax.Plateau):
    def init(self, dtype=jnp.float32):
        return super().init(dtype)._replace(best=jnp.asarray(-jnp.inf, dtype))


def test_a_rule_subclass_starts_fit_from_its_own_init():
    """fit starts its carries from kept device scalars only for the rules'
    own ``init``: a subclass's ``init`` is what it starts from (a stop rule
    already stopped ends the run at the first evaluation; a plateau rule with
    nothing to beat lowers the scale at each one)."""

    def run(rule):
        return scanax.fit(
            eqx_model(), TX, eqx_loss, (X, Y), steps=12, batch_size=BS,
            progress=False, callbacks=[scanax.Eval(VAL, every=2), rule],
        )  # fmt: skip

    assert run(scanax.EarlyStop("val_loss", patience=2)).steps == 12
    assert run(_StoppedAtStart("val_loss", patience=2)).steps == 2
    assert float(run(scanax.Plateau("val_loss", patience=1)).plateau.scale) == 1.0
    lowered = run(_NothingImproves("val_loss", patience=1, factor=0.5)).plateau
    assert float(lowered.scale) < 0.5 and float(lowered.best) == -np.inf


def test_a_calls_report_is_one_array_read_back_as_it_was():
    """A call's report leaves the device as one int32 array (one transfer, not
    one a field: 0.07 ms each on a TPU v5e) and reads back as the ``Report``
    it packs: one model's scalars, a population's per-member fields with the
    loop's one ``ran``."""
    from scanax._fit.program import Report

    one = Report(jnp.int32(5), jnp.int32(6), jnp.array(True), jnp.array(False),
                 jnp.array(False))  # fmt: skip
    members = Report(jnp.array([3, 4, 0]), jnp.int32(4), jnp.array([1, 0, 1], bool),
                     jnp.array(False))  # fmt: skip
    for report in (one, members):
        packed = jax.jit(Report.packed)(report)
        assert isinstance(packed, jax.Array) and packed.dtype == jnp.int32
        back = Report.read(jax.device_get(packed))
        assert int(back.ran) == int(report.ran)
        for field in ("applied", "stopped", "ended", "intact"):
            want, got = getattr(report, field), getattr(back, field)
            if want is None:
                assert got is None
                continue
            want = np.broadcast_to(np.asarray(want), np.shape(report.applied))
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- checkpoint loops


def test_epoch_loop_with_checkpoint_dir_trains_every_call(tmp_path):
    """Each call of an epoch loop trains its steps (it used to restore the first
    call's checkpoint and train nothing) and equals one long call."""
    model, opt = nnx_pair()
    for _ in range(3):
        _fit(model, opt, nnx_loss, 5, checkpoint_dir=tmp_path)
    assert int(opt.step[...]) == 15
    ref, ref_opt = nnx_pair()
    _fit(ref, ref_opt, nnx_loss, 15)
    leaves_equal(nnx.state(model), nnx.state(ref))

    # The same loop restarted in a new process: each call finds its own end
    # among the kept checkpoints, restores it and says so.
    again, again_opt = nnx_pair()
    for end in (5, 10, 15):
        with pytest.warns(RuntimeWarning, match=rf"already holds step {end}"):
            r = _fit(again, again_opt, nnx_loss, 5, checkpoint_dir=tmp_path)
        assert int(again_opt.step[...]) == end  # the checkpoint's steps, restored
        assert r.history["step"].tolist() == list(range(end - 4, end + 1))
    leaves_equal(nnx.state(again), nnx.state(ref))
    r = _fit(again, again_opt, nnx_loss, 2, checkpoint_dir=tmp_path)
    assert r.steps == 2 and r.history["step"].tolist() == [16, 17]


def test_checkpoint_past_this_calls_end_is_an_error(tmp_path):
    model, opt = nnx_pair()
    _fit(model, opt, nnx_loss, 12, checkpoint_dir=tmp_path, checkpoint_every=4)
    fresh, fresh_opt = nnx_pair()
    with pytest.raises(
        ValueError,
        match=r"(?s)holds step\(s\) 4, 8, 12, past this call's end: the model is at "
        r"step 0 and steps=3 ends at step 3.*Fix: ask for steps=4",
    ):
        _fit(fresh, fresh_opt, nnx_loss, 3, checkpoint_dir=tmp_path)
    assert int(fresh_opt.step[...]) == 0
    # Asking for enough steps resumes from the newest checkpoint it reaches; the
    # later checkpoint (12) is kept, and this call's own saves are written beside
    # it (orbax skips a step before its newest unless forced: they were lost)
    with pytest.warns(
        RuntimeWarning,
        match=r"also holds later step\(s\) 12 .* checkpoints \(up to step 10\) "
        r"are written beside them",
    ):
        r = _fit(fresh, fresh_opt, nnx_loss, 10, checkpoint_dir=tmp_path)
    assert r.steps == 10 and r.history["step"].tolist() == list(range(1, 11))
    ref, ref_opt = nnx_pair()
    _fit(ref, ref_opt, nnx_loss, 10)
    leaves_equal(nnx.state(fresh), nnx.state(ref))
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())[-2:] == [
        10,
        12,
    ]
    again, again_opt = nnx_pair()
    with pytest.warns(RuntimeWarning, match="already holds step 10"):
        r = _fit(again, again_opt, nnx_loss, 10, checkpoint_dir=tmp_path)
    assert r.history["step"].tolist() == list(range(1, 11))
    leaves_equal(nnx.state(again), nnx.state(ref))


def test_an_epoch_loop_restarted_with_other_call_lengths_keeps_its_history(tmp_path):
    """Three calls of 8 steps, then the loop restarted as one call of 16, twice:
    the 16-step call restores the first call's end (8) and writes steps 12 and
    16 over the older run's; before, orbax skipped them silently while the index
    credited the older run's step 16 to this call, whose restart then came back
    with the history of steps 9..16 only and the step-8 checkpoint deleted."""
    model, opt = nnx_pair()
    for _ in range(3):
        _fit(model, opt, nnx_loss, 8, checkpoint_dir=tmp_path, checkpoint_every=4)
    ref, ref_opt = nnx_pair()
    want = _fit(ref, ref_opt, nnx_loss, 16)
    for _ in range(2):
        again, again_opt = nnx_pair()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (restored; later kept)
            r = _fit(again, again_opt, nnx_loss, 16, checkpoint_dir=tmp_path,
                     checkpoint_every=4)  # fmt: skip
        assert r.steps == 16 and r.history["step"].tolist() == list(range(1, 17))
        np.testing.assert_allclose(r.history["loss"], want.history["loss"], rtol=1e-6)
        leaves_equal(nnx.state(again), nnx.state(ref))


# ---------------------------------------------------------------- per-step keys


def _noisy_loss(model, batch, key):
    x, y = batch
    noise = 0.1 * jr.normal(key, y.shape)
    return jnp.mean((jax.vmap(model)(x) + noise - y) ** 2)


def _step_key(t, key=KEY):
    return jr.fold_in(jr.split(key)[1], t)


def test_equinox_loss_gets_the_documented_per_step_key():
    @eqx.filter_jit
    def step(model, opt_state, batch, key):
        loss, grads = eqx.filter_value_and_grad(_noisy_loss)(model, batch, key)
        updates, opt_state = TX.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    model = eqx_model()
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for t in range(9):
        model, opt_state, loss = step(model, opt_state, batch_at(t), _step_key(t))
        losses.append(loss)
    one = _fit(eqx_model(), TX, _noisy_loss, 9)
    np.testing.assert_allclose(one.history["loss"], losses, rtol=1e-5)
    # Continuing calls continue the keys too.
    a = _fit(eqx_model(), TX, _noisy_loss, 4)
    b = _fit(a.model, TX, _noisy_loss, 5, opt_state=a.optimizer)
    np.testing.assert_array_equal(
        np.concatenate([a.history["loss"], b.history["loss"]]), one.history["loss"]
    )


def test_nnx_loss_may_take_a_key_too():
    def loss(model, batch, key):
        x, y = batch
        return jnp.mean((model(x) + 0.1 * jr.normal(key, y.shape) - y) ** 2)

    model, opt = nnx_pair()
    r = _fit(model, opt, loss, 3)
    ref, _ = nnx_pair()
    expected = loss(ref, batch_at(0), _step_key(0))
    np.testing.assert_allclose(r.history["loss"][0], expected, rtol=1e-5)


def test_typed_keys_in_iterable_batches():
    """A batch may carry typed PRNG keys; the loop gets them as keys."""
    batches = [(*batch_at(t), jr.key(100 + t)) for t in range(7)]

    def loss(model, batch):
        x, y, key = batch
        return _noisy_loss(model, (x, y), key)

    r = scanax.fit(eqx_model(), TX, loss, iter(batches), steps=7, progress=False)
    model = eqx_model()
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))
    for t, (x, y, key) in enumerate(batches):
        value, grads = eqx.filter_value_and_grad(_noisy_loss)(model, (x, y), key)
        np.testing.assert_allclose(r.history["loss"][t], value, rtol=1e-5)
        updates, opt_state = TX.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        model = eqx.apply_updates(model, updates)


def test_typed_keys_in_array_data():
    keys = jr.split(jr.key(3), X.shape[0])

    def loss(model, batch):
        x, y, k = batch
        noise = 0.1 * jax.vmap(lambda k: jr.normal(k, (1,)))(k)
        return jnp.mean((jax.vmap(model)(x) + noise - y) ** 2)

    r = scanax.fit(
        eqx_model(), TX, loss, (X, Y, keys), steps=3, batch_size=BS, progress=False
    )
    x, y = batch_at(0, key=None)
    expected = loss(eqx_model(), (x, y, keys[:BS]))
    np.testing.assert_allclose(r.history["loss"][0], expected, rtol=1e-5)


def test_key_errors():
    with pytest.raises(TypeError, match=r"(?s)takes a third argument.*key=None.*Fix"):
        scanax.fit(
            eqx_model(), TX, _noisy_loss, (X, Y), steps=2, batch_size=BS, progress=False
        )

    def four(model, batch, key, extra):
        return 0.0

    with pytest.raises(
        TypeError,
        match=r"takes 4 required positional arguments \(model, batch, key, extra\)",
    ):
        _fit(eqx_model(), TX, four, 2)

    def with_default(model, batch, scale=2.0):  # not a key: called with two
        return scale * eqx_loss(model, batch)

    r = _fit(eqx_model(), TX, with_default, 1)
    np.testing.assert_allclose(
        r.history["loss"][0], 2 * eqx_loss(eqx_model(), batch_at(0)), rtol=1e-5
    )


# ---------------------------------------------------------------- first-hour hints


def test_dict_loss_gets_the_pair_fix():
    def loss(model, batch):
        return {"loss": eqx_loss(model, batch), "mae": jnp.zeros(())}

    with pytest.raises(
        TypeError,
        match=r"(?s)returned a dict \('loss', 'mae'\).*Fix: return "
        r"`\(out\['loss'\], \{\.\.\.other metrics\}\)`",
    ):
        _fit(eqx_model(), TX, loss, 2)


def test_list_of_arrays_gets_the_tuple_and_batch_size_fix():
    with pytest.raises(
        TypeError,
        match=r"(?s)`data` is a list, so each element is one batch.*"
        r"pass a tuple or dict and a batch_size: data=\(x, y\), batch_size=32",
    ):
        scanax.fit(eqx_model(), TX, eqx_loss, [X, Y], steps=2, progress=False)


@pytest.mark.standard_promotion("optax.apply_every multiplies floats by a bool")
def test_cycling_optax_counts_are_not_steps():
    """optax.apply_every's count cycles: not a step count; fit keeps its own,
    so a second call continues the data order exactly."""
    params = {"w": jnp.zeros((3, 1))}

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    tx = optax.chain(optax.apply_every(3), optax.sgd(0.1))
    one = _fit(params, tx, loss, 10)
    r = _fit(params, tx, loss, 5)
    more = _fit(r.model, tx, loss, 5, opt_state=r.optimizer)
    np.testing.assert_array_equal(
        np.concatenate([r.history["loss"], more.history["loss"]]), one.history["loss"]
    )


def test_key_parameter_names():
    """A third parameter named key (even key=None) gets the key; a required
    keyword-only one is an error naming the fix."""

    def named(model, batch, key=None):
        return _noisy_loss(model, batch, key)

    r = _fit(eqx_model(), TX, named, 1)
    expected = _noisy_loss(eqx_model(), batch_at(0), _step_key(0))
    np.testing.assert_allclose(r.history["loss"][0], expected, rtol=1e-5)

    def keyword_only(model, batch, *, key):
        return _noisy_loss(model, batch, key)

    with pytest.raises(
        TypeError,
        match=r"(?s)required keyword-only parameter `key`.*Fix: define "
        r"loss_fn\(model, batch, key\)",
    ):
        _fit(eqx_model(), TX, keyword_only, 1)


def test_a_call_that_trains_no_step_keeps_the_checkpoint_it_started_from(tmp_path):
    """An epoch loop whose shared iterator runs out: the third call trains no
    step. Its end is its start, already on disk: nothing is saved (before:
    the checkpoint was deleted to be replaced, and the save of an empty
    history failed inside orbax)."""
    batches = iter([batch_at(t) for t in range(12)])
    model, opt = nnx_pair()
    for i in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = scanax.fit(model, opt, nnx_loss, batches, steps=8, progress=False,
                           callbacks=[scanax.Checkpoint(tmp_path, every=4)])  # fmt: skip
        # (the third: no batch left, said so)
        assert any("gave no batch" in str(w.message) for w in caught) == (i == 2)
    assert r.steps == 0 and int(opt.step[...]) == 12
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [
        4,
        8,
        12,
    ]
    again, again_opt = nnx_pair()  # (restores its own call's step 8, trains on)
    scanax.fit(again, again_opt, nnx_loss, [batch_at(t) for t in range(12)],
               steps=12, progress=False,
               callbacks=[scanax.Checkpoint(tmp_path, every=4)])  # fmt: skip
    leaves_equal(nnx.state(again), nnx.state(model))
