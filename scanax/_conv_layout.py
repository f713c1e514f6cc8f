"""Convolutions in a canonical layout, so that they run at full speed in loop bodies.

On XLA:CPU a convolution inside a loop body (``lax.scan``, ``lax.while_loop``) is
fast only in the layout XLA's CPU runtime calls directly: ``NHWC`` input, ``HWIO``
kernel, ``NHWC`` output (and their 1-D and 3-D kin). The forward pass of a Flax or
Equinox model is usually in that layout; its backward pass is not: JAX emits the
kernel gradient with dimension numbers such as ``CHWN``/``IHWO``/``HWNC`` and the
input gradient with a flipped kernel, and inside a loop body those run 17-28 times
slower than the same convolution outside one (200 Adam steps of a small CNN: 0.19 s
as a Python loop of a jitted step, 3.6 s as one jitted ``lax.scan``).

This module rewrites a traced program so that every convolution is the canonical
one between transposes: the operands are transposed to ``(batch, spatial...,
feature)`` and ``(spatial..., in, out)``, convolved with the same strides, padding,
dilations, group counts, precision and element type, and the result transposed
back to the layout the program asked for. The values are the same convolution's
(the same sums, in the order XLA picks for it). Convolutions nested in ``jit``,
``closed_call``, ``checkpoint``, ``scan``, ``while_loop``, ``cond`` and custom
JVP/VJP calls (their primal function) are rewritten too; other primitives that
hold programs (``shard_map``, ``pmap``, custom transposes) are left as they are.

* :func:`applies`: whether a backend needs it (CPU only, measured; the backend
  read from ``_backend.platform``).
* :func:`has_conv`: whether a program holds a convolution, at any depth.
* :func:`eval_rewritten` / :func:`rewrite`: the rewriting interpreter, and the
  rewritten program as a ``ClosedJaxpr``.
* :func:`wrap`: a function rewritten when traced (``scanax.scan``'s loop body).
* :func:`replay`: ``jax.core.eval_jaxpr``, rewritten where needed (fit's step).
"""

from __future__ import annotations

import contextlib
import functools as ft
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _backend, _caller, _errors as errors

# What the rewrite needs of JAX beyond its public API: the program types
# (``jax.extend.core``) and, to keep each equation's source and name stack in
# the rewritten program, ``jax.extend.source_info_util``. Both are JAX's
# extension API, not ``jax._src``; on a JAX without them scanax still imports
# and runs: without the program types the rewrite switches itself off (with a
# warning, once, where it would have applied), without source information it
# rewrites with the trace's own.
try:
    from jax.extend import core as _core
except ImportError:  # pragma: no cover - an unknown JAX
    _core = None
try:
    from jax.extend import source_info_util as _source_info
except ImportError:  # pragma: no cover - an unknown JAX
    _source_info = None

_CONV = "conv_general_dilated"

# Primitives whose sub-programs are rewritten (each takes its programs as
# parameters and keeps their signature). Others are bound unchanged.
_NESTED = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "remat",
        "remat2",
        "checkpoint",
        "scan",
        "while",
        "cond",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
    }
)


def applies(backend: str) -> bool:
    """Whether convolutions are rewritten on ``backend`` ("cpu", "gpu", "tpu"...).

    CPU only, measured: XLA:CPU runs a non-canonical convolution 17-28x slower in
    a loop body than outside one, and the canonical one at full speed. Other
    backends pick their own layouts (cuDNN, the TPU compiler) and were not
    measured, so their programs are left as they are.
    """
    return backend == "cpu"


# ---------------------------------------------------------------------------- search


def _jaxprs(params: dict) -> Iterator[Any]:
    for val in params.values():
        for v in val if isinstance(val, (tuple, list)) else (val,):
            if isinstance(v, _core.Jaxpr):
                yield v
            elif isinstance(v, _core.ClosedJaxpr):
                yield v.jaxpr


