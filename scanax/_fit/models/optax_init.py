"""The optimizer state ``scanax.fit`` makes for the optax kind: ``tx.init``
traced once per transform and parameter layout and run as one compiled call
(``made_state``), its state of constants filled on the host and kept on the
device for the next fit (``_Init``), what it looks like without making it
(``init_shapes``), and the kept arrays never handed out (``owned``)."""

from __future__ import annotations

import collections
import functools
import math
import threading
from typing import Any

import jax
import jax.extend
import jax.tree_util as jtu
import numpy as np

from ... import _fingerprint

# ``tx.init`` per transform and parameter layout (``_Init``), by the
# transform's fingerprint, the parameters' structure, shapes, dtypes and
# devices, and JAX's settings (the newest ``_INITS_KEPT``, as many as fit keeps
# programs: a key holds a transform's large arrays alive).
_INITS: collections.OrderedDict = collections.OrderedDict()
_INITS_KEPT = 32
_INITS_LOCK = threading.Lock()  # (fit may be called from several threads)


class _Init:
    """``tx.init`` for one parameter layout, traced once: ``traced`` (a
    ``jax.stages.Traced``), or None where one trace would not make what the
    eager init makes: an init that does not trace (it reads values), or one
    whose state holds anything but values it computes (seen while tracing:
    Python numbers, which a trace makes weakly typed arrays, NumPy arrays or
    float64 that x64 off makes float32, an array it closes over). Compiled on
    first use (``run``). Traced anew for each entry (a fresh function:
    ``jax.jit`` would reuse a trace of ``tx.init`` made before a value it
    reads changed)."""

    def __init__(self, tx: Any, params: Any):
        held: list = []

        def init(p):
            state = tx.init(p)
            held.extend(
                x
                for x in jtu.tree_leaves(state)
                if not isinstance(x, jax.core.Tracer) or x.aval.weak_type
            )
            return state

        try:
            # (every argument kept: an init that reads none, as Adam's, runs
            # where the parameters are, as the eager one makes its state there)
            traced = jax.jit(init, keep_unused=True).trace(params)
        except Exception:  # noqa: BLE001 - the eager init is the reference
            traced = None
        self.traced = None if held else traced
        try:  # (the compiled init is the reference: on any doubt, it is used)
            self.fills = None if self.traced is None else _fills(self.traced)
        except Exception:  # noqa: BLE001
            self.fills = None
        if self.fills is not None:
            self.out_tree = jtu.tree_structure(self.traced.out_info)
            self.nbytes = _nbytes(self.fills)
        self.made: tuple | None = None  # (where, the filled arrays), kept
        self._run = None

    def run(self, keep: bool) -> Any:
        """The init: its state made on the host and moved where the
        parameters are, then kept there for the next fit (``fills``: a small
        state of constants, as Adam's zeros), else compiled; None where it
        does not compile. A compiled init is a program of its own, compiled
        at a first call: 67-75 ms on a TPU v5e and 25-40 ms on CPU for Adam
        on a tiny MLP; a kept state costs a later fit neither a transfer nor
        a dispatch (``keep``: not for a fit on a mesh, whose placement may
        alias the kept arrays, so that a fit that runs no step would give them
        back)."""
        if self.fills is not None:
            return functools.partial(self._filled, keep=keep)
        if self._run is None and self.traced is not None:
            try:
                self._run = self.traced.lower().compile()
            except Exception:  # noqa: BLE001 - the eager init is the reference
                self.traced = None
        return self._run

    def _filled(self, params: Any, keep: bool) -> Any:
        """The state of constants (``fills``), where the compiled init would
        make it: on the parameters' device, committed if one of them is. Fit
        never donates the state it starts from, nor gives it back
        (``_owned``). Kept for the next fit, and taken from the one kept, only
        where ``keep``."""
        leaves = [x for x in jtu.tree_leaves(params) if isinstance(x, jax.Array)]
        where = next((x.sharding for x in leaves if x.committed), None)
        made = self.made if keep else None
        if made is None or made[0] != where or any(x.is_deleted() for x in made[1]):
            values = [np.full(s, value, dtype) for s, value, dtype in self.fills]
            made = (where, jax.device_put(values, where))
        if not keep:
            return jtu.tree_unflatten(self.out_tree, made[1])
        with _INITS_LOCK:  # (``_INITS``' most recently used, up to ``_KEPT_BYTES``)
            self.made, held = made, self.nbytes
            for init in reversed(_INITS.values()):
                if init is not self and init.made is not None:
                    held += init.nbytes
                    if held > _KEPT_BYTES:
                        init.made = None
        return jtu.tree_unflatten(self.out_tree, made[1])


