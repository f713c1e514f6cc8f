"""``scanax.fit(execution=...)``: the stepwise calls against the fused loop (the
same results, bit-identical on CPU, every feature kept), and ``"auto"``'s choice
with measured times injected (never by timing in a test)."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import scanax
from scanax._fit import program as _fit_program, schedule as _fit_schedule

optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

from fit_helpers import (  # noqa: E402
    BS,
    KEY,
    TX,
    X,
    Y,
    eqx_loss,
    eqx_model,
    nnx_loss,
    nnx_pair,
    ts_loss,
    ts_make,
)
from helpers import leaves_equal  # noqa: E402

STEPS = 20
RUN = dict(steps=STEPS, batch_size=BS, key=KEY, steps_per_call=6, progress=False)


@pytest.fixture(autouse=True)
def no_choices_on_disk(monkeypatch):
    """auto keeps its choices on disk next to JAX's compilation cache, which the
    suite's processes keep (conftest.py): here a choice made by one test (measured
    times injected) would be found by the next with the same program. Each test
    starts with none on disk; a test about the disk gives its own directory."""
    monkeypatch.setattr(_fit_schedule, "cache_directory", lambda: None)


def both(make, loss_fn, data=(X, Y), **kw):
    """The fused and the stepwise fit of the same model: ``[(result, objs)]``."""
    out = []
    for execution in ("fused", "stepwise"):
        objs = make()
        result = scanax.fit(*objs, loss_fn, data, **{**RUN, **kw}, execution=execution)
        assert result.execution == execution
        out.append((result, objs))
    return out


def arrays(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def same_history(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("kind", ["nnx", "eqx", "trainstate"])
def test_stepwise_equals_fused_for_every_kind(kind):
    make, loss = {
        "nnx": (nnx_pair, nnx_loss),
        "eqx": (lambda: (eqx_model(), TX), eqx_loss),
        "trainstate": (lambda: (ts_make(), None), ts_loss),
    }[kind]
    (fused, f_objs), (step, s_objs) = both(make, loss)
    same_history(fused.history, step.history)
    leaves_equal(arrays(fused.model), arrays(step.model))
    if kind == "nnx":  # (updated in place)
        leaves_equal(nnx.state(f_objs[0]), nnx.state(s_objs[0]))
        leaves_equal(nnx.state(f_objs[1]), nnx.state(s_objs[1]))
    else:
        leaves_equal(fused.optimizer, step.optimizer)
    assert fused.steps == step.steps == STEPS


def test_stepwise_nan_stop_keeps_the_last_good_state():
    y = Y.at[35].set(jnp.nan)  # (shuffled: met at step 3)
    out = []
    for execution in ("fused", "stepwise"):
        model, opt = nnx_pair()
        with pytest.warns(RuntimeWarning, match=r"scanax\.fit: step \d+ gave a non-f"):
            result = scanax.fit(
                model, opt, nnx_loss, (X, y), **RUN, execution=execution
            )
        out.append((result, nnx.state(model)))
    (fused, fm), (step, sm) = out
    assert 0 < step.steps == fused.steps < STEPS
    same_history(fused.history, step.history)
    leaves_equal(fm, sm)


def test_stepwise_evaluation_early_stop_accumulation_and_ema():
    kw = dict(
        eval_data=(X[:16], Y[:16]),
        eval_every=4,
        stop=scanax.EarlyStop("val_loss", patience=1),
        accumulate=2,
        ema=0.9,
    )
    (fused, _), (step, _) = both(nnx_pair, nnx_loss, **kw)
    same_history(fused.history, step.history)
    assert fused.best_step == step.best_step
    leaves_equal(fused.model, step.model)
    leaves_equal(fused.ema, step.ema)


def test_stepwise_iterable_data_with_in_loop_reports(capsys):
    batches = [(X[i : i + BS], Y[i : i + BS]) for i in range(0, 40, BS)] * 4
    out = []
    for execution in ("fused", "stepwise"):
        model, opt = nnx_pair()
        r = scanax.fit(
            model, opt, nnx_loss, batches, steps=STEPS, steps_per_call=6,
            progress=scanax.Progress(every=2), execution=execution,
        )  # fmt: skip
        out.append((r, nnx.state(model)))
        err = capsys.readouterr().err
        assert f"[{execution}]" in err and f"{STEPS}/{STEPS}" in err
    same_history(out[0][0].history, out[1][0].history)
    leaves_equal(out[0][1], out[1][1])


def test_stepwise_checkpoint_resume_equals_fused_uninterrupted(tmp_path):
    ref, _ = both(nnx_pair, nnx_loss)[0]
    model, opt = nnx_pair()
    kw = {**RUN, "checkpoint_dir": tmp_path, "checkpoint_every": 6}
    scanax.fit(model, opt, nnx_loss, (X, Y), **{**kw, "steps": 12},
               execution="stepwise")  # fmt: skip
    model, opt = nnx_pair()  # a new process: fresh objects, the same directory
    resumed = scanax.fit(model, opt, nnx_loss, (X, Y), **kw, execution="stepwise")
    assert resumed.steps == STEPS
    leaves_equal(ref.model, resumed.model)
    same_history(ref.history, resumed.history)  # (the restored steps too)


def make_member(key, lr):
    model = nnx_pair()[0]
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def test_stepwise_population_equals_fused():
    lrs = np.array([1e-3, 1e-2, 3e-2], np.float32)
    y = Y.at[7].set(jnp.nan)  # a member that meets it stops alone
    out = []
    for execution in ("fused", "stepwise"):
        pop = scanax.population(make_member, 3, key=KEY, lr=lrs)
        with pytest.warns(RuntimeWarning):
            r = scanax.fit(pop, None, nnx_loss, (X, y), **RUN, execution=execution)
        assert r.execution == execution
        out.append((r, [nnx.state(r.model[i]) for i in range(3)]))
    (fused, fm), (step, sm) = out
    np.testing.assert_array_equal(fused.steps, step.steps)
    same_history(fused.history, step.history)
    for a, b in zip(fm, sm):
        leaves_equal(a, b)


def _actor_critic(key):
    k1, k2, k3 = jr.split(key, 3)
    init = jax.nn.initializers.lecun_normal()
    params = {"w": init(k1, (4, 8)), "b": jnp.zeros(8), "pi": 0.01 * init(k2, (8, 2)),
              "v": init(k3, (8, 1))}  # fmt: skip
    return params, optax.adam(1e-2)


def _ppo_loss(params, mb):
    """PPO's clipped actor, clipped critic and entropy, normalised advantages."""
    h = jnp.tanh(mb["obs"] @ params["w"] + params["b"])
    logits, value = h @ params["pi"], (h @ params["v"])[:, 0]
    logp_all = jax.nn.log_softmax(logits)
    logp = logp_all[jnp.arange(mb["act"].shape[0]), mb["act"]]
    ratio = jnp.exp(logp - mb["logp"])
    adv = (mb["adv"] - mb["adv"].mean()) / (mb["adv"].std() + 1e-8)
    actor = -jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv).mean()
    v_clip = mb["value"] + jnp.clip(value - mb["value"], -0.2, 0.2)
    target = mb["target"]
    critic = 0.5 * jnp.maximum((value - target) ** 2, (v_clip - target) ** 2).mean()
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
    return actor + 0.5 * critic - 0.01 * entropy


