"""Nothing lost, nothing changed by a refusal: the seams of ``scanax.fit`` between
calls, restarts, checkpoints, logs and refusals, each against an uninterrupted
run or the files and objects as they were before the call."""

import os
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from fit_helpers import (
    BS,
    KEY,
    TX,
    X,
    Y,
    eqx_loss,
    eqx_model,
    nnx,
    nnx_loss,
    nnx_pair,
    optax,
    ts_loss,
    ts_make,
)
from helpers import leaves_equal, read_csv, read_tensorboard

import scanax


def snapshot(path):
    """Every file under ``path`` (or the file itself) with its bytes; None when
    it does not exist."""
    path = str(path)
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def fit_quiet(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return scanax.fit(*args, **kwargs)


# --------------------------------------------------------------- 1. epoch loop logs


def epoch_loop(directory, sinks, calls):
    """The documented epoch loop: one checkpoint_dir, one set of sinks, a fit of
    20 steps per call; a new model each time the script starts."""
    model, optimizer = nnx_pair()
    for _ in range(calls):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "already holds step"
            fit_quiet(
                model,
                optimizer,
                nnx_loss,
                (X, Y),
                steps=20,
                batch_size=BS,
                key=KEY,
                checkpoint_dir=directory,
                log=sinks(),
                log_every=10,
            )
    return model


@pytest.mark.parametrize("tensorboard", [False, True], ids=["csv", "csv+tensorboard"])
def test_epoch_loop_restarted_from_the_top_logs_each_step_once(tmp_path, tensorboard):
    """Killed after call 2 and run again from the top: the CSV (and TensorBoard)
    rows equal an uninterrupted run's, every step once."""
    if tensorboard:
        pytest.importorskip("tensorboardX")

    def sinks_in(where):
        def sinks():
            out = [scanax.CSV(where / "m.csv")]
            if tensorboard:
                out.append(scanax.TensorBoard(where / "tb"))
            return out

        return sinks

    whole, broken = tmp_path / "whole", tmp_path / "broken"
    reference = epoch_loop(whole / "ck", sinks_in(whole), 3)
    epoch_loop(broken / "ck", sinks_in(broken), 2)  # then killed
    restarted = epoch_loop(broken / "ck", sinks_in(broken), 3)  # from the top

    leaves_equal(nnx.state(restarted), nnx.state(reference))
    want = read_csv(whole / "m.csv")
    assert [int(r["step"]) for r in want] == [10, 20, 30, 40, 50, 60]
    assert read_csv(broken / "m.csv") == want
    if tensorboard:
        assert read_tensorboard(broken / "tb") == read_tensorboard(whole / "tb")


def test_an_epoch_loop_longer_than_the_checkpoints_kept_restarts_from_the_top(
    tmp_path,
):
    """Each call's last checkpoint is kept (besides the newest 3): a loop of 5
    calls killed after 4 and run again from the top restores every call's end."""
    sinks_whole = lambda: [scanax.CSV(tmp_path / "whole.csv")]  # noqa: E731
    sinks_broken = lambda: [scanax.CSV(tmp_path / "broken.csv")]  # noqa: E731
    reference = epoch_loop(tmp_path / "whole", sinks_whole, 5)
    epoch_loop(tmp_path / "broken", sinks_broken, 4)
    restarted = epoch_loop(tmp_path / "broken", sinks_broken, 5)
    leaves_equal(nnx.state(restarted), nnx.state(reference))
    assert read_csv(tmp_path / "broken.csv") == read_csv(tmp_path / "whole.csv")
    steps = sorted(int(e) for e in os.listdir(tmp_path / "broken") if e.isdigit())
    assert steps == [20, 40, 60, 80, 100]


def test_an_epoch_loop_with_early_stops_restarts_from_the_top(tmp_path):
    """Calls that stop early: a restarted call resumes from its own end, not
    from a later call's checkpoint that lies within its steps."""
    stop = scanax.EarlyStop("val_mae", patience=1, min_delta=0.05)

    def loop(directory, calls):
        model, optimizer = nnx_pair()
        out = []
        for _ in range(calls):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                res = fit_quiet(
                    model,
                    optimizer,
                    nnx_loss,
                    (X, Y),
                    steps=40,
                    batch_size=BS,
                    key=KEY,
                    eval_data=(X, Y),
                    eval_every=5,
                    stop=stop,
                    checkpoint_dir=directory,
                    log=scanax.CSV(directory / "m.csv"),
                )
            out.append((int(optimizer.step[...]), res.best_step))
        return model, out

    reference, ref_steps = loop(tmp_path / "whole", 3)
    assert ref_steps[0][0] < 40  # the first call stopped early
    loop(tmp_path / "broken", 2)
    restarted, steps = loop(tmp_path / "broken", 3)
    assert steps[-1] == ref_steps[-1]
    leaves_equal(nnx.state(restarted), nnx.state(reference))
    assert read_csv(tmp_path / "broken" / "m.csv") == read_csv(
        tmp_path / "whole" / "m.csv"
    )


# ------------------------------------------------ 2. a checkpoint before evaluating


@pytest.mark.filterwarnings("ignore:.*first at step:UserWarning")  # (on purpose)
def test_a_checkpoint_before_the_first_evaluation_saves_and_resumes(tmp_path):
    """checkpoint_every < eval_every: the first checkpoints hold an empty
    validation history; a run resumed from one equals an uninterrupted run."""
    kwargs = dict(
        batch_size=BS,
        key=KEY,
        eval_data=(X, Y),
        eval_every=10,
        steps_per_call=5,
    )
    model, optimizer = nnx_pair()
    ref = fit_quiet(model, optimizer, nnx_loss, (X, Y), steps=15, **kwargs)

    directory = tmp_path / "ck"
    first, first_opt = nnx_pair()
    res = fit_quiet(
        first,
        first_opt,
        nnx_loss,
        (X, Y),
        steps=5,
        checkpoint_dir=directory,
        checkpoint_every=5,
        **kwargs,
    )
    assert res.history["val_step"].tolist() == []
    assert int(first_opt.step[...]) == 5
    entries = sorted(os.listdir(directory))
    assert entries == ["5", "scanax-calls.json"]  # no temporary folder left

    again, again_opt = nnx_pair()  # a new process: resumes from step 5
    out = fit_quiet(
        again,
        again_opt,
        nnx_loss,
        (X, Y),
        steps=15,
        checkpoint_dir=directory,
        checkpoint_every=5,
        **kwargs,
    )
    leaves_equal(nnx.state(again), nnx.state(model))
    for name in ("step", "loss", "val_step", "val_loss"):
        np.testing.assert_array_equal(out.history[name], ref.history[name])


@pytest.mark.filterwarnings("ignore:.*first at step:UserWarning")  # (on purpose)
def test_a_checkpoint_of_a_training_metric_early_stop_before_its_first_check(
    tmp_path,
):
    """EarlyStop on a training metric without eval_data, checkpointed before
    its first check, resumes exactly (its kept best state included)."""
    stop = scanax.EarlyStop("loss", patience=100)
    kwargs = dict(batch_size=BS, key=KEY, eval_every=10, stop=stop, steps_per_call=5)
    model, optimizer = nnx_pair()
    ref = fit_quiet(model, optimizer, nnx_loss, (X, Y), steps=15, **kwargs)
    directory = tmp_path / "ck"
    fit_quiet(
        *nnx_pair(),
        nnx_loss,
        (X, Y),
        steps=5,
        checkpoint_dir=directory,
        checkpoint_every=5,
        **kwargs,
    )
    again, again_opt = nnx_pair()
    out = fit_quiet(
        again,
        again_opt,
        nnx_loss,
        (X, Y),
        steps=15,
        checkpoint_dir=directory,
        **kwargs,
    )
    leaves_equal(nnx.state(again), nnx.state(model))
    assert out.best_step == ref.best_step == 10


@pytest.mark.filterwarnings("ignore:.*first at step:UserWarning")  # (on purpose)
def test_a_population_checkpoint_before_the_first_evaluation(tmp_path):
    def population():
        return scanax.population(
            make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 3e-2])
        )

    kwargs = dict(
        batch_size=BS, key=KEY, eval_data=(X, Y), eval_every=10, steps_per_call=5
    )
    whole = population()
    ref = fit_quiet(whole, None, eqx_loss, (X, Y), steps=15, **kwargs)
    directory = tmp_path / "ck"
    fit_quiet(
        population(),
        None,
        eqx_loss,
        (X, Y),
        steps=5,
        checkpoint_dir=directory,
        checkpoint_every=5,
        **kwargs,
    )
    again = population()
    out = fit_quiet(
        again, None, eqx_loss, (X, Y), steps=15, checkpoint_dir=directory, **kwargs
    )
    leaves_equal(list(again.state), list(whole.state))
    np.testing.assert_array_equal(out.history["val_loss"], ref.history["val_loss"])


