"""``scanax.Rollout``: data generated on device by the model being trained,
checked against a hand-written PPO-style loop (collect, then ``epochs`` passes
of ``minibatches`` shuffled minibatches), for every model kind and a
population, across calls, checkpoints and kill -9."""

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import _rollout_job as job  # noqa: E402  (tests/ is on sys.path under pytest)
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from _rollout_job import env_reset
from helpers import JOBS_RUN_ELSEWHERE, count_traces, traced, xla_flags
from jax.experimental import io_callback

import scanax

HERE = Path(__file__).resolve().parent
KEY = jr.key(7)
TX = optax.adam(1e-2)


def rollout(epochs=2, minibatches=4, collect=job.collect, init=job.env_reset):
    return scanax.Rollout(collect, init, epochs=epochs, minibatches=minibatches)


def reference(params, steps, key, epochs=2, minibatches=4, tx=TX, collect=job.collect):
    """The documented algorithm, by hand: one jitted update per step."""
    period = epochs * minibatches
    init_key, rkey = jr.split(jr.fold_in(key, 2))
    carry = job.env_reset(init_key)
    opt = tx.init(params)

    @jax.jit
    def update(params, opt, batch):
        (loss, _), grads = jax.value_and_grad(job.loss_fn, has_aux=True)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses, rewards, orders = [], [], None
    for t in range(steps):
        if t % period == 0:
            rkey, ckey, skey = jr.split(rkey, 3)
            batch, carry, metrics = jax.jit(collect)(params, carry, ckey)
            rewards.append(float(metrics["reward"]))
            n = batch["obs"].shape[0]
            orders = [jr.permutation(jr.fold_in(skey, e), n) for e in range(epochs)]
        j = t % period
        if minibatches == 1:
            mb = batch
        else:
            size = n // minibatches
            idx = orders[j // minibatches][(j % minibatches) * size :][:size]
            mb = jtu.tree_map(lambda x: x[idx], batch)
        params, opt, loss = update(params, opt, mb)
        losses.append(float(loss))
    return params, np.array(losses), np.array(rewards), carry


@pytest.fixture(scope="module")
def solo():
    """48 steps of the documented PPO-style loop, by fit and by hand."""
    r = rollout()
    result = scanax.fit(
        job.params0(), TX, job.loss_fn, r, steps=48, key=KEY, progress=False
    )
    return result, r, reference(job.params0(), 48, KEY)


def test_fit_equals_the_hand_written_loop(solo):
    result, r, (params, losses, rewards, carry) = solo
    np.testing.assert_allclose(result.history["loss"], losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(result.history["rollout_step"], np.arange(1, 48, 8))
    np.testing.assert_allclose(result.history["rollout_reward"], rewards, rtol=1e-5)
    for a, b in zip(jtu.tree_leaves(result.model), jtu.tree_leaves(params)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    # the environment's state stays with the Rollout: as the hand loop's
    np.testing.assert_allclose(r.state.carry, carry, rtol=2e-5, atol=1e-6)
    assert result.steps == 48 and "ratio" in result.history


def test_one_collection_per_step_of_the_whole_batch():
    result = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(1, 1), steps=5, key=KEY, progress=False
    )
    _, losses, rewards, _ = reference(job.params0(), 5, KEY, 1, 1)
    np.testing.assert_allclose(result.history["loss"], losses, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(result.history["rollout_reward"], rewards, rtol=1e-5)
    np.testing.assert_array_equal(result.history["rollout_step"], np.arange(1, 6))


def test_ten_calls_equal_one(solo):
    whole = solo[0]
    r, params, opt, losses, rewards = rollout(), job.params0(), None, [], []
    for _ in range(6):  # 8 steps a call: one collection each
        out = scanax.fit(
            params, TX, job.loss_fn, r, steps=8, key=KEY, opt_state=opt, progress=False
        )
        params, opt = out.model, out.optimizer
        losses.append(out.history["loss"])
        rewards.append(out.history["rollout_reward"])
    np.testing.assert_array_equal(np.concatenate(losses), whole.history["loss"])
    np.testing.assert_array_equal(
        np.concatenate(rewards), whole.history["rollout_reward"]
    )
    for a, b in zip(jtu.tree_leaves(params), jtu.tree_leaves(whole.model)):
        np.testing.assert_array_equal(a, b)


def test_calls_that_split_a_collection_continue_it(solo):
    """Calls of 5 steps cut collections (8 steps each) in the middle: the feed
    (batch, orders, key) continues across them."""
    whole = solo[0]
    r, params, opt, losses = rollout(), job.params0(), None, []
    for steps in (5, 5, 5, 33):
        out = scanax.fit(
            params, TX, job.loss_fn, r, steps=steps, key=KEY, opt_state=opt,
            progress=False,
        )  # fmt: skip
        params, opt = out.model, out.optimizer
        losses.append(out.history["loss"])
    np.testing.assert_array_equal(np.concatenate(losses), whole.history["loss"])


def test_a_trained_model_starting_mid_period_collects_first():
    """A model whose optimizer is at step 3 (not a collection step) starts
    with a collection of its own."""
    params, opt = job.params0(), TX.init(job.params0())
    pre = scanax.fit(
        params, TX, job.loss_fn, rollout(), steps=3, key=KEY, progress=False
    )
    r = rollout()
    out = scanax.fit(
        pre.model, TX, job.loss_fn, r, steps=10, key=KEY, opt_state=pre.optimizer,
        progress=False,
    )  # fmt: skip
    assert opt is not None
    np.testing.assert_array_equal(out.history["step"], np.arange(4, 14))
    np.testing.assert_array_equal(out.history["rollout_step"], [9])
    assert np.isfinite(out.history["loss"]).all()


@pytest.mark.parametrize("kind", ["nnx", "equinox", "trainstate"])
def test_every_model_kind(kind, solo):
    ref = solo[0]
    p0 = job.params0()
    if kind == "nnx":
        nnx = pytest.importorskip("flax.nnx")

        class Policy(nnx.Module):
            def __init__(self):
                self.w1, self.w2 = nnx.Param(p0["w1"]), nnx.Param(p0["w2"])

            def params(self):
                return {"w1": self.w1[...], "w2": self.w2[...]}

        model = Policy()
        optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
        view = Policy.params
    elif kind == "equinox":
        eqx = pytest.importorskip("equinox")

        class Policy(eqx.Module):
            w1: jax.Array
            w2: jax.Array
            tag: str = eqx.field(static=True, default="policy")

            def params(self):
                return {"w1": self.w1, "w2": self.w2}

        model, optimizer, view = Policy(p0["w1"], p0["w2"]), TX, Policy.params
    else:
        ts = pytest.importorskip("flax.training.train_state")
        model = ts.TrainState.create(apply_fn=None, params=p0, tx=TX)
        optimizer, view = None, (lambda s: s.params)

    def collect(m, carry, key):
        return job.collect(view(m), carry, key)

    def loss_fn(m, batch):
        return job.loss_fn(view(m), batch)

    out = scanax.fit(
        model, optimizer, loss_fn, rollout(collect=collect), steps=48, key=KEY,
        progress=False,
    )  # fmt: skip
    np.testing.assert_allclose(out.history["loss"], ref.history["loss"], atol=1e-6)
    np.testing.assert_allclose(
        out.history["rollout_reward"], ref.history["rollout_reward"], atol=1e-6
    )
    trained = view(model) if kind == "nnx" else view(out.model)
    for a, b in zip(jtu.tree_leaves(trained), jtu.tree_leaves(ref.model)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_population_members_equal_solo_fits():
    def make(key, lr):
        return job.params0(key), optax.adam(lr)

    lrs = jnp.array([1e-2, 3e-3, 3e-2])
    pop = scanax.population(make, 3, key=jr.key(1), lr=lrs)
    r = rollout()
    out = scanax.fit(pop, None, job.loss_fn, r, steps=16, key=KEY, progress=False)
    assert out.history["rollout_reward"].shape == (3, 2)
    np.testing.assert_array_equal(out.history["rollout_step"], [1, 9])
    assert r.members == 3
    keys = jr.split(KEY, 3)
    for i, member_key in enumerate(jr.split(jr.key(1), 3)):
        alone = scanax.fit(
            job.params0(member_key), optax.adam(float(lrs[i])), job.loss_fn,
            rollout(), steps=16, key=keys[i], progress=False,
        )  # fmt: skip
        np.testing.assert_allclose(
            out.history["loss"][i], alone.history["loss"], rtol=1e-5, atol=1e-7
        )
        np.testing.assert_allclose(
            out.history["rollout_reward"][i], alone.history["rollout_reward"], rtol=1e-5
        )
    # the next call continues every member's feed: as one call of 24
    more = scanax.fit(pop, None, job.loss_fn, r, steps=8, key=KEY, progress=False)
    np.testing.assert_array_equal(more.history["rollout_step"], [17])
    pop2 = scanax.population(make, 3, key=jr.key(1), lr=lrs)
    once = scanax.fit(
        pop2, None, job.loss_fn, rollout(), steps=24, key=KEY, progress=False
    )
    np.testing.assert_array_equal(more.history["loss"], once.history["loss"][:, 16:])


def test_a_non_finite_step_stops_with_the_last_good_feed():
    """The third collection's batch is NaN: training stops before step 16 is
    applied, the model and the Rollout's feed as after step 15 (its second
    collection)."""

    def init(key):
        return {"s": job.env_reset(key), "n": jnp.zeros((), jnp.int32)}

    def collect(params, carry, key):
        batch, s, metrics = job.collect(params, carry["s"], key)
        bad = jnp.where(carry["n"] == 2, jnp.nan, 0.0)
        batch = {**batch, "adv": batch["adv"] + bad}
        return batch, {"s": s, "n": carry["n"] + 1}, metrics

    r = scanax.Rollout(collect, init, epochs=2, minibatches=4)
    with pytest.warns(RuntimeWarning, match="step 17"):
        out = scanax.fit(
            job.params0(), TX, job.loss_fn, r, steps=24, key=KEY, progress=False
        )
    assert out.steps == 16
    assert int(r.state.carry["n"]) == 2
    good = scanax.fit(
        job.params0(), TX, job.loss_fn, scanax.Rollout(collect, init, epochs=2,
        minibatches=4), steps=16, key=KEY, progress=False,
    )  # fmt: skip
    for a, b in zip(jtu.tree_leaves(out.model), jtu.tree_leaves(good.model)):
        np.testing.assert_array_equal(a, b)


def test_collections_are_logged_at_their_steps(tmp_path):
    path = tmp_path / "log.csv"
    scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(), steps=24, key=KEY, progress=False,
        log=scanax.CSV(path), log_every=4,
    )  # fmt: skip
    import csv

    rows = list(csv.DictReader(path.open()))
    logged = {int(r["step"]): r["rollout_reward"] for r in rows if r["rollout_reward"]}
    assert sorted(logged) == [1, 9, 17]
    assert all(np.isfinite(float(v)) for v in logged.values())
    windows = [4, 8, 12, 16, 20, 24]
    assert [int(r["step"]) for r in rows if r["loss"] not in ("", "nan")] == windows


def test_kill_9_then_resume_is_exact(tmp_path):
    directory, out = tmp_path / "ckpt", tmp_path / "digest"
    env = dict(os.environ, XLA_FLAGS=xla_flags(4))
    cmd = [sys.executable, str(HERE / "_rollout_job.py"), str(directory), str(out)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        saved = [n for n in os.listdir(directory)] if directory.exists() else []
        if any(n.isdigit() for n in saved):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    assert steps and max(steps) < job.STEPS
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    if JOBS_RUN_ELSEWHERE:  # (the same run, uninterrupted, as a job too)
        whole = tmp_path / "whole"
        subprocess.run(cmd[:2] + ["", str(whole)], env=env, check=True, timeout=300)
        assert out.read_text() == whole.read_text()
    else:
        assert out.read_text() == job.digest(job.job(None))


# ---------------------------------------------------------------------- errors


def _fit(r, **kw):
    kw = {"steps": 8, "key": KEY, "progress": False, **kw}
    return scanax.fit(job.params0(), TX, job.loss_fn, r, **kw)


def test_errors_before_anything_runs():
    with pytest.raises(TypeError, match="Rollout: `collect` must be callable"):
        scanax.Rollout(None, job.env_reset)
    with pytest.raises(ValueError, match="`minibatches` must be a positive int"):
        scanax.Rollout(job.collect, job.env_reset, minibatches=0)
    with pytest.raises(TypeError, match="needs `key`"):
        _fit(rollout(), key=None)
    with pytest.raises(TypeError, match="batch_size=4 is given"):
        _fit(rollout(), batch_size=4)
    with pytest.raises(ValueError, match="`accumulate` is not supported"):
        _fit(rollout(), accumulate=2)
    with pytest.raises(ValueError, match="minibatches=3 divides"):
        _fit(rollout(minibatches=3))


def test_errors_of_collect():
    def no_tuple(params, carry, key):
        return job.collect(params, carry, key)[0]

    def carry_dtype(params, carry, key):
        batch, s, m = job.collect(params, carry, key)
        return batch, s.astype(jnp.float16), m

    def carry_tree(params, carry, key):
        batch, s, m = job.collect(params, carry, key)
        return batch, (s,), m

    with pytest.raises(TypeError, match="must return \\(batch, carry\\)"):
        _fit(rollout(collect=no_tuple))
    with pytest.raises(TypeError, match="float32\\[4, 3\\] to float16\\[4, 3\\]"):
        _fit(rollout(collect=carry_dtype))
    with pytest.raises(TypeError, match="another structure"):
        _fit(rollout(collect=carry_tree))

    def four(params, carry, key):
        return (*job.collect(params, carry, key), None)

    def empty(params, carry, key):
        batch, s, m = job.collect(params, carry, key)
        return jtu.tree_map(lambda x: x[:0], batch), s, m

    with pytest.raises(TypeError, match=r"metrics\), got a tuple of 4\."):
        _fit(rollout(collect=four))
    # (before: a NaN loss for a mean, or training on nothing for a sum)
    with pytest.raises(
        ValueError,
        match=r"(?s)the batch `collect` returns has no examples.*\['obs'\]: "
        r"float32\[0, .*Fix: collect at least `minibatches` examples",
    ):
        _fit(rollout(collect=empty))


def test_collect_drawing_from_the_models_own_rngs_is_named():
    """collect sampling from the NNX model's own stream (model.rngs.action())
    draws the same numbers every collection: the warning names collect and its
    key (before: evaluate's warning, naming batches and evaluate's key=); with
    the documented fix, reseeding from collect's key, each collection differs."""
    nnx = pytest.importorskip("flax.nnx")

    class Policy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.rngs = rngs

    def make_collect(reseed):
        def collect(model, carry, key):
            if reseed:
                nnx.reseed(model, action=key)
            obs = jr.normal(key, (8, 3))
            return {"obs": obs}, carry + 1, {"u": jr.uniform(model.rngs.action())}

        return collect

    def loss_fn(model, mb):
        return jnp.mean(model.lin(mb["obs"]) ** 2)

    draws = {}
    for reseed in (False, True):
        m = Policy(nnx.Rngs(0, action=1))
        r = scanax.Rollout(make_collect(reseed), lambda k: jnp.zeros(()), minibatches=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = scanax.fit(
                m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param), loss_fn, r,
                steps=8, key=KEY, progress=False,
            )  # fmt: skip
        draws[reseed] = np.asarray(out.history["rollout_u"])
        said = [str(w.message) for w in caught if "own RNG stream" in str(w.message)]
        if reseed:
            assert not said
        else:
            assert said and all(
                s.startswith("scanax.fit: Rollout's `collect` draws random numbers")
                and "model.rngs.action" in s
                and "nnx.reseed(model, action=key)" in s
                for s in said
            ), said
    assert len(draws[False]) == 4 and len(set(draws[False].tolist())) == 1
    assert len(set(draws[True].tolist())) == 4


def test_a_rollout_kept_for_a_population_is_refused_for_one_model():
    r = rollout()

    def make(key):
        return job.params0(key), TX

    pop = scanax.population(make, 2, key=jr.key(1))
    scanax.fit(pop, None, job.loss_fn, r, steps=8, key=KEY, progress=False)
    with pytest.raises(ValueError, match="from a fit of a population of 2"):
        _fit(r)
    r.reset()
    assert _fit(r).steps == 8
    with pytest.raises(TypeError, match="shared_batches=True has no meaning"):
        scanax.fit(
            pop, None, job.loss_fn, r, steps=8, key=KEY, shared_batches=True,
            progress=False,
        )  # fmt: skip


def test_with_a_moving_average_and_bfloat16(solo):
    """Rollout composes with ema= (the feed and the average both join the
    state) and precision= (collect in float32, the loss in bfloat16)."""
    out = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(), steps=16, key=KEY, progress=False,
        ema=0.9,
    )  # fmt: skip
    np.testing.assert_array_equal(out.history["loss"], solo[0].history["loss"][:16])
    assert set(out.ema) == {"w1", "w2"}
    low = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(), steps=16, key=KEY, progress=False,
        precision="bfloat16",
    )  # fmt: skip
    np.testing.assert_allclose(
        low.history["rollout_reward"], solo[0].history["rollout_reward"][:2], rtol=1e-6
    )


def test_names_and_signatures_are_checked():
    def step_metric(params, carry, key):
        batch, s, m = job.collect(params, carry, key)
        return batch, s, {"step": m["reward"]}

    with pytest.raises(TypeError, match="metric named 'step'"):
        _fit(rollout(collect=step_metric))

    def loss_rollout_metric(p, batch):
        loss, _ = job.loss_fn(p, batch)
        return loss, {"rollout_reward": loss}

    with pytest.raises(ValueError, match="'rollout_...'"):
        scanax.fit(
            job.params0(), TX, loss_rollout_metric, rollout(), steps=8, key=KEY,
            progress=False,
        )  # fmt: skip
    with pytest.raises(TypeError, match="`init` cannot be called with 1"):
        scanax.Rollout(job.collect, lambda: 0)
    with pytest.raises(TypeError, match="`collect` cannot be called with 3"):
        scanax.Rollout(lambda model, carry: 0, job.env_reset)
    with pytest.raises(TypeError, match="epochs=2 counts passes over array data"):
        _fit(rollout(), epochs=2, steps=None)


def test_a_failed_fit_leaves_the_feed_of_a_pytree_model(solo):
    """An error in the second call: a pytree model is not handed back, so the
    Rollout keeps its state from before the fit."""
    r = rollout()
    first = _fit(r)
    before = jtu.tree_leaves(r.state._replace(key=jr.key_data(r.state.key)))
    calls = []

    def failing(params, batch):
        calls.append(1)
        loss, m = job.loss_fn(params, batch)
        bad = io_callback(_raise_late, jax.ShapeDtypeStruct((), jnp.float32))
        return loss + bad, m

    with pytest.raises(Exception, match="late"):
        scanax.fit(
            first.model, TX, failing, r, steps=24, key=KEY, steps_per_call=8,
            opt_state=first.optimizer, progress=False,
        )  # fmt: skip
    after = jtu.tree_leaves(r.state._replace(key=jr.key_data(r.state.key)))
    assert calls and _COUNT[0] > 12  # it trained, then failed
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


_COUNT = [0]


def _raise_late():
    _COUNT[0] += 1
    if _COUNT[0] > 12:  # after the first call's steps
        raise RuntimeError("late")
    return np.float32(0.0)


def test_early_stop_on_a_rollout_metric(solo):
    """EarlyStop(monitor="rollout_reward"): the mean of the collections since
    the last check, checked every eval_every steps; the best state restored is
    that of the best check, by the hand loop's rewards."""
    whole = solo[0]
    stop = scanax.EarlyStop("rollout_reward", patience=1, mode="max")
    out = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(), steps=48, key=KEY, progress=False,
        eval_every=16, stop=stop,
    )  # fmt: skip
    rewards = whole.history["rollout_reward"]  # collections at 1, 9, 17, 25, ...
    checks = [rewards[0:2].mean(), rewards[2:4].mean(), rewards[4:6].mean()]
    # the rule: stop after the first check without improvement (patience 1)
    improved = [True] + [c > max(checks[:i]) for i, c in enumerate(checks) if i]
    first_miss = next((i for i, up in enumerate(improved) if not up), None)
    n_checks = len(checks) if first_miss is None else first_miss + 1
    assert out.steps == 16 * n_checks
    assert out.best_step == 16 * (int(np.argmax(checks[:n_checks])) + 1)
    np.testing.assert_array_equal(
        out.history["loss"], whole.history["loss"][: out.steps]
    )


def _collect_sometimes_nan(params, carry, key):
    """``reward`` NaN in the collections below a threshold: a ``return``
    averaged over the episodes that ended, where none did."""
    batch, carry, metrics = job.collect(params, carry, key)
    reward = metrics["reward"]
    return batch, carry, {"reward": jnp.where(reward > NAN_BELOW, reward, jnp.nan)}


NAN_BELOW = 0.0


def test_early_stop_on_a_rollout_metric_skips_nan_collections(solo):
    """A NaN collection counts as no collection: the check's value is the mean
    of the others since the last check, and a check with none waits (before,
    one NaN made the check's value NaN, never an improvement: training stopped
    with no best state)."""
    global NAN_BELOW
    rewards = solo[0].history["rollout_reward"]  # collections at 1, 9, 17, ...
    NAN_BELOW = float(np.sort(rewards[:6])[2])  # half of the first six are NaN
    masked = np.where(rewards > NAN_BELOW, rewards, np.nan)
    stop = scanax.EarlyStop("rollout_reward", patience=1, mode="max")
    out = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(collect=_collect_sometimes_nan),
        steps=48, key=KEY, progress=False, eval_every=16, stop=stop,
    )  # fmt: skip
    np.testing.assert_array_equal(
        out.history["rollout_reward"], masked[: len(out.history["rollout_reward"])]
    )
    best, misses, at, pending = -np.inf, 0, None, []
    steps = 48
    for i, window in enumerate((masked[0:2], masked[2:4], masked[4:6])):
        pending.extend(window[~np.isnan(window)])
        if not pending:
            continue  # (no collection with a value since the last check)
        value, pending = np.mean(pending), []
        if value > best:
            best, at, misses = value, 16 * (i + 1), 0
        else:
            misses += 1
            if misses >= 1:
                steps = 16 * (i + 1)
                break
    assert at is not None and out.best_step == at
    assert out.steps == steps
    np.testing.assert_array_equal(
        out.history["loss"], solo[0].history["loss"][: out.steps]
    )


