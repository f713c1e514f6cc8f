"""``scanax.scan_until``: a scan that stops early, and stays reverse-differentiable.

Two lowerings of the same loop, chosen by JAX's own differentiation machinery:

* the primal is a ``lax.while_loop``: without gradients, the steps after the stop
  are never run;
* it is wrapped in a ``jax.custom_jvp`` whose rule is the JVP of a ``lax.scan`` over
  all ``T`` steps, where a ``lax.cond`` on a ``done`` flag skips (freezes the carry,
  outputs zeros) every step after the stop. JAX linearizes and transposes that
  scan for reverse mode, so ``jax.grad`` works, also from outside a ``jax.jit``.
  When a ``vmap`` inside the differentiation batches the loop, a ``jnp.where``
  replaces the ``cond`` (see ``_any_batched``).

The body is closure-converted first (``jax.closure_convert``), so values it closes
over are explicit, differentiable inputs of the custom JVP.
"""

from __future__ import annotations

import functools as ft
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _eager, _remat
from ._errors import long as errors
from ._loop import Loop, call_lowering, move_out_axes, prepare

Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")

_CALL = "scanax.scan_until"


def scan_until(
    f: Callable[[Carry, X], tuple[Carry, Y]],
    init: Carry,
    xs: X | None = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    until: Callable[[Carry], Any],
    in_axes: Any = 0,
    out_axes: Any = 0,
    remat: Any = False,
) -> tuple[Carry, Y, jax.Array]:
    """``scanax.scan`` that ends after the first step whose new carry satisfies
    ``until``.

    Conceptually equivalent to::

        def scan_until(f, init, xs, length=None, *, until):
            carry, ys, steps = init, [zeros_like(y)] * length, 0
            for i in range(length):  # reversed(range(length)) with reverse=True
                carry, ys[i] = f(carry, xs[i])
                steps += 1
                if until(carry):
                    break
            return carry, stack(ys), steps

    ``until`` is checked after each step, never on ``init``, so at least one step
    runs when ``length > 0``. The bound is static (``length`` or the length of
    ``xs``), so ``ys`` always has the full length: the outputs of the steps not
    run are zeros (with ``reverse=True`` the zeros are at the front).

    Without gradients, the loop is a ``lax.while_loop``: the steps after the stop
    cost nothing. Under ``jax.grad``/``jax.jvp`` (with respect to ``init``, ``xs``,
    broadcast inputs or values ``f`` closes over) it differentiates a ``lax.scan``
    over all ``length`` steps in which the steps after the stop are skipped by a
    ``lax.cond``: reverse mode then stores residuals for every step (as
    ``lax.scan`` would), and skipped steps cost only the loop's overhead.

    ``scanax.scan`` has no ``until=``, so that it always returns the pair
    ``(carry, ys)`` of ``jax.lax.scan``.

    Arguments:
        f, init, xs, length, reverse, unroll, in_axes, out_axes: as in
            ``scanax.scan`` (``unroll`` applies to the differentiated scan).
        remat: as in ``scanax.scan``, for the differentiated scan: ``True`` or a
            ``jax.checkpoint_policies`` policy checkpoints each step; ``"sqrt"``
            nests it in √T checkpointed chunks (O(√T) carries stored).
        until: ``until(carry) -> bool``: a function of the carry returning a scalar
            boolean (a Python bool or a ``bool[]`` array).

    Returns:
        ``(final_carry, ys, steps)``: ``steps`` is an ``int32[]`` array, the number
        of steps run.

    Raises:
        TypeError: as ``scanax.scan``; and if ``until`` is not callable or does not
            return a scalar bool.
        ValueError: as ``scanax.scan``.

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> def step(x, _):
        ...     return x * 2.0, x
        >>> x, ys, steps = scanax.scan_until(step, 1.0, length=10,
        ...                                  until=lambda x: x > 10.0)
        >>> float(x), int(steps), ys.tolist()
        (16.0, 4, [1.0, 2.0, 4.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    """
    if _eager.active():  # un-jitted: compile once per distinct program
        return _eager.call(
            scan_until,
            f,
            init,
            xs,
            length,
            reverse,
            unroll,
            until=until,
            in_axes=in_axes,
            out_axes=out_axes,
            remat=remat,
        )
    loop, codec = prepare(_CALL, f, init, xs, length, in_axes)
    remat = _remat.resolve(_CALL, remat)
    if not callable(until):
        raise errors.until_not_callable(until)

    def stop(dynamic):
        return until(codec.decode(dynamic))

    init_arrays = jtu.tree_map(jnp.asarray, loop.init)
    _check_until(stop, init_arrays)

    def step(dynamic, x):
        new, y = loop.body(dynamic, x)
        return new, y, jnp.asarray(stop(new))

    if remat is not None and remat != "sqrt":
        step = _remat.checkpoint(step, remat)

    def lowering():
        with jax.named_scope("scanax.until"):
            return run_until(
                step,
                init_arrays,
                loop.xs,
                loop.length,
                reverse,
                unroll,
                sqrt=remat == "sqrt",
            )

    dynamic, ys, steps = call_lowering(codec, f, lowering)
    return codec.finish(dynamic), move_out_axes(_CALL, ys, out_axes), steps