def make_member(key, lr):
    import equinox as eqx

    return eqx.nn.MLP(3, 1, 8, 1, key=key), optax.adam(lr)


# ---------------------------------------------- 3. a refusal while tracing changes nothing


def vector_loss(model, batch):
    x, y = batch
    return (model(x) - y) ** 2  # not a scalar


def vector_eval(model, batch):
    x, y = batch
    return jnp.abs(model(x) - y)  # not a scalar


def complex_metric_loss(model, batch):
    loss, extra = nnx_loss(model, batch)
    return loss, {"z": jax.lax.complex(extra["mae"], extra["mae"])}


def per_example_eval(model, batch):
    x, y = batch
    return nnx_loss(model, batch)[0], {"err": model(x) - y}


REFUSED_WHILE_TRACING = {
    "unknown monitor": (
        dict(stop=scanax.EarlyStop("val_nothing", patience=1), eval_data=(X, Y)),
        nnx_loss,
        ValueError,
        "val_nothing",
    ),
    "eval_fn vector": (
        dict(eval_data=(X, Y), eval_fn=vector_eval),
        nnx_loss,
        TypeError,
        "eval_fn",
    ),
    "loss_fn vector": (dict(), vector_loss, TypeError, "loss_fn"),
    # issue 38: the metric rule, and evaluation data unlike what is read
    "complex metric": (dict(), complex_metric_loss, TypeError, r"complex64\[\]"),
    "per-example eval metric": (
        dict(eval_data=(X, Y), eval_fn=per_example_eval, eval_batch_size=10),
        nnx_loss,
        ValueError,
        "shape depends on the batch size",
    ),
    "eval_data structure": (
        dict(eval_data={"x": X, "y": Y}),
        nnx_loss,
        TypeError,
        "`loss_fn` raised TypeError while it was traced on a batch of `eval_data`",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_WHILE_TRACING))
@pytest.mark.parametrize("directory_exists", [False, True])
def test_a_refusal_while_tracing_changes_no_file_and_no_model(
    tmp_path, case, directory_exists
):
    options, loss_fn, error, match = REFUSED_WHILE_TRACING[case]
    if "eval_data" in options:
        options = {"eval_every": 5, **options}
    log = tmp_path / "m.csv"
    log.write_text("step,loss\n10,0.5\n20,0.25\n")
    directory = tmp_path / "ck"
    if directory_exists:  # written by the same run without its mistake
        good = {}
        if "stop" in options:
            good = dict(stop=scanax.EarlyStop("val_loss", patience=1), eval_every=5)
            good["eval_data"] = (X, Y)
        with warnings.catch_warnings():  # (4 steps: no evaluation, on purpose)
            warnings.filterwarnings("ignore", ".*first at step", UserWarning)
            fit_quiet(
                *nnx_pair(1),
                nnx_loss,
                (X, Y),
                steps=4,
                batch_size=BS,
                key=KEY,
                checkpoint_dir=directory,
                **good,
            )
        (directory / "6.orbax-checkpoint-tmp-1").mkdir()  # a killed save's leftover
    model, optimizer = nnx_pair()
    before = (snapshot(log), snapshot(directory), jax.device_get(nnx.state(model)))
    opt_before = jax.device_get(nnx.state(optimizer))
    with pytest.raises(error, match=match):
        fit_quiet(
            model,
            optimizer,
            loss_fn,
            (X, Y),
            steps=8,
            batch_size=BS,
            key=KEY,
            checkpoint_dir=directory,
            checkpoint_every=4,
            log=scanax.CSV(log),
            **options,
        )
    assert snapshot(log) == before[0]
    assert snapshot(directory) == before[1]
    leaves_equal(nnx.state(model), before[2])
    leaves_equal(nnx.state(optimizer), opt_before)


def test_an_unwritable_log_path_is_refused_before_the_first_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model, optimizer = nnx_pair()
    before = jax.device_get(nnx.state(model))
    with pytest.raises(scanax.SinkError, match="a-file") as info:
        fit_quiet(
            model,
            optimizer,
            nnx_loss,
            (X, Y),
            steps=8,
            batch_size=BS,
            log=scanax.CSV(blocker / "m.csv"),
        )
    assert info.value.result is None  # nothing trained
    assert int(optimizer.step[...]) == 0
    leaves_equal(nnx.state(model), before)


# ------------------------------------------------------------- 5. the key has one home


def keyed_loss(model, batch, key):
    x, y = batch
    noise = 0.1 * jr.normal(key, y.shape)
    return jnp.mean((model(x) - y - noise) ** 2)


def resumed(make, loss, saved_key, given_key, directory, **kwargs):
    """An uninterrupted 8-step run with ``saved_key``, and the same run saved
    at step 4 then resumed to step 8 by a call given ``given_key``:
    ``(whole, ref, again, out)``, each run's objects and result (``make()``:
    a fit's first two arguments)."""
    whole = make()
    ref = fit_quiet(*whole, loss, (X, Y), steps=8, key=saved_key, **kwargs)
    kwargs["checkpoint_dir"] = directory
    fit_quiet(*make(), loss, (X, Y), steps=4, key=saved_key, **kwargs)
    again = make()
    out = fit_quiet(*again, loss, (X, Y), steps=8, key=given_key, **kwargs)
    return whole, ref, again, out


def test_a_resume_with_another_key_uses_the_saved_key_for_everything(tmp_path):
    """Saved at step 4 with key 1, resumed to step 8 with key 2: the shuffle and
    the per-step keys both continue key 1's run (docs/checkpoint.md)."""
    with pytest.warns(RuntimeWarning, match="a run given another key="):
        (model, _), ref, (again, _), out = resumed(
            nnx_pair, keyed_loss, jr.key(1), jr.key(2), tmp_path / "ck",
            batch_size=BS, steps_per_call=4,
        )  # fmt: skip
    leaves_equal(nnx.state(again), nnx.state(model))
    np.testing.assert_array_equal(out.history["loss"], ref.history["loss"])


