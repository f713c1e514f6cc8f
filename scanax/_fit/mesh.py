"""Data parallelism for ``scanax.fit`` on a ``jax.sharding.Mesh``, in one process
or across the processes of a ``jax.distributed`` job.

Nothing is home-made: batches get a ``NamedSharding`` over the mesh's ``"data"``
axis, the training state is replicated (or placed as NNX sharding annotations or
the leaves' own shardings say, or sharded by ``shard="fsdp"``'s rule), and XLA's
SPMD partitioner inserts the gradient all-reduce and parameter all-gathers.

Across processes every process runs the same ``fit``; what each decides on its
own host is agreed through ``processes.py`` (the coordination service's
key-value store), so that every process runs the same compiled calls.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import _caller
from .._errors import fit as errors, population as pop_errors, short_type
from .processes import bar_here, check_processes, fewest

AXIS = "data"
MEMBERS = "members"  # a population's member axis (population parallelism)
SHARD = ("fsdp",)  # the values of fit's ``shard=``


def check(mesh: Any) -> None:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise errors.mesh_type(mesh)
    if AXIS not in mesh.axis_names:
        raise errors.mesh_axis(mesh, AXIS)


def auto(mesh: Any) -> Any:
    """The same mesh with every axis ``Auto``: the partitioner (GSPMD/Shardy) then
    propagates our shardings and inserts the gradient all-reduce; an ``Explicit``
    mesh (``jax.make_mesh``'s default) would make every op of ``loss_fn`` obey
    sharding-in-types rules instead."""
    axis_type = jax.sharding.AxisType
    if all(t == axis_type.Auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * mesh.devices.ndim
    )


def check_population(mesh: Any, k: int) -> None:
    """A population's mesh: a ``members`` axis that divides the ``k`` members of a
    call, and optionally a ``data`` axis for the batches."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise errors.mesh_type(mesh)
    if MEMBERS not in mesh.axis_names:
        raise pop_errors.mesh_axis(mesh)
    if k % mesh.shape[MEMBERS]:
        raise pop_errors.members_not_divisible(k, mesh.shape[MEMBERS])


def by_member(mesh: Any, tree: Any) -> Any:
    """Each leaf split over ``members`` on its leading (member) axis."""
    sharding = NamedSharding(mesh, P(MEMBERS))
    return jtu.tree_map(lambda x: _put(x, sharding), tree)


def keep_by_member(mesh: Any, tree: Any) -> Any:
    """Inside a compiled call: ``by_member``'s placement kept on an output."""
    return _constrain(mesh, P(MEMBERS), tree)


def _constrain(mesh: Any, spec: Any, tree: Any) -> Any:
    """Inside a compiled call: every leaf of ``tree`` placed by ``spec``."""
    sharding = NamedSharding(mesh, spec)
    return jtu.tree_map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def has_data_axis(mesh: Any) -> bool:
    return AXIS in mesh.axis_names


def data_size(mesh: Any) -> int:
    return mesh.shape[AXIS] if AXIS in mesh.axis_names else 1


def check_batch(mesh: Any, batch_size: int, what: str) -> None:
    n = data_size(mesh)
    if batch_size % n:
        raise errors.batch_not_divisible(what, batch_size, n)


def check_shard(shard: Any, mesh: Any, population: bool) -> None:
    """``fit``'s ``shard=``: None, or ``"fsdp"`` with a mesh, for one model."""
    if shard is None:
        return
    if not isinstance(shard, str) or shard not in SHARD:
        raise errors.shard_value(shard, SHARD)
    if mesh is None:
        raise errors.shard_without_mesh(shard)
    if population:
        raise errors.shard_with_population(shard)


def state_shardings(
    mesh: Any, adapter: Any, leaves: list, shard: str | None = None
) -> list:
    """One sharding per state leaf.

    A leaf's partition spec is the model's own sharding annotation where present
    (``adapter.partition_specs()``), else the spec of the ``NamedSharding`` the
    leaf already has on this mesh's devices, else replicated; axes the mesh does
    not have are replicated. With ``shard="fsdp"``, a leaf whose spec does not
    use ``"data"`` is also split over ``"data"`` on its largest axis that the
    ``"data"`` size divides and that the spec leaves free (the first of equal
    ones); a leaf with no such axis stays as it is, and those with at least as
    many elements as ``"data"`` has devices are listed in one warning. Optimizer
    moments have their parameter's shape, so they get their parameter's
    sharding.
    """
    specs: list = [None] * len(leaves)
    tree = adapter.partition_specs()
    if tree is not None:
        found = jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))
        if len(found) == len(leaves):
            specs = [x if isinstance(x, P) else None for x in found]
    layers = adapter.layer_axes() if shard == "fsdp" else None
    layers = layers if layers is not None and len(layers) == len(leaves) else None
    n = data_size(mesh)
    out, unsharded = [], []
    for i, leaf in enumerate(leaves):
        ndim = getattr(leaf, "ndim", 0)
        spec = specs[i] if specs[i] is not None else _own_spec(mesh, leaf)
        axes = [None] * ndim
        if spec is not None and ndim:
            axes = [a if _known(mesh, a) else None for a in spec]
            axes += [None] * (ndim - len(axes))
        sized = getattr(leaf, "size", 1) > 0  # (else replicated, as its outputs)
        if shard == "fsdp" and ndim and sized and n > 1 and AXIS not in _names(axes):
            axis = fsdp_axis(leaf.shape, axes, n, None if layers is None else layers[i])
            if axis is not None:
                axes[axis] = AXIS
            elif leaf.size >= n:
                unsharded.append(i)
        out.append(NamedSharding(mesh, P(*axes)))
    if unsharded:
        names = adapter.names()
        rows = [(names[i], short_type(leaves[i])) for i in unsharded]
        warnings.warn(
            errors.fsdp_unsharded(rows, n),
            RuntimeWarning,
            stacklevel=_caller.user_level(),
        )
    return out