def test_a_new_rollout_reuses_the_compiled_init_and_a_reused_one_warns():
    def init(key):
        traced("init")  # (runs while tracing)
        return env_reset(key)

    with count_traces() as traces:
        first = _fit(rollout(init=init))
        assert traces["init"] == 1
        _fit(rollout(init=init))  # rebuilt Rollout, same functions: no new trace
        assert traces["init"] == 1
    r = rollout(init=init)
    _fit(r)
    with pytest.warns(RuntimeWarning, match="was left at step 8 .* starts at step 0"):
        _fit(r)  # a fresh model on the used Rollout
    again = scanax.fit(  # continuing where it was left: no warning
        first.model, TX, job.loss_fn, r, steps=8, key=KEY, opt_state=first.optimizer,
        progress=False,
    )  # fmt: skip
    assert again.steps == 8


def _collect_more(params, carry, key):
    batch, carry, metrics = job.collect(params, carry, key)
    return batch, carry, {**metrics, "spread": jnp.std(batch["adv"])}


def test_resuming_with_a_new_collect_metric_keeps_one_entry_per_collection(tmp_path):
    """A checkpoint of a ``collect`` without ``spread``, resumed with it: NaN
    for the collections before, a warning, every ``rollout_*`` array one entry
    per ``rollout_step`` (before, ``rollout_spread`` was shorter)."""
    kw = dict(key=KEY, progress=False, checkpoint_dir=tmp_path, checkpoint_every=8)
    scanax.fit(job.params0(), TX, job.loss_fn, rollout(), steps=16, **kw)
    with pytest.warns(
        RuntimeWarning,
        match="`collect` returns other metrics than the first 2 collections",
    ):
        out = scanax.fit(
            job.params0(),
            TX,
            job.loss_fn,
            rollout(collect=_collect_more),
            steps=32,
            **kw,
        )
    h = out.history
    np.testing.assert_array_equal(h["rollout_step"], [1, 9, 17, 25])
    assert h["rollout_spread"].shape == h["rollout_reward"].shape == (4,)
    assert (
        np.isnan(h["rollout_spread"][:2]).all()
        and np.isfinite(h["rollout_spread"][2:]).all()
    )


