"""scanax.scan with NNX objects in the carry under transformations: NNX's own
(``nnx.jit``, ``nnx.vmap``) write the changes back to the objects; JAX's
(``jax.jit``, ``jax.vmap``) give the traced function copies, which come back only
when it returns them; objects made outside the traced function are refused."""

import functools as ft

import helpers
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import pytest

import scanax

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

close = ft.partial(helpers.close, rtol=1e-5, atol=1e-5)
STEPS = 4


def setup(seed=0):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def loss_fn(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def train_step(carry, batch):
    model, optimizer = carry
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return (model, optimizer), loss


def batches():
    x = jr.normal(jr.key(5), (STEPS, 8, 3))
    return x, x.sum(-1, keepdims=True)


def python_loop(seed=0):
    """The reference: the same steps in a Python loop, eagerly."""
    model, optimizer = setup(seed)
    data, losses = batches(), []
    for i in range(STEPS):
        _, loss = train_step((model, optimizer), jtu.tree_map(lambda a: a[i], data))
        losses.append(loss)
    return nnx.state((model, optimizer)), jnp.stack(losses)


def snapshot(*objects):
    return jtu.tree_map(helpers.to_numpy, nnx.state(objects))


def train(model, optimizer, data):
    (model_out, optimizer_out), losses = scanax.scan(
        train_step, (model, optimizer), data
    )
    assert model_out is model and optimizer_out is optimizer
    return losses


# ------------------------------------------------------------------ updated


@pytest.mark.parametrize(
    "jit",
    [
        nnx.jit,
        ft.partial(nnx.jit, graph=False),
        ft.partial(nnx.jit, graph_updates=False),
    ],
    ids=["nnx.jit", "nnx.jit-graph=False", "nnx.jit-graph_updates=False"],
)
def test_nnx_jit_updates_the_objects_in_place(jit):
    model, optimizer = setup()
    want_state, want_losses = python_loop()
    losses = jit(train)(model, optimizer, batches())
    close(losses, want_losses)
    close(nnx.state((model, optimizer)), want_state)
    assert int(optimizer.step[...]) == STEPS


def test_jax_jit_objects_returned_match_python_loop_and_leave_yours_as_they_were():
    """What docs/scan.md says: ``jax.jit`` passes the function copies of your
    objects; scanax.scan updates those, and they reach you when returned."""
    model, optimizer = setup()
    before = snapshot(model, optimizer)
    want_state, want_losses = python_loop()

    @jax.jit
    def run(model, optimizer, data):
        return (model, optimizer), train(model, optimizer, data)

    (model_out, optimizer_out), losses = run(model, optimizer, batches())
    close(losses, want_losses)
    close(nnx.state((model_out, optimizer_out)), want_state)
    assert int(optimizer_out.step[...]) == STEPS
    # The objects passed to jax.jit are not changed (jax.jit's copies were).
    helpers.leaves_equal(snapshot(model, optimizer), before)
    assert int(optimizer.step[...]) == 0


def test_jax_jit_split_merge_matches_python_loop():
    """NNX's functional form: state in, objects rebuilt inside, state out."""
    model, optimizer = setup()
    graphdef, state = nnx.split((model, optimizer))
    want_state, want_losses = python_loop()

    @jax.jit
    def run(state, data):
        model, optimizer = nnx.merge(graphdef, state)
        losses = train(model, optimizer, data)
        return nnx.state((model, optimizer)), losses

    new_state, losses = run(state, batches())
    nnx.update((model, optimizer), new_state)
    close(losses, want_losses)
    close(nnx.state((model, optimizer)), want_state)


def test_jax_jit_objects_made_inside_match_python_loop():
    want_state, want_losses = python_loop(seed=3)

    @jax.jit
    def run(data):
        model, optimizer = setup(seed=3)
        losses = train(model, optimizer, data)
        return nnx.state((model, optimizer)), losses

    state, losses = run(batches())
    close(losses, want_losses)
    close(state, want_state)


def test_vmap_over_stacked_objects_nnx_and_jax_agree():
    """A population: ``nnx.vmap`` updates the stacked objects in place;
    ``jax.vmap`` returns the updated copies (the objects passed stay as they
    were), with the same values, each member its own Python loop."""
    make = nnx.vmap(setup, in_axes=0, out_axes=0)
    keys = jax.vmap(jr.key)(jnp.arange(2))  # member i: the Python loop of seed i
    data = batches()
    want = [python_loop(seed=i) for i in range(2)]

    models, optimizers = make(keys)
    before = snapshot(models, optimizers)

    def run(model, optimizer):
        return (model, optimizer), train(model, optimizer, data)

    (jax_models, jax_opts), jax_losses = jax.vmap(run)(models, optimizers)
    helpers.leaves_equal(snapshot(models, optimizers), before)

    nnx_losses = nnx.vmap(lambda m, o: train(m, o, data))(models, optimizers)
    close(jax_losses, nnx_losses)
    close(nnx.state((jax_models, jax_opts)), nnx.state((models, optimizers)))
    for i, (state, losses) in enumerate(want):
        close(nnx_losses[i], losses)
        close(jtu.tree_map(lambda a: a[i], nnx.state((models, optimizers))), state)
    assert optimizers.step[...].tolist() == [STEPS, STEPS]


# ------------------------------------------------------------------ refused

MADE_OUTSIDE = (
    r"(?s)^scanax.scan: the NNX {names} (was|were) made outside the function "
    r"being traced.*cannot be updated in place.*Nothing was run and "
    r"nothing was changed\.\nFix: pass (it|them) in as (an argument|arguments): to "
    r"`nnx.jit`.*or to `jax.jit`, and return (it|them) from the jitted function"
)


def _counting(calls):
    def step(carry, batch):
        calls.append(1)
        return train_step(carry, batch)

    return step


SCANS = {
    "scan": scanax.scan,
    "scan_until": ft.partial(scanax.scan_until, until=lambda carry: False),
}


@pytest.mark.parametrize("call", list(SCANS))
@pytest.mark.parametrize("jit", [jax.jit, nnx.jit], ids=["jax.jit", "nnx.jit"])
def test_error_objects_closed_over_by_the_jitted_function(jit, call):
    model, optimizer = setup()
    before, calls = snapshot(model, optimizer), []

    @jit
    def run(data):
        return SCANS[call](_counting(calls), (model, optimizer), data)[1]

    names = r"objects carry\[0\] \(Linear\), carry\[1\] \(Optimizer\)"
    with pytest.raises(
        TypeError, match=MADE_OUTSIDE.format(names=names).replace("scan:", f"{call}:")
    ):
        run(batches())
    assert calls == []  # refused before the body was traced
    helpers.leaves_equal(snapshot(model, optimizer), before)


def test_error_object_passed_undifferentiated_to_jax_grad():
    """``jax.grad`` traces only the argument it differentiates: the optimizer,
    passed beside it, is the caller's own object, from outside the trace."""
    model, optimizer = setup()
    before, calls = snapshot(model, optimizer), []

    def total(model, optimizer):
        carry, losses = scanax.scan(_counting(calls), (model, optimizer), batches())
        return losses.sum(), carry

    names = r"object carry\[1\] \(Optimizer\)"
    with pytest.raises(TypeError, match=MADE_OUTSIDE.format(names=names)):
        jax.grad(total, has_aux=True)(model, optimizer)
    assert calls == []
    helpers.leaves_equal(snapshot(model, optimizer), before)


def test_error_outside_variables_inside_a_new_object():
    """A new object made in the trace around one from outside: found when the scan
    writes back, before anything runs, and named by its Variables."""

    class Pair(nnx.Module):
        def __init__(self, model, optimizer):
            self.model, self.optimizer = model, optimizer

    model, optimizer = setup()
    before = snapshot(model, optimizer)

    def step(pair, batch):
        _, loss = train_step((pair.model, pair.optimizer), batch)
        return pair, loss

    @jax.jit
    def run(data):
        return scanax.scan(step, Pair(model, optimizer), data)[1]

    names = r"objects carry\['model'\] \(Linear\), carry\['optimizer'\] \(Optimizer\)"
    with pytest.raises(TypeError, match=MADE_OUTSIDE.format(names=names)):
        run(batches())
    helpers.leaves_equal(snapshot(model, optimizer), before)