def test_a_population_with_shared_batches_resumes_with_the_saved_shuffle(tmp_path):
    def population():
        pop = scanax.population(
            make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 3e-2])
        )
        return pop, None

    with pytest.warns(RuntimeWarning, match="a run given another key="):
        (whole, _), ref, (again, _), out = resumed(
            population, eqx_loss, jr.key(1), jr.key(2), tmp_path / "ck",
            batch_size=BS, shared_batches=True, steps_per_call=4,
        )  # fmt: skip
    leaves_equal(list(again.state), list(whole.state))
    np.testing.assert_array_equal(out.history["loss"], ref.history["loss"])


def test_a_resume_with_a_key_of_another_implementation_is_refused(tmp_path):
    directory = tmp_path / "ck"
    fit_quiet(
        *nnx_pair(),
        keyed_loss,
        (X, Y),
        steps=4,
        batch_size=BS,
        key=jr.key(1, impl="rbg"),
        checkpoint_dir=directory,
    )
    before = snapshot(directory)
    model, optimizer = nnx_pair()
    with pytest.raises(ValueError, match=r"key<rbg>.*key<threefry2x32>"):
        fit_quiet(
            model,
            optimizer,
            keyed_loss,
            (X, Y),
            steps=8,
            batch_size=BS,
            key=jr.key(1),
            checkpoint_dir=directory,
        )
    assert snapshot(directory) == before
    assert int(optimizer.step[...]) == 0


@pytest.mark.parametrize("saved, given", [("typed", "raw"), ("raw", "typed")])
def test_a_resume_with_a_raw_key_of_a_typed_one_is_the_same_run(tmp_path, saved, given):
    """jax.random.PRNGKey(1) and jax.random.key(1) hold the same bits: a run
    saved with one resumes with the other and ends as the run never stopped
    (before: refused as "another PRNG implementation")."""
    make = {"typed": lambda: jr.key(1), "raw": lambda: jr.PRNGKey(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no other-key warning either)
        (model, _), ref, (again, _), out = resumed(
            nnx_pair, keyed_loss, make[saved](), make[given](), tmp_path / "ck",
            batch_size=BS,
        )  # fmt: skip
    np.testing.assert_array_equal(out.history["loss"], ref.history["loss"])
    leaves_equal(nnx.state(again), nnx.state(model))


# ------------------------------------------------------------------ 7. keys as jax's


BAD_KEYS = {
    "int": 0,
    "float": 1.5,
    "string": "abc",
    "float array": jnp.array([1.0, 2.0]),
    "uint32[3]": jnp.zeros(3, jnp.uint32),
    "int32[2]": jnp.zeros(2, jnp.int32),
    "three keys": jr.split(jr.key(0), 3),
    "three raw keys": jr.split(jr.PRNGKey(0), 3),
}


@pytest.mark.parametrize("name", list(BAD_KEYS))
@pytest.mark.parametrize("population", [False, True], ids=["solo", "population"])
def test_a_bad_key_is_refused_naming_key(name, population):
    if population:
        pop = scanax.population(
            make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 2e-2])
        )
        args = (pop, None, eqx_loss)
    else:
        args = (*nnx_pair(), nnx_loss)
    with pytest.raises(TypeError, match=r"scanax.fit: `key` .*jax.random.key"):
        fit_quiet(*args, (X, Y), steps=2, batch_size=BS, key=BAD_KEYS[name])


def test_a_raw_uint32_key_is_the_typed_key_with_its_data():
    results = []
    for key in (jr.key(3), jr.PRNGKey(3)):
        model, optimizer = nnx_pair()
        results.append(
            fit_quiet(
                model, optimizer, keyed_loss, (X, Y), steps=8, batch_size=BS, key=key
            )
        )
        results.append(nnx.state(model))
    np.testing.assert_array_equal(
        results[0].history["loss"], results[2].history["loss"]
    )
    leaves_equal(results[1], results[3])


# -------------------------------------------- 11. repeated calls of any optimizer


@pytest.mark.parametrize(
    "tx",
    [
        optax.sgd(0.05),
        optax.sgd(0.05, momentum=0.9),
        pytest.param(
            optax.MultiSteps(TX, 2),
            marks=pytest.mark.standard_promotion("optax's MultiSteps mixes dtypes"),
        ),
    ],
    ids=["sgd", "momentum", "multisteps"],
)
def test_ten_calls_equal_one_for_optimizers_that_keep_no_count(tx):
    model = eqx_model()
    once = fit_quiet(
        model, tx, eqx_loss, (X, Y), steps=20, batch_size=BS, key=KEY, steps_per_call=4
    )
    params, opt_state = model, None
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "keeps no step count" warning
        for _ in range(10):
            res = fit_quiet(
                params,
                tx,
                eqx_loss,
                (X, Y),
                steps=2,
                batch_size=BS,
                key=KEY,
                opt_state=opt_state,
            )
            params, opt_state = res.model, res.optimizer
            losses.append(res.history["loss"])
    leaves_equal(eqx_filter_params(params), eqx_filter_params(once.model))
    leaves_equal(opt_state, once.optimizer)
    np.testing.assert_array_equal(np.concatenate(losses), once.history["loss"])


