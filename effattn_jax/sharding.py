"""Logical axis names -> mesh axes, through the one rules table in `mesh.rules`.

Parameters carry `logical_axes` metadata (e.g. ('embed', 'mlp')); activations
are constrained with `constrain(x, ('batch', 'length', 'embed'))`. Outside a
`use_rules` context (single device, tests) `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
_ACTIVE: list[tuple[Mesh, dict]] = []


def make_mesh(data: int, fsdp: int, tensor: int, devices=None) -> Mesh:
    """Mesh with axes (data, fsdp, tensor); one size may be -1 to take the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"mesh: {len(devices)} devices are not divisible by the fixed axes product {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"mesh: data*fsdp*tensor={n} but only {len(devices)} devices are available")
    return Mesh(np.array(devices[:n]).reshape(sizes), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: dict
) -> PartitionSpec:
    """PartitionSpec for a value with these logical axes; a mesh axis is used at most
    once, and only where it divides the dimension (otherwise that dim stays replicated)."""
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape, strict=True):
        chosen = []
        size = 1
        for ax in rules.get(name, []) if name else []:
            n = mesh.shape[ax]
            if ax in used or n == 1 or dim % (size * n):
                continue
            chosen.append(ax)
            size *= n
        used.update(chosen)
        out.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return PartitionSpec(*out)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: dict):
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules))
    )


def shard_over_batch_heads(fn, q, k, v, segment_ids):
    """Runs fn(q, k, v, segment_ids) per shard of the batch and head axes (shard_map).

    Pallas kernels cannot be partitioned automatically (Mosaic refuses), so the
    attention core is mapped over the mesh explicitly. The sequence axis stays
    whole; heads are split only when q and kv heads split alike (else GQA
    groups would be cut). Outside `use_rules` it just calls fn.
    """
    if not _ACTIVE:
        return fn(q, k, v, segment_ids)
    mesh, rules = _ACTIVE[-1]
    qs = logical_to_spec(("batch", None, "heads", None), q.shape, mesh, rules)
    ks = logical_to_spec(("batch", None, "kv_heads", None), k.shape, mesh, rules)
    if qs[2] != ks[2]:
        qs, ks = PartitionSpec(qs[0], None, None, None), PartitionSpec(ks[0], None, None, None)
    seg_spec = PartitionSpec(qs[0], None)
    if segment_ids is None:
        segment_ids = jax.numpy.ones(q.shape[:2], jax.numpy.int32)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qs, ks, ks, seg_spec), out_specs=qs, check_vma=False)(
        q, k, v, segment_ids
    )
