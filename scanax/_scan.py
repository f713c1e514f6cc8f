"""The core: ``scanax.scan``, a drop-in superset of ``jax.lax.scan``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.tree_util as jtu

from . import _eager, _errors as errors, _long
from ._loop import call_lowering, check_unroll, move_out_axes, prepare, run_lax
from ._tree import as_int, not_numeric

Carry = TypeVar("Carry")
X = TypeVar("X")
Y = TypeVar("Y")

_CALL = "scanax.scan"


def scan(
    f: Callable[[Carry, X], tuple[Carry, Y]],
    init: Carry,
    xs: X | None = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    in_axes: Any = 0,
    out_axes: Any = 0,
    progress: Any = False,
    remat: Any = False,
    keep_every: int = 1,
    keep: Any = "all",
) -> tuple[Carry, Y]:
    """Scan ``f`` over ``xs`` while carrying state: ``jax.lax.scan``, and more.

    Conceptually equivalent to::

        def scan(f, init, xs, length=None, *, in_axes=0, out_axes=0):
            carry, ys = init, []
            for i in range(length):
                x = tree_map(lambda leaf, ax: leaf if ax is None else take(leaf, i, ax),
                             xs, in_axes)
                carry, y = f(carry, x)
                ys.append(y)
            return carry, stack(ys, axis=out_axes)

    Every call valid for ``jax.lax.scan`` is valid here and gives the same result;
    with no new option it lowers to the same single ``lax.scan``.

    Arguments:
        f: the loop body, ``f(carry, x) -> (carry, y)``.
        init: the initial carry: any pytree. Arrays are carried; other leaves (such
            as functions or strings in an Equinox module) are static and must come
            back unchanged. Flax NNX objects (Modules, Optimizers, Rngs, Variables)
            may be carried: after the scan the objects passed in are updated in
            place to their final state, and also returned. Under ``jax.jit``
            (``jax.vmap``, ``jax.grad``) those are the copies that transformation
            gives the function: return them from it, or use ``nnx.jit``, which
            writes the changes back to yours.
        xs: the values to scan over (or to broadcast, see ``in_axes``).
        length: the number of iterations; required when nothing is scanned.
        reverse, unroll: as in ``jax.lax.scan``.
        in_axes: an int, ``None`` or a pytree prefix of ``xs`` of those. An int
            iterates over that axis of the leaves below it; ``None`` broadcasts
            them: ``f`` gets the same value at every step. Broadcast arrays are
            passed to the loop as operands (not tiled, not baked in as
            constants: no retrace under ``jit`` when their values change) and are
            differentiable. Broadcast non-array leaves (functions, strings, ints,
            optax transforms) reach ``f`` unchanged and are static.
        out_axes: an int or a pytree prefix of ``ys``: where the step axis goes in
            the stacked outputs.
        progress: ``False`` (default: no bar, the same program as without the
            option), ``True``, an int ``every`` or ``scanax.Progress(...)``: a tqdm
            bar updated from inside the compiled loop every ``every`` steps
            (default: about 20 updates). Works under ``jit``, ``grad`` and
            ``vmap`` (one bar for the batch). Needs ``tqdm``.
        remat: ``False`` (default), ``True`` or a ``jax.checkpoint_policies``
            policy to checkpoint ``f`` (reverse mode stores the carries and
            recomputes each step), or ``"sqrt"``: checkpoint chunks of ``√length``
            steps, so reverse mode stores O(√length) carries for one extra
            forward pass.
        keep_every: keep the outputs of every ``keep_every``-th step only:
            ``ys[keep_every - 1::keep_every]`` (``length // keep_every`` of them).
        keep: ``"all"`` (default): stack the kept outputs; ``"last"``: the output
            of the last step run; ``"sum"``/``"mean"``: their sum/mean; or a
            function ``fn(acc, y) -> acc`` folded over each output leaf (e.g.
            ``jnp.maximum``). The reductions use O(1) memory; their ``ys`` has no
            step axis, so ``out_axes`` must stay 0. To stop early, see
            ``scanax.scan_until``; recipes in ``docs/long_scans.md``.

    Returns:
        ``(final_carry, ys)``, as ``jax.lax.scan``.

    Raises:
        TypeError: for a badly structured call: ``f`` not callable or not returning
            a pair, a carry that changes structure, shape or dtype, a non-array
            leaf to scan over, ``in_axes`` holding other than int/None, NNX
            objects in the carry made outside the function being traced (NNX
            lets only the trace that made them write them).
        ValueError: for bad values: disagreeing lengths, axes out of range, no
            way to tell the length, an NNX object that ``f`` changes but does not
            carry.
        TypeError, ValueError: for an invalid ``progress``, ``remat``,
            ``keep_every`` or ``keep`` (naming what is allowed).

    Example:
        >>> import jax.numpy as jnp, scanax
        >>> def step(total, xw):
        ...     x, w = xw
        ...     return total + x @ w, total
        >>> w = jnp.array([1.0, 2.0])
        >>> total, partial = scanax.scan(step, 0.0, (jnp.ones((3, 2)), w),
        ...                              in_axes=(0, None))
        >>> float(total), partial.tolist()
        (9.0, [0.0, 3.0, 6.0])
    """
    check_unroll(_CALL, unroll)
    with _arrays_jax_holds(init, xs):
        return _scan(
            f, init, xs, length, reverse, unroll, in_axes, out_axes, progress,
            remat, keep_every, keep,
        )  # fmt: skip


@contextlib.contextmanager
def _arrays_jax_holds(init: Any, xs: Any) -> Iterator[None]:
    """A ``TypeError`` raised for a NumPy array of strings or objects in
    ``init`` or ``xs`` (JAX's own names no leaf), raised again naming them."""
    try:
        yield
    except TypeError as err:
        rows = [
            (name + jtu.keystr(path), x)
            for name, tree in (("init", init), ("xs", xs))
            for path, x in not_numeric(tree)
        ]
        if not rows:
            raise
        raise errors.not_numeric(_CALL, rows) from err


def _scan(
    f, init, xs, length, reverse, unroll, in_axes, out_axes, progress, remat,
    keep_every, keep,
):  # fmt: skip
    """``scan``, its arguments checked."""
    # Un-jitted: compile once per distinct program. Not with a progress bar: each
    # call has its own bar for the program to report to (so its own program).
    if progress is False and _eager.active():
        if isinstance(length, jax.Array):  # (concrete here: static, as lax.scan's)
            length = length if as_int(length) is None else as_int(length)
        return _eager.call(
            scan,
            f,
            init,
            xs,
            length,
            reverse,
            unroll,
            in_axes=in_axes,
            out_axes=out_axes,
            progress=progress,
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
    loop, codec = prepare(_CALL, f, init, xs, length, in_axes)
    if options is None:
        lowering = lambda: run_lax(loop, reverse, unroll)
    else:
        lowering = lambda: options.run(_CALL, loop, reverse, unroll)
    dynamic, ys = call_lowering(codec, f, lowering)
    if options is not None and options.keep != "all":
        return codec.finish(dynamic), ys
    return codec.finish(dynamic), move_out_axes(_CALL, ys, out_axes)