def test_the_counted_state_continues_with_the_documented_chain():
    """The state fit returns for a transform without a step count is the state
    of ``optax.chain(tx, optax.scale_by_schedule(lambda step: 1.0))``: an optax
    user can continue by hand with it."""
    tx = optax.sgd(0.05)
    res = fit_quiet(eqx_model(), tx, eqx_loss, (X, Y), steps=3, batch_size=BS)
    chained = optax.chain(tx, optax.scale_by_schedule(lambda step: 1.0))
    want = chained.init(eqx_filter_params(res.model))
    assert jax.tree.structure(res.optimizer) == jax.tree.structure(want)
    assert int(res.optimizer[1].count) == 3
    # One more step by hand with that chain equals fit's fourth step (data in
    # order without a key: step 3 takes rows 24-31).
    import equinox as eqx

    params, static = eqx.partition(res.model, eqx.is_inexact_array)
    batch = (X[3 * BS : 4 * BS], Y[3 * BS : 4 * BS])
    grads = jax.grad(lambda p: eqx_loss(eqx.combine(p, static), batch))(params)
    updates, state = chained.update(grads, res.optimizer, params)
    by_hand = eqx.combine(optax.apply_updates(params, updates), static)
    four = fit_quiet(eqx_model(), tx, eqx_loss, (X, Y), steps=4, batch_size=BS)
    close_leaves = eqx_filter_params(by_hand), eqx_filter_params(four.model)
    for a, b in zip(*(jax.tree.leaves(t) for t in close_leaves)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(state[1].count) == int(four.optimizer[1].count) == 4


def eqx_filter_params(model):
    import equinox as eqx

    return eqx.filter(model, eqx.is_inexact_array)


# ------------------------------------------------- 12. early stop keeps counting


@pytest.mark.parametrize("kind", ["nnx", "optax", "trainstate"])
def test_after_restoring_the_best_the_next_call_continues_after_the_last_step(kind):
    """EarlyStop restores the best model but its step count keeps counting: the
    next call continues the data order after the last step run."""
    stop = scanax.EarlyStop("val_loss", patience=1, min_delta=10.0)  # stops early
    kwargs = dict(batch_size=BS, key=KEY, eval_data=(X, Y), eval_every=4)
    if kind == "nnx":
        model, optimizer = nnx_pair()
        args, loss = (model, optimizer), nnx_loss
    elif kind == "optax":
        args, loss = (eqx_model(), TX), eqx_loss
    else:
        args, loss = (ts_make(), None), ts_loss
    res = fit_quiet(*args, loss, (X, Y), steps=40, stop=stop, **kwargs)
    last = int(res.history["step"][-1])
    assert res.best_step == 4 and last == 8
    if kind == "nnx":
        assert int(optimizer.step[...]) == last
        after = fit_quiet(model, optimizer, loss, (X, Y), steps=3, **kwargs)
    elif kind == "optax":
        after = fit_quiet(
            res.model, TX, loss, (X, Y), steps=3, opt_state=res.optimizer, **kwargs
        )
    else:
        assert int(res.model.step) == last
        after = fit_quiet(res.model, None, loss, (X, Y), steps=3, **kwargs)
    assert after.history["step"].tolist() == [last + 1, last + 2, last + 3]


# ---------------------------------------------- 13. every checkpoint unreadable


def test_when_no_checkpoint_is_readable_the_warning_says_training_starts_over(
    tmp_path,
):
    directory = tmp_path / "ck"
    fit_quiet(
        *nnx_pair(),
        nnx_loss,
        (X, Y),
        steps=8,
        batch_size=BS,
        checkpoint_dir=directory,
        checkpoint_every=4,
    )
    for step in ("4", "8"):
        for root, _, files in os.walk(directory / step / "state"):
            for name in files:
                os.remove(os.path.join(root, name))
    model, optimizer = nnx_pair()
    with pytest.warns(RuntimeWarning) as seen:
        fit_quiet(
            model,
            optimizer,
            nnx_loss,
            (X, Y),
            steps=8,
            batch_size=BS,
            checkpoint_dir=directory,
            checkpoint_every=4,
        )
    messages = [str(w.message) for w in seen]
    assert "checkpoint 8" in messages[0] and "an older one" in messages[0]
    assert "checkpoint 4" in messages[1]
    assert "no readable checkpoint is left" in messages[1]
    assert "starts from step 0" in messages[1]
    assert int(optimizer.step[...]) == 8


# ------------------------------------------------ warnings point at the user's line


def test_warnings_point_at_the_callers_line(tmp_path):
    def poisoned(model, batch):  # NaN from the first step on
        x, y = batch
        return jnp.mean((model(x) - y) ** 2) * jnp.float32(jnp.nan)

    with pytest.warns(RuntimeWarning, match="non-finite") as seen:
        fit_quiet(*nnx_pair(), poisoned, (X, Y), steps=4, batch_size=BS)
    assert [w.filename for w in seen] == [__file__]

    def member_nan(model, batch, hp):
        x, y = batch
        loss = jnp.mean((jax.vmap(model)(x) - y) ** 2)
        return loss * jnp.where(hp["lr"] > 0.015, jnp.float32(jnp.nan), 1.0)

    pop = scanax.population(make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 2e-2]))
    with pytest.warns(RuntimeWarning, match="member") as seen:
        fit_quiet(pop, None, member_nan, (X, Y), steps=4, batch_size=BS)
    assert [w.filename for w in seen] == [__file__]

    directory = tmp_path / "ck"
    model, optimizer = nnx_pair()
    fit_quiet(
        model,
        optimizer,
        nnx_loss,
        (X, Y),
        steps=2,
        batch_size=BS,
        checkpoint_dir=directory,
    )
    with pytest.warns(RuntimeWarning, match="already holds step 2") as seen:
        fit_quiet(
            *nnx_pair(),
            nnx_loss,
            (X, Y),
            steps=2,
            batch_size=BS,
            checkpoint_dir=directory,
        )
    assert [w.filename for w in seen] == [__file__]


# ----------------------------------------------------- Ctrl-C during a population


def test_ctrl_c_during_a_population_fit_keeps_its_last_checked_state():
    """A KeyboardInterrupt after step 20 (raised by a log sink) leaves the
    population as a fit of 20 steps does, and the next call continues."""

    def interrupt(step, metrics):
        if step == 20:
            raise KeyboardInterrupt

    def population():
        return scanax.population(
            make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 3e-2])
        )

    kwargs = dict(batch_size=BS, key=KEY, steps_per_call=10)
    ref = population()
    fit_quiet(ref, None, eqx_loss, (X, Y), steps=20, **kwargs)
    pop = population()
    with pytest.raises(KeyboardInterrupt):
        fit_quiet(pop, None, eqx_loss, (X, Y), steps=40, log=interrupt, **kwargs)
    assert pop.step == 20
    leaves_equal(list(pop.state), list(ref.state))
    more = fit_quiet(pop, None, eqx_loss, (X, Y), steps=5, **kwargs)
    assert more.history["step"].tolist() == [21, 22, 23, 24, 25]


@pytest.mark.standard_promotion("optax's reduce_on_plateau mixes dtypes")
def test_a_plateau_chain_continues_and_runs_inside_multisteps():
    """reduce_on_plateau's own count (its window) is no step count: a second
    call continues at Adam's; inside optax.MultiSteps it still gets value=."""
    tx = optax.chain(TX, optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
    one = fit_quiet(eqx_model(), tx, eqx_loss, (X, Y), steps=10, batch_size=BS)
    a = fit_quiet(eqx_model(), tx, eqx_loss, (X, Y), steps=5, batch_size=BS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = fit_quiet(
            a.model, tx, eqx_loss, (X, Y), steps=5, batch_size=BS, opt_state=a.optimizer
        )
    assert b.history["step"].tolist() == [6, 7, 8, 9, 10]
    np.testing.assert_array_equal(
        np.concatenate([a.history["loss"], b.history["loss"]]), one.history["loss"]
    )
    multi = fit_quiet(
        eqx_model(), optax.MultiSteps(tx, 2), eqx_loss, (X, Y), steps=4, batch_size=BS
    )
    assert multi.history["step"].tolist() == [1, 2, 3, 4]


def test_a_population_whose_members_all_stop_mid_call_ends_at_that_step():
    """Every member non-finite at step 3, calls of 7 steps: the run ends there
    (its clock counts the 3 steps run, each member applied 2), not at the end
    of a call already dispatched (which runs no step)."""

    def nan_from(model, batch):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    batches = [(X[:BS], Y[:BS])] * 14
    batches[2] = (X[:BS], Y[:BS].at[0].set(jnp.nan))
    pop = scanax.population(make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 2e-2]))
    with pytest.warns(RuntimeWarning, match="member"):
        res = fit_quiet(pop, None, nan_from, batches, steps=14, steps_per_call=7)
    assert pop.step == 3
    assert res.steps.tolist() == [2, 2]
    assert res.history["step"].tolist() == [1, 2, 3]


def test_best_of_a_population_with_an_empty_history_and_the_warning_when_none_trains():
    """Every member non-finite at its first step: the warning says that none is
    left training; a later call's empty history still ranks (all last: 0)."""

    def nan_loss(model, batch):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2) * jnp.float32(jnp.nan)

    pop = scanax.population(make_member, 2, key=jr.key(0), lr=jnp.array([1e-2, 2e-2]))
    with pytest.warns(RuntimeWarning, match="no member is left training"):
        fit_quiet(pop, None, nan_loss, (X, Y), steps=3, batch_size=BS)
    with pytest.warns(RuntimeWarning, match=r"every member .* trains none"):
        again = fit_quiet(pop, None, nan_loss, (X, Y), steps=3, batch_size=BS)
    assert again.history["loss"].shape == (2, 0)
    assert again.best("loss") == 0


