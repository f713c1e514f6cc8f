"""``scanax.fit``'s compiled loop on an accelerator: its steps run as chunks of a
static length (a ``lax.scan``: XLA knows its trip count), only the loop over
chunks is dynamic, and nothing branches per step (on a GPU every iteration of a
dynamic ``while_loop`` and every ``lax.cond`` that runs copies a predicate to the
host). Checked on CPU in the program a GPU gets (``_backend.platform`` set to
``"gpu"``): in XLA's optimized program, the step's matmuls sit in a ``while``
whose ``backend_config`` holds ``known_trip_count``, and no ``conditional`` is
reachable from that loop's body, for every feature (the boundaries' work runs
in loops of at most one trip: the program holds no conditional). Events (evaluations, early
stops, rollout collections, logs, checkpoints, progress reports) land on the
same steps as with one step per iteration (CPU's plan), and stepwise execution
equals fused."""

import re

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from fit_helpers import BS, KEY, MLP, TX, X, Y, nnx, nnx_loss, nnx_pair

import scanax
from scanax import _backend
from scanax._fit import plan as _fit_plan, program as _fit_program

pytestmark = pytest.mark.filterwarnings("ignore:.*non-finite.*:RuntimeWarning")


@pytest.fixture
def gpu(monkeypatch):
    """fit decides as it does on a GPU (its programs are built anew)."""
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")


# The structure is read from XLA:CPU's (or XLA:GPU's) optimized HLO text, where a
# while of a static trip count carries ``known_trip_count`` in its backend_config.
# On a TPU v5e no loop of k known iterations was found in XLA:TPU's text for any
# of the tests below (the same plans, k 8 and 64): what its compiler writes
# differs, so there these tests say nothing and are skipped.
hlo_text = pytest.mark.skipif(
    jax.default_backend() == "tpu",
    reason="reads XLA:CPU/GPU's known_trip_count, not in XLA:TPU's HLO text",
)


# ---------------------------------------------------------------------------- HLO


