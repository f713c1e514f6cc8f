"""``scanax.population``: many independent members (seeds x hyperparameters),
built by one ``make`` function and trained together by ``scanax.fit``.

The members' states are stacked on a leading member axis. ``fit`` vmaps its
compiled loop over that axis; each member's optimizer is rebuilt inside the
compiled step from its own (traced) hyperparameters, by calling ``make`` again
while tracing: an ``optax.adam(lr)`` whose ``lr`` is a Python float in ``make``
receives a traced array, so one program serves every value.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ... import _caller, _fingerprint, _tree
from ..._errors import population as errors, short_type
from .. import mesh as _mesh
from . import (
    adapt as _models,
    nnx as _models_nnx,
    optax as _models_optax,
    trainstate as _models_trainstate,
)

_CALL = errors.CALL


class Population:
    """``n`` members built by ``make(key_i, **{name: values[i]})``, stacked.

    Made by :func:`population`; trained by ``scanax.fit(pop, None, loss_fn, ...)``,
    which updates it in place (as NNX objects are) and continues where the last
    call stopped.

    Attributes:
        n: the number of members.
        hyperparameters: ``{name: values}``, NumPy arrays of length ``n``.
        step: steps trained so far (the population's clock; a member stopped by a
            non-finite step keeps its own count, see ``stopped``).
        stopped: a boolean array: members stopped by a non-finite loss or
            gradient. They keep their last good state and are not trained by later
            ``fit`` calls.
    """

    def __init__(self, make: Callable, n: int, key: Any, hyperparameters: dict):
        self.make = make
        self.n = n
        keys = jr.split(key, n)
        self._hp = {k: jnp.asarray(v) for k, v in hyperparameters.items()}
        self.state, self.treedef, self.kind, self.names = _build(make, keys, self._hp)
        # (made under jax.set_mesh, keys would not trace under fit's own mesh,
        # made Auto, where ``make`` is traced with one of them)
        self.keys = _mesh.off_explicit_mesh(keys)
        self.step = 0
        self.stopped = np.zeros(n, bool)
        self._members: dict[int, tuple] = {}
        self._trained: list[int] | None = None
        self._updates: bool | None = None

    @property
    def members(self) -> int:
        """The population's size (``_feature.Base``)."""
        return self.n

    def trained(self) -> list[int]:
        """The positions of the trained parameters among a member's leaves."""
        if self._trained is None:
            self._trained = self.adapter(0).trained()
        return self._trained

    def updates(self) -> bool:
        """Whether a member's ``loss_fn`` may return a third element (a
        TrainState's updates, an Equinox model's new ``eqx.nn.State``); asked
        of a member's adapter once (it runs ``make``), as ``trained``."""
        if self._updates is None:
            self._updates = self.kind == "trainstate" or bool(
                getattr(self.adapter(0), "held", False)
            )
        return self._updates

    def __len__(self) -> int:
        return self.n

    @property
    def hyperparameters(self) -> dict:
        """``{name: values}``: the values the members get (NumPy, in the dtype
        they are traced in)."""
        return {k: np.asarray(v) for k, v in self._hp.items()}

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={short_type(v)}" for k, v in self._hp.items())
        return (
            f"scanax.Population({self.kind}, n={self.n}, step={self.step}"
            + (f", {hp}" if hp else "")
            + ")"
        )

    def fingerprint(self) -> Any:
        """What the compiled loop depends on: ``make``'s code (and everything it
        names), the kind, the hyperparameters' names, dtypes and shapes; None when
        ``make`` cannot be fingerprinted."""
        make = _fingerprint.of(self.make)
        if make is None:
            return None
        hp = tuple(
            (k, v.dtype.name, v.shape, bool(getattr(v, "weak_type", False)))
            for k, v in self._hp.items()
        )
        return ("population", make, self.kind, hp)

    def hp(self) -> dict:
        """The hyperparameters as stacked JAX arrays (the compiled loop's input)."""
        return self._hp

    def step_factory(self, call_for: Callable, accumulate: int = 1) -> Callable:
        """``step(leaves, batch, key, hp)`` of one member, for the compiled loop:
        ``make`` is called again while tracing, with ``hp`` traced, for the
        optimizer (and static structure) it builds; the model it builds is unused
        (and removed by the compiler). ``call_for(hp)`` is the loss as
        ``call(model, batch, key)``."""
        make, treedef, kind = self.make, self.treedef, self.kind
        placeholder = self.keys[0]

        def step(leaves, batch, key, hp):
            adapter = _adapt(make, placeholder, hp)
            flat, own = jtu.tree_flatten(adapter.state)
            if own.num_leaves != treedef.num_leaves or any(
                jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != b.dtype
                for a, b in zip(flat, leaves)
            ):
                raise errors.structure_depends_on_hp(kind, list(hp))
            new, loss, metrics, grads = adapter.make_step(call_for(hp), accumulate)(
                jtu.tree_unflatten(own, leaves), batch, key
            )
            return jtu.tree_leaves(new), loss, metrics, grads

        return step

    def eval_factory(self, call_for: Callable) -> Callable:
        """``evaluate(leaves, batch, key, hp) -> (loss, metrics)`` of one member in
        eval mode (the kind's ``make_eval``: NNX ``Module.eval()``, Equinox
        inference mode), for the compiled loop; ``make`` is called again while
        tracing, as in ``step_factory``, for the member's structure."""
        make, placeholder = self.make, self.keys[0]

        def evaluate(leaves, batch, key, hp):
            adapter = _adapt(make, placeholder, hp)
            own = jtu.tree_structure(adapter.state)
            model = jtu.tree_unflatten(own, leaves)
            return adapter.make_eval(call_for(hp))(model, batch, key)

        return evaluate

    def adapter(self, i: int) -> Any:
        """Member ``i``'s adapter (``_models``), made by ``make`` again."""
        values = {k: v[i].item() for k, v in self._hp.items()}
        return _adapt(self.make, self.keys[i], values)

    def view(self, leaves: list, hp: dict, fn: Callable, *args: Any) -> Any:
        """``fn(model, *args)`` on one member's ``leaves`` in eval mode (the
        kind's ``make_call``), while tracing, as ``eval_factory``."""
        adapter = _adapt(self.make, self.keys[0], hp)
        own = jtu.tree_structure(adapter.state)
        return adapter.make_call(fn)(jtu.tree_unflatten(own, leaves), *args)

    def member(self, i: int, state: list | None = None) -> tuple[Any, Any]:
        """Member ``i`` as an ordinary ``(model, optimizer)`` pair of its kind, built
        by ``make`` and holding its trained state (made once per state), or the
        state ``state`` (an earlier result's: made anew)."""
        i = member_index(i, self.n)
        state = self.state if state is None else state
        found = self._members.get(i)
        if found is not None and found[0] is state:
            return found[1]
        adapter = self.adapter(i)
        own = jtu.tree_structure(adapter.state)
        pair = adapter.finish(jtu.tree_unflatten(own, [x[i] for x in state]))
        if state is self.state:
            self._members[i] = (state, pair)
        return pair

    def model_of(self, i: int, leaves: list) -> Any:
        """A model of member ``i``'s kind holding ``leaves`` (one member's state
        leaves, not stacked), as ``member`` builds it (``adapter.model_of``)."""
        adapter = self.adapter(i)
        own = jtu.tree_structure(adapter.state)
        return adapter.model_of(jtu.tree_unflatten(own, leaves))

    def update(self, state: list, stopped: np.ndarray, step: int) -> None:
        """The state after a ``fit`` call (members made earlier are made again)."""
        self.state, self.stopped, self.step = list(state), np.asarray(stopped), step
        self._members = {}


