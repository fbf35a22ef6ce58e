"""Pallas TPU kernels against a TPU core's fast memories, for a config and a train step's program:
the scalar-prefetched tables each call holds in SMEM and the scoped VMEM it asks for.

libtpu's `compiled.memory_analysis()` counts HBM only (no SMEM or VMEM figure); the program's
text has what a kernel call takes: its operands (the scalar-prefetched tables lead: integers)
and its scoped VMEM limit (`scoped_memory_configs`, memory space 1). The limit is what the kernel
asks Mosaic for, sized from its blocks, scratch and temporaries, not a measured peak."""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from effattn_jax.attention import moba_block_sizes
from effattn_jax.config import Config, ConfigError
from effattn_jax.ops.tpu_tables import SMEM_BYTES, CallTables, moba_call_tables


def moba_tpu_tables(cfg: Config, mesh_sizes: dict[str, int]) -> list[CallTables]:
    """The MoBA TPU kernel calls of one layer's train step on one chip, with the largest call's
    SMEM tables, from the config and the mesh's axis sizes (arithmetic, nothing traced)."""
    context, tensor = mesh_sizes.get("context", 1), mesh_sizes.get("tensor", 1)
    sizes = moba_block_sizes(cfg).resolve("tpu")
    return moba_call_tables(
        batch=max(1, cfg.data.batch_size // (mesh_sizes.get("data", 1) * mesh_sizes.get("fsdp", 1))),
        queries=cfg.data.seq_len // context,
        key_len=cfg.data.seq_len,
        q_heads=max(1, cfg.model.num_heads // tensor),
        kv_heads=max(1, cfg.num_kv_heads // tensor),
        block_size=cfg.moba.block_size,
        top_k=cfg.moba.top_k,
        past_q_tile=sizes.past_q_tile,
        runs=2 if context > 1 else 1,
    )


# VMEM per TPU core by libtpu's device_kind (bytes), as libtpu (0.0.50.1) reports its capacity when
# a kernel's scratch overflows it, compiling ahead of time for each ("would exceed memory (size=...)")
VMEM_BYTES = {"TPU v5 lite": 128 << 20, "TPU v5": 64 << 20, "TPU v6 lite": 128 << 20}
KNOBS = {
    "SMEM": "mesh.context (fewer queries per chip), moba.block_size, or a smaller slice of the schedule "
    "(pallas_kernels.moba.tpu_smem.SMEM_BUDGET_BYTES)",
    "VMEM": "moba.block_size, moba.key_tile, moba.past_q_tile",
}


class KernelMemory(NamedTuple):
    """One Pallas TPU kernel of a program: its call sites, and the largest site's scalar-prefetched
    tables (SMEM) and scoped VMEM limit (None: Mosaic's default). smem_exact: every table flat
    (counted as laid out); else the SMEM is an estimate (a padded table's layout is inferred)."""

    kernel: str
    calls: int
    smem_bytes: int
    vmem_bytes: int | None
    smem_exact: bool = True


_ITEMSIZE = {
    "i32": 4,
    "s32": 4,
    "ui32": 4,
    "u32": 4,
    "i64": 8,
    "s64": 8,
    "i16": 2,
    "s16": 2,
    "i8": 1,
    "s8": 1,
}
_LOWERED_TYPE = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d+)>")
_COMPILED_TYPE = re.compile(r"\b([a-z]+\d+)\[([\d,]*)\]")
_VMEM = re.compile(r"memory_space\W+1\W+offset\W+\d+\W+size\W+(\d+)")


def _leading_table_bytes(types: list[tuple[str, list[int]]]) -> tuple[int, bool]:
    """SMEM of a call: its leading integer operands, the scalar-prefetched tables (the MoBA
    kernels and splash attention take every table first, before any float operand). A table of
    two or more dims is counted with its last dim padded to 128 entries, as Mosaic lays it out
    in SMEM (an int32 [64, 16, 3] table took 512 KiB); a flat one as it is. -> (bytes, whether
    every table was flat)."""
    total, flat = 0, True
    for dtype, dims in types:
        if dtype not in _ITEMSIZE:
            break
        flat &= len(dims) < 2
        padded = dims if len(dims) < 2 else [*dims[:-1], -(-dims[-1] // 128) * 128]
        total += math.prod(padded) * _ITEMSIZE[dtype]
    return total, flat


def _call_sites(hlo_text: str):
    """(kernel, smem bytes, smem exact, vmem bytes | None) of each tpu_custom_call in a lowered StableHLO
    module or a compiled HLO module's text."""
    for line in hlo_text.splitlines():
        if "tpu_custom_call" not in line:
            continue
        vmem = _VMEM.search(line.replace("\\22", '"'))
        vmem = int(vmem.group(1)) if vmem else None
        if "stablehlo.custom_call" in line:  # lowered: kernel_name = "...", ... : (operand types) -> ...
            name = re.search(r'kernel_name = "([^"]+)"', line)
            operands = line.rsplit(" : (", 1)[-1].split(") ->", 1)[0]
            types = [
                (t, [int(x) for x in dims.split("x") if x]) for dims, t in _LOWERED_TYPE.findall(operands)
            ]
            yield (name.group(1) if name else "pallas kernel"), *_leading_table_bytes(types), vmem
        elif "custom_call_target=" in line:  # compiled: %name.N = ... custom-call(...), operand_layout_...
            name = re.match(r"\s*(?:ROOT )?%?([\w-]+?)(?:\.\d+)? = ", line)
            name = re.sub(r"^(?:transpose_|jvp_)+|_+$", "", name.group(1)) if name else None  # AD's prefixes
            operands = re.search(r"operand_layout_constraints=\{(.*?)\}, [a-z_]+=", line)
            types = [
                (t, [int(x) for x in dims.split(",") if x])
                for t, dims in _COMPILED_TYPE.findall(operands.group(1) if operands else "")
            ]
            yield name or "pallas kernel", *_leading_table_bytes(types), vmem


def kernel_memory(hlo_text: str) -> list[KernelMemory]:
    """Per Pallas TPU kernel of a program's text (lowered or compiled): call sites, the largest
    SMEM tables and the largest scoped VMEM limit, by kernel name."""
    found: dict[str, KernelMemory] = {}
    for name, smem, exact, vmem in _call_sites(hlo_text):
        seen = found.get(name, KernelMemory(name, 0, 0, None))
        limits = [v for v in (vmem, seen.vmem_bytes) if v is not None]
        found[name] = KernelMemory(
            name,
            seen.calls + 1,
            max(smem, seen.smem_bytes),
            max(limits, default=None),
            exact and seen.smem_exact,
        )
    return sorted(found.values())


def check_kernel_memory(kernels: list[KernelMemory], device_kind: str, topology: str) -> None:
    """Refuses (ConfigError, one line) a program whose kernel would overflow a TPU core's SMEM
    with its tables (counted exactly: flat tables), or ask for more scoped VMEM than the core
    has: before libtpu's compile, which takes minutes at 1M tokens. An estimated overflow is
    left to libtpu, whose refusal the dry run reports."""
    caps = {"SMEM": SMEM_BYTES.get(device_kind), "VMEM": VMEM_BYTES.get(device_kind)}
    for k in kernels:
        for space, used in (("SMEM", k.smem_bytes), ("VMEM", k.vmem_bytes)):
            known = space == "VMEM" or k.smem_exact
            if known and caps[space] is not None and used is not None and used > caps[space]:
                raise ConfigError(
                    "mesh.topology",
                    topology,
                    f"kernel {k.kernel} needs {used / 2**20:.2f} MiB of {space} per call, over the "
                    f"{caps[space] / 2**20:.2f} MiB of a {device_kind} core; change {KNOBS[space]}",
                )


def memory_lines(kernels: list[KernelMemory], device_kind: str) -> list[str]:
    """One line per kernel for the dry run: SMEM tables and scoped VMEM against the core's."""
    smem_cap, vmem_cap = SMEM_BYTES.get(device_kind), VMEM_BYTES.get(device_kind)
    lines = []
    for k in kernels:
        smem = f"SMEM tables {'' if k.smem_exact else 'about '}{k.smem_bytes / 2**10:,.1f}" + (
            f" of {smem_cap / 2**10:,.0f}" if smem_cap else ""
        )
        vmem = "scoped VMEM: Mosaic's default"
        if k.vmem_bytes:
            vmem = f"scoped VMEM {k.vmem_bytes / 2**20:.1f}" + (
                f" of {vmem_cap / 2**20:.0f}" if vmem_cap else ""
            )
            vmem += " MiB"
        lines.append(f"{k.kernel} ({k.calls} call{'s' if k.calls > 1 else ''}): {smem} KiB, {vmem}")
    return lines
