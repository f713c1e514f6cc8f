"""The loops of ``scanax.scan_until`` (``_until``) and its derivatives.

The primal is a ``lax.while_loop`` that stops at the stop step (``forward``),
wrapped in a ``jax.custom_jvp`` (``early_exit``). Its rule runs the same loop,
storing the carry entering each step (every ``stride``-th with
``remat="sqrt"``), and gives the tangents as a linear map over the steps taken
only: forward mode pushes tangents through each step (``tangents``), reverse
mode walks back from the stop step running each step's ``jax.vjp`` at its
stored carry (``cotangents``, ``Back``). The map and its transpose are bound as
a ``lax.custom_linear_solve`` (``linear``), JAX's one public primitive that is
transposable, batchable and evaluable at once, so ``jax.jvp``, ``jax.grad`` and
``vmap`` in any order all work; derivatives are first order.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Literal
from jax.extend.core.primitives import convert_element_type_p

from ._errors import long as errors, short_type

# ------------------------------------------------------------------ the loop plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the loops of one call share.

    ``step(carry, x, *consts) -> (carry, y, stop)``; step ``i`` reads ``xs[t]``
    (``t = i``, or ``length - 1 - i`` with ``reverse``); its output goes to row
    ``t // keep_every`` of ``ys`` if ``(t + 1) % keep_every == 0``, else to a
    scratch row past the end. ``stride``: the carry entering step ``i`` is stored
    (for the gradient) when ``i % stride == 0``.
    """

    step: Callable
    y_shape: Any
    length: int
    reverse: bool
    stride: int
    keep_every: int
    ticker: Any = None
    saving: bool = False  # store each step's linearization (remat=False)
    axes: tuple = ()  # the manual mesh axes (shard_map) the loop varies over

    @property
    def rows(self) -> int:  # kept outputs, plus the scratch row when thinned
        kept = self.length // self.keep_every
        return kept + (self.keep_every > 1)

    @property
    def slots(self) -> int:  # stored carries, plus a scratch slot when strided
        return -(-self.length // self.stride) + (self.stride > 1)

    def index(self, i: jax.Array) -> jax.Array:
        return self.length - 1 - i if self.reverse else i

    def row(self, t: jax.Array) -> jax.Array:
        k = self.keep_every
        if k == 1:
            return t
        return jnp.where((t + 1) % k == 0, t // k, self.rows - 1)

    def slot(self, i: jax.Array) -> jax.Array:
        k = self.stride
        if k == 1:
            return i
        return jnp.where(i % k == 0, i // k, self.slots - 1)

    def trim(self, ys: Any) -> Any:
        if self.keep_every == 1:
            return ys
        return jtu.tree_map(lambda a: a[: self.rows - 1], ys)


def take(tree: Any, i: jax.Array) -> Any:
    return jtu.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)


def put(tree: Any, value: Any, i: jax.Array) -> Any:
    return jtu.tree_map(
        lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value
    )


def stacked(rows: int, tree: Any, axes: tuple = ()) -> Any:
    """Zeros of ``rows`` of each leaf, varying over its manual axes and ``axes``."""

    def one(s):
        return vary(jnp.zeros((rows, *s.shape), s.dtype), (*manual_axes(s), *axes))

    return jtu.tree_map(one, tree)


# ------------------------------------------------------------------ types


def manual_axes(tree: Any) -> tuple:
    """The manual mesh axes (inside ``jax.shard_map``) that any leaf of ``tree``
    (arrays or shape/dtype structs) varies over, sorted; () outside."""
    found: set = set()
    for a in jtu.tree_leaves(tree):
        mat = getattr(a, "manual_axis_type", None)  # a ShapeDtypeStruct's
        if mat is None and not isinstance(a, jax.ShapeDtypeStruct):
            mat = getattr(jax.typeof(a), "mat", None)
        found.update(getattr(mat, "varying", ()))
    return tuple(sorted(found, key=str))


def vary(tree: Any, axes: tuple) -> Any:
    """``tree`` with each array leaf cast (``jax.lax.pcast``) to vary over the
    manual mesh axes ``axes`` it does not vary over yet."""
    if not axes:
        return tree

    def one(a):
        missing = tuple(n for n in axes if n not in manual_axes(a))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jtu.tree_map(one, tree)


def retyped(a: Any, like: Any) -> Any:
    """``a`` with the dtype and weak type of ``like``: a linear map's outputs
    have exactly the types ``custom_linear_solve`` declares for them (those of
    its inputs), so that a gradient has its input's type (a Python number's
    weak ``float32``, as ``jax.grad`` gives it) with or without ``jit``."""
    t = jax.typeof(a)
    weak = bool(getattr(like, "weak_type", False))
    if t.dtype == like.dtype and t.weak_type == weak:
        return a
    # (``lax.convert_element_type`` cannot make a weak type; its primitive can)
    return convert_element_type_p.bind(
        a, new_dtype=like.dtype, weak_type=weak, sharding=None
    )


def is_float(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def float_mask(tree: Any) -> list[bool]:
    return [is_float(a) for a in jtu.tree_leaves(tree)]


def floats(tree: Any, mask: list[bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` that ``mask`` marks (default: the inexact ones)."""
    leaves = jtu.tree_leaves(tree)
    mask = float_mask(tree) if mask is None else mask
    return [a for a, m in zip(leaves, mask) if m]


def merged(tree: Any, floats: list[Any], mask: list[bool] | None = None) -> Any:
    """``tree`` with the leaves ``mask`` marks replaced by ``floats``, in order."""
    leaves, treedef = jtu.tree_flatten(tree)
    mask = float_mask(tree) if mask is None else mask
    it = iter(floats)
    return jtu.tree_unflatten(
        treedef, [next(it) if m else a for a, m in zip(leaves, mask)]
    )


def tangent_tree(tree: Any, floats: list[Any]) -> Any:
    """Tangents of ``tree``: ``floats`` for its inexact leaves, symbolic zeros
    for the others (float0, with the manual axes the leaf varies over)."""
    zeros = jtu.tree_map(lambda a: SymbolicZero(jax.typeof(a).to_tangent_aval()), tree)
    return merged(zeros, floats, float_mask(tree))


class Active(NamedTuple):
    """Which leaves of ``(init, xs, consts)`` have tangents (not symbolic zeros,
    inexact): the linear map's inputs."""

    init: list[bool]
    xs: list[bool]
    consts: list[bool]

    @staticmethod
    def of(primals: Any, tangents: Any) -> Active:
        def one(p, t):
            return [
                is_float(a) and not isinstance(b, SymbolicZero)
                for a, b in zip(jtu.tree_leaves(p), jtu.tree_leaves(t))
            ]

        return Active(*(one(p, t) for p, t in zip(primals, tangents)))

    def tangents(self, tangents: Any) -> list[Any]:
        """The tangents of the active leaves, in order."""
        return [
            t
            for tree, mask in zip(tangents, self)
            for t, m in zip(jtu.tree_leaves(tree), mask)
            if m
        ]

    def split(self, flat: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        a, b = sum(self.init), sum(self.init) + sum(self.xs)
        return list(flat[:a]), list(flat[a:b]), list(flat[b:])


# ------------------------------------------------------------------ the forward loop


class State(NamedTuple):
    i: jax.Array  # steps run
    done: jax.Array
    carry: Any
    ys: Any
    stored: Any  # the carries stored for the gradient (None: not stored)


def loop(plan: Plan, body: Callable, state: Any, ticker: Any = None) -> Any:
    """``while i < length and not done: state = body(state)``; with a ``ticker``,
    in chunks of its ``every`` steps, reporting before each and at the stop."""
    n = plan.length

    def steps_to(limit):
        return lambda s: (s.i < limit) & ~s.done

    if ticker is None:
        return jax.lax.while_loop(steps_to(n), body, state)

    def chunk(s):
        ticker.tick(s.i)
        limit = jnp.minimum(s.i + ticker.every, n)
        return jax.lax.while_loop(steps_to(limit), body, s)

    state = jax.lax.while_loop(steps_to(n), chunk, state)
    ticker.end(state.i)
    return state


def forward(
    plan: Plan, init: Any, xs: Any, consts: Any, store: bool, saved: Any = None
) -> State:
    """Run until the stop; with ``store``, keep the carries for the gradient (with
    a ``Saved`` layout: each step's linearization, its varying residuals)."""

    def body(s):
        t = plan.index(s.i)
        stored, x = s.stored, take(xs, t)
        if saved is not None:
            (carry, y, stop), leaves = saved.linearize(s.carry, x)
            stored = put(stored, saved.varying(leaves), s.i)
        else:
            if store:
                stored = put(stored, s.carry, plan.slot(s.i))
            carry, y, stop = plan.step(s.carry, x, *consts)
        return State(s.i + 1, stop, carry, put(s.ys, y, plan.row(t)), stored)

    if saved is not None:
        stored = stacked(plan.slots, saved.buffers, plan.axes)
    else:
        stored = stacked(plan.slots, init, plan.axes) if store else None
    # Inside shard_map each shard stops at its own step: the count, the flag and
    # the outputs vary over the loop's axes.
    zero, done = vary((jnp.zeros((), jnp.int32), jnp.zeros((), bool)), plan.axes)
    ys = stacked(plan.rows, plan.y_shape, plan.axes)
    state = State(zero, done, init, ys, stored)
    return loop(plan, body, state, plan.ticker)


def early_exit(plan: Plan) -> Callable:
    @jax.custom_jvp
    def fn(init, xs, consts):
        s = forward(plan, init, xs, consts, store=False)
        return s.carry, plan.trim(s.ys), s.i

    @ft.partial(fn.defjvp, symbolic_zeros=True)
    def fn_jvp(primals, tangents):
        primals = first_order(primals)
        active = Active.of(primals, tangents)
        check_consts_vary(plan, primals[2], active.consts)
        t_in = active.tangents(tangents)
        saved = Saved.of(plan, primals, active) if plan.saving and t_in else None
        s = forward(plan, *primals, store=True, saved=saved)
        out = (s.carry, plan.trim(s.ys))
        res = Residuals(*primals, s.stored, s.i, active, saved)
        t_out = [jnp.zeros_like(a) for a in floats(out)]
        if t_in:
            with jax.named_scope("scanax.until_grad"):
                t_out = linear(plan, res, t_in, t_out)
        t_carry, t_ys, t_steps = tangent_tree((*out, s.i), t_out)
        return (*out, s.i), (t_carry, t_ys, t_steps)

    return fn


def check_consts_vary(plan: Plan, consts: Any, mask: list[bool]) -> None:
    """Inside ``jax.shard_map``: each value the step reads and is differentiated
    with respect to varies over the loop's axes. One that does not is cast
    inside the step (``pvary``), and the cast's transpose is a ``psum``: one per
    step of the loop back, which a shard that stopped earlier does not run."""
    if not plan.axes:
        return
    found = [
        (short_type(a), manual_axes(a))
        for a in floats(consts, mask)
        if manual_axes(a) != plan.axes
    ]
    if found:
        raise errors.until_invariant_closure(plan.axes, found)


@jax.custom_jvp
def first_order(primals: Any) -> Any:
    """``primals``, unchanged; differentiated (the rule's inputs carrying
    tangents of an outer differentiation: a second-order derivative), a named
    error instead of ``custom_linear_solve``'s."""
    return primals


@ft.partial(first_order.defjvp, symbolic_zeros=True)
def _first_order_jvp(primals, tangents):
    if any(not isinstance(t, SymbolicZero) for t in jtu.tree_leaves(tangents)):
        raise errors.until_second_order()
    return primals, tangents


def linear(plan: Plan, res: Any, t_in: list[Any], like_out: list[Any]) -> Any:
    """``tangents(t_in)``, transposed by ``cotangents``: a square linear map
    ``(t_in, 0) -> (0, t_out)`` bound as a ``custom_linear_solve``."""
    # Its transpose needs all of the right side linear in the tangents: the zeros
    # are made from the first one.
    anchor = jnp.sum(t_in[0]) * 0
    zeros_out = [
        vary(jnp.broadcast_to(anchor.astype(a.dtype), a.shape), manual_axes(a))
        for a in like_out
    ]
    types_in = [jax.typeof(a) for a in t_in]
    types_out = [jax.typeof(a) for a in zeros_out]

    def solve(_, b):
        t_out = tangents(plan, res, b[0])
        return [jnp.zeros_like(a) for a in b[0]], list(map(retyped, t_out, types_out))

    def transpose_solve(_, ct):
        ct_in = cotangents(plan, res, ct[1])
        return list(map(retyped, ct_in, types_in)), [jnp.zeros_like(a) for a in ct[1]]

    return jax.lax.custom_linear_solve(
        lambda v: v, (t_in, zeros_out), solve, transpose_solve
    )[1]


class Residuals(NamedTuple):
    init: Any
    xs: Any
    consts: Any
    stored: Any
    steps: jax.Array
    active: Active
    saved: Any = None  # a ``Saved`` layout: ``stored`` holds residuals


class Saved:
    """The layout of one step's linearization, stored for the backward loop
    (``remat=False``): the leaves of ``jax.vjp``'s function of the step (its
    residuals), those that vary from step to step stored per step, those that
    depend only on the broadcast values computed once.

    Which are which is read from the jaxpr of the step's linearization: a
    residual varies if it depends on the carry or the step's ``x``. The loop
    replays that jaxpr (``linearize``): the user's step is traced once.
    """

    def __init__(self, closed, out_tree, treedef, mask, fixed, buffers, k):
        self.closed, self.out_tree, self.treedef = closed, out_tree, treedef
        self.mask, self.fixed, self.k = mask, fixed, k
        self.buffers = buffers  # ShapeDtypeStructs of the varying leaves

    @staticmethod
    def of(plan: Plan, primals: Any, active: Active) -> Saved | None:
        """The layout; None where its ``length`` rows would take more than
        ``BUDGET`` bytes (the loops then store carries and recompute each step,
        as with ``remat=True``)."""
        init, xs, consts = primals
        x0 = take(xs, 0)
        k = floats(consts, active.consts)
        holder = []

        def leaves(carry, x, k):  # the step's outputs, then its residuals
            out, vjp = _vjp(plan, active, consts, carry, x, k)
            flat, treedef = jtu.tree_flatten(vjp)
            holder.append(treedef)
            return out, flat

        closed, (out_shape, shapes) = jax.make_jaxpr(leaves, return_shape=True)(
            init, x0, k
        )
        jaxpr = closed.jaxpr
        out_tree = jtu.tree_structure(out_shape)
        residuals = jaxpr.outvars[out_tree.num_leaves :]
        n_vary = len(jtu.tree_leaves(init)) + len(jtu.tree_leaves(x0))
        flags = [i < n_vary for i in range(len(jaxpr.invars))]
        mask = _varying(jaxpr.replace(outvars=residuals), flags)
        buffers = [s for s, m in zip(shapes, mask) if m]  # (with their axes)
        row = sum(b.size * b.dtype.itemsize for b in buffers)
        if row * plan.slots > BUDGET:
            return None
        # The fixed leaves, once, from the equations they need only (not the
        # step, whose callbacks would run once more).
        outs = [v for v, m in zip(residuals, mask) if not m]
        needed = {v for v in outs if _var(v)}
        kept = []
        for eqn in reversed(jaxpr.eqns):
            if any(v in needed for v in eqn.outvars):
                kept.append(eqn)
                needed.update(v for v in eqn.invars if _var(v))
        pruned = jaxpr.replace(eqns=kept[::-1], outvars=outs)
        args = jtu.tree_leaves((init, x0, k))
        fixed = jax.core.eval_jaxpr(pruned, closed.consts, *args)
        return Saved(closed, out_tree, holder[0], mask, fixed, buffers, k)

    def linearize(self, carry: Any, x: Any) -> tuple[Any, list[Any]]:
        """One step and the leaves of its linearization (the traced jaxpr
        replayed)."""
        args = jtu.tree_leaves((carry, x, self.k))
        flat = jax.core.eval_jaxpr(self.closed.jaxpr, self.closed.consts, *args)
        n = self.out_tree.num_leaves
        return jtu.tree_unflatten(self.out_tree, flat[:n]), list(flat[n:])

    def varying(self, leaves: list[Any]) -> list[Any]:
        return [a for a, m in zip(leaves, self.mask) if m]

    def vjp(self, varying: list[Any]) -> Callable:
        """The step's ``jax.vjp`` function from its stored varying residuals."""
        fixed, vary = iter(self.fixed), iter(varying)
        leaves = [next(vary) if m else next(fixed) for m in self.mask]
        return jtu.tree_unflatten(self.treedef, leaves)


# The most bytes the stored linearizations of one call may take (their
# ``length`` rows, zeroed on each call): beyond it, carries are stored instead.
BUDGET = 256 * 2**20

# Primitives that apply one jaxpr to their inputs, one to one (``jit``, calls,
# ``jax.checkpoint``, custom derivatives' primal): which of their outputs vary
# is read inside. Loops (``while``, ``scan``) and ``cond`` are not: their
# outputs are taken to vary with any varying input.
_CALLS = {
    "jit", "pjit", "closed_call", "core_call", "checkpoint", "remat",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
}  # fmt: skip


def _var(v: Any) -> bool:
    return not isinstance(v, Literal)


def _varying(jaxpr: Any, flags: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs ``flags`` marks."""
    vary = {v for v, f in zip(jaxpr.invars, flags) if f}
    for eqn in jaxpr.eqns:
        ins = [_var(v) and v in vary for v in eqn.invars]
        if not any(ins):
            continue
        inner = _inner(eqn)
        outs = [True] * len(eqn.outvars) if inner is None else _varying(inner, ins)
        vary.update(v for v, f in zip(eqn.outvars, outs) if f)
    return [_var(v) and v in vary for v in jaxpr.outvars]


def _inner(eqn: Any) -> Any:
    """The jaxpr a call-like equation applies to its inputs, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    for param in eqn.params.values():
        inner = getattr(param, "jaxpr", param)  # (a ClosedJaxpr's own)
        if (
            hasattr(inner, "eqns")
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def _vjp(plan: Plan, active: Active, consts: Any, carry: Any, x: Any, k: Any):
    """``(step outputs, jax.vjp function)`` of the step at ``carry``, ``x``, as a
    function of the inexact leaves of the carry and the active leaves of ``x``
    and the consts (``k``, those of the consts)."""

    def fn(c, x_, k_):
        new, y, stop = plan.step(
            merged(carry, c),
            merged(x, x_, active.xs),
            *merged(consts, k_, active.consts),
        )
        return (floats(new), floats(y)), (new, y, stop)

    _, vjp, out = jax.vjp(fn, floats(carry), floats(x, active.xs), k, has_aux=True)
    return out, vjp


# ------------------------------------------------------------------ the derivatives


def tangents(plan: Plan, res: Residuals, t_in: list[Any]) -> list[Any]:
    """Forward mode: the tangents of the float leaves of ``(carry, ys)``."""
    act = res.active
    t_init, t_xs, t_k = act.split(t_in)
    # Every float leaf of the carry has a tangent (zero where init's has none).
    full = [jnp.zeros_like(a) for a in floats(res.init)]
    t_carry0 = floats(merged(merged(res.init, full), t_init, act.init))

    def body(s):
        i, carry, t_carry, t_ys = s
        t = plan.index(i)
        fn, primals = float_step(plan, res, carry, take(res.xs, t))
        tangents = (t_carry, take(t_xs, t), t_k)
        _, (t_new, t_y), new = jax.jvp(fn, primals, tangents, has_aux=True)
        return i + 1, new, t_new, put(t_ys, t_y, plan.row(t))

    t_ys = stacked(plan.rows, floats(plan.y_shape), plan.axes)
    zero = vary(jnp.zeros((), jnp.int32), plan.axes)
    state = (zero, res.init, t_carry0, t_ys)
    _, _, t_carry, t_ys = jax.lax.while_loop(lambda s: s[0] < res.steps, body, state)
    return [*t_carry, *plan.trim(t_ys)]


def float_step(plan: Plan, res: Residuals, carry: Any, x: Any) -> tuple:
    """The step as a function of the inexact leaves of its carry and the active
    leaves of ``x`` and the consts (returning the inexact leaves of its new carry
    and output, and the new carry), and those arguments."""
    act = res.active

    def fn(c, x_, k):
        new, y, _ = plan.step(
            merged(carry, c), merged(x, x_, act.xs), *merged(res.consts, k, act.consts)
        )
        return (floats(new), floats(y)), new

    return fn, (floats(carry), floats(x, act.xs), floats(res.consts, act.consts))


def cotangents(plan: Plan, res: Residuals, ct_out: list[Any]) -> list[Any]:
    """Reverse mode: the cotangents of the active leaves of ``(init, xs, consts)``,
    from those of ``(carry, ys)``: back from the stop step, one step at a time."""
    act = res.active
    n_carry = len(floats(res.init))
    g, ct_ys = list(ct_out[:n_carry]), list(ct_out[n_carry:])
    if plan.keep_every > 1:  # the scratch row reads as a zero cotangent
        ct_ys = [jnp.concatenate([a, jnp.zeros_like(a[:1])]) for a in ct_ys]
    g_xs = [jnp.zeros_like(a) for a in floats(res.xs, act.xs)]
    g_k = [jnp.zeros_like(a) for a in floats(res.consts, act.consts)]
    back = Back(plan, res, ct_ys)
    if plan.stride == 1:
        g, g_xs, g_k = back.steps(res.stored, 0, 0, res.steps, (g, g_xs, g_k))
    else:
        g, g_xs, g_k = back.segments((g, g_xs, g_k))
    g_init = floats(merged(res.init, g), act.init)
    return [*g_init, *g_xs, *g_k]


@dataclasses.dataclass(frozen=True)
class Back:
    """The backward loops: over stored carries (``steps``), or over segments of
    ``stride`` steps, each recomputed from its stored first carry (``segments``)."""

    plan: Plan
    res: Residuals
    ct_ys: list[Any]

    def steps(self, carries, offset, lo, hi, acc):
        """Steps ``hi - 1`` down to ``lo``; the carry entering step ``j`` is
        ``carries[j - offset]``."""
        plan, res = self.plan, self.res

        def body(s):
            j, (g, g_xs, g_k) = s
            t = plan.index(j)
            if res.saved is not None:  # the step's stored linearization
                vjp = res.saved.vjp(take(carries, j - offset))
            else:  # the step recomputed from its stored carry
                carry, x = take(carries, j - offset), take(res.xs, t)
                fn, primals = float_step(plan, res, carry, x)
                _, vjp, _ = jax.vjp(fn, *primals, has_aux=True)
            g, g_x, g_kj = vjp((g, take(self.ct_ys, plan.row(t))))
            g_xs = put(g_xs, g_x, t)
            g_k = [a + b for a, b in zip(g_k, g_kj)]
            return j - 1, (g, g_xs, g_k)

        _, acc = jax.lax.while_loop(lambda s: s[0] >= lo, body, (hi - 1, acc))
        return acc

    def segments(self, acc):
        plan, res, k = self.plan, self.res, self.plan.stride
        seg0 = stacked(k, res.init)

        def recompute(start, end):
            def body(s):
                j, carry, seg = s
                seg = put(seg, carry, j - start)
                x = take(res.xs, plan.index(j))
                return j + 1, plan.step(carry, x, *res.consts)[0], seg

            first = take(res.stored, start // k)
            state = (start, first, seg0)
            return jax.lax.while_loop(lambda s: s[0] < end, body, state)[2]

        def body(s):
            segment, acc = s
            start = segment * k
            end = jnp.minimum(start + k, res.steps)
            acc = self.steps(recompute(start, end), start, start, end, acc)
            return segment - 1, acc

        last = (res.steps - 1) // k
        return jax.lax.while_loop(lambda s: s[0] >= 0, body, (last, acc))[1]
