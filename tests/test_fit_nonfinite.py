"""``scanax.fit``'s guard against non-finite steps, for one model: the loss is
tested every step, the gradients are not; a non-finite gradient marks the
parameter it trains (NaN there, fused into the update: ``_fit_program.marked``),
the call's end tests whether the parameters are still intact, and the host
replays a bad call to find its first bad step. Held against a plain Python
loop of optax steps and against fits that stop before the bad step, with one
step per iteration (CPU's plan) and in chunks (a GPU's)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import leaves_equal, poison

import scanax
from scanax import _backend
from scanax._fit import solo as _fit_solo

N_STEPS = 40
W0 = {"w": jnp.array([[0.5], [-0.25], [1.0]]), "u": jnp.array([0.25, -1.0])}
TX = optax.adam(1e-2)


def loss_fn(p, batch):
    """A linear model's error, plus ``poison``: the step whose batch is flagged
    (``y[0, 0] == 0``) has a NaN gradient for ``u``, which no loss ever uses:
    after it, every loss stays finite."""
    x, y = batch
    err = x @ p["w"] - y
    return jnp.mean(err**2) + poison(p["u"], y[0, 0] == 0)


def batches(bad=None, n=N_STEPS):
    rng = np.random.default_rng(0)
    out = []
    for t in range(n):
        x = rng.normal(size=(4, 3)).astype(np.float32)
        y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
        if t == bad:
            y[0, 0] = 0.0
        out.append((jnp.asarray(x), jnp.asarray(y)))
    return out


def python_loop(data, fn=loss_fn, p0=W0):
    """The reference: optax steps in a Python loop; the parameters after them
    and their losses."""
    p, state, losses = p0, TX.init(p0), []
    for batch in data:
        loss, g = jax.value_and_grad(fn)(p, batch)
        updates, state = TX.update(g, state, p)
        p = optax.apply_updates(p, updates)
        losses.append(float(loss))
    return p, losses


def fit(data, steps=N_STEPS, **kw):
    kw = {"steps": steps, "progress": False, "steps_per_call": N_STEPS, **kw}
    return scanax.fit(W0, TX, loss_fn, data, **kw)


@pytest.fixture(params=["cpu", "gpu"])
def plan(request, monkeypatch):
    """fit's plan for a CPU (a step per iteration) or a GPU (chunks)."""
    monkeypatch.setattr(_backend, "platform", lambda: request.param)
    return request.param


def counted_replays(monkeypatch):
    calls = []
    replay = _fit_solo.Model._replay

    def counting(self, run, args, count):
        calls.append(count)
        return replay(self, run, args, count)

    monkeypatch.setattr(_fit_solo.Model, "_replay", counting)
    return calls


@pytest.mark.parametrize("bad", [0, 13, 39])
def test_a_bad_gradient_the_losses_never_show(plan, bad, monkeypatch):
    """Every loss of the call is finite: the parameters marked at the end
    find the call bad, and the replays find the step: the run ends with the
    state after the steps before it, exactly a shorter fit's, and as a Python
    loop's. The replays: about log2 of the call's steps."""
    replays = counted_replays(monkeypatch)
    data = batches(bad)
    with pytest.warns(
        RuntimeWarning,
        match=rf"step {bad + 1} gave non-finite gradients.*state after step {bad} ",
    ):
        out = fit(data)
    assert out.steps == bad and len(out.history["loss"]) == bad
    assert 0 < len(replays) <= 3 + math.ceil(math.log2(N_STEPS))
    p, losses = python_loop(data[:bad])
    np.testing.assert_allclose(out.history["loss"], losses, rtol=2e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
        out.model,
        p,
    )
    if bad:
        leaves_equal(out.model, fit(data[:bad], steps=bad).model)
    else:
        leaves_equal(out.model, W0)


def test_a_replay_that_differs_from_its_run_stops_at_the_calls_start(plan, monkeypatch):
    """Replays that do not reproduce their run (steps that are not
    deterministic; here each replay of some steps reports one step more than
    it applied) cannot say which step was bad: the run ends at the bad call's
    start, the last state known good, with a warning that says why, and no
    internal error."""
    replay = _fit_solo.Model._replay

    def differing(self, run, args, count):
        out = replay(self, run, args, count)
        if count:  # (a replay of no step runs none: it cannot differ)
            out = out._replace(report=out.report.at[0].add(1))
        return out

    monkeypatch.setattr(_fit_solo.Model, "_replay", differing)
    data = batches(N_STEPS + 10, n=2 * N_STEPS)  # (the second call: its 11th)
    with pytest.warns(
        RuntimeWarning, match=rf"not deterministic.*after step {N_STEPS} "
    ):
        out = fit(data, steps=2 * N_STEPS)
    assert out.steps == N_STEPS and len(out.history["loss"]) == N_STEPS
    leaves_equal(out.model, fit(data[:N_STEPS], steps=N_STEPS).model)