def has_conv(closed_jaxpr: Any) -> bool:
    """Whether a program holds a ``conv_general_dilated``, at any depth.

    Arguments:
        closed_jaxpr: a ``ClosedJaxpr`` (what ``jax.make_jaxpr`` returns) or a
            ``Jaxpr``.

    Returns:
        True if any equation, or any equation of a program in an equation's
        parameters (``jit``, custom JVP/VJP, ``scan``/``while``/``cond`` bodies,
        ``checkpoint``...), is a convolution.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> conv = lambda x, w: jax.lax.conv(x, w, (1,), "SAME")
        >>> x, w = jnp.ones((1, 1, 5)), jnp.ones((1, 1, 3))
        >>> has_conv(jax.make_jaxpr(jax.jit(conv))(x, w))
        True
        >>> has_conv(jax.make_jaxpr(jnp.sin)(x))
        False
    """
    return _has_conv(_open(closed_jaxpr), {})


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, _core.ClosedJaxpr) else jaxpr


def _has_conv(jaxpr: Any, seen: dict[int, bool]) -> bool:
    key = id(jaxpr)
    if key not in seen:
        seen[key] = False  # (a program holds no cycle; this only memoizes)
        seen[key] = any(
            eqn.primitive.name == _CONV
            or any(_has_conv(sub, seen) for sub in _jaxprs(eqn.params))
            for eqn in jaxpr.eqns
        )
    return seen[key]


# ---------------------------------------------------------------------------- conv


def _perms(dn: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The transposes that bring lhs, rhs and out from ``dn``'s layout to the
    canonical one: ``(batch, spatial..., feature)``, ``(spatial..., in, out)``."""
    lhs = (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])
    rhs = (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])
    out = (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1])
    return lhs, rhs, out


def canonical_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """The canonical dimension numbers of an ``ndim``-dimensional convolution
    (``ndim = 4``: ``NHWC``/``HWIO``/``NHWC``)."""
    n = ndim
    feature = (0, n - 1, *range(1, n - 1))
    return lax.ConvDimensionNumbers(
        lhs_spec=feature, rhs_spec=(n - 1, n - 2, *range(n - 2)), out_spec=feature
    )


def is_canonical(params: dict) -> bool:
    """Whether a ``conv_general_dilated`` equation's parameters are canonical."""
    dn = params["dimension_numbers"]
    return dn == canonical_numbers(len(dn.lhs_spec))


def _transpose(x: Any, perm: tuple[int, ...]) -> Any:
    return x if perm == tuple(range(len(perm))) else lax.transpose(x, perm)


def _conv(eqn: Any, lhs: Any, rhs: Any) -> Any:
    """``eqn`` (a convolution) on ``lhs`` and ``rhs``, in the canonical layout."""
    params = eqn.params
    if is_canonical(params) or params.get("out_sharding") is not None:
        # (an output sharding names the equation's own axes: left as it is)
        return eqn.primitive.bind(lhs, rhs, **params)
    lhs_perm, rhs_perm, out_perm = _perms(params["dimension_numbers"])
    canonical = canonical_numbers(len(lhs_perm))
    # Group counts need no care: batch_group_count splits the batch dimension
    # and feature_group_count the feature dimension, wherever those lie.
    with jax.named_scope("scanax.conv_layout"):
        out = eqn.primitive.bind(
            _transpose(lhs, lhs_perm),
            _transpose(rhs, rhs_perm),
            **{**params, "dimension_numbers": canonical},
        )
        return _transpose(out, tuple(int(i) for i in np.argsort(out_perm)))


# ---------------------------------------------------------------- interpreter


def eval_rewritten(closed_jaxpr: Any, consts: Any, *args: Any) -> list[Any]:
    """Evaluate a program as ``jax.core.eval_jaxpr`` does, convolutions canonical.

    Every equation is bound as it is, except convolutions (bound in the
    canonical layout between transposes) and the programs nested in ``jit``,
    ``checkpoint``, ``scan``, ``while_loop``, ``cond`` and custom JVP/VJP
    calls that hold a convolution (rewritten, then bound).

    Arguments:
        closed_jaxpr: a ``ClosedJaxpr`` or a ``Jaxpr``.
        consts: the values of its constants (``closed_jaxpr.consts``).
        *args: the values of its inputs, flat.

    Returns:
        The list of its outputs, flat.
    """
    jaxpr = _open(closed_jaxpr)
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    seen: dict[int, bool] = {}
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        with _source_of(eqn), eqn.ctx.manager:
            if eqn.primitive.name == _CONV:
                outs = _conv(eqn, *invals)
            else:
                params = eqn.params
                if eqn.primitive.name in _NESTED and any(
                    _has_conv(sub, seen) for sub in _jaxprs(params)
                ):
                    params = {k: _rewrite_param(v) for k, v in params.items()}
                bind = eqn.primitive.get_bind_params(params)
                outs = eqn.primitive.bind(*invals, **bind)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _source_of(eqn: Any) -> Any:
    """The equation's traceback and name stack, for what it binds (nothing
    without ``jax.extend.source_info_util``)."""
    if _source_info is None:
        return contextlib.nullcontext()
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    return _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)


