"""Data parallelism for ``scanax.fit`` on a ``jax.sharding.Mesh``.

Nothing is home-made: batches get a ``NamedSharding`` over the mesh's ``"data"``
axis, the training state is replicated (or placed as NNX sharding annotations
say), and XLA's SPMD partitioner inserts the gradient all-reduce.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ._errors import fit as errors, population as pop_errors

AXIS = "data"
MEMBERS = "members"  # a population's member axis (population parallelism)


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


def has_data_axis(mesh: Any) -> bool:
    return AXIS in mesh.axis_names


def data_size(mesh: Any) -> int:
    return mesh.shape[AXIS] if AXIS in mesh.axis_names else 1


def check_batch(mesh: Any, batch_size: int, what: str) -> None:
    n = data_size(mesh)
    if batch_size % n:
        raise errors.batch_not_divisible(what, batch_size, n)


def state_shardings(mesh: Any, adapter: Any, leaves: list) -> list:
    """One sharding per state leaf: the model's own sharding annotations where
    present (``adapter.partition_specs()``; axes the mesh does not have are
    replicated), replicated otherwise."""
    replicated = NamedSharding(mesh, P())
    specs = None
    tree = adapter.partition_specs()
    if tree is not None:
        specs = jtu.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))
        if len(specs) != len(leaves):
            specs = None
    if specs is None:
        return [replicated] * len(leaves)
    out = []
    for spec, leaf in zip(specs, leaves):
        if not isinstance(spec, P) or getattr(leaf, "ndim", 0) == 0:
            out.append(replicated)
            continue
        axes = [a if _known(mesh, a) else None for a in spec]
        out.append(NamedSharding(mesh, P(*axes)))
    return out


def _known(mesh: Any, axis: Any) -> bool:
    if axis is None:
        return True
    names = axis if isinstance(axis, tuple) else (axis,)
    return all(a in mesh.axis_names for a in names)


def place(leaves: list, shardings: list) -> list:
    return [jax.device_put(x, s) for x, s in zip(leaves, shardings)]


def replicate(mesh: Any, tree: Any) -> Any:
    sharding = NamedSharding(mesh, P())
    return jtu.tree_map(lambda x: _put(x, sharding), tree)


def batch_constraint(mesh: Any, batch: Any) -> Any:
    """Inside the compiled loop: each batch leaf split over 'data' on axis 0."""
    sharding = NamedSharding(mesh, P(AXIS))
    return jtu.tree_map(lambda x: jax.lax.with_sharding_constraint(x, sharding), batch)


def put_chunk(mesh: Any, chunk: Any) -> Any:
    """A host chunk ``[steps, batch, ...]`` onto the mesh, batch axis sharded.

    Multi-process: each process passes its own part of the global batch (its
    iterable yields process-local batches), as ``jax.make_array_from_process_local
    _data`` expects.
    """
    for path, x in jtu.tree_flatten_with_path(chunk)[0]:
        if x.ndim < 2:
            raise errors.batch_no_leading_axis(jtu.keystr(path), x)
        check_batch(mesh, x.shape[1] * jax.process_count(), "the batch size")
    sharding = NamedSharding(mesh, P(None, AXIS) if has_data_axis(mesh) else P())
    return jtu.tree_map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
        chunk,
    )


def _put(x: Any, sharding: Any) -> Any:
    if jax.process_count() > 1:
        if jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            # A typed PRNG key has no NumPy form: it travels as its key data.
            data = _put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, x.shape)
    return jax.device_put(x, sharding)
