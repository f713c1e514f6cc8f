"""What a user's function takes after ``(model, batch)``, one rule for
``scanax.fit``'s ``loss_fn`` and ``eval_fn``, ``scanax.evaluate``'s ``eval_fn``
and ``scanax.predict``'s ``fn``; and whether a function traced with a key uses
it (``uses_key``).

The rule (``arguments``), for one model: the third positional parameter is the
key when it has no default, or when it is named ``key``, ``rng`` or ``rngs``
(with a default too: ``loss_fn(model, batch, rngs=None)`` gets the key, a JAX
key array, which NNX layers such as ``Dropout`` take as ``rngs=``); ``*args``
takes it too. A population's function may take the member's hyperparameters
third (unless that parameter has a key's name) and the key fourth, by the
same rule. Anything else that would silently never get a key is refused, naming
the parameter: a keyword-only parameter with a key's name, and a third
parameter with a default named like a key (``dropout_rng=None``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex

from .._errors import keys as errors

NAMES = errors.NAMES


class Takes(NamedTuple):
    """What a function takes after ``(model, batch)``: a population member's
    hyperparameters (``hp``, third) and a key (``key``: last), and the name
    of the key's parameter (``param``, for messages)."""

    hp: bool
    key: bool
    param: str = "key"
    hp_param: str | None = None  # (the hyperparameters' parameter, by name)


def arguments(
    fn: Callable,
    call: str,
    name: str,
    population: bool = False,
    key: bool = True,
) -> Takes:
    """``Takes`` of ``fn`` by the rule above, its arity checked (at least
    ``(model, batch)``; at most what ``call`` passes). ``key=False``: ``fn``
    takes no key (``predict``'s before it took one)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: called with two
        return Takes(False, False)
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    most = 2 + int(key) + int(population)
    required = [p.name for p in positional if p.default is p.empty]
    if len(required) > most:
        raise errors.too_many(call, name, required, population)
    if len(positional) < 2 and not varargs:
        raise errors.too_few(call, name, [p.name for p in positional], population)
    for p in params:
        if p.kind == p.KEYWORD_ONLY:
            if p.default is p.empty:
                raise errors.keyword_only(call, name, p.name)
            if p.name in NAMES:
                raise errors.key_keyword_only(call, name, p.name)
    extra = positional[2:]
    if not extra:
        return Takes(population and varargs, varargs)
    third = extra[0]
    if not population or third.name in NAMES:
        return Takes(False, _is_key(third, call, name), third.name)
    fourth = extra[1:2]
    if not fourth:
        hp = third.default is third.empty or varargs
        return Takes(hp, varargs, "key", third.name if hp else None)
    return Takes(True, _is_key(fourth[0], call, name), fourth[0].name, third.name)


def _is_key(p: inspect.Parameter, call: str, name: str) -> bool:
    if p.default is p.empty or p.name in NAMES:
        return True
    lowered = p.name.lower()
    if "key" in lowered or "rng" in lowered:
        raise errors.key_like(call, name, p.name)
    return False


def uses_key(fn: Callable, args: Sequence[Any], index: int) -> bool:
    """Whether any output of ``fn(*args)`` depends on ``args[index]`` (traced:
    ``args`` may be ``jax.ShapeDtypeStruct``s). Conservative: an equation with
    a traced input that depends on it makes all of its outputs depend on it,
    except inside calls of a nested program (``jax.jit``, ``jax.checkpoint``,
    custom derivatives), which are followed (not loops: a loop's carry is
    taken as depending on every input)."""
    closed = jax.make_jaxpr(fn)(*args)
    sizes = [len(jax.tree_util.tree_leaves(a)) for a in args]
    first = sum(sizes[:index])
    invars = closed.jaxpr.invars[first : first + sizes[index]]
    marks = [any(v is w for w in invars) for v in closed.jaxpr.invars]
    return any(depends(closed.jaxpr, marks))


def depends(jaxpr: Any, tainted_in: list[bool], cut: tuple = ()) -> list[bool]:
    """For each output of ``jaxpr``, whether it depends on an input marked in
    ``tainted_in``; the outputs of primitives named in ``cut`` (e.g.
    ``stop_gradient``, for a gradient's dependence) depend on nothing. With a
    ``cut``, a call with custom derivatives is not followed (its outputs
    depend on all its inputs): its rule, not its primal program, says what
    its gradient depends on (a straight-through estimator's primal is under
    ``stop_gradient``)."""
    tainted = {v for v, t in zip(jaxpr.invars, tainted_in) if t}

    def hit(v: Any) -> bool:
        return not isinstance(v, jex.Literal) and v in tainted

    for eqn in jaxpr.eqns:
        marks = [hit(v) for v in eqn.invars]
        if not any(marks) or eqn.primitive.name in cut:
            continue
        custom = cut and eqn.primitive.name.startswith("custom_")
        inner = None if custom else _inner(eqn)
        if inner is not None:
            outs = depends(inner, marks, cut)
            tainted.update(v for v, t in zip(eqn.outvars, outs) if t)
        else:
            tainted.update(eqn.outvars)
    return [hit(v) for v in jaxpr.outvars]


# Calls of one nested program whose inputs and outputs are the equation's.
_CALLS = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
)


def _inner(eqn: Any) -> Any:
    """The nested program called by ``eqn``, or None."""
    if eqn.primitive.name not in _CALLS:
        return None
    found = [
        getattr(p, "jaxpr", p)
        for p in eqn.params.values()
        if isinstance(p, (jex.Jaxpr, jex.ClosedJaxpr))
    ]
    if len(found) != 1:
        return None
    inner = found[0]
    if len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
        return None
    return inner