def test_a_populations_refusals_while_tracing_change_no_member():
    """Issue 38's refusals for a population: a complex metric, evaluation data
    unlike what the loss reads, an evaluation drawing from its key without
    ``key=``; named before any step, every member as it was."""

    def population():
        return scanax.population(make_member, 2, key=jr.key(3), lr=[1e-3, 1e-2])

    def draws(model, batch, key):
        return eqx_loss(model, batch) + jr.normal(key)

    def complex_metric(model, batch):
        loss = eqx_loss(model, batch)
        return loss, {"z": jax.lax.complex(loss, loss)}

    cases = [
        (complex_metric, {}, r"metrics\['z'\] returned by `loss_fn` is complex64"),
        (
            eqx_loss,
            dict(eval_data={"x": X, "y": Y}),
            "traced on a batch of `eval_data`",
        ),
        (eqx_loss, dict(eval_data=(X, Y), eval_fn=draws), "uses its key `key` in eval"),
    ]
    for loss_fn, options, match in cases:
        pop = population()
        before = jax.device_get(list(pop.state))
        if "eval_data" in options:
            options = {"eval_every": 2, **options}
        with pytest.raises(TypeError, match=match):
            fit_quiet(pop, None, loss_fn, (X, Y), steps=4, batch_size=BS, **options)
        leaves_equal(list(pop.state), before)


# ------------------------------------------------- a newcomer's port (issue 38)


def _masked(p, batch):
    x, y, m = batch
    return jnp.sum(((x * p["w"]) - y) ** 2 * m), jnp.sum(m)


def test_a_ratio_loss_trains_on_its_value():
    """docs/evaluate.md: the loss may be a ``scanax.Ratio`` (a per-token loss);
    training reads it as ``num / den``, as a hand-written loss would."""
    import optax

    x = jr.normal(jr.key(0), (64, 5))
    m = (jr.uniform(jr.key(1), (64, 5)) > 0.3).astype(jnp.float32)
    data = (x, x.sum(1, keepdims=True) * m, m)
    p = {"w": jnp.zeros((5,))}

    def as_ratio(p, b):
        return scanax.Ratio(*_masked(p, b))

    def by_hand(p, b):
        num, den = _masked(p, b)
        return num / den

    kw = dict(steps=6, batch_size=16, progress=False, key=jr.key(2))
    ratio = scanax.fit(p, optax.sgd(0.1), as_ratio, data, **kw)
    hand = scanax.fit(p, optax.sgd(0.1), by_hand, data, **kw)
    np.testing.assert_allclose(ratio.history["loss"], hand.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(ratio.model["w"], hand.model["w"], rtol=1e-6)
    assert not np.allclose(ratio.model["w"], 0.0)  # (it trained)


def test_object_form_messages_name_the_objects():
    """Refusals met in the object form name the objects, not only the keywords."""
    import optax

    x = jnp.ones((8, 3))
    p = {"w": jnp.zeros((3,))}

    def loss(p, b):
        return jnp.mean((b @ p["w"]) ** 2)

    with pytest.raises(TypeError, match=r"scanax.EarlyStop \(stop=\) is given"):
        scanax.fit(
            p, optax.sgd(0.1), loss, x, steps=2, batch_size=4, progress=False,
            callbacks=[scanax.EarlyStop("loss", patience=1)],
        )  # fmt: skip
    with pytest.raises(TypeError, match=r"scanax.Eval \(eval_data=\) is given"):
        scanax.fit(
            p, optax.sgd(0.1), loss, x, steps=2, batch_size=4, progress=False,
            callbacks=[scanax.Eval(x)],
        )  # fmt: skip
    with pytest.raises(
        TypeError, match=r"scanax.Eval: .*got tuple \(\[0\] list, \[1\] list\)"
    ):
        scanax.Eval(([1.0, 2.0], [3.0, 4.0]), every=2)


def test_eval_arguments_are_named_by_eval():
    """scanax.Eval's own checks name scanax.Eval (they said scanax.fit)."""
    data = (jnp.ones((4, 2)), jnp.ones(4))
    with pytest.raises(
        ValueError,
        match=r"^scanax\.Eval: `every` must be a "
        r"positive int, got 0\.\nFix: pass every=1 or more\.$",
    ):
        scanax.Eval(data, every=0)
    with pytest.raises(
        TypeError,
        match=r"^scanax\.Eval: `batch_size` must be a "
        r"positive int, got float 1\.5",
    ):
        scanax.Eval(data, every=2, batch_size=1.5)


@pytest.mark.parametrize(
    "keywords, named",
    [
        ({"eval_data": (X, Y), "eval_every": 0}, "eval_every"),
        (
            {"eval_data": (X, Y), "eval_every": 2, "eval_batch_size": 0},
            "eval_batch_size",
        ),
        ({"checkpoint_dir": "ckpt", "checkpoint_every": 0}, "checkpoint_every"),
        ({"log": print, "log_every": 0}, "log_every"),
    ],
)
def test_fit_counts_are_named_as_fit_keywords(tmp_path, keywords, named):
    """A bad count given to one of fit's keywords is named as that keyword (it
    was the `every` of the object fit makes from it), before anything runs."""
    if "checkpoint_dir" in keywords:
        keywords = {**keywords, "checkpoint_dir": str(tmp_path / "ckpt")}
    model, tx = eqx_model(), TX
    with pytest.raises(ValueError) as err:
        fit_quiet(model, tx, eqx_loss, (X, Y), steps=2, batch_size=BS, **keywords)
    assert str(err.value) == (
        f"scanax.fit: `{named}` must be a positive int, got 0.\nFix: pass "
        f"{named}=1 or more."
    )
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("sink", [scanax.CSV, scanax.TensorBoard])
def test_a_sink_window_is_checked_by_kind(tmp_path, sink):
    with pytest.raises(ValueError, match=r"`every` must be a positive int"):
        sink(str(tmp_path / "log"), every=0)
    with pytest.raises(TypeError, match=r"`every` must be a positive int"):
        sink(str(tmp_path / "log"), every=1.5)


def test_reviewers_refusals_are_named_and_early(tmp_path):
    """An existing file as best_dir, a list given to Log, two sinks on one
    file: refused by name before anything runs (issue 38's review)."""
    import optax

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"best_dir .* exists and is not a directory"):
        scanax.EarlyStop("loss", patience=1, best_dir=afile)
    with pytest.raises(TypeError, match=r"scanax.Log: takes one sink, got list"):
        scanax.Log([print, print])
    x = jnp.ones((8, 3))
    p = {"w": jnp.ones((3,))}
    path = str(tmp_path / "log.csv")
    with pytest.raises(ValueError, match=r"scanax.CSV and a scanax.CSV writing to"):
        scanax.fit(
            p, optax.sgd(0.1), lambda p, b: jnp.mean(b @ p["w"]), x, steps=2,
            batch_size=4, progress=False,
            callbacks=[scanax.CSV(path, every=1), scanax.CSV(path, every=2)],
        )  # fmt: skip
    assert not os.path.exists(path)
    np.testing.assert_array_equal(p["w"], 1.0)


