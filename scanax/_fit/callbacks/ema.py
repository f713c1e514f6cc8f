"""``scanax.Ema``: an exponential moving average of the trained parameters,
kept in the compiled loop as part of the training state.

A feature (``_feature``): its leaves follow the model's (and a plateau rule's),
so that everything the loop does to the state it does to the average too: the
last good state after a non-finite step (a step that is not applied does not
update it), float16's skipped steps, checkpoints and their exact resume, an
early stop's best state, a population's members (one average each).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from ..._errors import fit as errors
from .. import feature as _feature
from ..models import population as _population


def check_decay(ema: Any) -> float | None:
    """``ema=`` checked: None, or a decay in ``[0, 1)`` (any real number, a
    NumPy or JAX scalar too)."""
    if ema is None:
        return None
    dtype = getattr(ema, "dtype", None)  # a NumPy or JAX scalar
    scalar = dtype is not None and np.ndim(ema) == 0 and dtype.kind in "iuf"
    if isinstance(ema, bool) or not (isinstance(ema, numbers.Real) or scalar):
        raise errors.ema_type(ema)
    try:
        ema = float(ema)
    except (TypeError, ValueError):
        raise errors.ema_type(ema) from None
    if not 0.0 <= float(ema) < 1.0:
        raise errors.ema_value(ema)
    return float(ema)


@dataclasses.dataclass(frozen=True)
class Ema(_feature.Feature):
    """Keep an exponential moving average of the trained parameters in the
    compiled loop (``scanax.fit(..., callbacks=[scanax.Ema(0.999)])``).

    Conceptually equivalent to (``p``: the trained parameters)::

        e = p                      # before the call's first step (or state=)
        for each step applied:     # (a non-finite or skipped step is not)
            e = decay * e + (1 - decay) * p

    computed in each parameter's dtype. ``result.ema`` is a model of the same
    kind holding the average (at ``best_step`` when an early stop restores the
    best state; a population's: ``result.ema[i]``, per member).

    Arguments:
        decay: in ``[0, 1)`` (a Python or NumPy real).
        on_eval: evaluations (and the early-stop and plateau rules on them)
            use the average instead of the parameters.
        state: ``result.ema`` of an earlier ``fit`` of this model (a
            population's too): the average continues from it instead of
            starting at the parameters. Not part of the compiled program.

    Example:
        >>> import scanax
        >>> scanax.Ema(0.999, on_eval=True)
        Ema(decay=0.999, on_eval=True)
    """

    decay: float
    _: dataclasses.KW_ONLY
    on_eval: bool = False
    state: Any = dataclasses.field(default=None, compare=False, repr=False)

    phase: ClassVar[int] = 20
    field: ClassVar[str] = "ema"

    def __post_init__(self) -> None:
        if self.decay is None:
            raise errors.ema_type(None)
        object.__setattr__(self, "decay", check_decay(self.decay))
        if not isinstance(self.on_eval, bool):
            raise errors.ema_on_eval_type(self.on_eval)

    def leaf_names(self, base: Any) -> list[str]:
        return [f"ema.{base.names[i]}" for i in base.trained()]

    def init_member(self, base: Any, model: list) -> list:
        return [model[i] for i in base.trained()]

    def given_leaves(self, base: Any) -> list | None:
        if self.state is None:
            return None
        if base.members is None:
            given = base.trained_of(self.state)
        else:  # a population's result.ema
            given = getattr(self.state, "leaves", None)
        expected = [base.state[i] for i in base.trained()]
        if given is None or _types(given) != _types(expected):
            raise errors.ema_state_mismatch()
        return [jnp.asarray(a) for a in given]

    def leaf_specs(self, specs: list, base: Any) -> list:
        """The average's annotations are those of its parameters."""
        return [specs[i] for i in base.trained()]

    def wrap_step(self, make: Callable, base: Any, names: list[str]) -> Callable:
        where, decay, at = base.trained(), self.decay, len(names)

        def wrapped(call_for: Callable) -> Callable:
            inner = make(call_for)

            def step(leaves, batch, key, hp):
                new, loss, metrics, grads = inner(leaves[:at], batch, key, hp)
                average = _update(decay, leaves[at:], [new[i] for i in where])
                return [*new, *average], loss, metrics, grads

            return step

        return wrapped

    def eval_view(self, leaves: list, base: Any, at: int) -> list:
        """With ``on_eval``: the average in place of the parameters."""
        if not self.on_eval:
            return leaves
        return averaged(leaves, base.trained(), at)

    def result(self, base: Any, leaves: list, at: int) -> Any:
        where = base.trained()
        if base.members is None:
            return base.model_of(averaged(leaves, where, at)[: len(base.state)])
        return EmaMembers(base, where, list(leaves[at : at + len(where)]))


def averaged(leaves: list, where: list[int], at: int) -> list:
    """``leaves`` with the average (its leaves from ``at``) in place of the
    parameters (positions ``where``)."""
    out = list(leaves)
    for j, i in enumerate(where):
        out[i] = leaves[at + j]
    return out


def _types(leaves: list) -> list:
    return [(jnp.shape(a), jnp.result_type(a)) for a in leaves]


def _update(decay: float, average: list, params: list) -> list:
    return [
        (decay * e + (1.0 - decay) * p.astype(e.dtype)).astype(e.dtype)
        for e, p in zip(average, params)
    ]


class EmaMembers(Sequence):
    """``result.ema`` of a population ``fit``: member ``i``'s averaged model
    (``[i]``), as an ordinary object of its kind; ``leaves``: the averages
    (what ``Ema(state=)`` continues from)."""

    def __init__(self, pop: Any, where: list[int], leaves: list):
        self._pop, self._where, self.leaves = pop, where, leaves

    def __len__(self) -> int:
        return self._pop.n

    def __getitem__(self, i: Any) -> Any:
        i = _population.member_index(i, len(self))
        leaves = [x[i] for x in self._pop.state]
        for j, e in zip(self._where, self.leaves):
            leaves[j] = e[i]
        return self._pop.model_of(i, leaves)