_CALLS = re.compile(
    r"\b(?:condition|body|to_apply|calls|true_computation|false_computation)"
    r"=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def computations(text):
    """``{name: [instruction lines]}`` of an HLO module's text."""
    out, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def callees(line):
    found = _CALLS.findall(line)
    for group in _BRANCHES.findall(line):
        found += [g.strip().lstrip("%") for g in group.split(",")]
    return found


def reachable(comps, root):
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += callees(line)
    return seen


def chunk_loops(text):
    """``[(trip count, body reach)]``: every while with a known trip count."""
    comps = computations(text)
    out = []
    for lines in comps.values():
        for line in lines:
            if " while(" in line and "known_trip_count" in line:
                n = int(re.search(r'known_trip_count":\{"n":"(\d+)"', line).group(1))
                body = re.search(r"\bbody=%([\w.\-]+)", line).group(1)
                out.append((n, reachable(comps, body)))
    return comps, out


def has(comps, names, op):
    return any(f" {op}(" in line for n in names for line in comps[n])


def once_loops(comps):
    """``[(where, body reach)]`` of every while whose condition is a flag it
    carries (``_once.once_if``'s loop of at most one trip), not a count:
    the computation that holds it, and what its body reaches."""
    out = []
    for where, lines in comps.items():
        for line in lines:
            if " while(" not in line:
                continue
            cond = re.search(r"\bcondition=%([\w.\-]+)", line).group(1)
            (root,) = [x for x in comps[cond] if x.lstrip().startswith("ROOT")]
            if re.search(r"= pred\[\] get-tuple-element\(", root):
                body = re.search(r"\bbody=%([\w.\-]+)", line).group(1)
                out.append((where, reachable(comps, body)))
    return out


def newest_program():
    (program,) = _fit_program.PROGRAMS.values()
    (exe,) = program.executables.values()
    return program, exe.as_text()


def assert_chunked(k_at_least=2, events=False):
    """The fit just run compiled one program whose step (its dots) runs in a
    loop of ``plan.k`` iterations with a known trip count, with no conditional
    reachable from it; ``events``: the boundaries' work runs in loops of at
    most one trip outside it, and the program holds no conditional at all (on
    a TPU one moves a small state out of on-chip memory, ``_once``)."""
    program, text = newest_program()
    k = program.chunks.plan.k
    assert k >= k_at_least
    comps, loops = chunk_loops(text)
    steps = [body for n, body in loops if n == k and has(comps, body, "dot")]
    assert steps, f"no loop of {k} known iterations runs the step"
    for body in steps:
        assert not has(comps, body, "conditional")
    if events:
        assert not has(comps, set(comps), "conditional")
        stepping = set().union(*steps)
        onces = [body for where, body in once_loops(comps) if where not in stepping]
        assert onces, "no loop of at most one trip outside the step's loop"
    return program


def fresh():
    _fit_program.PROGRAMS.clear()
    _fit_program.EXECUTABLES.clear()


def fit(model=None, opt=None, data=None, **kw):
    if model is None:
        model, opt = nnx_pair()
    kw = {"steps": 40, "batch_size": BS, "key": KEY, "progress": False, **kw}
    return scanax.fit(model, opt, nnx_loss, (X, Y) if data is None else data, **kw)


# ---------------------------------------------------------------------------- the rule


def test_chunk_length_rule(gpu):
    """A chunk of about 2 ms of estimated steps, a power of two up to 256, no
    longer than an event's period, a divisor of the periods when one is long
    enough; one step for a step of milliseconds or a step with a host
    callback."""

    def tiny(x):
        return jnp.tanh(x @ x)

    def big(x):
        return jnp.tanh(x @ x)

    small = jax.make_jaxpr(tiny)(jnp.ones((8, 8))).jaxpr
    large = jax.make_jaxpr(big)(jax.ShapeDtypeStruct((8192, 8192), jnp.float32)).jaxpr
    printing = jax.make_jaxpr(lambda x: jax.debug.print("{}", x) or x)(1.0).jaxpr
    assert _fit_plan.chunk_length(small) == 64
    assert _fit_plan.chunk_length(large) == 1  # (~11 ms a step)
    assert _fit_plan.chunk_length(printing) == 1
    assert _fit_plan.chunk_length(small, (100,)) == 50  # evaluation every 100
    assert _fit_plan.chunk_length(small, (16,)) == 16  # a rollout's period
    assert _fit_plan.chunk_length(small, (100, 16)) == 16  # gcd 4: cut chunks
    assert _fit_plan.chunk_length(small, (97,)) == 64  # prime: cut chunks


def test_the_chunk_length_reads_the_steps_inputs_not_the_data(gpu):
    """A step's cost is estimated from its own inputs (the state, the order),
    not from the arrays it closes over: an MNIST-sized dataset counted there
    (as a step traced by ``jax.jit`` takes it, as an input of its program)
    made a tiny step's chunk 4, not 64."""
    ks = []

    def call(data, x):
        step, _ = _fit_program.trace_once(lambda x: jnp.tanh(x @ x) + data[0, 0], x)
        inputs = [(v.aval.shape, v.aval.dtype) for v in step.jaxpr.invars]
        assert inputs == [(x.shape, x.dtype)]
        ks.append(_fit_plan.chunk_length(step.jaxpr, ()))
        return step(x)

    data = jax.ShapeDtypeStruct((60_000, 784), jnp.float32)  # (abstract: no memory)
    jax.make_jaxpr(call)(data, jnp.ones((8, 8)))
    assert ks == [64]


def test_one_step_per_iteration_on_cpu(monkeypatch):
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    fresh()
    fit()
    program, _ = newest_program()
    assert program.chunks.plan.k == 1


@pytest.mark.parametrize(
    "options",
    [
        lambda tmp: {"steps_per_call": 100},
        lambda tmp: {"callbacks": [scanax.Checkpoint(tmp / "ckpt", every=100)]},
        lambda tmp: {"progress": scanax.Progress(every=100, leave=False)},
    ],
    ids=["steps_per_call", "checkpoint_every", "bar_every"],
)
def test_chunks_fit_the_calls_the_host_ends(gpu, tmp_path, options):
    """Where the host ends calls every 100 steps, a tiny step's chunk of 64 would
    run 128-192 steps per call of 100 (a window's steps past the call's end run
    masked): ``k`` divides 100 instead, so every call runs whole chunks. (Values
    against the CPU plan under checkpoints and calls of a given length:
    ``test_events_land_on_the_same_steps``.)"""
    fresh()
    fit(steps=200, **options(tmp_path))
    program, _ = newest_program()
    assert program.chunks.plan.k == 50
    assert program.chunks.plan.count(0, 100) == 2  # two whole chunks a call
    fresh()
    fit(steps=200)
    assert newest_program()[0].chunks.plan.k == 64  # (no cut: the step's own k)


@pytest.fixture
def calls(monkeypatch):
    """``[(start, steps)]`` of every call the schedule sizes, with the plan."""
    from scanax._fit import schedule as _fit_schedule

    out = []
    want = _fit_schedule.Schedule.want

    def spy(self, start, end):
        n = want(self, start, end)
        out.append((start, n))
        return n

    monkeypatch.setattr(_fit_schedule.Schedule, "want", spy)
    return out


def test_calls_fit_sizes_end_on_the_chunks_grid(gpu, calls, monkeypatch):
    """After the 8-step timing call, a call fit sizes from a start off the grid
    ends on a multiple of ``k``: whole chunks (it spanned one more, masked)."""
    from scanax._fit import schedule as _fit_schedule

    monkeypatch.setattr(_fit_schedule, "_SECONDS_PER_CALL", 0.003)  # several calls
    fresh()
    fit(steps=600)
    k = newest_program()[0].chunks.plan.k
    assert k == 64 and calls[0] == (0, 8) and len(calls) > 2
    ends = [start + n for start, n in calls]
    assert all(end % k == 0 for end in ends[1:-1]), calls
    assert ends[-1] == 600


def test_the_rest_that_fits_one_call_runs_in_one(gpu, calls, monkeypatch):
    """Once the step's time is known, steps that fit one call (its buffers, the
    time a call aims at) run in one call, its last chunk cut, not a call of
    whole chunks and another; more than fits still end on the grid."""
    from scanax._fit import schedule as _fit_schedule
    from scanax._fit.data.arrays import ArraySource

    monkeypatch.setattr(_fit_schedule, "_SECONDS_PER_CALL", 1e9)  # (length decides)
    fresh()
    fit(steps=8)  # (times the step: the next fits know it)
    k = newest_program()[0].chunks.plan.k
    length = ArraySource.LENGTH
    assert k == 64 and length % k
    calls.clear()
    model, opt = nnx_pair()
    one = fit(model, opt, steps=length)
    assert calls == [(0, length)]
    np.testing.assert_array_equal(one.history["step"], np.arange(1, length + 1))
    calls.clear()
    fit(steps=length + 5)
    assert calls == [
        (0, length // k * k),
        (length // k * k, length + 5 - length // k * k),
    ]
    # the cut chunk's masked steps change nothing: the same training as with one
    # step per iteration (CPU's plan)
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    ref_model, ref_opt = nnx_pair()
    ref = fit(ref_model, ref_opt, steps=length)
    np.testing.assert_allclose(
        one.history["loss"], ref.history["loss"], rtol=2e-5, atol=1e-6
    )
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref_model))
    ):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_host_batches_and_in_loop_reports_fit_the_chunks(gpu, calls, monkeypatch):
    """An iterable's calls of 100 host batches cut chunks like a steps_per_call
    (k divides 100), and the bar's in-loop reports with no every of the user's
    come on multiples of k once the plan is known."""
    from scanax._fit import engine as _engine

    everies = []
    every = _engine.Run.every
    monkeypatch.setattr(
        _engine.Run,
        "every",
        lambda self, n: everies.append(every(self, n)) or everies[-1],
    )

    def batches():
        for i in range(10**6):
            j = (i % 6) * BS
            yield X[j : j + BS], Y[j : j + BS]

    def run():
        fresh()
        return fit(
            data=batches(),
            steps=300,
            batch_size=None,
            progress=scanax.Progress(leave=False),
        )

    chunked = run()
    k = newest_program()[0].chunks.plan.k
    assert k == 50 and [n for _, n in calls] == [100, 100, 100]
    assert everies[0] == 10  # (the first call: the plan is not known yet)
    assert all(e % k == 0 for e in everies[1:]), everies
    # the same training as with one step per iteration (CPU's plan)
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    one = run()
    np.testing.assert_array_equal(chunked.history["step"], one.history["step"])
    np.testing.assert_allclose(
        chunked.history["loss"], one.history["loss"], rtol=2e-5, atol=1e-6
    )