def test_stepwise_population_of_ppo_agents_equals_fused():
    """A population's step in a ``lax.cond`` compiled differently from the
    loop body (the last bits of member 0's Adam moments differed, a reviewer's
    case); each stepwise step is now a one-step ``while_loop`` of the fused
    loop's own body."""
    k = jr.split(jr.key(4), 4)
    data = {"obs": jr.normal(k[0], (16, 4)), "act": jr.bernoulli(k[1], 0.5, (16,)).astype(jnp.int32),
            "logp": jnp.full((16,), -0.69), "adv": jr.normal(k[2], (16,)),
            "value": 0.1 * jr.normal(k[3], (16,))}  # fmt: skip
    data["target"] = data["adv"] + data["value"]
    out = []
    for execution in ("fused", "stepwise"):
        pop = scanax.population(_actor_critic, 3, key=jr.key(0))
        r = scanax.fit(pop, None, _ppo_loss, data, steps=12, batch_size=8, key=jr.key(1),
                       progress=False, execution=execution)  # fmt: skip
        out.append((r, pop))
    (fused, fp), (step, sp) = out
    same_history(fused.history, step.history)
    for a, b in zip(fp.state, sp.state, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
def test_stepwise_on_a_mesh_equals_fused():
    mesh = jax.make_mesh((4,), ("data",))
    (fused, _), (step, _) = both(nnx_pair, nnx_loss, mesh=mesh)
    same_history(fused.history, step.history)
    leaves_equal(fused.model, step.model)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
def test_stepwise_population_on_a_members_mesh_equals_fused():
    mesh = jax.make_mesh((4,), ("members",))
    lrs = np.array([1e-3, 3e-3, 1e-2, 3e-2], np.float32)
    out = []
    for execution in ("fused", "stepwise"):
        pop = scanax.population(make_member, 4, key=KEY, lr=lrs)
        r = scanax.fit(pop, None, nnx_loss, (X, Y), **RUN, mesh=mesh,
                       execution=execution)  # fmt: skip
        out.append(r)
    same_history(out[0].history, out[1].history)
    for i in range(4):
        leaves_equal(nnx.state(out[0].model[i]), nnx.state(out[1].model[i]))


def test_stepwise_rollout_equals_fused():
    def init(key):
        return jr.normal(key, (3,))

    def collect(model, carry, key):
        x = carry + jr.normal(key, (BS, 3))
        return (x, jnp.sin(x[:, :1])), carry * 0.9, {"level": jnp.mean(x)}

    roll = lambda: scanax.Rollout(collect, init, epochs=2, minibatches=2)
    out = []
    for execution in ("fused", "stepwise"):
        model, opt = nnx_pair()
        r = scanax.fit(model, opt, nnx_loss, roll(), steps=12, key=KEY,
                       progress=False, execution=execution)  # fmt: skip
        out.append((r, nnx.state(model)))
    same_history(out[0][0].history, out[1][0].history)
    leaves_equal(out[0][1], out[1][1])


# ---------------------------------------------------------------------------- auto


def test_choose_and_worth_a_trial(monkeypatch):
    # Measured on this machine's CPU (issue 28, without the conv rewrite): a
    # small CNN's Adam step takes ~11 ms inside a loop and ~0.9 ms dispatched;
    # the tiny MLP's ~5 us fused and ~60 us dispatched.
    monkeypatch.setattr(_fit_schedule, "cores", lambda: 8)  # (trials allowed)
    assert _fit_schedule.choose(fused=11e-3, stepwise=0.9e-3) == "stepwise"
    assert _fit_schedule.choose(fused=5e-6, stepwise=60e-6) == "fused"
    assert _fit_schedule.choose(fused=1.0, stepwise=0.95) == "fused"  # the margin
    assert not _fit_schedule.worth_a_trial(5e-6, 1000, 0.3)
    assert _fit_schedule.worth_a_trial(1e-3, 10_000, 0.5)
    assert not _fit_schedule.worth_a_trial(1e-3, 10_000, 5.0)  # a costly compile
    assert not _fit_schedule.worth_a_trial(2e-4, 10**7, 0.1)  # dispatch would cost


@pytest.mark.parametrize(
    "platform, cores, tried",
    [("cpu", 2, False), ("cpu", 1, False), ("cpu", 4, True), ("gpu", 2, True)],
)
def test_no_trial_where_its_compile_takes_a_core_from_training(
    monkeypatch, platform, cores, tried
):
    """Issue 38: on a CPU of two cores, the trial's compile on another thread
    took a core from the training it measured (the Flax NNX tutorial's CNN:
    1.07-1.20x a fused first fit, a 5.4-5.6 s compile to keep fused). There,
    auto stays fused with no trial; on more cores, or where the steps run on
    an accelerator, the trial runs as before."""
    monkeypatch.setattr(_fit_schedule._backend, "platform", lambda: platform)
    monkeypatch.setattr(_fit_schedule, "cores", lambda: cores)
    assert _fit_schedule.worth_a_trial(1e-3, 10_000, 0.5) is tried
    exe = _fit_schedule.Execution(_fit_program.Program(lambda *a: None), "auto")
    started = []
    monkeypatch.setattr(exe, "_start_trial", lambda args: started.append(args))
    exe.ran("fused", 145, 1.45)  # 10 ms a step over a long call
    run = type("Run", (), {"end": 100_000, "done": 145})()
    assert exe.next_mode(run, None) == "fused"
    assert bool(started) is tried


class Injected:
    """``Execution.ran`` given these seconds per step instead of the clock's,
    and trials forced (every run is long enough)."""

    def __init__(self, monkeypatch, fused, stepwise):
        self.per_step = {"fused": fused, "stepwise": stepwise}
        self.calls = []
        ran = _fit_schedule.Execution.ran

        def fake(execution, mode, steps, seconds):
            self.calls.append(mode)
            ran(execution, mode, steps, self.per_step[mode] * steps)

        monkeypatch.setattr(_fit_schedule.Execution, "ran", fake)
        monkeypatch.setattr(_fit_schedule, "worth_a_trial", lambda *a: True)
        monkeypatch.setattr(_fit_schedule, "_MIN_CALL_SECONDS", 0.0)
        # (the trial's compile, on another thread, done before the next call)
        monkeypatch.setattr(_fit_schedule.concurrent.futures, "ThreadPoolExecutor",
                            Synchronous)  # fmt: skip


class Synchronous:
    """A pool running what is submitted at once."""

    def __init__(self, workers):
        pass

    def submit(self, fn):
        future = _fit_schedule.concurrent.futures.Future()
        future.set_result(fn())
        return future

    def shutdown(self, wait=True):
        pass


def forget_programs():
    _fit_program.PROGRAMS.clear()  # (a choice is kept with its program)


@pytest.mark.parametrize(
    "times, chosen",
    [((11e-3, 0.9e-3), "stepwise"), ((5e-6, 60e-6), "fused")],
    ids=["cnn-like", "tiny-mlp-like"],
)
def test_auto_chooses_by_measured_times(monkeypatch, times, chosen):
    forget_programs()
    injected = Injected(monkeypatch, *times)
    ref, _ = both(nnx_pair, nnx_loss, steps=48)[0]
    forget_programs()
    injected.calls.clear()
    model, opt = nnx_pair()
    r = scanax.fit(model, opt, nnx_loss, (X, Y), **{**RUN, "steps": 48})
    assert r.execution == chosen
    assert injected.calls[0] == "fused" and "stepwise" in injected.calls
    trial = injected.calls.index("stepwise")
    assert set(injected.calls[trial + 1 :]) <= {chosen}
    # the same results as fused alone, across the switch
    same_history(ref.history, r.history)
    leaves_equal(ref.model, nnx.state(model))
    # a second fit of the same structure starts with the choice: no new trial
    injected.calls.clear()
    r2 = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 12})
    assert r2.execution == chosen and set(injected.calls) == {chosen}
    forget_programs()