class Members(Sequence):
    """``result.model`` / ``result.optimizer`` of a population ``fit``: member ``i``
    (``[i]``) as an ordinary object of its kind, usable without scanax."""

    def __init__(self, pop: Population, part: int, made: dict | None = None):
        self._pop, self._part = pop, part
        self._state = pop.state  # (this result's: a later fit replaces pop's)
        # members made after that (shared by a result's models and optimizers)
        self._old: dict[int, Any] = {} if made is None else made

    def __len__(self) -> int:
        return self._pop.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._pop.n))]
        if self._state is self._pop.state:  # (pop.member(i)'s object)
            return self._pop.member(i)[self._part]
        i = member_index(i, self._pop.n)
        if i not in self._old:
            self._old[i] = self._pop.member(i, self._state)
        return self._old[i][self._part]

    def __repr__(self) -> str:
        what = ("models", "optimizers")[self._part]
        return f"<{self._pop.n} {what} of {self._pop!r}; [i] gives member i>"


def population(make: Callable, n: int, *, key: Any, **hyperparameters: Any):
    """``n`` independent members for ``scanax.fit`` to train together, in one
    compiled loop.

    Conceptually equivalent to::

        keys = jax.random.split(key, n)
        members = [make(keys[i], **{k: v[i] for k, v in hyperparameters.items()})
                   for i in range(n)]

    but built in one traced call and stacked on a member axis.

    Arguments:
        make: ``make(key, **hyperparameters) -> (model, optimizer)``, one member in
            any kind ``fit`` accepts: ``(nnx.Module, nnx.Optimizer)``, ``(Equinox
            module or pytree, optax transform)`` or ``(TrainState, None)``. It is
            traced: each hyperparameter is a JAX scalar, usable wherever a number
            is (``optax.adam(lr)``, a weight decay, a schedule constant), not in a
            Python branch or a shape.
        n: the number of members.
        key: a ``jax.random`` key; member ``i`` is built with
            ``jax.random.split(key, n)[i]``.
        **hyperparameters: arrays of length ``n`` (or a scalar, the same for every
            member); member ``i`` gets element ``i`` of each.

    Returns:
        A :class:`Population`.

    Raises:
        TypeError: ``n`` not a positive int, ``key`` not a key, ``make`` not
            callable or not returning a supported pair, a hyperparameter that is
            not numeric.
        ValueError: a hyperparameter whose length is not ``n``, or one that
            ``make`` uses as a Python value (a branch or a shape).

    Example:
        >>> import jax, jax.numpy as jnp, optax, scanax
        >>> def make(key, lr):
        ...     return {"w": jax.random.normal(key, ())}, optax.sgd(lr)
        >>> pop = scanax.population(make, 4, key=jax.random.key(0),
        ...                         lr=jnp.array([0.01, 0.02, 0.05, 0.1]))
        >>> pop
        scanax.Population(optax, n=4, step=0, lr=float32[4])
    """
    if not callable(make):
        raise errors.make_not_callable(make)
    if isinstance(n, bool):
        raise errors.n_type(n)
    try:
        n = operator.index(n)
    except TypeError:
        raise errors.n_type(n) from None
    if n < 1:
        raise errors.n_type(n)
    if not _is_key(key):
        raise errors.key_type(key)
    values = {}
    for name, v in hyperparameters.items():
        try:
            a = np.asarray(v)
        except Exception:  # noqa: BLE001 - reported as a type error below
            a = np.asarray(None)
        # (bfloat16 and the other ML float types are NumPy kind "V")
        if a.dtype.kind not in "biuf" and not jnp.issubdtype(a.dtype, jnp.floating):
            raise errors.hp_type(name, v)
        if a.ndim == 0:
            a = np.full(n, a)
        if a.ndim != 1 or a.shape[0] != n:
            raise errors.hp_length(name, a.shape, n)
        values[name] = a
    refused = _caller.cannot_bind(make, key, **values)
    if refused is not None:
        raise errors.make_arguments(list(values), *refused)
    return Population(make, n, key, values)


