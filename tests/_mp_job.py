"""Training jobs for tests/test_multiprocess.py, run in real processes.

``python tests/_mp_job.py PROCESS NUM_PROCESSES PORT DEVICES OUT SCENARIO...``
starts one process of a ``jax.distributed`` job on localhost (CPU collectives:
gloo; ``DEVICES`` forced host devices per process), runs each scenario's ``fit``
on the global mesh and writes ``OUT/<scenario>.<PROCESS>.npz``: the history and
the final state (gathered). ``NUM_PROCESSES`` 1 runs without ``jax.distributed``.
A ``ckpt:DIR`` scenario trains with checkpoints in ``DIR`` (resuming from them).

The test process imports this module for the same scenarios in one process.
"""

import os
import sys
import time

if __name__ == "__main__":
    kept = [  # (the test process's other flags: conftest.py's compile options)
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    devices = f"--xla_force_host_platform_device_count={sys.argv[4]}"
    os.environ["XLA_FLAGS"] = " ".join([devices, *kept])
    # On CPU wherever it runs (tests/test_multiprocess.py sets it too): two
    # processes on one GPU fail in NCCL's init.
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import scanax  # noqa: E402

N, BS, STEPS = 64, 16, 12
# NumPy data: nothing may touch JAX's backend before jax.distributed.initialize.
X = np.random.default_rng(0).normal(size=(N, 4)).astype(np.float32)
Y = np.sin(X @ np.array([[1.0], [-2.0], [0.5], [0.25]], np.float32))
CKPT_STEPS, CKPT_EVERY = 64, 16


class MLP(nnx.Module):
    def __init__(self, rngs, annotate=False):
        init = nnx.initializers.lecun_normal()
        if annotate:  # tensor parallel over 'model' (replicated without that axis)
            init = nnx.with_partitioning(init, (None, "model"))
        self.l1 = nnx.Linear(4, 64, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def mesh_for(name):
    n = jax.device_count()
    if name == "fsdp_2x2":
        return jax.make_mesh((n // 2, 2), ("data", "model"))
    return jax.make_mesh((n,), ("data",))


def own_rows(x, mesh):
    """This process's rows of ``x`` (each process holds an equal block, in
    process order), made a global array split over 'data'."""
    k, i = jax.process_count(), jax.process_index()
    rows = x.shape[0] // k
    local = np.asarray(x[i * rows : (i + 1) * rows])
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)


def own_batches(steps):
    """This process's part of every global batch (global batch ``t``: the rows
    ``fit`` would draw in order, ``X[t*BS:(t+1)*BS]`` cycling over epochs)."""
    k, i = jax.process_count(), jax.process_index()
    part = BS // k
    out = []
    for t in range(steps):
        start = (t % (N // BS)) * BS + i * part
        out.append((X[start : start + part], Y[start : start + part]))
    return out


KERNEL = "model['l1']['kernel']"  # a population state leaf's name


def make_member(key, lr):
    """A population member (the ``population`` scenario)."""
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(key))
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def run_population():
    """Four members (each its own learning rate and batches) split over the
    global devices by a ``members`` axis: ``(result, population, None)``."""
    mesh = jax.make_mesh((jax.device_count(),), ("members",))
    lrs = np.array([1e-3, 3e-3, 1e-2, 3e-2], np.float32)
    pop = scanax.population(make_member, n=4, key=jr.key(3), lr=lrs)
    result = scanax.fit(
        pop, None, loss_fn, (X, Y), steps=STEPS, batch_size=BS, key=jr.key(7),
        mesh=mesh, progress=False,
    )  # fmt: skip
    return result, pop, None


def run(name, directory=None):
    """One scenario's fit on the global mesh: ``(result, model, optimizer)``."""
    if name == "population":
        return run_population()
    mesh = mesh_for(name)
    kw = dict(steps=STEPS, progress=False, mesh=mesh)
    data = (X, Y)
    if name in ("array", "fsdp_2x2"):
        kw.update(batch_size=BS, key=jr.key(7), progress=name == "array")
    elif name == "differ":  # process 1 asks for other batches than process 0
        kw.update(batch_size=BS * (1 + jax.process_index()), key=jr.key(7))
    elif name == "fsdp":  # with each process passing only its rows of the data
        data = (own_rows(X, mesh), own_rows(Y, mesh))
        kw.update(batch_size=BS, key=jr.key(7))
    elif name == "iter":
        data = own_batches(STEPS)
    elif name == "ckpt":
        kw.update(batch_size=BS, key=jr.key(7), steps=CKPT_STEPS, steps_per_call=4)
        if directory is not None:
            kw.update(checkpoint_dir=directory, checkpoint_every=CKPT_EVERY)
    if name.startswith("fsdp"):
        kw.update(shard="fsdp")
    # Built without eager sharding: fit places the annotated Variables (under
    # jax.set_mesh every initializer would be compiled for the mesh: seconds).
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0), annotate=name == "fsdp_2x2")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    result = scanax.fit(model, optimizer, loss_fn, data, **kw)
    return result, model, optimizer


def gathered(x):
    """The whole value of a (possibly sharded, multi-process) array, on the host."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jr.key_data(x)
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x.addressable_data(0) if not x.is_fully_addressable else x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def state_leaves(model, optimizer):
    return jtu.tree_leaves((nnx.state(model), nnx.state(optimizer)))


def per_device_bytes(leaves):
    """Bytes of the state on one device: each leaf's shard on the first device."""
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)


def outcome(result, model, optimizer):
    if isinstance(model, scanax.Population):  # the stacked members
        leaves = model.state
        member = result.model[1]  # (every process asks: an SPMD gather)
        kernel = gathered(member.l1.kernel.get_value())
    else:
        leaves = state_leaves(model, optimizer)
    out = {f"leaf{i}": gathered(x) for i, x in enumerate(leaves)}
    out.update({f"history_{k}": v for k, v in result.history.items()})
    if isinstance(model, scanax.Population):
        out["member1_kernel"] = kernel
        out["row1_kernel"] = out[f"leaf{model.names.index(KERNEL)}"][1]
    out["steps"] = np.asarray(result.steps)
    out["bytes"] = np.asarray(per_device_bytes(leaves))
    out["full_bytes"] = np.asarray(sum(x.nbytes for x in leaves))
    return out


def main(argv):
    process, count, port, _, out_dir, *scenarios = argv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if int(count) > 1:
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=int(count),
            process_id=int(process),
            initialization_timeout=60,
            heartbeat_timeout_seconds=2,  # a dead peer ends the job quickly
            shutdown_timeout_seconds=10,
        )
    for scenario in scenarios:
        name, _, directory = scenario.partition(":")
        began = time.perf_counter()
        try:
            out = outcome(*run(name, directory or None))
        except ValueError as err:
            if name != "differ":
                raise
            out = {"error": np.asarray(str(err))}
        out["seconds"] = np.asarray(time.perf_counter() - began)
        np.savez(os.path.join(out_dir, f"{name}.{process}.npz"), **out)
        print(f"{name}: {float(out['seconds']):.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