def test_a_program_found_compiled_still_counts_its_compile_for_a_trial(monkeypatch):
    """A second ``fit`` finds the fused program compiled (no compile now), but a
    trial would compile the stepwise programs, about as long as the fused one
    took: the trial's threshold keeps that cost (before, a found program counted
    as free, and a short second run of a slow-to-compile PPO population started
    a 20 s compile on a thread, slowing that run and the next)."""
    forget_programs()
    scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 12})
    (program,) = _fit_program.PROGRAMS.values()
    assert program.compile_seconds > 0
    program.compile_seconds = 100.0  # (a slow compile, as the PPO population's)
    calls = []
    ran = _fit_schedule.Execution.ran

    def two_ms(execution, mode, steps, seconds):  # 48 steps: ~0.1 s left
        calls.append(mode)
        ran(execution, mode, steps, 2e-3 * steps)

    monkeypatch.setattr(_fit_schedule.Execution, "ran", two_ms)
    monkeypatch.setattr(_fit_schedule, "cores", lambda: 8)  # (trials allowed)
    monkeypatch.setattr(_fit_schedule, "_TRIAL_SECONDS", 0.01)
    monkeypatch.setattr(_fit_schedule, "_MIN_CALL_SECONDS", 0.0)
    monkeypatch.setattr(_fit_schedule.concurrent.futures, "ThreadPoolExecutor",
                        Synchronous)  # fmt: skip
    r = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 48})
    assert r.execution == "fused" and set(calls) == {"fused"}  # no trial
    program.compile_seconds = 1e-4  # (a cheap compile: the same run tries)
    r = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 48})
    assert "stepwise" in calls
    forget_programs()