def test_a_parameter_not_finite_from_the_start_is_not_a_bad_step(plan):
    """A parameter the loss does not use, NaN before training: its gradient is
    0, nothing marks it, and training runs as a Python loop does."""
    p0 = {**W0, "unused": jnp.array([jnp.nan, 1.0])}

    def plain(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] - y) ** 2)

    data = batches()[:12]
    out = scanax.fit(p0, TX, plain, data, steps=12, progress=False)
    assert out.steps == 12
    p, _ = python_loop(data, plain, p0)
    np.testing.assert_allclose(out.model["w"], p["w"], rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(out.model["unused"], p0["unused"])


def test_an_update_that_overflows_stops_before_it(monkeypatch):
    """Off CPU (the GPU's plan), finite gradients whose update makes a
    parameter infinite (that the loss then no longer sees: ``tanh``
    saturates): before the guard marked parameters, fit trained on with it
    silently; now it stops before that step, the parameters finite. (On CPU
    each step tests its gradients, and a loss must show it.)"""
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    p0 = {"p": jnp.zeros((1,))}

    def saturating(p, batch):
        return jnp.sum(batch * jnp.tanh(p["p"]))

    data = [jnp.zeros((1,)), jnp.zeros((1,)), jnp.full((1,), 1e10), jnp.ones((1,))]
    with pytest.warns(RuntimeWarning, match="step 3 gave non-finite gradients or"):
        out = scanax.fit(p0, optax.sgd(1e30), saturating, data, steps=4, progress=False)
    assert out.steps == 2
    np.testing.assert_array_equal(out.model["p"], p0["p"])


def test_an_overflowing_update_a_later_loss_shows_is_found(plan):
    """Finite gradients whose update makes the parameter infinite, and the
    next loss shows it. Off CPU the marks stop before that step; on CPU the
    next loss stopped the loop, and fit had returned the infinite parameter
    as "the state after the last good step" (review 2026-12-07): now the
    parameters are tested on the host and the same step is found."""
    p0 = {"p": jnp.zeros((1,))}

    def linear(p, batch):
        return jnp.sum(batch * p["p"])

    data = [jnp.full((1,), v) for v in (1e-30, 2e-30, 1e10, 1.0)]
    with pytest.warns(
        RuntimeWarning,
        match=r"step 3 gave non-finite gradients or parameters.*state after step 2 ",
    ):
        out = scanax.fit(p0, optax.sgd(1e30), linear, data, steps=4, progress=False)
    assert out.steps == 2 and len(out.history["loss"]) == 2
    np.testing.assert_array_equal(out.model["p"], [-3.0])  # -1e30 * (1e-30 + 2e-30)


def test_an_overflow_by_a_calls_last_update_is_said_in_the_warning(plan):
    """On CPU, a call's last update is tested only by the next call's first
    loss: the state after it, which fit returns, holds the infinite parameter,
    and the warning now says so with a fix (before: "the result holds the
    state after step 3", silently infinite). Off CPU (the marks), the call's
    end tests its parameters: the state before the overflow is returned."""
    p0 = {"p": jnp.zeros((1,))}

    def linear(p, batch):
        return jnp.sum(batch * p["p"])

    data = [jnp.full((1,), v) for v in (1e-30, 2e-30, 1e10, 1.0, 1.0)]
    if plan == "cpu":
        said = (
            r"(?s)step 4 gave a non-finite loss \(-inf\).*state after step 3 .*But "
            r"the parameters after step 3 are not all finite: the update of step 3, "
            r"the last of a call.*Fix: restore an earlier checkpoint"
        )
    else:
        said = r"step 3 gave non-finite gradients or parameters.*state after step 2 "
    with pytest.warns(RuntimeWarning, match=said):
        out = scanax.fit(
            p0, optax.sgd(1e30), linear, data, steps=5, steps_per_call=3, progress=False
        )
    if plan == "cpu":
        assert out.steps == 3 and not np.isfinite(out.model["p"]).all()
    else:
        assert out.steps == 2
        np.testing.assert_array_equal(out.model["p"], [-3.0])


def test_a_nan_stop_with_a_restored_best_says_which_state_is_returned():
    """EarlyStop(restore_best=True) returns its best state after a NaN stop:
    the warning says so (before: "the result holds the state after step 2",
    while it held step 1's)."""
    data = batches(n=6)
    x, y = data[2]
    data[2] = (x, y.at[0].set(jnp.nan))
    stop = scanax.EarlyStop("loss", patience=5)
    with pytest.warns(
        RuntimeWarning,
        match=r"step 3 gave a non-finite loss \(nan\).*The last good state is after "
        r"step 2 .*the result holds EarlyStop's best state \(restore_best=True",
    ):
        out = fit(data, steps=6, callbacks=[scanax.Eval(None, every=1), stop])
    assert out.steps == 2
    assert out.best_step == 1 + int(np.argmin(out.history["loss"][:2]))


def test_stepwise_equals_fused_through_a_bad_gradient(monkeypatch):
    """Both executions find the same step and end with the same state, bit
    for bit (chunks: the GPU's plan)."""
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    data = batches(21)
    with pytest.warns(RuntimeWarning, match="step 22 gave non-finite gradients"):
        fused = fit(data, steps_per_call=30)
    with pytest.warns(RuntimeWarning, match="step 22 gave non-finite gradients"):
        stepwise = fit(data, steps_per_call=30, execution="stepwise")
    assert stepwise.execution == "stepwise"
    assert fused.steps == stepwise.steps == 21
    leaves_equal(fused.model, stepwise.model)
    leaves_equal(fused.history, stepwise.history)


def _inner(eqn):
    """The jaxprs in an equation's parameters (a loop's body, a call's)."""
    for v in eqn.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(s, "eqns"):
                yield s
            elif hasattr(s, "jaxpr") and hasattr(s.jaxpr, "eqns"):
                yield s.jaxpr


def _reductions(jaxpr):
    """The reductions of arrays (not scalars) in ``jaxpr`` and its inner
    jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        reducing = eqn.primitive.name in ("reduce_max", "reduce_min", "reduce_or")
        if reducing and any(getattr(v.aval, "ndim", 0) for v in eqn.invars):
            found.append(eqn.primitive.name)
        for sub in _inner(eqn):
            found += _reductions(sub)
    return found


def _step_scans(jaxpr, k):
    """The ``lax.scan``s of ``k`` iterations in ``jaxpr`` (the chunks)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["length"] == k:
            out += list(_inner(eqn))
        for sub in _inner(eqn):
            out += _step_scans(sub, k)
    return out


def test_no_reduction_of_the_gradients_per_step(monkeypatch):
    """The structure the speed comes from: in the chunk's steps (a scan of
    ``k`` steps, the GPU's plan) no array is reduced by a max, min or any (the
    loss only sums); the call tests the parameters once, outside them."""
    from scanax._fit import program as _fit_program

    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    seen = []
    executable = _fit_program.Program.executable

    def record(program, args):
        seen.append((program, jax.make_jaxpr(program.chunks.fused)(*args).jaxpr))
        return executable(program, args)

    monkeypatch.setattr(_fit_program.Program, "executable", record)
    _fit_program.PROGRAMS.clear()
    fit(batches(), steps=8, steps_per_call=8)
    ((program, jaxpr),) = seen
    k = program.chunks.plan.k
    (scan,) = _step_scans(jaxpr, k)
    assert _reductions(scan) == []
    assert "reduce_or" in _reductions(jaxpr)


def test_a_gradient_not_finite_only_where_a_parameter_already_is(plan):
    """The documented limit of the marks (off CPU): an element already NaN at
    a call's start cannot be marked, so a non-finite gradient there alone
    (the loss ignores that element: ``nansum``) does not stop training. It
    changes only that element (NaN before and after) and its optimizer state;
    every other parameter trains as in a Python loop. On CPU each step tests
    its gradients: the first step stops."""
    p0 = {"w": W0["w"], "m": jnp.array([jnp.nan, 1.0])}

    def nan_ignoring(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] - y) ** 2) + jnp.nansum(p["m"] ** 2)

    data = batches()[:12]
    assert np.isnan(jax.grad(nan_ignoring)(p0, data[0])["m"][0])
    if plan == "cpu":
        with pytest.warns(RuntimeWarning, match="step 1 gave non-finite gradients"):
            out = scanax.fit(p0, TX, nan_ignoring, data, steps=12, progress=False)
        assert out.steps == 0
        leaves_equal(out.model, p0)
        return
    out = scanax.fit(p0, TX, nan_ignoring, data, steps=12, progress=False)
    assert out.steps == 12
    p, _ = python_loop(data, nan_ignoring, p0)
    np.testing.assert_allclose(out.model["w"], p["w"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(out.model["m"], p["m"], rtol=2e-5)  # (NaN, then m[1])


def test_a_failure_after_a_bad_step_leaves_nnx_objects_at_the_last_good_state(
    monkeypatch, tmp_path
):
    """The call dispatched after the bad one runs nothing; when the run then
    fails at its end (here its last checkpoint), the NNX objects hold the
    state before the bad step, not that call's pass-through of the marked
    one."""
    from flax import nnx

    from scanax._fit import hooks

    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(W0["w"])
            self.u = nnx.Param(W0["u"])

    def nnx_loss(model, batch):
        return loss_fn({"w": model.w[...], "u": model.u[...]}, batch)

    def full_disk(self, run):
        raise OSError("disk full")

    def pair():
        model = Net()
        return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

    data = batches(5)[:16]
    monkeypatch.setattr(hooks.Saver, "end", full_disk)
    model, opt = pair()
    with pytest.raises(OSError, match="disk full"), pytest.warns(RuntimeWarning):
        scanax.fit(
            model, opt, nnx_loss, data, steps=16, steps_per_call=8, progress=False,
            checkpoint_dir=tmp_path, checkpoint_every=4,
        )  # fmt: skip
    assert int(opt.step[...]) == 5
    p, _ = python_loop(data[:5])
    np.testing.assert_allclose(model.w[...], p["w"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(model.u[...], p["u"], rtol=2e-5, atol=1e-6)


def test_the_bar_ends_on_the_last_good_steps_loss(capsys, monkeypatch):
    """In-loop reports may move the bar past the bad step (in chunks the call
    runs on): it ends at the steps applied, showing the last good step's
    loss."""
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    data = batches(13)
    with pytest.warns(RuntimeWarning, match="step 14 gave"):
        out = fit(data, steps_per_call=20, progress=True)
    assert out.steps == 13
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert " 13/40 " in last
    assert f"loss={float(out.history['loss'][-1]):.4g}" in last


def test_a_nan_loss_with_nan_gradients_is_named_alike_on_both_plans(plan, monkeypatch):
    """The warning names the loss when the bad step's loss is not finite (its
    gradients then tell nothing more), in the same words on both plans, and
    one replay finds it on both (off CPU: the replay of the steps before it
    leaves the parameters intact)."""
    replays = counted_replays(monkeypatch)

    def both(p, batch):
        x, y = batch
        bad = jnp.where(y[0, 0] == 0, jnp.nan, 0.0)
        return jnp.mean((x @ p["w"] - y) ** 2) + bad * jnp.sum(p["u"])

    data = batches(6)[:16]
    with pytest.warns(RuntimeWarning) as caught:
        out = scanax.fit(W0, TX, both, data, steps=16, progress=False)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "scanax.fit: step 7 gave a non-finite loss (nan); training stopped before"
    )
    assert out.steps == 6
    assert replays == [6]
    leaves_equal(out.model, fit(data[:6], steps=6).model)


def test_a_population_member_holding_an_overflowed_update_is_said(plan):
    """A member's update that makes its parameter infinite (finite gradients)
    is seen only by its next loss: the member stops holding the infinite
    parameter, and the warning now says so with a fix (before: "each keeps
    its last good state", silently infinite). The other member trains on."""

    def make(key, lr):
        return {"p": jnp.zeros((1,))}, optax.sgd(lr)

    def linear(p, batch):
        return jnp.sum(batch * p["p"])

    data = [jnp.full((1,), v) for v in (1e-30, 2e-30, 1e10, 1.0, 1.0)]
    pop = scanax.population(make, 2, key=jax.random.key(0), lr=jnp.array([1e30, 1e-3]))
    with pytest.warns(RuntimeWarning, match=r"(?s)member 0 \(step 4\)") as said:
        out = scanax.fit(pop, None, linear, data, steps=5, progress=False)
    said = str(said[0].message)
    assert "But member(s) [0] hold parameters that are not all finite" in said
    assert "Fix: restore an earlier checkpoint" in said
    assert not np.isfinite(out.model[0]["p"]).all()  # (what it says: the state held)
    np.testing.assert_array_equal(out.steps, [3, 5])
