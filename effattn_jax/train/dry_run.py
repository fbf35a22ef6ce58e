"""`train.dry_run=true`: size a run and check it fits its target chips, from a laptop.

The model is built abstractly (shapes only, nothing allocated); the parameter counts, FLOPs per
token and the whole run's compute are printed. With `mesh.topology` (e.g. v5p:4x4x4) the train
step is then compiled ahead of time for that TPU slice with libtpu (the `tpu` extra; no TPU
needed) and the compiler's per-chip memory is printed against the chip's HBM, with each Pallas
kernel's SMEM tables and scoped VMEM from the program (effattn_jax/train/tpu_memory.py); a kernel
that would overflow either is refused in one line before libtpu's compile.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

from effattn_jax.collectives import collective_bytes
from effattn_jax.config import (
    MESH_AXES,
    Config,
    ConfigError,
    check_batch_divides,
    check_context_split,
    moba_block_size,
)
from effattn_jax.flops import PFLOPS_DAY, pflops_days, train_flops_per_token
from effattn_jax.memory import program_bytes
from effattn_jax.model import Transformer, param_counts
from effattn_jax.ops.platform import tracing_for
from effattn_jax.ops.tpu_tables import SMEM_BUDGET_BYTES
from effattn_jax.sharding import config_mesh
from effattn_jax.train.gpu_kernels import check_gpu_kernels, runs_gpu_kernels
from effattn_jax.train.tpu_memory import (
    KNOBS,
    KernelMemory,
    check_kernel_memory,
    kernel_memory,
    memory_lines,
    moba_tpu_tables,
)

# HBM per chip by libtpu's device_kind (GiB)
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}


@contextlib.contextmanager
def _native_stderr_kept_for_errors():
    """libtpu, loaded off a TPU VM, writes a page of start-up warnings (no TPU accelerator type, no
    worker hostnames) to the process's stderr: held back here, and written out only if the block
    raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _topology_devices(name: str):
    from jax.experimental import topologies

    try:
        with _native_stderr_kept_for_errors():
            return topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    except Exception as e:  # libtpu missing, or a topology it does not know
        raise ConfigError(
            "mesh.topology",
            name,
            f"not a TPU slice libtpu can build ({type(e).__name__}: {str(e).splitlines()[0]}); needs the "
            "tpu extra (pip install -e '.[tpu]') and a name like v5e:2x2 or v5p:4x4x4",
        ) from e


def compile_for_topology(cfg: Config) -> dict:
    """Ahead-of-time compile of the train step on the topology's chips -> memory figures."""
    from effattn_jax.train.state import make_setup
    from effattn_jax.train.step import make_train_step

    devices = _topology_devices(cfg.mesh.topology)
    try:
        mesh = config_mesh(cfg.mesh, devices)
    except ValueError as e:  # the slice is too small, or does not divide, for the fixed mesh axes
        sizes = "x".join(str(getattr(cfg.mesh, axis)) for axis in MESH_AXES)
        why = f"{cfg.mesh.topology} has {len(devices)} chips: {str(e).removeprefix('mesh: ')}"
        raise ConfigError(f"mesh ({'x'.join(MESH_AXES)})", sizes, why) from None
    setup = make_setup(cfg, mesh)
    start = time.perf_counter()
    kind = devices[0].device_kind
    fit = {"chips": len(devices), "mesh": dict(mesh.shape), "device_kind": kind}
    fit["hbm_bytes"] = HBM_GIB[kind] * 2**30 if kind in HBM_GIB else None
    with tracing_for("tpu"):  # `auto` and `pallas` pick the real TPU kernels, not their interpretation
        lowered = make_train_step(setup).lower(setup.abstract_state, setup.abstract_batch())
    text = lowered.as_text()
    fit["tpu_kernels"] = text.count("tpu_custom_call")  # Pallas/Mosaic calls in the step
    kernels = kernel_memory(text)
    check_kernel_memory(kernels, kind, cfg.mesh.topology)  # SMEM/VMEM overflow: refused before compiling
    del text
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # the compiler itself refuses a program larger than the chip: that is the answer
        return fit | {
            "compile_seconds": time.perf_counter() - start,
            "bytes_per_chip": None,
            "fits": False,
            "refused": str(e),
            "kernel_memory": [k._asdict() for k in kernels],
        }
    compiled_text = compiled.as_text()
    kernels = kernel_memory(compiled_text) or kernels
    used = program_bytes(compiled)
    fits = fit["hbm_bytes"] is None or used <= fit["hbm_bytes"]
    return fit | {
        "compile_seconds": time.perf_counter() - start,
        "bytes_per_chip": int(used),
        "fits": fits,
        "kernel_memory": [k._asdict() for k in kernels],
        "collective_bytes": collective_bytes(compiled_text),
        "context_gather_bytes": context_gather_bytes(cfg, dict(mesh.shape)),
    }