def fsdp_axis(
    shape: tuple, axes: list, n: int, layers: int | None = None
) -> int | None:
    """``shard="fsdp"``'s rule: the largest axis of ``shape`` that ``n`` divides
    and ``axes`` leaves free (the first of equal ones), never a ``Stack``'s
    layer axis ``layers`` (a scan over the layers would gather them all), or
    None."""
    free = [
        d
        for d, size in enumerate(shape)
        if axes[d] is None and size % n == 0 and d != layers
    ]
    if not free:
        return None
    return max(free, key=lambda d: (shape[d], -d))


def _names(axes: list) -> set:
    out: set = set()
    for a in axes:
        out.update(a if isinstance(a, tuple) else (a,))
    return out


def _own_spec(mesh: Any, leaf: Any) -> Any:
    """The spec of a leaf already placed with a ``NamedSharding`` over the devices
    of ``mesh`` (by the user, or by an earlier ``fit``), else None."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    own = sharding.mesh
    if own.axis_names != mesh.axis_names or own.devices.shape != mesh.devices.shape:
        return None
    if [d.id for d in own.devices.flat] != [d.id for d in mesh.devices.flat]:
        return None
    return sharding.spec


def _known(mesh: Any, axis: Any) -> bool:
    if axis is None:
        return True
    names = axis if isinstance(axis, tuple) else (axis,)
    return all(a in mesh.axis_names for a in names)


def explicit_mesh(x: Any) -> Any:
    """The mesh of Explicit axes ``x`` is placed on (its sharding is part of
    its type there: ``jax.make_mesh``'s default, ``jax.set_mesh``), or None."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    explicit = jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))
    return mesh if explicit else None


def off_explicit_mesh(x: Any) -> Any:
    """``x``, moved to one device of the mesh of Explicit axes it is on."""
    mesh = explicit_mesh(x)
    return x if mesh is None else jax.device_put(x, mesh.devices.flat[0])


def not_on_an_explicit_mesh(names: list[str], leaves: list, pop: bool) -> None:
    """No leaf on a mesh of Explicit axes, else the error naming the first (the
    model's leaves before the optimizer's)."""
    named = sorted(zip(names, leaves), key=lambda pair: pair[0].startswith("opt"))
    for name, x in named:
        mesh = explicit_mesh(x)
        if mesh is not None:
            raise errors.on_explicit_mesh(name, tuple(mesh.axis_names), pop)


def place(leaves: list, shardings: list) -> list:
    return [_put(x, s) for x, s in zip(leaves, shardings)]


def replicate(mesh: Any, tree: Any) -> Any:
    sharding = NamedSharding(mesh, P())
    return jtu.tree_map(lambda x: _put(x, sharding), tree)


def everywhere(mesh: Any, tree: Any) -> Any:
    """Inside a compiled call: ``tree`` replicated over the mesh, so that every
    process can read it on the host (what the host reads of a population split
    over processes by its ``members`` axis)."""
    return _constrain(mesh, P(), tree)


def host_value(x: Any) -> np.ndarray:
    """The whole value of ``x`` on the host of every process; an array spanning
    other processes' devices is gathered (a collective: every process of the
    job must ask for it at the same point, as fit's processes do)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place_data(mesh: Any, data: Any) -> Any:
    """Array data on the mesh: a leaf that already has a ``NamedSharding`` over
    the mesh's devices keeps its spec (a global array made with
    ``jax.make_array_from_process_local_data``: each process holds only its
    rows), every other leaf is replicated."""

    def put(x):
        spec = _own_spec(mesh, x)
        spec = spec if spec is not None and all(_known(mesh, a) for a in spec) else P()
        return _put(x, NamedSharding(mesh, spec))

    return jtu.tree_map(put, data)


def batch_constraint(mesh: Any, batch: Any, axis: int = 0) -> Any:
    """Inside the compiled loop: each batch leaf split over 'data' on ``axis``
    (1 for the micro-batches of ``accumulate``)."""
    return _constrain(mesh, P(*(None,) * axis, AXIS), batch)


def put_chunk(mesh: Any, chunk: Any, axis: int = 1) -> Any:
    """A host chunk ``[steps, batch, ...]`` onto the mesh, batch axis (``axis``;
    2 for ``[steps, micro-batches, batch, ...]``) sharded.

    Multi-process: each process passes its own part of the global batch (its
    iterable yields process-local batches), as ``jax.make_array_from_process_local
    _data`` expects.
    """
    for path, x in jtu.tree_flatten_with_path(chunk)[0]:
        if x.ndim < axis + 1:
            raise errors.batch_no_leading_axis(jtu.keystr(path), x)
        check_batch(mesh, x.shape[axis] * jax.process_count(), "the batch size")
    spec = P(*(None,) * axis, AXIS) if has_data_axis(mesh) else P()
    sharding = NamedSharding(mesh, spec)
    return jtu.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
        chunk,
    )


def _put(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # a global array: JAX reshards it
    if jax.process_count() > 1:
        if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            # A typed PRNG key has no NumPy form: it travels as its key data.
            data = _put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, x.shape)
    return jax.device_put(x, sharding)


def _on_mesh(x: Any, run: Any, given: Any) -> Any:
    """``x``, placed on the run's mesh ``run``, moved to ``given`` (the same
    devices and spec; other leaves as they are)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh != run:
        return x
    return jax.device_put(x, NamedSharding(given, sharding.spec))