def test_host_cuts_not_on_cpu(monkeypatch):
    monkeypatch.setattr(_backend, "platform", lambda: "cpu")
    assert _fit_plan.host_cuts(100, 10, 7) == ()
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    assert _fit_plan.host_cuts(100, None, 7) == (100, 7)


def test_plan_counts_and_ends():
    plan = _fit_plan.Plan(8, (20,))
    # windows of the global grid, cut at multiples of 20 and at the call's end
    ends, t = [], 5
    while t < 45:
        t = plan.end(t, 45)
        ends.append(t)
    assert ends == [8, 16, 20, 24, 32, 40, 45]
    assert plan.count(5, 40) == len(ends)
    assert plan.end(5, 45, every=3) == 6


# ---------------------------------------------------------------------------- structure


@hlo_text
def test_no_options(gpu):
    fresh()
    fit()
    assert_chunked()


@hlo_text
def test_evaluation_progress_bar_and_early_stop(gpu):
    fresh()
    fit(
        eval_data=(X[:16], Y[:16]),
        eval_every=8,
        stop=scanax.EarlyStop("val_loss", patience=3),
        progress=scanax.Progress(leave=False),
    )
    assert_chunked(events=True)


@hlo_text
def test_plateau_and_a_training_metric_monitor(gpu):
    fresh()
    fit(
        eval_every=8,
        plateau=scanax.Plateau("mae", patience=1),
        stop=scanax.EarlyStop("loss", patience=5),
    )
    assert_chunked(events=True)