def test_a_short_first_call_does_not_start_a_trial(monkeypatch):
    """The first fused calls are small, and a rollout's collection makes one
    step of each period slow: a call under ``_MIN_CALL_SECONDS`` says little of
    the run's steps (a PPO population's first call of 8 steps measured 11 ms a
    step, its long calls 1.1 ms, and started a trial that a 1.1 ms step did not
    warrant). The trial waits for a long call's time."""
    monkeypatch.setattr(_fit_schedule, "cores", lambda: 8)  # (trials allowed)
    exe = _fit_schedule.Execution(_fit_program.Program(lambda *a: None), "auto")
    exe.compile_seconds = 5.0
    run = type("Run", (), {"end": 15_600, "done": 8})()
    started = []
    monkeypatch.setattr(exe, "_start_trial", lambda args: started.append(args))
    exe.ran("fused", 8, 0.087)  # 10.9 ms a step, over 0.09 s: not counted
    assert exe.next_mode(run, None) == "fused" and not started
    exe.ran("fused", 145, 0.16)  # 1.1 ms a step: 17 s left, under 10x the compile
    assert exe.next_mode(run, None) == "fused" and not started
    exe.ran("fused", 145, 1.45)  # 10 ms a step over a long call: worth a trial
    exe.next_mode(run, None)
    assert started