def owned(opt_state: Any, started: set) -> Any:
    """``opt_state`` as fit gives it back: the arrays it started from (a run
    that ran no step: an empty iterable) copied, as a kept state of constants
    may be among them, which the next fit starts from, on this thread or
    another, while the user may donate or delete what fit gave back."""
    if not started:
        return opt_state
    return jtu.tree_map(
        lambda x: jax.device_put(x, may_alias=False) if id(x) in started else x,
        opt_state,
    )


# The largest state ``_Init`` makes on the host (bytes): beyond it, the host's
# fill and the transfer cost more than the compile they save. The states kept
# on the device for the next fit (by the inits ``_INITS`` holds, the most
# recently used first), up to ``_KEPT_BYTES`` in all: device memory held after
# the fits that made them. (An init ``_INITS`` dropped goes with its state.)
_FILLED_BYTES = 1 << 22
_KEPT_BYTES = 1 << 24


def _nbytes(fills: list) -> int:
    return sum(math.prod(s) * np.dtype(d).itemsize for s, _, d in fills)


def _fills(traced: Any) -> list | None:
    """``(shape, value, dtype)`` per output of a traced init whose every output
    is a constant or a constant broadcast (as Adam's zeros and count), up to
    ``_FILLED_BYTES`` in all; else None."""
    closed = traced.jaxpr
    made = {}  # the outputs of the broadcasts of a literal
    for eqn in closed.jaxpr.eqns:
        (operand,) = eqn.invars if len(eqn.invars) == 1 else (None,)
        if eqn.primitive.name == "broadcast_in_dim" and _scalar_literal(operand):
            made[eqn.outvars[0]] = operand.val
    fills = []
    for var in closed.jaxpr.outvars:
        if _scalar_literal(var):
            value = var.val
        elif isinstance(var, jax.extend.core.Var) and var in made:
            value = made[var]
        else:
            return None
        if not isinstance(var.aval.dtype, np.dtype):  # (a key's: no NumPy fill)
            return None
        fills.append((var.aval.shape, value, var.aval.dtype))
    return fills if _nbytes(fills) <= _FILLED_BYTES else None


def _scalar_literal(var: Any) -> bool:
    return isinstance(var, jax.extend.core.Literal) and np.shape(var.val) == ()


def _init_of(tx: Any, tx_key: Any, params: Any) -> _Init | None:
    """The cached ``_Init`` of ``tx`` for ``params``; None where none is kept:
    a transform without a fingerprint (a rebuilt one would trace again), or a
    parameter that is not a JAX array on one device."""
    leaves, treedef = jtu.tree_flatten(params)
    if tx_key is None or not all(_on_one_device(x) for x in leaves):
        return None
    key = (
        tx_key,
        treedef,
        tuple((x.shape, x.dtype, _weak(x), x.sharding) for x in leaves),
        # JAX's settings a trace reads: x64, the default device... (jit's own
        # key), and the PRNG implementation, which is not in it
        _fingerprint.trace_context(),
        jax.config.jax_default_prng_impl,
    )
    with _INITS_LOCK:
        found = _INITS.get(key)
        if found is not None:
            _INITS.move_to_end(key)
            return found
    made = _Init(tx, params)
    with _INITS_LOCK:  # (another thread's, made meanwhile, is the one kept)
        found = _INITS.setdefault(key, made)
        if found is not made:
            return found
        while len(_INITS) > _INITS_KEPT:
            _INITS.popitem(last=False)
    return found


def made_state(tx: Any, tx_key: Any, params: Any, keep: bool) -> Any:
    """``tx.init(params)``: one compiled call, not one dispatch per array it
    makes (17 for Adam on four arrays: 3.9 ms a call on a TPU v5e, against 0.6
    ms for one compiled call); eager where no ``_Init`` is kept or it says so."""
    init = _init_of(tx, tx_key, params)
    run = None if init is None else init.run(keep)
    return tx.init(params) if run is None else run(params)


def init_shapes(tx: Any, tx_key: Any, params: Any) -> Any:
    """What ``tx.init(params)`` makes, for a check: its shapes and dtypes (the
    traced ``_Init``'s, no arrays made), or the state itself where tracing
    would not tell."""
    init = _init_of(tx, tx_key, params) or _Init(tx, params)
    return tx.init(params) if init.traced is None else init.traced.out_info


def _weak(x: Any) -> bool:
    return getattr(x, "weak_type", False)  # (a PRNG key array has none)


def _on_one_device(x: Any) -> bool:
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) == 1
    )