# ---------------------------------------------------------------- the placement


def _device_put(tree: Any) -> Any:
    """``jax.device_put(tree)`` (no mesh): host values onto the default device;
    a tree of JAX arrays as it is, which is what ``device_put`` returns for it
    without a device, less its cost per call (0.17 ms for a PRNG key on CPU)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if all(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves
    ):
        return tree
    return jax.device_put(tree)


class Placement:
    """Where the arrays of a ``fit`` (or an ``evaluate``) live: the default
    device (``mesh`` None), or a mesh with a ``data`` axis (batches split over
    it), a ``members`` axis (a population's members split over it), or both, over
    one process or many. Every "on a mesh or not" decision of the fit wing is one
    of its methods; the module's functions above are what they call on a mesh.
    """

    def __init__(self, mesh: Any = None, given: Any = None):
        self.mesh = mesh  # (Auto axes: ``auto``)
        self.given = mesh if given is None else given  # the user's ``mesh=``
        self.back: list | None = None  # (``state``: the leaves ``hand_back`` moves)

    @staticmethod
    def of(mesh: Any, members: int | None = None) -> Placement:
        """``fit``'s ``mesh=`` checked (a population's: ``members`` per call) and
        made ``Auto``."""
        if mesh is None:
            return Placement()
        if members is None:
            check(mesh)
        else:
            check_population(mesh, members)
        return Placement(auto(mesh), mesh)

    @property
    def local(self) -> bool:
        """No mesh: one device, whose host callbacks from inside a compiled loop
        run once (the in-loop bar reports)."""
        return self.mesh is None

    def fingerprint(self) -> Any:
        """What a compiled program depends on: the mesh's shape and devices."""
        if self.mesh is None:
            return None
        return (self.mesh.shape_tuple, self.mesh.device_ids.tobytes())

    def context(self) -> Any:
        """The mesh as context while tracing: NNX Variables with sharding
        annotations need one when the step merges them."""
        if self.mesh is None:
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    # ------------------------------------------------------------ arguments

    def check_source(self, source: Any) -> None:
        """The data source fits the mesh (batch sizes the ``data`` axis divides;
        a rollout takes no mesh)."""
        if self.mesh is not None:
            source.check_mesh(self.mesh)

    def check_processes(self, data: Any, **arguments: Any) -> None:
        if self.mesh is not None:
            check_processes(self.mesh, data, **arguments)

    def bar(self, spec: Any) -> Any:
        """The progress bar's spec where this process shows it, else None."""
        return spec if self.mesh is None else bar_here(self.mesh, spec)

    def fewest(self, count: int) -> int:
        """The smallest ``count`` of every process of the mesh."""
        return int(count) if self.mesh is None else fewest(self.mesh, count)

    # ------------------------------------------------------------ placing

    def put(self, tree: Any) -> Any:
        """Array data onto the devices (on a mesh: global arrays keep their
        spec, the rest replicated)."""
        if self.mesh is None:
            return _device_put(tree)
        return place_data(self.mesh, tree)

    def replicate(self, tree: Any) -> Any:
        """``tree`` on every device (None stays None)."""
        if tree is None:
            return None
        if self.mesh is None:
            return _device_put(tree)
        return replicate(self.mesh, tree)

    def put_chunk(self, chunk: Any, axis: int) -> Any:
        """A host chunk of batches onto the devices, its batch axis ``axis``
        split over ``data``."""
        if self.mesh is None:
            return jax.device_put(chunk)
        return put_chunk(self.mesh, chunk, axis)

    def check_unplaced(self, names: list[str], leaves: list, pop: bool) -> None:
        """Without a mesh, no state leaf (of a population if ``pop``) may be on
        a mesh of Explicit axes: its sharding is part of its type there, and a
        loop built for one device would fail in JAX's sharding checks."""
        if self.mesh is None:
            not_on_an_explicit_mesh(names, leaves, pop)

    def state(self, adapter: Any, leaves: list, shard: str | None) -> tuple:
        """The training state's leaves placed, and their shardings (None
        without a mesh: where they already are)."""
        if self.mesh is None:
            return leaves, None
        if self.given is not self.mesh:
            self.back = [explicit_mesh(x) == self.given for x in leaves]
        shardings = tuple(state_shardings(self.mesh, adapter, leaves, shard))
        return place(leaves, shardings), shardings

    def hand_back(self, leaves: list) -> list:
        """The state's leaves as ``fit`` gives them back: those that came on
        the mesh it was given, of ``Explicit`` axes (``jax.make_mesh``'s
        default; the run's own copy is ``Auto``), back on it, so that the
        user's code under ``jax.set_mesh(mesh)`` takes them (the same buffers,
        not a copy); the others on the run's mesh, where code written for one
        device takes them."""
        if self.back is None or not any(self.back):
            return leaves
        return [
            _on_mesh(x, self.mesh, self.given) if back else x
            for x, back in zip(leaves, self.back, strict=True)
        ]

    def devices(self, leaf: Any) -> list:
        """The devices whose memory a call uses."""
        if self.mesh is not None:
            return list(self.mesh.devices.flat)
        return list(getattr(leaf, "devices", jax.devices)())[:1]

    def host(self, tree: Any) -> Any:
        """Every leaf's whole value on this host (across processes: gathered)."""
        if self.mesh is None:
            return jtu.tree_map(np.asarray, jax.device_get(tree))
        return jtu.tree_map(host_value, tree)

    # ------------------------------------------------------------ inside a call

    def constrain_even(self, batch: Any) -> Any:
        """Inside a compiled evaluation: a batch split over ``data`` on its
        leading axis where the axis size divides every leaf's (a remainder batch
        is left as XLA places it)."""
        if self.mesh is None:
            return batch
        size = data_size(self.mesh)
        if any(x.shape[0] % size for x in jtu.tree_leaves(batch)):
            return batch
        return batch_constraint(self.mesh, batch)

    def constrain_batch(self, batch: Any, axis: int) -> Any:
        """Inside the compiled loop: a batch split over ``data`` on ``axis``."""
        if self.mesh is None or not has_data_axis(self.mesh):
            return batch
        return batch_constraint(self.mesh, batch, axis)

    # ------------------------------------------------------------ populations

    @property
    def members_axis(self) -> str | None:
        return None if self.mesh is None else MEMBERS

    @property
    def members_multiple(self) -> int:
        """What a group's size must be a multiple of: the ``members`` axis."""
        return 1 if self.mesh is None else dict(self.mesh.shape).get(MEMBERS, 1)

    def by_member(self, tree: Any) -> Any:
        return tree if self.mesh is None else by_member(self.mesh, tree)

    def readable(self, report: Any, kept: Any) -> tuple[Any, Any]:
        """Inside a population's call: ``report`` readable on every process's
        host (members split over processes' devices gathered), ``kept`` (the
        carry) left split by member."""
        if self.mesh is None:
            return report, kept
        return everywhere(self.mesh, report), keep_by_member(self.mesh, kept)
