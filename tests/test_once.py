"""``_once.once_if``: work where it is due, as a ``lax.cond`` or (inside
``branch_free(True)``, as fit's chunked loop traces its boundaries) a loop of at
most one trip with no conditional: the same values either way, under ``jit``
and ``vmap`` (a batched predicate), against the plain Python choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scanax._once import branch_free, once_if


def work(x, y):
    return {"s": jnp.sin(x) * y, "n": jnp.int32(3)}


def skip(x, y):
    return {"s": x, "n": jnp.int32(0)}


def reference(due, x, y):
    """The Python choice, compiled alone (the same ops XLA compiles in
    ``once_if``'s branch)."""
    return jax.jit(work if due else skip)(x, y)


def same(got, want):
    # (one float32 rounding apart at most: off CPU XLA may fuse the sine with
    # the product in one program and not in the other)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("due", [False, True])
def test_the_same_values_as_the_python_choice(loop, due):
    x, y = jnp.arange(3.0), jnp.float32(2.0)

    def f(due, x, y):
        with branch_free(loop):
            return once_if(due, work, skip, x, y)

    same(jax.jit(f)(due, x, y), reference(due, x, y))


@pytest.mark.parametrize("loop", [False, True])
def test_a_batched_predicate_chooses_per_lane(loop):
    due = jnp.array([True, False, True, False])
    x = jnp.arange(12.0).reshape(4, 3)
    y = jnp.arange(4.0)

    def f(due, x, y):
        with branch_free(loop):
            return once_if(due, work, skip, x, y)

    got = jax.jit(jax.vmap(f))(due, x, y)
    for i in range(4):
        same(jax.tree.map(lambda a: a[i], got), reference(bool(due[i]), x[i], y[i]))


def test_only_the_branch_free_program_holds_no_conditional():
    def program(loop):
        def f(due, x, y):
            with branch_free(loop):
                return once_if(due, work, skip, x, y)

        return jax.jit(f).lower(True, jnp.ones(3), 1.0).compile().as_text()

    assert " conditional(" in program(False)
    looped = program(True)
    assert " conditional(" not in looped and " while(" in looped
    # (restored on the way out: outside ``branch_free``, a conditional again)
    after = jax.jit(lambda due, x, y: once_if(due, work, skip, x, y))
    assert " conditional(" in after.lower(True, jnp.ones(3), 1.0).compile().as_text()