# Build programs by fingerprint of ``make`` and the arguments' types: a new
# population of the same structure (other hyperparameter values) reuses one.
_BUILDS: dict = {}


def _build(make: Callable, keys: Any, hp: dict) -> tuple[list, Any, str, list]:
    """The members' stacked state: ``make`` traced once for all members; the state's
    structure, the kind and the leaf names, from that trace."""
    fingerprint = _fingerprint.of(make)
    types = tuple((k, v.dtype.name, v.shape) for k, v in hp.items())
    cache = (
        None if fingerprint is None else (fingerprint, types, keys.shape, keys.dtype)
    )
    found = None if cache is None else _BUILDS.get(cache)
    if found is None:
        box: dict = {}

        def one(key, values):
            adapter = _adapt(make, key, values)
            if _kind(adapter) == "nnx" and (part := adapter.made_outside()):
                raise errors.make_returned_outer_model(part)
            flat, treedef = jtu.tree_flatten(adapter.state)
            found = _static_tracers(treedef)
            if found is not None:
                owner, tracers = found
                names = [k for k, v in values.items() if any(v is t for t in tracers)]
                raise errors.hp_in_static_field(names or list(values), owner)
            box["treedef"], box["kind"] = treedef, _kind(adapter)
            box["names"] = adapter.names()
            box["arrays"] = _array_pattern(adapter)
            return flat

        found = (jax.jit(_over_members(one)), box)
    built, box = found
    try:
        leaves = built(keys, hp)
    except PYTHON_VALUE_ERRORS as err:
        raise errors.hp_used_as_python_value(list(hp), err) from err
    except TypeError as err:  # (a traced value as a shape: JAX's own TypeError)
        if hp and "concrete values" in str(err):
            raise errors.hp_used_as_python_value(list(hp), err) from err
        raise
    if box["kind"] == "optax" and hp:
        # A hyperparameter kept as a model field is a Python number (static, not
        # trained) in a solo run, but a traced array here: compare with member 0.
        values = {k: v[0].item() for k, v in hp.items()}
        extra = box["arrays"] - _array_pattern(_adapt(make, keys[0], values))
        if extra:
            raise errors.hp_in_model_fields(list(hp), sorted(extra))
    if cache is not None:
        _BUILDS[cache] = found
        while len(_BUILDS) > 32:
            _BUILDS.pop(next(iter(_BUILDS)))
    return leaves, box["treedef"], box["kind"], box["names"]