@hlo_text
def test_in_loop_progress_reports(gpu):
    """Calls of a given length report to the bar from inside the loop: at
    the chunk boundaries, through one loop of at most one trip per chunk."""
    fresh()
    fit(steps_per_call=40, progress=scanax.Progress(every=8, leave=False))
    assert_chunked(events=True)


@hlo_text
def test_accumulation_ema_and_float16(gpu):
    fresh()
    fit(accumulate=2, ema=0.9, precision="float16")
    assert_chunked()


@hlo_text
def test_a_rollout_collects_at_chunk_boundaries(gpu):
    import _rollout_job as job

    fresh()
    rollout = scanax.Rollout(job.collect, job.env_reset, epochs=2, minibatches=4)
    scanax.fit(
        job.params0(), TX, job.loss_fn, rollout, steps=32, key=KEY, progress=False
    )
    program = assert_chunked(events=True)
    assert program.chunks.plan.k == 8  # (the period: a collection per chunk)


@hlo_text
def test_a_population_with_members_stopping(gpu):
    def make(key, lr, blow):
        model = MLP(nnx.Rngs(key))
        return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    def loss(model, batch, hp):
        value, metrics = nnx_loss(model, batch)
        return value + jnp.where(hp["blow"] > 0, jnp.nan, 0.0), metrics

    fresh()
    pop = scanax.population(
        make,
        3,
        key=jr.key(0),
        lr=jnp.array([1e-2, 2e-2, 3e-2]),
        blow=jnp.array([0, 1, 0]),
    )
    result = scanax.fit(
        pop, None, loss, (X, Y), steps=24, batch_size=BS, key=KEY, progress=False
    )
    assert list(result.steps) == [24, 0, 24]
    assert_chunked()


@hlo_text
def test_a_mesh(gpu):
    devices = np.array(jax.devices()[:2])
    mesh = jax.sharding.Mesh(devices, ("data",))
    fresh()
    fit(mesh=mesh)
    assert_chunked()