def test_auto_choice_kept_on_disk_with_the_compile_cache(monkeypatch, tmp_path):
    forget_programs()
    Injected(monkeypatch, 11e-3, 0.9e-3)
    monkeypatch.setattr(_fit_schedule, "cache_directory", lambda: str(tmp_path))
    r = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 48})
    assert r.execution == "stepwise"
    files = list((tmp_path / "scanax-execution").iterdir())
    assert len(files) == 1 and files[0].read_text() == "stepwise"
    forget_programs()  # a new process: nothing in memory, the file on disk
    monkeypatch.setattr(_fit_schedule, "worth_a_trial", lambda *a: False)
    r2 = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 12})
    assert r2.execution == "stepwise"
    forget_programs()


def test_a_corrupt_choice_file_is_ignored(monkeypatch, tmp_path):
    forget_programs()
    Injected(monkeypatch, 11e-3, 0.9e-3)
    monkeypatch.setattr(_fit_schedule, "cache_directory", lambda: str(tmp_path))
    scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 48})
    (path,) = (tmp_path / "scanax-execution").iterdir()
    path.write_bytes(b"\xff\xfe\x00")
    forget_programs()
    monkeypatch.setattr(_fit_schedule, "worth_a_trial", lambda *a: False)
    r = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **{**RUN, "steps": 12})
    assert r.execution == "fused"  # (no choice read: fused, no trial)
    forget_programs()


def test_auto_without_a_trial_is_fused():
    r = scanax.fit(*nnx_pair(), nnx_loss, (X, Y), **RUN)
    assert r.execution == "fused"


@pytest.mark.parametrize("bad", ["fast", 1, None])
def test_unknown_execution(bad):
    model, opt = nnx_pair()
    before = jax.tree.map(np.asarray, nnx.state(model))
    kind = ValueError if isinstance(bad, str) else TypeError
    with pytest.raises(kind, match=r"^scanax\.fit: `execution` must be one of 'a"):
        scanax.fit(model, opt, nnx_loss, (X, Y), **RUN, execution=bad)
    leaves_equal(before, nnx.state(model))


def test_auto_is_fused_across_processes(monkeypatch):
    """Each process's timings are its own; the processes of a job must run the
    same programs: no trial, no choice read."""
    monkeypatch.setattr(_fit_schedule.jax, "process_count", lambda: 2)
    program = _fit_program.Program(lambda *a: None)
    program.choice = "stepwise"  # (even a choice made before)
    execution = _fit_schedule.Execution(program, "auto")
    assert execution.mode == "fused" and not execution.deciding
    assert _fit_schedule.Execution(program, "stepwise").mode == "stepwise"