def _rewrite_param(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_rewrite_param(v) for v in value)
    if isinstance(value, _core.ClosedJaxpr) and has_conv(value):
        return rewrite(value)
    if isinstance(value, _core.Jaxpr) and has_conv(value):
        closed = rewrite(_core.ClosedJaxpr(value, ()))
        # An open program (checkpoint's) must stay open; the rewrite adds no
        # constants (transposes and convolutions only), so this holds.
        return closed.jaxpr if not closed.consts else value
    return value


def rewrite(closed_jaxpr: Any) -> Any:
    """The program with every convolution canonical, as a new ``ClosedJaxpr``.

    Arguments:
        closed_jaxpr: a ``ClosedJaxpr``.

    Returns:
        A ``ClosedJaxpr`` of the same inputs and outputs (shapes, dtypes, weak
        types) computing the same values, its convolutions in the canonical
        layout. A program without a convolution is returned as it is.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> conv = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")  # NCHW, OIHW
        >>> x, w = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3))
        >>> closed = rewrite(jax.make_jaxpr(conv)(x, w))
        >>> [str(e.params["dimension_numbers"].lhs_spec) for e in closed.eqns
        ...  if e.primitive.name == "conv_general_dilated"]
        ['(0, 3, 1, 2)']
        >>> (y,) = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, w)
        >>> bool(jnp.allclose(y, conv(x, w)))
        True
    """
    if not has_conv(closed_jaxpr):
        return closed_jaxpr
    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
        for a in closed_jaxpr.in_avals
    ]
    return jax.make_jaxpr(
        lambda *args: eval_rewritten(closed_jaxpr, closed_jaxpr.consts, *args)
    )(*avals)


# --------------------------------------------------------------- entry points


def _needed() -> bool:
    if not applies(_backend.platform()) or jax.config.jax_disable_jit:
        return False
    if _core is None:
        _warn_unavailable()
        return False
    return True


@ft.cache
def _warn_unavailable() -> None:
    warnings.warn(
        errors.conv_layout_unavailable(jax.__version__),
        RuntimeWarning,
        stacklevel=_caller.user_level(),
    )


def replay(closed_jaxpr: Any, *flat_args: Any) -> list[Any]:
    """``jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat_args)``, with
    convolutions canonical where the backend needs it (see :func:`applies`).

    Arguments:
        closed_jaxpr: a ``ClosedJaxpr``.
        *flat_args: the values of its inputs, flat.

    Returns:
        The list of its outputs, flat.
    """
    if _needed() and has_conv(closed_jaxpr):
        return eval_rewritten(closed_jaxpr, closed_jaxpr.consts, *flat_args)
    return jax.core.eval_jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, *flat_args)


def wrap(fn: Callable) -> Callable:
    """``fn``, its convolutions canonical when it is traced on a backend that
    needs it (see :func:`applies`).

    The wrapper traces ``fn`` to a program; one without a convolution is
    replayed as it is, equation by equation (the program that ``fn`` itself
    would give; ``fn`` is traced once), one with convolutions is evaluated by
    :func:`eval_rewritten`. Under ``jax.disable_jit`` or on other backends it is
    ``fn``.

    Arguments:
        fn: a function of arrays (pytrees of them) to arrays.

    Returns:
        A function of ``fn``'s signature and values.
    """

    @ft.wraps(fn)
    def wrapped(*args: Any) -> Any:
        if not _needed():
            return fn(*args)
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = replay(closed, *jtu.tree_leaves(args))
        return jtu.tree_unflatten(jtu.tree_structure(shapes), flat)

    return wrapped