# ---------------------------------------------------------------------------- events


def _nan_after(steps):
    def loss(model, batch):
        value, metrics = nnx_loss(model, batch)
        bad = jnp.where(model.l1.kernel.value[0, 0] > 1e9, jnp.nan, 0.0)
        return value + bad, metrics

    return loss


EVAL = (X[:16], Y[:16])
CASES = {
    "plain": {},
    "evaluation and early stop": dict(
        eval_data=EVAL, eval_every=6, stop=scanax.EarlyStop("val_loss", patience=1)
    ),
    "plateau on a training metric": dict(
        eval_every=7, plateau=scanax.Plateau("mae", patience=1, factor=0.5)
    ),
    "moving average, float16": dict(ema=0.9, precision="float16"),
    "accumulation": dict(accumulate=2),
    "calls of 13 steps": dict(steps_per_call=13),
}


def _run(monkeypatch, platform, tmp, **kw):
    monkeypatch.setattr(_backend, "platform", lambda: platform)
    model, opt = nnx_pair()
    csv = tmp / "log.csv"
    out = fit(
        model,
        opt,
        steps=45,
        checkpoint_dir=tmp / "ckpt",
        checkpoint_every=10,
        log=scanax.CSV(csv),
        log_every=4,
        **kw,
    )
    saved = sorted(int(d.name) for d in (tmp / "ckpt").iterdir() if d.name.isdigit())
    rows = [line.split(",")[0] for line in csv.read_text().splitlines()]
    return out, saved, rows


@pytest.mark.parametrize("case", CASES)
def test_events_land_on_the_same_steps(monkeypatch, tmp_path, case):
    """Chunked (the GPU's plan) against one step per iteration (CPU's):
    the same steps trained, evaluations, checkpoints, log rows and stops at
    the same steps, the same values up to float32 rounding (the two loops
    compile the step differently)."""
    fresh()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "gpu").mkdir()
    one, saved1, rows1 = _run(monkeypatch, "cpu", tmp_path / "cpu", **CASES[case])
    fresh()
    chunked, saved2, rows2 = _run(monkeypatch, "gpu", tmp_path / "gpu", **CASES[case])
    program, _ = newest_program()
    assert program.chunks.plan.k > 1
    assert chunked.steps == one.steps and chunked.best_step == one.best_step
    assert saved2 == saved1 and rows2 == rows1
    assert set(chunked.history) == set(one.history)
    for name, values in one.history.items():
        if name.endswith("step"):
            np.testing.assert_array_equal(chunked.history[name], values)
        else:
            np.testing.assert_allclose(
                chunked.history[name], values, rtol=2e-5, atol=1e-6
            )


def test_a_rollout_collects_at_the_same_steps(monkeypatch):
    import _rollout_job as job

    def run(platform):
        monkeypatch.setattr(_backend, "platform", lambda: platform)
        rollout = scanax.Rollout(job.collect, job.env_reset, epochs=2, minibatches=4)
        return scanax.fit(
            job.params0(),
            TX,
            job.loss_fn,
            rollout,
            steps=36,
            key=KEY,
            progress=False,
            steps_per_call=13,
        )

    one, chunked = run("cpu"), run("gpu")
    np.testing.assert_array_equal(
        chunked.history["rollout_step"], one.history["rollout_step"]
    )
    np.testing.assert_allclose(
        chunked.history["loss"], one.history["loss"], rtol=2e-5, atol=1e-6
    )


def test_a_non_finite_step_stops_at_the_same_step(monkeypatch):
    """A step that is not finite in the middle of a chunk: the call stops
    there with the last good state, as with one step per iteration."""

    def loss(model, batch):
        value, metrics = nnx_loss(model, batch)
        return jnp.where(value < 0.35, jnp.nan, value), metrics

    def run(platform):
        monkeypatch.setattr(_backend, "platform", lambda: platform)
        model, opt = nnx_pair()
        with pytest.warns(RuntimeWarning, match="non-finite"):
            out = scanax.fit(
                model,
                opt,
                loss,
                (X, Y),
                steps=200,
                batch_size=BS,
                key=KEY,
                progress=False,
            )
        return out, jax.tree.leaves(__import__("flax").nnx.state(model))

    (one, state1), (chunked, state2) = run("cpu"), run("gpu")
    assert 0 < chunked.steps == one.steps < 200
    for a, b in zip(state1, state2):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["plain", "evaluation and early stop"])