def _over_members(one: Callable) -> Callable:
    """``one(key, values)`` for every member: on CPU a ``lax.map``, each member
    built as a solo ``make`` is; elsewhere a ``vmap``.

    On CPU, jaxlib 0.10's batched LAPACK kernels (a QR for each orthogonal
    initialiser: PureJaxRL's and CleanRL's agents) fan their batch out onto the
    intra-op thread pool they run on and wait for it; two of them at once on a
    2-thread pool deadlock the process (reproduced in pure JAX: ``jax.jit(
    jax.vmap(init))`` of six orthogonal initialisers hung in 2 of 8 runs here,
    ``lax.map`` in none of 16). Built one member at a time there is no batch to
    fan out, the compile is shorter (0.55 s against 0.63-0.93 s for 1,024 tiny
    MLPs here) and the run a few milliseconds."""
    if jax.default_backend() != "cpu":
        return jax.vmap(one)
    return lambda keys, values: jax.lax.map(lambda kv: one(*kv), (keys, values))


PYTHON_VALUE_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def _array_pattern(adapter: Any) -> set:
    """The paths of an optax-kind model's array leaves (trained or carried)."""
    if not isinstance(adapter, _models_optax.OptaxAdapter):
        return set()
    return {jtu.keystr(adapter.paths[i]) for i in (*adapter.train, *adapter.other)}


def _adapt(make: Callable, key: Any, values: dict) -> Any:
    out = make(key, **values)
    if not isinstance(out, tuple) or len(out) != 2:
        raise errors.make_result(out)
    return _models.adapt(*out)


def _static_tracers(treedef: Any) -> tuple[str, list] | None:
    """The type of the first node whose static data holds traced values (a
    hyperparameter in an ``eqx.field(static=True)``) and those values, or
    None."""
    todo = [treedef]
    while todo:
        node = todo.pop()
        data = node.node_data()
        if data is not None:
            try:
                leaves = jtu.tree_leaves(data[1])
            except Exception:  # noqa: BLE001 - static data JAX cannot walk
                leaves = []
            tracers = [x for x in leaves if isinstance(x, jax.core.Tracer)]
            if tracers:
                return getattr(data[0], "__name__", repr(data[0])), tracers
        todo.extend(node.children())
    return None


def _kind(adapter: Any) -> str:
    return {
        _models_nnx.NNXAdapter: "nnx",
        _models_optax.OptaxAdapter: "optax",
        _models_trainstate.TrainStateAdapter: "trainstate",
    }[type(adapter)]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jnp.shape(x) == ()
    return jnp.shape(x) == (2,) and dtype == jnp.uint32


def member_index(i: Any, n: int) -> int:
    """Member index ``i`` of ``n`` (negative counts from the end), checked."""
    return _tree.index_in(i, n, lambda index: errors.member_index(i, index, n))


def is_population(x: Any) -> bool:
    return isinstance(x, Population)
