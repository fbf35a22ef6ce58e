"""Logical axis names -> mesh axes, through the one rules table in `mesh.rules`.

Parameters carry `logical_axes` metadata (e.g. ('embed', 'mlp')); activations
are constrained with `constrain(x, ('batch', 'length', 'embed'))`. Outside a
`use_rules` context (single device, tests) `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

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
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes product {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"mesh: data*fsdp*tensor={n} but only {len(devices)} devices are available")
    return Mesh(np.array(devices[:n]).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: dict) -> PartitionSpec:
    """PartitionSpec for a value with these logical axes; a mesh axis is used at most
    once, and only where it divides the dimension (otherwise that dim stays replicated)."""
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape):
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
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh, rules)))
