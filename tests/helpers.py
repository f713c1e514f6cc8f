"""What several test files share: ``close`` (two pytrees equal leaf by leaf, within
a tolerance), ``leaves_equal`` (exactly equal), ``ref_scan`` (``scanax.scan``'s
semantics as a Python loop), ``count_compiles`` (backend compiles inside a
block) and ``scan_counts`` (a scan equation's constants and carry, across JAX
versions). What fit's test files share (its task and models) is in ``fit_helpers``."""

from __future__ import annotations

import csv
import logging
import os

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

# The jobs tests start (kill -9 and resume) run where this process runs, except
# on a TPU, which admits one process: there conftest.py sends them to the CPU,
# so the reference for a job's result is made by a job too (an uninterrupted
# one), not in this process (a TPU's numbers are not the CPU's).
JOBS_RUN_ELSEWHERE = jax.default_backend() == "tpu"


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a job this process starts: this process's (conftest.py's
    choices), with ``devices`` host devices."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    return " ".join([f"--xla_force_host_platform_device_count={devices}", *flags])


def working_bytes(compiled) -> int:
    """A compiled program's working memory beyond its arguments, as XLA reports
    it: XLA:CPU as temporaries (its peak holds arguments and outputs alone),
    XLA:TPU in its peak (temporaries 0 there, seen on a v5e)."""
    m = compiled.memory_analysis()
    peak = (getattr(m, "peak_memory_in_bytes", 0) or 0) - m.argument_size_in_bytes
    return max(m.temp_size_in_bytes, peak)


def to_numpy(x):
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        x = jr.key_data(x)
    return np.asarray(x)


def close(a, b, *, rtol, atol, structure=True, types=False):
    """Assert that ``a`` and ``b`` hold the same values, leaf by leaf.

    Every file states its own tolerance (``ft.partial(close, rtol=..., atol=...)``).
    ``structure``: the two pytree structures are equal (else only the number of
    leaves). ``types``: each pair of leaves also has the same shape and dtype.
    Callable leaves (functions kept as static fields) must be the same object; PRNG
    keys compare by their data.
    """
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    if structure:
        assert jtu.tree_structure(a) == jtu.tree_structure(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if callable(x) and not hasattr(x, "shape"):
            assert x is y
            continue
        if types:
            assert jnp.shape(x) == jnp.shape(y)
            assert jnp.result_type(x) == jnp.result_type(y)
        np.testing.assert_allclose(to_numpy(x), to_numpy(y), rtol=rtol, atol=atol)


def leaves_equal(a, b):
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jr.key_data(x), jr.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class count_compiles:
    """``with count_compiles() as c: ...``: ``c.n`` programs built inside: backend
    compiles, and programs loaded from JAX's persistent compilation cache (which
    conftest.py turns on), each of which jit's in-memory caches missed."""

    COMPILED = "/jax/core/compile/backend_compile_duration"
    LOADED = "/jax/compilation_cache/cache_hits"

    def __enter__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._compiled)
        jax.monitoring.register_event_listener(self._loaded)
        return self

    def _compiled(self, event, duration, **kwargs):
        self.n += event == self.COMPILED

    def _loaded(self, event, **kwargs):
        self.n += event == self.LOADED

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._compiled)
        jax.monitoring.unregister_event_listener(self._loaded)


_TRACES = "scanax-tests.traces"


def traced(name: str) -> None:
    """Record that ``name`` ran (called from a function while it is traced)."""
    logging.getLogger(_TRACES).info(name)


class count_traces(logging.Handler):
    """Counts ``traced(name)`` records, by name, while open. A function that
    counts its own traces this way keeps its fingerprint: it reads only the
    ``logging`` library (a counter object it read itself would make it have
    none, and fit traces such a function again at every call)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __enter__(self):
        logger = logging.getLogger(_TRACES)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(_TRACES).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.names.append(record.getMessage())

    def __getitem__(self, name: str) -> int:
        return self.names.count(name)


def ref_scan(f, init, xs=None, length=None, reverse=False, in_axes=0, out_axes=0):
    """The semantics of scanax.scan, as a Python loop."""
    axes = _broadcast_axes(in_axes, xs)
    leaves, treedef = jtu.tree_flatten(xs)
    ax_leaves = treedef.flatten_up_to(axes) if leaves else []
    if length is None:
        length = next(x.shape[a] for x, a in zip(leaves, ax_leaves) if a is not None)
    carry, ys = init, []
    steps = range(length)
    for i in reversed(steps) if reverse else steps:
        sl = [
            x if a is None else jnp.take(x, i, axis=a)
            for x, a in zip(leaves, ax_leaves)
        ]
        carry, y = f(carry, jtu.tree_unflatten(treedef, sl))
        ys.append(y)
    if reverse:
        ys = ys[::-1]
    if not ys:
        return carry, None
    stacked = jtu.tree_map(lambda *a: jnp.stack(a), *ys)
    return carry, jtu.tree_map(
        lambda y, ax: jnp.moveaxis(y, 0, ax),
        stacked,
        _broadcast_axes(out_axes, stacked),
    )


def _broadcast_axes(axes, tree):
    if axes is None or isinstance(axes, int):
        return jtu.tree_map(lambda _: axes, tree)
    return jtu.tree_map(
        lambda a, sub: jtu.tree_map(lambda _: a, sub),
        axes,
        tree,
        is_leaf=lambda x: x is None,
    )


def scan_counts(eqn):
    """``(consts, carry)``: how many of a ``scan`` equation's inputs are
    constants of its body and how many are the carry (the rest are ``xs``).

    The one place tests read these from a jaxpr: JAX names them by version
    (``num_consts``/``num_carry`` parameters up to 0.10; from 0.11 a flat tree
    ``ft_in`` of (consts, carry, xs) that sorts the inputs)."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
    return len(consts), len(carry)


def read_csv(path):
    """The rows of a CSV file, as dicts of strings."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_tensorboard(logdir):
    """``{tag: [(step, value), ...]}`` as TensorBoard shows it (purges applied)."""
    import pytest

    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


@jax.custom_jvp
def poison(u, bad):
    """0 in value; a NaN gradient for ``u`` where ``bad``, else 0: a step whose
    loss is finite and whose gradients are not."""
    return jnp.zeros((), u.dtype)


@poison.defjvp
def _poison_jvp(primals, tangents):
    u, bad = primals
    return poison(u, bad), jnp.where(bad, jnp.nan, 0.0) * jnp.sum(tangents[0])
