"""Property test: scanax.scan equals a Python loop on random pytrees.

Random nesting of dicts/tuples/lists, mixed dtypes, scanned and broadcast parts
(different in_axes), static (non-array) leaves, lengths including 0, reverse.
"""

import functools as ft

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from helpers import close as _close, ref_scan
from hypothesis import HealthCheck, given, settings, strategies as st

import scanax

close = ft.partial(_close, rtol=1e-5, atol=1e-5)

DTYPES = [np.float32, np.int32, np.float16, np.bool_]


@st.composite
def leaves(draw, length):
    """(value, in_axes) for one leaf of xs."""
    kind = draw(st.sampled_from(["scan0", "scan1", "bcast", "static"]))
    dtype = draw(st.sampled_from(DTYPES))
    extra = draw(st.lists(st.integers(1, 3), max_size=2))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    if kind == "static":
        return draw(st.sampled_from(["tag", 3, np.tanh, None])), None
    if kind == "scan1":
        shape, axis = (extra[:1] or [2]) + [length] + extra[1:], 1
    elif kind == "scan0":
        shape, axis = [length, *extra], 0
    else:
        shape, axis = extra, None
    value = (rng.standard_normal(shape) * 3).astype(dtype)
    return value, axis


@st.composite
def trees(draw, length, depth=2):
    if depth == 0 or draw(st.booleans()):
        return draw(leaves(length))
    n = draw(st.integers(1, 3))
    children = [draw(trees(length, depth - 1)) for _ in range(n)]
    container = draw(st.sampled_from(["tuple", "list", "dict"]))
    if container == "dict":
        return (
            {f"k{i}": v for i, (v, _) in enumerate(children)},
            {f"k{i}": a for i, (_, a) in enumerate(children)},
        )
    kind = tuple if container == "tuple" else list
    return kind(v for v, _ in children), kind(a for _, a in children)


def step(carry, x):
    """Touch every array leaf, cast back to the carry's dtype."""
    total, count = carry
    arrays = [a for a in jtu.tree_leaves(x) if isinstance(a, jax.Array)]
    s = sum((jnp.sum(a.astype(jnp.float32)) for a in arrays), jnp.float32(0))
    statics = [a for a in jtu.tree_leaves(x) if not isinstance(a, jax.Array)]
    bump = jnp.float32(len(statics))
    new = (total * 0.5 + s + bump, count + 1)
    return new, {"s": s, "first": arrays[0] if arrays else s}


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    length=st.integers(0, 4),
    data=st.data(),
    reverse=st.booleans(),
)
def test_scan_equals_python_loop(length, data, reverse):
    xs, in_axes = data.draw(trees(length))
    init = (jnp.float32(1.0), jnp.int32(0))
    has_scanned = any(a is not None for a in jtu.tree_leaves(in_axes))
    n = None if has_scanned and data.draw(st.booleans()) else length
    got = scanax.scan(step, init, xs, n, reverse=reverse, in_axes=in_axes)
    if length == 0:
        assert int(got[0][1]) == 0 and float(got[0][0]) == 1.0
        return
    want = ref_scan(step, init, _as_jax(xs), length, reverse=reverse, in_axes=in_axes)
    close(got, want, rtol=1e-3, atol=1e-3)


def _as_jax(xs):
    return jtu.tree_map(
        lambda a: jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a, xs
    )