def test_a_feature_object_refuses_in_its_own_name(tmp_path):
    """A refusal raised when a feature object is made starts with the object's
    name and shows the object form in its fix (the keyword in parentheses)."""
    with pytest.raises(
        ValueError, match=r"(?s)^scanax.Ema: the decay 1.5 .*scanax.Ema\("
    ):
        scanax.Ema(1.5)
    with pytest.raises(ValueError, match=r"^scanax.Checkpoint: `every` must be a"):
        scanax.Checkpoint(tmp_path, every=0)
    with pytest.raises(TypeError, match=r"(?s)^scanax.Checkpoint: its directory .*Fix"):
        scanax.Checkpoint(3)
    with pytest.raises(TypeError, match=r"^scanax.Eval: `fn` \(eval_fn=\) must be"):
        scanax.Eval(jnp.ones((4, 2)), every=2, fn=3)


@pytest.mark.parametrize("bad", [6, 10])
def test_a_data_iterator_that_fails_keeps_the_call_in_flight(bad):
    """The host prepares the next call's batches while a call runs: a loader
    that raises then kept the model at the call before the one in flight
    (review 2026-12-06: 4 steps dispatched, 0 kept). Now the call in flight is
    checked and kept, as a run of just those steps gives, then the error goes
    on."""

    def batches(fail_at):
        for i in range(100):
            if i == fail_at:
                raise RuntimeError("the loader died")
            j = i % (len(X) // BS)
            yield X[j * BS : (j + 1) * BS], Y[j * BS : (j + 1) * BS]

    model, optimizer = nnx_pair()
    with pytest.raises(RuntimeError, match="the loader died"):
        scanax.fit(
            model,
            optimizer,
            nnx_loss,
            batches(bad),
            steps=20,
            steps_per_call=4,
            progress=False,
        )
    kept = int(optimizer.step[...])
    assert kept == bad // 4 * 4  # every whole call of 4 before the failing batch
    ref_model, ref_optimizer = nnx_pair()
    scanax.fit(
        ref_model,
        ref_optimizer,
        nnx_loss,
        batches(None),
        steps=kept,
        steps_per_call=4,
        progress=False,
    )
    leaves_equal(nnx.state(model), nnx.state(ref_model))


def test_ctrl_c_on_an_nnx_fit_says_which_step_the_model_holds():
    """After Ctrl-C the NNX objects hold the last checked call's step (20 of a
    call 0..40), so re-running the same cell trains 40 more steps from there:
    the interrupt says so and gives the steps that end the run where it would
    have (and that call ends as an uninterrupted run does)."""

    def interrupt(step, metrics):
        if step == 20:
            raise KeyboardInterrupt

    kwargs = dict(batch_size=BS, key=KEY, steps_per_call=10)
    model, opt = nnx_pair()
    with pytest.raises(KeyboardInterrupt) as caught:
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=40, log=interrupt, **kwargs)
    text = "".join(getattr(caught.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert re.search(
            r"hold step 20 .*from step 0 to 40\)\. Calling the same fit\(\.\.\., "
            r"steps=40\) again trains that many more steps from step 20; to end "
            r"this run at step 40, pass steps=20\.",
            text,
        )
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=20, **kwargs)
    ref, ref_opt = nnx_pair()
    fit_quiet(ref, ref_opt, nnx_loss, (X, Y), steps=40, **kwargs)
    leaves_equal(nnx.state(model), nnx.state(ref))


def test_ctrl_c_while_batches_are_read_keeps_the_call_in_flight_and_its_log_rows():
    """Ctrl-C while the next call's batches are read (a generator raising
    KeyboardInterrupt at batch 23): the call in flight (steps 13..18) is
    checked and kept, as for a failing iterator (before: dropped), and the
    log's open window is written at step 18, as at a run's end (before:
    dropped, and the continued call's window 20 held steps 19..20 only). The
    rows then equal two calls of 18 and 22 steps."""
    x, y = np.asarray(X), np.asarray(Y)

    def batches(start=0, stop_at=None):
        for i in range(start, 10_000):
            if i == stop_at:
                raise KeyboardInterrupt
            j = i % 6
            yield x[j * BS : (j + 1) * BS], y[j * BS : (j + 1) * BS]

    def run(model, opt, data, steps, rows):
        log = scanax.Log(lambda s, m: rows.append((s, m["loss"])), every=5)
        return fit_quiet(model, opt, nnx_loss, data, steps=steps, steps_per_call=6,
                         callbacks=[log])  # fmt: skip

    model, opt, rows = *nnx_pair(), []
    with pytest.raises(KeyboardInterrupt):
        run(model, opt, batches(stop_at=23), 40, rows)
    assert int(opt.step[...]) == 18
    run(model, opt, batches(18), 22, rows)
    ref, ref_opt, want = *nnx_pair(), []
    run(ref, ref_opt, batches(), 18, want)
    run(ref, ref_opt, batches(18), 22, want)
    assert [s for s, _ in rows] == [5, 10, 15, 18, 20, 25, 30, 35, 40]
    np.testing.assert_allclose(np.array(rows), np.array(want), rtol=1e-6)
    leaves_equal(nnx.state(model), nnx.state(ref))


def _arrays(model):
    return [x for x in jax.tree.leaves(model) if isinstance(x, jax.Array)]


def _batches(start=0, stop_at=None):
    """The regression batches in order; KeyboardInterrupt at batch ``stop_at``."""
    x, y = np.asarray(X), np.asarray(Y)
    for i in range(start, 10_000):
        if i == stop_at:
            raise KeyboardInterrupt
        j = i % 6
        yield x[j * BS : (j + 1) * BS], y[j * BS : (j + 1) * BS]


@pytest.mark.parametrize("kind", ["eqx", "ts", "nnx"])
def test_ctrl_c_gives_the_last_checked_result_on_the_exception(kind):
    """Equinox and TrainState results are new objects: a Ctrl-C lost every
    step of the run (without a Checkpoint). The exception now carries the
    result of the last checked state, ``fit_result``, with its history, equal
    to a run of that many steps; for NNX, the objects it updated in place."""
    make = {
        "eqx": lambda: (eqx_model(), TX, eqx_loss),
        "ts": lambda: (ts_make(), None, ts_loss),
        "nnx": lambda: (*nnx_pair(), nnx_loss),
    }[kind]
    model, opt, loss = make()
    with pytest.raises(KeyboardInterrupt) as caught:
        fit_quiet(model, opt, loss, _batches(stop_at=23), steps=40, steps_per_call=6)
    got = caught.value.fit_result
    assert got.steps == 18 and len(got.history["loss"]) == 18  # (calls of 6)
    assert any("`fit_result`" in n for n in caught.value.__notes__)
    ref_model, ref_opt, _ = make()
    want = fit_quiet(ref_model, ref_opt, loss, _batches(), steps=18, steps_per_call=6)
    np.testing.assert_array_equal(got.history["loss"], want.history["loss"])
    if kind == "nnx":
        assert got.model is model and got.optimizer is opt
        leaves_equal(nnx.state(model), nnx.state(ref_model))
    else:
        leaves_equal(_arrays(got.model), _arrays(want.model))


def test_ctrl_c_before_any_call_is_checked():
    """Nothing checked: an Equinox run's result is the model as given (0
    steps); an NNX run's objects are as given, and ``fit_result`` is None."""
    with pytest.raises(KeyboardInterrupt) as caught:
        fit_quiet(eqx_model(), TX, eqx_loss, _batches(stop_at=0), steps=40)
    assert caught.value.fit_result.steps == 0
    leaves_equal(_arrays(caught.value.fit_result.model), _arrays(eqx_model()))
    model, opt = nnx_pair()
    with pytest.raises(KeyboardInterrupt) as caught:
        fit_quiet(model, opt, nnx_loss, _batches(stop_at=0), steps=40)
    assert caught.value.fit_result is None and int(opt.step[...]) == 0


# ------------------------------------------- errors and interrupts around saves


def _csv_steps(path):
    return [int(r["step"]) for r in read_csv(path)]


def test_an_interrupted_save_leaves_the_log_rows_of_the_steps_the_objects_hold(
    tmp_path, monkeypatch
):
    """Ctrl-C while checkpoint 40 is written: the objects hold step 40, and the
    log has its rows up to 40 (before: the save ran before the log sinks, so
    rows 35 and 40 were never written and the continued call went on at 45).
    The continued call's rows and state equal an uninterrupted run's."""
    from scanax._fit import checkpoint as ckpt_module

    save = ckpt_module.Checkpoints.save
    fire = [40]

    def interrupted_save(self, step, *args, **kwargs):
        if step == fire[0]:
            fire[0] = None
            raise KeyboardInterrupt
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.Checkpoints, "save", interrupted_save)

    def run(model, opt, steps, tag):
        callbacks = [
            scanax.Checkpoint(tmp_path / f"ck{tag}", every=20),
            scanax.CSV(tmp_path / f"{tag}.csv", every=5),
        ]
        return fit_quiet(model, opt, nnx_loss, (X, Y), steps=steps, batch_size=BS,
                         key=KEY, steps_per_call=10, callbacks=callbacks)  # fmt: skip

    model, opt = nnx_pair()
    with pytest.raises(KeyboardInterrupt):
        run(model, opt, 60, "cut")
    assert int(opt.step[...]) == 40
    assert _csv_steps(tmp_path / "cut.csv") == list(range(5, 41, 5))
    run(model, opt, 20, "cut")
    ref, ref_opt = nnx_pair()
    run(ref, ref_opt, 60, "whole")
    assert _csv_steps(tmp_path / "cut.csv") == list(range(5, 61, 5))
    np.testing.assert_allclose(
        [float(r["loss"]) for r in read_csv(tmp_path / "cut.csv")],
        [float(r["loss"]) for r in read_csv(tmp_path / "whole.csv")],
        rtol=1e-6,
    )
    leaves_equal(nnx.state(model), nnx.state(ref))


