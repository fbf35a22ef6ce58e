"""Compile the MoBA Pallas kernels for real hardware, on this CPU, at the benchmark shapes.

    python -m eval.bench.aot_compile [--seqs 8192,32768,131072] [--topology v5p:2x2x1]
        [--block-size 512] [--top-k 3] [--no-gpu] [--json]

TPU: Mosaic lowering plus a libtpu ahead-of-time compile of forward+backward
for a TPU topology (needs the `tpu` extra, no TPU). GPU: jax.export lowering for
CUDA (Triton kernels). Batch 1, 16 heads, head dim 128, block 512, top_k 3 (by
default), bf16. Prints compile time and the compiled HBM need (`effattn_jax.memory.program_bytes`
of the TPU executable: arguments + outputs + temporaries); a kernel the compiler refuses (e.g.
short of VMEM) fails the compile with its message. `--json` prints a list of rows {seq,
tpu_compile_s, tpu_hbm_bytes, cuda_export_s, triton_kernels} (the last two null with --no-gpu).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from effattn_jax.cli import positive_int, positive_int_list
from effattn_jax.memory import program_bytes
from effattn_jax.ops.moba import BlockSizes
from effattn_jax.ops.routing import moba_routing
from eval.bench import common
from pallas_kernels.common import gpu_lowering_target
from pallas_kernels.moba.attention import moba_pallas


def grad_fn(kernel, block_sizes, head_dim, block_size=512, top_k=3):
    def loss(q, k, v):
        r = moba_routing(q, k, block_size=block_size, top_k=top_k)
        out = moba_pallas(
            q, k, v, r.own_start, r.past_start, block_size, head_dim**-0.5, kernel, False, block_sizes
        )
        return out.astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv=None):
    p = common.parser(__doc__, __file__)
    p.add_argument("--seqs", type=positive_int_list, default=[8192, 32768, 131072])
    p.add_argument("--heads", type=positive_int, default=16)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--block-size", type=positive_int, default=512)
    p.add_argument("--top-k", type=positive_int, default=3)
    p.add_argument("--no-gpu", action="store_true", help="skip the CUDA export")
    args = p.parse_args(argv)
    topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    about = (
        f"TPU topology {args.topology} ({topo.devices[0].device_kind}); batch 1, {args.heads} heads, "
        f"head dim {args.head_dim}, block {args.block_size}, top_k {args.top_k}, bf16, forward+backward"
    )
    with common.report(args, about) as emit:
        print("| seq | TPU compile s | TPU HBM needed GiB | CUDA export s | Triton kernels |")
        print("|---|---|---|---|---|")
        rows = []
        for seq in args.seqs:
            r = compile_one(args, topo, seq)
            rows.append(r)
            gpu = "- | -" if args.no_gpu else f"{r['cuda_export_s']:.1f} | {r['triton_kernels']}"
            print(
                f"| {seq} | {r['tpu_compile_s']:.0f} | {r['tpu_hbm_bytes'] / 2**30:.1f} | {gpu} |", flush=True
            )
        emit(rows)


def compile_one(args, topo, seq: int) -> dict:
    """The TPU compile (and the CUDA export) of forward+backward at `seq`."""
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shape = (1, seq, args.heads, args.head_dim)
    t = time.perf_counter()
    compiled = (
        grad_fn("tpu", BlockSizes(), args.head_dim, args.block_size, args.top_k)
        .lower(*[jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)] * 3)
        .compile()
    )
    row = {"seq": seq, "tpu_compile_s": time.perf_counter() - t, "tpu_hbm_bytes": program_bytes(compiled),
           "cuda_export_s": None, "triton_kernels": None}  # fmt: skip
    if args.no_gpu:
        return row
    t = time.perf_counter()
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_lowering_target():
        exported = jax.export.export(
            grad_fn("gpu", BlockSizes(), args.head_dim, args.block_size, args.top_k),  # auto tiles
            platforms=["cuda"],
            disabled_checks=[triton],
        )(*[jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3)
    row["cuda_export_s"] = time.perf_counter() - t
    row["triton_kernels"] = exported.mlir_module().count("xla.gpu.triton")
    return row


if __name__ == "__main__":
    main()