def context_gather_bytes(cfg: Config, mesh_sizes: dict[str, int]) -> int:
    """The analytic all-gather volume over the context axis, per chip and forward pass: what each
    attention layer gathers from the other N - 1 shards for its rows (per-head K and V; MLA's
    latent and RoPE key, and EG-MLA's token ids)."""
    n = mesh_sizes.get("context", 1)
    if n == 1:
        return 0
    m, a = cfg.model, cfg.mla
    rows = cfg.data.batch_size // (mesh_sizes["data"] * mesh_sizes["fsdp"])
    width = {  # bytes per token
        "mha": cfg.num_kv_heads * 2 * cfg.head_dim * jnp.dtype(m.dtype).itemsize,
        "mla": (a.kv_lora_rank + a.qk_rope_head_dim) * jnp.dtype(m.dtype).itemsize,
    }
    width["eg_mla"] = width["mla"] + 4
    per_token = sum(width[cfg.layer_spec(i)[0]] for i in range(m.num_layers))
    return rows * cfg.data.seq_len * (n - 1) // n * per_token


def dry_run(cfg: Config, *, compile: bool = True) -> dict:
    """Prints the run's size (and, with mesh.topology, its compiled per-chip memory); returns
    the figures. Allocates no parameters."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=cfg.train.seed)))
    counts = param_counts(model)
    flops_token = train_flops_per_token(cfg, counts["non_embedding"])
    tokens = cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len
    report = {
        **{f"params_{k}": v for k, v in counts.items()},
        "train_flops_per_token": flops_token,
        "tokens": tokens,
        "pflops_days_6nd": pflops_days(counts["non_embedding"], tokens),
        "pflops_days": flops_token * tokens / PFLOPS_DAY,
    }
    print(
        f"parameters: {counts['non_embedding']:,} non-embedding, {counts['embedding']:,} embedding, "
        f"{counts['embedding_gate']:,} gate tables"
        + (f", {counts['token_table']:,} token tables" if counts["token_table"] else "")
        + f" ({counts['total']:,} in all)"
    )
    print(
        f"train FLOPs/token: {flops_token / 1e9:.2f} GFLOP (6·N incl. the output head, + attention); "
        f"{tokens / 1e9:.2f}B tokens ({cfg.train.steps:,} steps x {cfg.data.batch_size} x "
        f"{cfg.data.seq_len}); {report['pflops_days']:,.1f} PFLOP/s-days "
        f"(6·N·D alone: {report['pflops_days_6nd']:,.1f})"
    )
    if not cfg.mesh.topology:
        sizes = {axis: getattr(cfg.mesh, axis) for axis in MESH_AXES}
        # no devices to build a mesh of: the configured sizes (no -1) must split the batch
        if min(sizes.values()) > 0:
            check_batch_divides(cfg, sizes)
            check_context_split(cfg, sizes)
            if moba_block_size(cfg) is not None:  # the TPU kernels' SMEM tables, from the shapes alone
                report["moba_tpu_tables"] = [c._asdict() for c in moba_tpu_tables(cfg, sizes)]
                budget = f"budget {SMEM_BUDGET_BYTES / 2**10:,.0f} KiB"
                for c in report["moba_tpu_tables"]:
                    print(
                        f"MoBA TPU kernel {c['kernel']} per layer and chip: {c['calls']} call(s), "
                        f"SMEM tables {c['table_bytes'] / 2**10:,.1f} KiB a call ({budget})"
                    )
        print("no mesh.topology: the ahead-of-time compile was skipped (e.g. mesh.topology=v5p:4x4x4)")
        # the MoBA GPU kernels moba.impl runs and their tiles against this GPU's shared memory (an
        # H100/H200's on a host without one): ConfigError, one line, when they cannot run or fit
        if moba_block_size(cfg) is not None and runs_gpu_kernels(cfg.moba.impl, "gpu"):
            for line in check_gpu_kernels(cfg):
                print(f"MoBA GPU kernels, {line}")
    elif compile:
        fit = compile_for_topology(cfg)
        used, cap = fit["bytes_per_chip"], fit["hbm_bytes"]
        report |= fit
        where = (
            f"compiled for {cfg.mesh.topology} ({fit['chips']} x {fit['device_kind']}, mesh {fit['mesh']})"
        )
        if used is None:
            print(f"{where}: DOES NOT FIT, the compiler refused it: {fit['refused'].splitlines()[0]}")
            space = next((m for m in ("SMEM", "VMEM") if f"space={m.lower()}" in fit["refused"]), None)
            if space:
                print(f"a kernel overflows {space}: change {KNOBS[space]}")
        else:
            of = f"{cap / 2**30:.0f} GiB" if cap else "unknown capacity"
            verdict = "" if cap is None else (" fits" if fit["fits"] else " DOES NOT FIT")
            print(
                f"{where} in {fit['compile_seconds']:.0f} s ({fit['tpu_kernels']} kernel calls): "
                f"{used / 2**30:.2f} GiB per chip of {of}:{verdict}"
            )
            for line in memory_lines([KernelMemory(**k) for k in fit["kernel_memory"]], fit["device_kind"]):
                print(f"TPU kernel {line}")
            moved = ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in sorted(fit["collective_bytes"].items()))
            print(f"collectives per step and chip (MiB): {moved or 'none'}")
            if fit["context_gather_bytes"]:
                print(
                    f"analytic context all-gather per forward pass and chip: "
                    f"{fit['context_gather_bytes'] / 2**20:,.1f} MiB"
                )
    return report