def _check_until(stop: Callable, init: Any) -> None:
    try:
        out = jax.eval_shape(stop, init)
    except TypeError as err:
        if "not a valid JAX type" not in str(err):
            raise
        out = None
    dtype = getattr(out, "dtype", None)
    shape = getattr(out, "shape", None)
    if shape != () or dtype != jnp.bool_:
        raise errors.until_not_bool(out)


def _x_example(xs: Any) -> Any:
    def one(a):
        t = jax.typeof(a)
        return jax.ShapeDtypeStruct(t.shape[1:], t.dtype, weak_type=t.weak_type)

    return jtu.tree_map(one, xs)


def run_until(
    step: Callable,
    init: Any,
    xs: Any,
    length: int,
    reverse: bool,
    unroll: Any,
    sqrt: bool = False,
) -> tuple[Any, Any, jax.Array]:
    """``step(carry, x) -> (carry, y, stop)`` over arrays; ``(carry, ys, steps)``.
    With ``sqrt``, the differentiated scan is √T-checkpointed."""
    converted, consts = jax.closure_convert(step, init, _x_example(xs))
    y_shape = jax.eval_shape(converted, init, _x_example(xs), *consts)[1]
    if length == 0:
        ys = jtu.tree_map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_shape)
        return init, ys, jnp.zeros((), jnp.int32)
    fn = _early_exit(converted, y_shape, length, reverse, unroll, sqrt)
    return fn(init, xs, tuple(consts))


def _zeros(shapes: Any) -> Any:
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _early_exit(step, y_shape, length, reverse, unroll, sqrt):
    @jax.custom_jvp
    def fn(init, xs, consts):
        return _while(step, y_shape, length, reverse, init, xs, consts)

    @fn.defjvp
    def fn_jvp(primals, tangents):
        select = _any_batched(primals)
        scan = ft.partial(
            _masked_scan, step, y_shape, length, reverse, unroll, select, sqrt
        )
        return jax.jvp(scan, primals, tangents)

    return fn


def _while(step, y_shape, length, reverse, init, xs, consts):
    """The primal: stops running steps at the stop."""

    def cond(state):
        i, done, _, _ = state
        return (i < length) & ~done

    def body(state):
        i, _, carry, ys = state
        t = length - 1 - i if reverse else i
        x = jtu.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, t, 0, False), xs)
        carry, y, stop = step(carry, x, *consts)
        ys = jtu.tree_map(
            lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, t, 0), ys, y
        )
        return i + 1, stop, carry, ys

    ys0 = jtu.tree_map(lambda s: jnp.zeros((length, *s.shape), s.dtype), y_shape)
    state = (jnp.zeros((), jnp.int32), jnp.zeros((), bool), init, ys0)
    steps, _, carry, ys = jax.lax.while_loop(cond, body, state)
    return carry, ys, steps


def _any_batched(tree: Any) -> bool:
    """Whether a ``vmap`` inside the differentiation batches these values.

    A ``lax.cond`` with a batched predicate becomes a select whose operands go
    through ``stop_gradient``; inside this JVP rule those operands include
    tangents, and JAX cannot transpose ``stop_gradient`` (``grad(vmap(...))``
    fails). Batched, both branches run anyway, so a select costs the same.
    """
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # pragma: no cover - a JAX without it: always select
        return True
    return any(isinstance(x, BatchTracer) for x in jtu.tree_leaves(tree))


def _masked_scan(
    step, y_shape, length, reverse, unroll, select, sqrt, init, xs, consts
):
    """The differentiable twin: all steps, those after the stop skipped by a cond
    (or, when batched, run and discarded by a select)."""

    def run(carry, x):
        return step(carry, x, *consts)

    def skip(carry, x):
        return carry, _zeros(y_shape), jnp.ones((), bool)

    def masked(done, carry, x):
        new, y, stop = run(carry, x)
        keep = ft.partial(jnp.where, done)
        carry = jtu.tree_map(keep, carry, new)
        y = jtu.tree_map(lambda v: keep(jnp.zeros_like(v), v), y)
        return carry, y, stop

    def body(state, x):
        carry, done, steps = state
        if select:
            carry, y, stop = masked(done, carry, x)
        else:
            carry, y, stop = jax.lax.cond(done, skip, run, carry, x)
        return (carry, done | stop, steps + (~done).astype(jnp.int32)), y

    state = (init, jnp.zeros((), bool), jnp.zeros((), jnp.int32))
    if sqrt:
        loop = Loop(body, state, xs, length)
        (carry, _, steps), ys, _ = _remat.run_sqrt(loop, reverse, unroll)
        return carry, ys, steps
    (carry, _, steps), ys = jax.lax.scan(
        body, state, xs, length=length, reverse=reverse, unroll=unroll
    )
    return carry, ys, steps
