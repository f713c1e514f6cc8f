"""``scanax.scan_until``: a scan that stops early, differentiable at the cost of the
steps it takes.

The loop runs as a ``lax.while_loop`` that stops at the stop step, wrapped in a
``jax.custom_jvp`` (on the closure-converted body: values it closes over are
explicit, differentiable inputs). The JVP rule runs the same while loop, storing
each step's linearization (its varying residuals; with ``remat=True`` the carry
entering each step, with ``remat="sqrt"`` every ``c``-th, ``c = √T``) in
preallocated buffers, and returns its tangents as a linear map of the input
tangents with a hand-written transpose:

* forward (``_until_grad.tangents``, for ``jax.jvp``): a while loop over the
  steps taken that pushes tangents through each step (``jax.jvp`` of the step);
* transpose (``_until_grad.cotangents``, for ``jax.grad``): a while loop from the
  stop step down to 0 that pulls cotangents back through each step, its stored
  linearization (with ``remat=True``: ``jax.vjp`` of the step at its stored
  carry; with ``"sqrt"``: one segment of ``c`` carries
  recomputed at a time), accumulating the cotangents of the carry, of the
  broadcast/closed-over values, and of ``xs`` (written at each step's index).

The pair is bound as a ``lax.custom_linear_solve`` whose ``solve`` is the forward
map and ``transpose_solve`` its transpose: JAX then transposes (``grad``), batches
(``vmap``, in either order: a batched loop runs until every example stopped, each
frozen at its own stop by ``while_loop``'s batching rule) and evaluates (``jvp``)
it, and never differentiates a loop over all ``T`` steps. The map is square, as a
solve needs: ``(t_in, 0) -> (0, t_out)``.

Those loops and derivatives live in ``_until_grad``; here are the public face,
the options and the bar. ``keep_every``/``keep`` and ``progress`` transform the
step (an accumulator in the carry, a ``keep_every``-th output slot) and the loop
(a tick per chunk of ``every`` steps, the last report at the stop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.extend.core import jaxprs_in_params

from . import _caller, _eager, _long, _progress, _remat, _thin, _until_grad
from ._errors import long as errors
from ._loop import call_lowering, move_out_axes, prepare
from ._tree import as_int

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
    progress: Any = False,
    remat: Any = False,
    keep_every: int = 1,
    keep: Any = "all",
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

    The loop is a ``lax.while_loop``: the steps after the stop never run, with or
    without gradients. Reverse mode (``jax.grad``, with respect to ``init``,
    ``xs``, broadcast inputs or values ``f`` closes over) stores each step taken's
    linearization (its residuals, as ``lax.scan`` does; values the step only reads
    once) and runs back from the stop: about a ``lax.scan`` of the steps taken, in
    memory ``length`` steps' residuals. ``remat=True`` stores only the carry
    entering each step and recomputes each step going back (``remat="sqrt"``:
    about ``2√length`` carries). Forward mode (``jax.jvp``) runs the steps taken
    once more with their tangents. Derivatives are first order only (a derivative
    of a derivative, e.g. ``jax.hessian``, raises a ``TypeError``).

    ``scanax.scan`` has no ``until=``, so that it always returns the pair
    ``(carry, ys)`` of ``jax.lax.scan``.

    Arguments:
        f, init, xs, length, reverse, in_axes, out_axes: as in ``scanax.scan``.
        unroll: accepted as in ``scanax.scan``; the loops are while loops, which
            do not unroll.
        until: ``until(carry) -> bool``: a function of the carry returning a scalar
            boolean (a Python bool or a ``bool[]`` array).
        progress: as in ``scanax.scan``: the bar's total is ``length`` and it ends
            (and closes) at the stop step. Under ``vmap``, one bar for the batch.
        remat: as in ``scanax.scan``: ``False`` stores each step's residuals under
            ``grad``; ``True`` (or a policy: treated as ``True``) only the carry
            entering each step, recomputing the step going back; ``"sqrt"`` every
            ``⌈√length⌉``-th carry, recomputing one segment at a time.
        keep_every, keep: as in ``scanax.scan``, over the steps run: with
            ``keep="all"`` the kept outputs of steps not run are zeros; the
            reductions (``"last"``, ``"sum"``, ``"mean"``, a function) see only the
            kept outputs of steps run, and are zeros if none ran.

    Returns:
        ``(final_carry, ys, steps)``: ``steps`` is an ``int32[]`` array, the number
        of steps run.

    Raises:
        TypeError: as ``scanax.scan``; if ``until`` is not callable or does not
            return a scalar bool; and inside ``jax.shard_map``, if a value ``f``
            closes over that does not vary over the shards is differentiated
            (cast it with ``jax.lax.pcast(w, axes, to="varying")``).
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
    # Un-jitted: compile once per distinct program; not with a bar (each call has
    # its own bar for the program to report to), as in scanax.scan.
    if progress is False and _eager.active():
        if isinstance(length, jax.Array):  # (concrete here: static, as lax.scan's)
            length = length if as_int(length) is None else as_int(length)
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
            keep_every=keep_every,
            keep=keep,
        )
    options = _long.resolve(
        _CALL,
        progress=progress,
        remat=remat,
        keep_every=keep_every,
        keep=keep,
        out_axes=out_axes,
    )
    if not callable(until):
        raise errors.until_not_callable(until)
    refused = _caller.cannot_bind(until, None)
    if refused is not None:
        raise errors.until_arity(refused[0])
    loop, codec = prepare(_CALL, f, init, xs, length, in_axes)
    spec, remat, keep_every, keep = (
        (options.progress, options.remat, options.keep_every, options.keep)
        if options is not None
        else (None, None, 1, "all")
    )
    if keep_every != 1 or keep != "all":
        _thin.check_length(_CALL, loop.length, keep_every, keep)

    def stop(dynamic):
        return until(codec.decode(dynamic))

    def step(dynamic, x):
        new, y = loop.body(dynamic, x)
        return new, y, jnp.asarray(stop(new))

    init_arrays = jtu.tree_map(jnp.asarray, loop.init)
    _check_until(stop, init_arrays)

    n = loop.length
    stride = _remat.chunk_size(n) if remat == "sqrt" else 1
    # remat=False: each step's linearization stored, not recomputed going back;
    # True (or a policy) and "sqrt" store carries and recompute each step.
    saving = remat is None or remat is False
    ticker = _Ticker(spec, n) if spec is not None and n > 0 else None

    def lowering():
        with jax.named_scope("scanax.until"):
            args = (step, init_arrays, loop.xs, n, reverse, stride, keep_every)
            if keep in ("all",):
                return run_until(*args, ticker, saving)
            return _run_reduced(*args, keep, ticker, saving)

    dynamic, ys, steps = call_lowering(codec, f, lowering)
    if keep != "all":
        return codec.finish(dynamic), ys, steps
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
    """The type of one step's slice of ``xs`` (weak types and the manual mesh
    axes it varies over included; also for ``length=0``)."""
    return jax.eval_shape(
        lambda xs: jtu.tree_map(lambda a: jnp.zeros_like(a, shape=a.shape[1:]), xs),
        xs,
    )


def _promoted(init: Any, new: Any) -> Any:
    """``init`` with each weakly typed leaf (a Python number: ``init=0.0``) whose
    step returns another dtype (``bfloat16`` with ``bfloat16`` ``xs``) promoted to
    the result type, as ``lax.scan`` does (its gradient converts back, to the weak
    ``float32`` ``jax.grad`` gives a Python number); ``init`` itself if none is."""
    if jtu.tree_structure(init) != jtu.tree_structure(new):
        return init  # (reported by the loop, with the paths)

    def one(a, b):
        if not jax.typeof(a).weak_type or a.dtype == b.dtype:
            return a
        return jax.lax.convert_element_type(a, jnp.result_type(a, b))

    out = jtu.tree_map(one, init, new)
    same = all(a is b for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(init)))
    return init if same else out


def _converted(step: Callable, init: Any, xs: Any) -> tuple:
    """``(converted, consts, init, xs, out, axes)``: ``step`` closure-converted
    (``converted(carry, x, *consts)``: the values it closes over explicit), the
    types of its outputs, and the manual mesh axes the loop varies over. A
    weakly typed ``init`` leaf the step returns in another dtype is promoted
    (``_promoted``) and the step traced again: the one trace otherwise.

    Inside ``jax.shard_map`` each shard runs until its own stop, so what the loop
    carries and returns varies over every manual axis that an input or an output
    of the step varies over: ``init`` and ``xs`` are cast to vary over them
    (``jax.lax.pcast``; their gradients are summed over the shards they were
    cast from), and the step traced again. Outside, ``axes`` is ()."""
    while True:
        x0 = _x_example(xs)
        converted, consts = jax.closure_convert(step, init, x0)
        out = jax.eval_shape(converted, init, x0, *consts)
        promoted = _promoted(init, out[0])
        if promoted is not init:  # (traced again with the promoted carry)
            init = promoted
            continue
        axes = _until_grad.manual_axes((init, xs, consts, out))
        leaves = jtu.tree_leaves((init, xs))
        if all(len(_until_grad.manual_axes(a)) == len(axes) for a in leaves):
            if axes:
                _check_no_collectives(converted, (init, x0, *consts), axes)
            return converted, consts, init, xs, out, axes
        init, xs = _until_grad.vary((init, xs), axes)


# Cross-shard operations (not casts): a shard that stopped never joins them.
_NOT_COLLECTIVES = {"pvary", "pcast", "axis_index"}


def _check_no_collectives(fn: Callable, args: tuple, axes: tuple) -> None:
    """Inside ``jax.shard_map``: the step (and ``until``) must not communicate
    over the loop's axes, since each shard stops at its own step."""
    found: list[str] = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            named = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            named = named if isinstance(named, tuple) else (named,)
            if eqn.primitive.name not in _NOT_COLLECTIVES and set(named) & set(axes):
                found.append(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    if found:
        raise errors.until_collective(axes, sorted(set(found)))


def run_until(
    step: Callable,
    init: Any,
    xs: Any,
    length: int,
    reverse: bool,
    stride: int = 1,
    keep_every: int = 1,
    ticker: Any = None,
    saving: bool = True,
) -> tuple[Any, Any, jax.Array]:
    """``step(carry, x) -> (carry, y, stop)`` over arrays; ``(carry, ys, steps)``."""
    converted, consts, init, xs, out, axes = _converted(step, init, xs)
    y_shape = out[1]
    if length == 0:
        ys = _until_grad.stacked(0, y_shape, axes)
        return init, ys, _until_grad.vary(jnp.zeros((), jnp.int32), axes)
    plan = _until_grad.Plan(
        converted, y_shape, length, reverse, stride, keep_every, ticker, saving, axes
    )
    return _until_grad.early_exit(plan)(init, xs, tuple(consts))


# ------------------------------------------------------------------ keep= reductions


def _run_reduced(
    step, init, xs, length, reverse, stride, keep_every, keep, ticker, saving
):
    """``keep`` a reduction: an accumulator (and a count of kept outputs) carried
    next to the carry, folded with each kept output of a step run."""
    x0 = _x_example(xs)
    y_shape = jax.eval_shape(step, init, x0)[1]
    acc0 = _thin.acc_init(keep, y_shape)
    k = keep_every

    def reduced(state, x_t):
        (carry, acc, count), (x, t) = state, x_t
        carry, y, stop = step(carry, x)
        new, _ = _thin.fold(keep, acc, y, count > 0)
        kept = (t + 1) % k == 0
        acc = jtu.tree_map(lambda a, b: jnp.where(kept, b, a), acc, new)
        return (carry, acc, count + kept.astype(jnp.int32)), None, stop

    state0 = (init, acc0, jnp.zeros((), jnp.int32))
    with_t = (xs, jnp.arange(length, dtype=jnp.int32))
    (carry, acc, count), _, steps = run_until(
        reduced, state0, with_t, length, reverse, stride, 1, ticker, saving
    )
    if keep == "mean":
        denom = jnp.maximum(count, 1)
        acc = jtu.tree_map(lambda a: a / denom.astype(a.dtype), acc)
    if keep in ("sum", "mean"):  # back from the wider accumulator
        acc = jtu.tree_map(
            lambda a, s: a.astype(_thin.reduced_dtype(keep, s)), acc, y_shape
        )
    return carry, acc, steps


# ------------------------------------------------------------------ progress=


class _Ticker:
    """One call's bar: in the loop, a report before each chunk of ``every`` steps
    and one at the stop (``tick``, ``end``); on the host (``report``), opened by a
    run's first report (0 steps done), moved to the largest count seen, closed at
    the stop step.

    Under ``vmap`` every example reports (``jax.debug.callback`` runs once per
    example): the first report of the stop closes the bar (at that example's stop,
    or further), the others are late reports of a finished run, dropped until the
    next run starts.
    """

    def __init__(self, spec: _progress.Progress, total: int):
        self.spec, self.total, self.bar = spec, total, None
        self.every = spec.every or _progress.default_every(total)

    def tick(self, done: jax.Array, last: bool = False) -> None:
        with jax.named_scope("scanax.progress"):
            jax.debug.callback(lambda d: self.report(d, last), done)

    def end(self, steps: jax.Array) -> None:
        self.tick(steps, last=True)

    def report(self, done: Any, last: bool) -> None:
        done = int(done)
        if self.bar is None:
            if last or done != 0:
                return  # a late report of a finished run
            self.bar = _progress.open_bar(self.spec, self.total, _CALL)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if last:
            self.bar.close()
            self.bar = None
