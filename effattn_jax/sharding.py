"""Logical axis names -> mesh axes, through the one rules table in `mesh.rules`.

Parameters carry `logical_axes` metadata (e.g. ('embed', 'mlp')); activations
are constrained with `constrain(x, ('batch', 'length', 'embed'), rules)`. The
rules travel with the modules (frozen from the config by `sharding_rules`);
the mesh is jax's own context mesh (`jax.sharding.use_abstract_mesh`, set by
the train step), so no mesh lives in a module global. Without a context mesh
(single device, tests, generation) `constrain` is the identity.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from effattn_jax.config import MESH_AXES

Rules = tuple[tuple[str, tuple[str, ...]], ...]  # hashable, so modules and jit can hold it


def leaves_by_path(tree) -> dict[tuple[str, ...], object]:
    """A pytree's leaves keyed by their path of dict keys and attribute names (as strings): how a
    parameter tree is matched against another format's names or another tree's shapes."""
    return {
        tuple(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def sharding_rules(cfg) -> Rules:
    """The config's `mesh.rules` table in hashable form."""
    return tuple((name, tuple(axes)) for name, axes in cfg.mesh.rules.items())


def make_mesh(data: int, fsdp: int, tensor: int, devices=None, *, context: int = 1) -> Mesh:
    """Mesh with axes MESH_AXES (data, fsdp, context, tensor); one size may be -1 to take the
    remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, context, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices do not divide by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"mesh: data*fsdp*context*tensor={n} but only {len(devices)} devices are available")
    return Mesh(np.array(devices[:n]).reshape(sizes), MESH_AXES)


def config_mesh(mesh_cfg, devices=None) -> Mesh:
    """The mesh of a config's `mesh` section."""
    m = mesh_cfg
    return make_mesh(m.data, m.fsdp, m.tensor, devices, context=m.context)


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh_shape: Mapping[str, int], rules: Rules
) -> PartitionSpec:
    """PartitionSpec for a value with these logical axes. A mesh axis is used at most once,
    and only where it divides the dimension; where it does not, that dimension loses the
    axis's parallelism and a warning (once per case) names the axis and the sizes."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape, strict=True):
        chosen = []
        size = 1
        for axis in table.get(name, ()) if name else ():
            n = mesh_shape[axis]
            if axis in used or n == 1:
                continue
            if dim % (size * n):
                warnings.warn(
                    f"sharding: logical axis '{name}' (size {dim}) is not split over mesh axis '{axis}' "
                    f"(size {n}{f', after {size}-way' if size > 1 else ''}): it does not divide",
                    stacklevel=2,
                )
                continue
            chosen.append(axis)
            size *= n
        used.update(chosen)
        out.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*out)


def context_mesh():
    """jax's current (abstract) mesh, or None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, axes: Sequence[str | None], rules: Rules | None) -> jax.Array:
    """Sharding constraint from logical axes under the context mesh; identity without one."""
    mesh = context_mesh()
    if mesh is None or rules is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh.shape, rules))


def batch_head_specs(q, k, rules: Rules, mesh) -> tuple[PartitionSpec, PartitionSpec]:
    """PartitionSpecs of q [B, S, Hq, D] and k/v [B, S, Hkv, D] split over batch and heads only;
    heads only where q and kv heads split alike (else GQA groups would be cut)."""
    q_spec = logical_to_spec(("batch", None, "heads", None), q.shape, mesh.shape, rules)
    kv_spec = logical_to_spec(("batch", None, "kv_heads", None), k.shape, mesh.shape, rules)
    if q_spec[2] != kv_spec[2]:
        return PartitionSpec(q_spec[0], None, None, None), PartitionSpec(kv_spec[0], None, None, None)
    return q_spec, kv_spec


def shard_over_batch_heads(fn, q, k, v, segment_ids, rules: Rules | None):
    """Runs fn(q, k, v, segment_ids) per shard of the batch and head axes (shard_map).

    Pallas kernels cannot be partitioned automatically (Mosaic refuses), so the
    attention core is mapped over the context mesh explicitly. The sequence axis
    stays whole; heads are split only when q and kv heads split alike (else GQA
    groups would be cut). Without a context mesh it just calls fn.
    """
    mesh = context_mesh()
    if mesh is None or rules is None:
        return fn(q, k, v, segment_ids)
    q_spec, kv_spec = batch_head_specs(q, k, rules, mesh)
    if segment_ids is None:
        segment_ids = jax.numpy.ones(q.shape[:2], jax.numpy.int32)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, PartitionSpec(q_spec[0], None)),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def shard_over_batch(fn, *xs, rules: Rules | None):
    """fn(*xs) per shard of the batch axis (shard_map; every x is [B, ...], and so is the result),
    every other axis whole: for the Pallas kernels whose work is per batch row, which Mosaic will not
    partition. Without a context mesh it just calls fn."""
    mesh = context_mesh()
    if mesh is None or rules is None:
        return fn(*xs)
    batch = PartitionSpec(logical_to_spec(("batch",), xs[0].shape[:1], mesh.shape, rules)[0])
    return jax.shard_map(fn, mesh=mesh, in_specs=(batch,) * len(xs), out_specs=batch, check_vma=False)(*xs)