def test_stepwise_equals_fused(gpu, case):
    """Stepwise execution dispatches the fused loop's chunks one at a time:
    the same arithmetic, bit for bit."""
    fused = fit(steps=45, steps_per_call=20, **CASES[case])
    stepwise = fit(steps=45, steps_per_call=20, execution="stepwise", **CASES[case])
    assert stepwise.execution == "stepwise"
    for name, values in fused.history.items():
        np.testing.assert_array_equal(stepwise.history[name], values)
    for a, b in zip(jax.tree.leaves(fused.model), jax.tree.leaves(stepwise.model)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_stepwise_donates_on_a_tpu_only_large_leaves(monkeypatch, platform):
    """A stepwise step donates its loop state to the next; on a TPU only the
    leaves of at least 64 KiB (a donated small state made the chunk's steps
    twice as slow there: ``stepwise.donated``), elsewhere every leaf. Either
    way stepwise equals fused bit for bit."""
    monkeypatch.setattr(_backend, "platform", lambda: platform)
    fresh()
    params = {"big": jnp.full((128, 128), 0.01), "small": jnp.ones(3)}
    x = jr.normal(KEY, (64, 128))

    def loss(p, b):
        return jnp.mean((b[0] @ p["big"][:, :3] * p["small"] - b[0][:, :3]) ** 2)

    kw = dict(steps=30, batch_size=8, key=KEY, progress=False, steps_per_call=10)
    fused = scanax.fit(params, optax.adam(1e-3), loss, (x,), **kw)
    stepwise = scanax.fit(
        params, optax.adam(1e-3), loss, (x,), execution="stepwise", **kw
    )
    assert stepwise.execution == "stepwise"
    np.testing.assert_array_equal(stepwise.history["loss"], fused.history["loss"])
    for a, b in zip(jax.tree.leaves(fused.model), jax.tree.leaves(stepwise.model)):
        np.testing.assert_array_equal(a, b)
    (program,) = _fit_program.PROGRAMS.values()
    (step,) = program.stepwise.values()
    args = jax.tree.leaves(
        step._step.args_info[0], is_leaf=lambda a: hasattr(a, "donated")
    )
    state = args[step.n_fixed + step.n_env :]
    assert [a.donated for a in args[: step.n_fixed + step.n_env]] == [False] * (
        step.n_fixed + step.n_env
    )
    big = [np.prod(a.shape) * a.dtype.itemsize >= 1 << 16 for a in state]
    assert sum(big) == 3  # the parameter and Adam's two moments
    assert [a.donated for a in state] == (
        big if platform == "tpu" else [True] * len(state)
    )


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest.py)")
def test_donated_counts_a_leafs_share_on_one_device(monkeypatch):
    """On a TPU the size that decides a donation is a leaf's share on one
    device (a split leaf's buffers are its shards); elsewhere every leaf is
    donated."""
    from jax.sharding import NamedSharding, PartitionSpec

    from scanax._fit.stepwise import donated

    f32 = jnp.float32
    split = NamedSharding(jax.make_mesh((4,), ("data",)), PartitionSpec("data"))
    monkeypatch.setattr(_backend, "platform", lambda: "tpu")
    assert donated(jax.ShapeDtypeStruct((128, 128), f32))  # 64 KiB
    assert not donated(jax.ShapeDtypeStruct((127, 128), f32))
    assert not donated(jax.ShapeDtypeStruct((128, 128), f32, sharding=split))
    assert donated(jax.ShapeDtypeStruct((512, 128), f32, sharding=split))
    assert not donated(jnp.zeros(3))
    monkeypatch.setattr(_backend, "platform", lambda: "gpu")
    assert donated(jax.ShapeDtypeStruct((1,), f32)) and donated(jnp.zeros(3))
