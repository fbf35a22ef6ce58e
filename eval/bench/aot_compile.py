"""Compile the MoBA Pallas kernels for real hardware, on this CPU, at the benchmark shapes.

    python -m eval.bench.aot_compile [--seqs 8192,32768,131072] [--topology v5p:2x2x1]
        [--block-size 512] [--top-k 3] [--no-gpu]

TPU: Mosaic lowering plus a libtpu ahead-of-time compile of forward+backward
for a TPU topology (needs the `tpu` extra, no TPU). GPU: jax.export lowering for
CUDA (Triton kernels). Batch 1, 16 heads, head dim 128, block 512, top_k 3 (by
default), bf16. Prints compile time and the compiled HBM need (TPU memory_analysis);
a kernel the compiler refuses (e.g. short of VMEM) fails the compile with its message.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from effattn_jax.ops.moba import BlockSizes
from effattn_jax.ops.routing import moba_routing
from eval.bench.common import compiled_bytes
from eval.processes import platform_line
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
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", default="8192,32768,131072")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--no-gpu", action="store_true", help="skip the CUDA export")
    args = p.parse_args(argv)
    print(platform_line())
    topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    print(
        f"jax {jax.__version__}; TPU topology {args.topology} ({topo.devices[0].device_kind}); batch 1, "
        f"{args.heads} heads, head dim {args.head_dim}, block {args.block_size}, top_k {args.top_k}, bf16, "
        "forward+backward"
    )
    print("| seq | TPU compile s | TPU HBM needed GiB | CUDA export s | Triton kernels |")
    print("|---|---|---|---|---|")
    for seq in [int(s) for s in args.seqs.split(",")]:
        shape = (1, seq, args.heads, args.head_dim)
        t = time.perf_counter()
        compiled = (
            grad_fn("tpu", BlockSizes(), args.head_dim, args.block_size, args.top_k)
            .lower(*[jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)] * 3)
            .compile()
        )
        tpu_s = time.perf_counter() - t
        need = compiled_bytes(compiled) / 2**30
        if args.no_gpu:
            print(f"| {seq} | {tpu_s:.0f} | {need:.1f} | - | - |", flush=True)
            continue
        t = time.perf_counter()
        triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        with gpu_lowering_target():
            exported = jax.export.export(
                grad_fn("gpu", BlockSizes(64, 64), args.head_dim, args.block_size, args.top_k),
                platforms=["cuda"],
                disabled_checks=[triton],
            )(*[jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3)
        gpu_s = time.perf_counter() - t
        n_triton = exported.mlir_module().count("xla.gpu.triton")
        print(f"| {seq} | {tpu_s:.0f} | {need:.1f} | {gpu_s:.1f} | {n_triton} |", flush=True)


if __name__ == "__main__":
    main()