@pytest.mark.parametrize(
    "metric, found",
    [("abc", "is str, expected an array"), (jnp.complex64(1 + 2j), "is complex64")],
    ids=["string", "complex"],
)
def test_a_metric_that_is_not_a_real_number_is_refused(metric, found):
    def collect(params, carry, key):
        return (*job.collect(params, carry, key)[:2], {"z": metric})

    with pytest.raises(
        TypeError, match=rf"metric metrics\['z'\] returned by `collect` {found}"
    ):
        _fit(rollout(collect=collect))


def test_an_array_metric_of_collect_is_kept_per_collection(solo):
    """The one metric rule (``_model_step.check_metrics``): an array metric of
    a fixed shape is recorded with its shape, as ``loss_fn``'s and an
    evaluation's are (before: refused as not a scalar)."""

    def collect(params, carry, key):
        batch, s, m = job.collect(params, carry, key)
        return batch, s, {**m, "pair": jnp.stack([m["reward"], 2 * m["reward"]])}

    out = scanax.fit(
        job.params0(), TX, job.loss_fn, rollout(collect=collect), steps=48, key=KEY,
        progress=False,
    )  # fmt: skip
    rewards = solo[0].history["rollout_reward"]
    assert out.history["rollout_pair"].shape == (6, 2)
    np.testing.assert_array_equal(out.history["rollout_reward"], rewards)
    np.testing.assert_array_equal(
        out.history["rollout_pair"], np.stack([rewards, 2 * rewards], 1)
    )


def test_an_init_leaf_that_is_not_an_array_is_refused():
    def init(key):
        return {"s": job.env_reset(key), "name": "cartpole"}

    with pytest.raises(TypeError, match=r"`init` returned str at carry\['name'\]"):
        _fit(rollout(init=init))


def test_python_numbers_in_the_init_carry_are_kept():
    """What ``lax.scan`` takes as a carry leaf (a Python bool/int/float/complex)
    ``init`` may return too."""

    def init(key):
        return {"s": job.env_reset(key), "c": 1j, "n": 3}

    def collect(params, carry, key):
        batch, s, metrics = job.collect(params, carry["s"], key)
        return batch, {**carry, "s": s, "c": carry["c"] * 1j}, metrics

    r = rollout(collect=collect, init=init)
    _fit(r)
    assert complex(r.state.carry["c"]) == 1j * 1j  # (8 steps: one collection)
    assert int(r.state.carry["n"]) == 3