def test_a_failed_save_says_which_step_the_nnx_objects_hold(tmp_path, monkeypatch):
    """A checkpoint save that fails (the directory made read-only) after steps
    ran: the error's note names the step the NNX objects hold and the steps=
    that ends the run (before: only "run the same call again", which in the
    same session trained 60 steps past the planned end). Following it ends as
    the uninterrupted run; the failed save is not tried again."""
    from scanax._fit import checkpoint as ckpt_module

    write = ckpt_module._write_index
    tried = []

    def refused(directory, starts):
        if 40 in starts:
            tried.append(40)
            raise PermissionError(13, "Permission denied", str(directory))
        return write(directory, starts)

    monkeypatch.setattr(ckpt_module, "_write_index", refused)
    model, opt = nnx_pair()
    kwargs = dict(batch_size=BS, key=KEY, steps_per_call=10)
    with pytest.raises(PermissionError, match="saving checkpoint 40") as caught:
        fit_quiet(model, opt, nnx_loss, (X, Y), steps=60,
                  callbacks=[scanax.Checkpoint(tmp_path / "ck", every=20)], **kwargs)  # fmt: skip
    assert tried == [40] and int(opt.step[...]) == 40
    text = "".join(getattr(caught.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert re.search(
            r"stopped by this error; the NNX model and optimizer hold step 40 .*"
            r"to end this run at step 60, pass steps=20\.",
            text,
        )
    monkeypatch.setattr(ckpt_module, "_write_index", write)
    fit_quiet(model, opt, nnx_loss, (X, Y), steps=20, **kwargs)
    ref, ref_opt = nnx_pair()
    fit_quiet(ref, ref_opt, nnx_loss, (X, Y), steps=60, **kwargs)
    leaves_equal(nnx.state(model), nnx.state(ref))


def _stream(fail_at=None, start=0, error=KeyboardInterrupt):
    """Batches ``start``, ``start + 1``, ... of (X, Y) in order, raising
    ``error`` when batch ``fail_at`` is asked for."""
    x, y = np.asarray(X), np.asarray(Y)
    n = len(x) // BS
    for i in range(start, 1000):
        if i == fail_at:
            raise error
        j = i % n
        yield x[j * BS : (j + 1) * BS], y[j * BS : (j + 1) * BS]


def test_ctrl_c_before_a_resumed_call_is_read_says_the_objects_are_as_given(tmp_path):
    """A restarted job restores checkpoint 20, then Ctrl-C while its first
    batches are read: the NNX objects are as given (no call was read), and the
    note says so and that the same call resumes from checkpoint 20 (before: it
    said they held step 20, and following its steps=20 ended the run 20 steps
    short). The same call again ends as the uninterrupted run."""

    def run(model, opt, data, steps):
        return fit_quiet(model, opt, nnx_loss, data, steps=steps, steps_per_call=5,
                         callbacks=[scanax.Checkpoint(tmp_path, every=10)])  # fmt: skip

    run(*nnx_pair(), _stream(), 20)  # (the first job: died after step 20)
    model, opt = nnx_pair()
    given = jax.device_get(nnx.state((model, opt)))
    with pytest.raises(KeyboardInterrupt) as caught:
        run(model, opt, _stream(22), 40)
    leaves_equal(nnx.state((model, opt)), given)
    if sys.version_info >= (3, 11):
        text = "".join(getattr(caught.value, "__notes__", []))
        assert re.search(
            r"hold step 0, as given: checkpoint 20 was restored, but no call of it "
            r"was read\. The same fit\(\.\.\., steps=40\) again resumes from "
            r"checkpoint 20 and ends at step 40\.",
            text,
        )
    run(model, opt, _stream(), 40)
    ref, ref_opt = nnx_pair()
    fit_quiet(ref, ref_opt, nnx_loss, _stream(), steps=40, steps_per_call=5)
    leaves_equal(nnx.state(model), nnx.state(ref))


@pytest.mark.parametrize("every", [None, 20])
def test_a_failing_data_iterator_saves_the_last_checked_state_of_an_equinox_fit(
    tmp_path, every
):
    """An Equinox fit's result is not returned when its data iterator raises:
    with a Checkpoint, the last checked state (step 30) is saved before the
    error goes on (before: nothing without every=, only step 20 with it, while
    the log had rows up to 30), and the same call resumes there to end as the
    uninterrupted run."""

    def run(data):
        return fit_quiet(eqx_model(), TX, eqx_loss, data, steps=50, steps_per_call=10,
                         callbacks=[scanax.Checkpoint(tmp_path, every=every)])  # fmt: skip

    with pytest.raises(RuntimeError, match="loader died"):
        run(_stream(30, error=RuntimeError("loader died")))
    assert max(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == 30
    resumed = run(_stream())  # (a resumed call skips the 30 batches used)
    ref = fit_quiet(eqx_model(), TX, eqx_loss, _stream(), steps=50, steps_per_call=10)
    import equinox as eqx

    leaves_equal(
        eqx.filter(resumed.model, eqx.is_array), eqx.filter(ref.model, eqx.is_array)
    )
    np.testing.assert_allclose(resumed.history["loss"], ref.history["loss"], rtol=1e-6)


def _eqx_array_fit(directory=None, loss=eqx_loss, callbacks=(), **kwargs):
    """An Equinox fit of 50 steps over (X, Y) in order, calls of 5 steps."""
    ckpt = [] if directory is None else [scanax.Checkpoint(directory, every=1000)]
    return fit_quiet(eqx_model(), TX, loss, (X, Y), steps=50, batch_size=BS, key=None,
                     steps_per_call=5, callbacks=[*ckpt, *callbacks], **kwargs)  # fmt: skip


def _resumes_as_uninterrupted(directory, saved):
    """The checkpoint saved last is ``saved``, and the same call given the
    directory again ends as the run that was never stopped."""
    import equinox as eqx

    assert max(int(p.name) for p in directory.iterdir() if p.name.isdigit()) == saved
    resumed, ref = _eqx_array_fit(directory), _eqx_array_fit()
    leaves_equal(
        eqx.filter(resumed.model, eqx.is_array), eqx.filter(ref.model, eqx.is_array)
    )
    np.testing.assert_array_equal(resumed.history["loss"], ref.history["loss"])


def test_ctrl_c_while_the_next_call_runs_saves_the_last_checked_state(tmp_path):
    """Ctrl-C (a sink raising it) while call 26..30 runs and 21..25 is read:
    the checkpoint of step 25, the state the exception's ``fit_result`` holds,
    is saved before it goes on, and the run resumes there to end as the
    uninterrupted one (review: nothing was saved whenever a call was in
    flight, as it nearly always is: a restart began again from step 0)."""

    def ctrl_c(step, metrics):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        _eqx_array_fit(tmp_path, callbacks=[scanax.Log(ctrl_c, every=5)])
    assert caught.value.fit_result.steps == 25
    _resumes_as_uninterrupted(tmp_path, 25)


def test_a_call_that_fails_keeps_the_call_before_it(tmp_path):
    """The call of steps 31..35 fails (a host callback in the loss raises
    at step 33): the call of steps 26..30 had run whole, so it is checked
    and kept (the exception's ``fit_result``, the checkpoint) before the error
    goes on (review: an error while a call was launched lost the one before,
    20 where 30 ran), and the run resumes there to end as the uninterrupted
    one."""
    import equinox as eqx

    calls = [0]

    def tick(_):
        calls[0] += 1
        if calls[0] == 33:
            raise RuntimeError("the host side failed")

    def loss(model, batch):
        jax.debug.callback(tick, batch[0][0, 0])
        return eqx_loss(model, batch)

    with pytest.raises(Exception, match="the host side failed") as caught:
        _eqx_array_fit(tmp_path, loss=loss)
    result = caught.value.fit_result
    assert result.steps == 30
    ref = fit_quiet(eqx_model(), TX, eqx_loss, (X, Y), steps=30, batch_size=BS,
                    key=None)  # fmt: skip
    leaves_equal(
        eqx.filter(result.model, eqx.is_array), eqx.filter(ref.model, eqx.is_array)
    )
    _resumes_as_uninterrupted(tmp_path, 30)


class _Resumable:
    """A resumable iterator of (X, Y)'s batches in order (Grain's
    get_state/set_state), failing once when batch ``fail_at`` is drawn."""

    def __init__(self, fail_at=None):
        self.i, self.fail_at = 0, fail_at
        self.x, self.y = np.asarray(X), np.asarray(Y)

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == self.fail_at:
            self.fail_at = None
            raise RuntimeError("loader died")
        j = self.i % (len(self.x) // BS)
        self.i += 1
        return self.x[j * BS : (j + 1) * BS], self.y[j * BS : (j + 1) * BS]

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = int(state["i"])


def test_a_save_after_a_failed_read_records_the_data_where_training_stopped(tmp_path):
    """A resumable iterator failing midway through a read (batches 20, 21
    drawn, 22 failed): the checkpoint saved for step 20 records the iterator
    at 20, and the resumed run ends as the uninterrupted one (review: it
    recorded 22, so two batches were never trained)."""

    def run(data, directory=None):
        callbacks = [] if directory is None else [scanax.Checkpoint(directory)]
        return fit_quiet(eqx_model(), TX, eqx_loss, data, steps=40, steps_per_call=5,
                         callbacks=callbacks)  # fmt: skip

    with pytest.raises(RuntimeError, match="loader died"):
        run(_Resumable(fail_at=22), tmp_path)
    resumed, ref = run(_Resumable(), tmp_path), run(_Resumable())
    np.testing.assert_allclose(resumed.history["loss"], ref.history["loss"], rtol=1e-6)


def test_a_save_after_an_error_failing_in_the_background_leaves_the_error(
    tmp_path, monkeypatch
):
    """The save after a data error fails while written in the background (a
    full disk): the data error is what is raised, the failed save a note on
    it (review: the save's OSError replaced it)."""
    from scanax._fit import checkpoint as ckpt_module

    finish = ckpt_module.Checkpoints._finish

    def full_disk(self):
        if self.writing == 30:
            raise OSError(28, "No space left on device")
        return finish(self)

    monkeypatch.setattr(ckpt_module.Checkpoints, "_finish", full_disk)
    with pytest.raises(RuntimeError, match="loader died") as caught:
        fit_quiet(eqx_model(), TX, eqx_loss, _stream(30, error=RuntimeError("loader died")),
                  steps=50, steps_per_call=10, callbacks=[scanax.Checkpoint(tmp_path)])  # fmt: skip
    if sys.version_info >= (3, 11):
        text = "".join(getattr(caught.value, "__notes__", []))
        assert "saving checkpoint 30" in text and "No space left" in text


def test_continuing_from_fit_result_equals_an_uninterrupted_run():
    """An Equinox run stopped by Ctrl-C in a log sink at step 9 (calls of 6):
    its ``fit_result`` holds step 12 and the resumable iterator is set back
    there (a review found the 6 batches read ahead lost), so continuing from
    the result equals an uninterrupted run of 18 steps."""

    def sink(step, metrics):
        if step == 9:
            raise KeyboardInterrupt

    data = _Resumable()
    with pytest.raises(KeyboardInterrupt) as caught:
        fit_quiet(eqx_model(), TX, eqx_loss, data, steps=40, steps_per_call=6,
                  callbacks=[scanax.Log(sink, every=1)])  # fmt: skip
    got = caught.value.fit_result
    assert got.steps == 12 and data.i == 12
    assert any("set back to step 12" in n for n in caught.value.__notes__)
    more = fit_quiet(got.model, TX, eqx_loss, data, steps=6, steps_per_call=6,
                     opt_state=got.optimizer)  # fmt: skip
    want = fit_quiet(
        eqx_model(), TX, eqx_loss, _Resumable(), steps=18, steps_per_call=6
    )
    leaves_equal(_arrays(more.model), _arrays(want.model))
