"""Everything this project wants to know from a GPU, in one run within `--budget-s` on one H200,
compiles included (300 s by default, where sections skip the cases past their share; every case
takes about 1,800 s; `--sections` runs a part); it prints as it goes and rewrites
`<out>/gpu_suite.json` after every case. Every kernel runs with the shipped defaults (tiles `auto`).

    python -m eval.bench.gpu_suite --out DIR [--budget-s 300] [--sections a,b] [--json]
    python -m eval.bench.gpu_suite --out DIR --dry     # on a CPU: tiny shapes, kernels interpreted

`--json` prints that JSON on stdout at the end as well (the progress lines go to stderr): keys
date, jax, device, backend, device_count, dry, sections (section name -> its rows).

Sections, in order (a section stops starting cases once its share of the budget is spent, and
says so in the JSON; the transformers section's share, 0.3, comes on top of the others', which
sum to the budget):
- correctness: the compiled kernels against the references (eval/bench/gpu_checks.py): MoBA
  forward and gradients at 8K, bf16 (packed documents with GQA, top-k 1, top-k covering every
  block), the MLA and MoBA decode kernels against XLA at 16 and 128 heads, and DSA's sparse
  attention kernel against its XLA path at 8K, top-2,048 (V3.2's per-head widths; GQA), and its
  fused selection against `dsa_select` on V3.2's indexer (64 heads of 128) at 8K.
- attention: MoBA (Pallas GPU kernels: `pallas_gpu`, and beside it the Mosaic GPU kernels on Hopper
  and the Triton kernels, whichever it is not) against cuDNN flash attention, forward + backward, bf16,
  head dim 128, block-local routing, alternated, for three shapes: batch 1 with 16 heads, block
  512, top_k 3 at 8K/32K/128K; the same with 16 query heads on 4 KV heads; FlashMoBA's benchmark
  configuration (batch 2, 16 heads, block 128, top_k 8). The loss and gradients against the XLA
  path's at each shape's first length (largest relative difference).
- routing: MoBA's gate through its Pallas kernel against the XLA gate, the floor (bytes at the copy
  rate) and the MoBA forward, at 32K and 128K (eval/bench/gpu_routing.py); the picks against XLA's.
- block_kernels: the selected blocks' kernels alone, Mosaic GPU (Hopper) against Triton, on the
  tiles of the attention section's shape at 8K and 128K (and at 128K with Mosaic's two-warpgroup
  tiles): results compared, forward and backward timed (eval/bench/block_kernels.py).
- tiles: the evidence for the Triton kernels' tile table, forward + backward of the attention
  section's first shape at one length for each tile set of `GPU_TILES` and a few larger ones; a
  set over the device's shared memory is refused before it compiles and says so.
- own_kernels: MoBA's own-block kernels on Mosaic GPU against the Triton ones, compiled, at the
  attention section's shape at 8K and 128K: their differences and each one's forward and backward
  ms (eval/bench/own_kernels.py); a GPU before Hopper says it has no Mosaic GPU backend.
- moba_decode: a decode step of a 12-layer d-768 MHA model, MoBA core (its decode kernel) against
  dense, at 32K and 128K (eval/decoding.py).
- latent_decode: the absorbed MLA and EG-MLA decode steps (their kernels) at 32K, the cache
  bytes they read per second against a device-to-device copy; then the MLA decode kernel alone
  (on Hopper the Mosaic GPU one with the Triton one beside it) against the XLA step at 16 and
  128 heads, batch 1 and 16 (eval/bench/latent_kernel.py).
- dsa: DSA's Triton kernels timed (eval/bench/gpu_dsa.py): the sparse attention forward + backward
  against its XLA path at 8K and 32K (V3.2's per-head widths, top-2,048), and at 8K in
  `dsa.absorb`'s form (one latent KV head of 576, values 512), beside the selection's ms; the
  latent decode step over the top-2,048 rows against MLA's decode kernel over all 32K slots, 16
  and 128 heads, batch 1 and 16; the fused selection against `dsa_select` in XLA on V3.2's indexer
  (64 heads of 128, bf16, top-2,048) at 8K and 32K.
- train: 30 steps of a small MoBA model with the GPU kernels beside the same run with the XLA
  path (same initialisation, same batches, float32): the losses must agree within `--loss-tol`.
- train_py: `train.py` itself on the configs/gpu/ models for a few dozen steps (a subprocess each):
  tokens/s and MFU from the run's TensorBoard scalars. It needs the data stack (grain) and the
  built-in corpus (`python -m effattn_jax.data.fetch`, or $EFFATTN_CACHE holding it); without
  them the section says so.
- long_attention: the first shape at 256K, 512K and 1M tokens, FlashMoBA's at 512K (one timed
  repeat each: cuDNN takes seconds there), if the budget and memory allow.
- transformers: decode tokens/s of our Generator beside transformers' generate (static cache,
  SDPA) on the same Llama-architecture shapes, prompts of 4K and 32K, batch 1 and 16, each side
  in a process of its own (eval/bench/gpu_transformers.py), with what our compiled step launches
  (operations by kind, bytes) and a profiler trace of each of our generations under <out>/traces;
  without torch and transformers it says so. Every case takes minutes: --budget-s 1800 reaches them all.

`--sections a,b` runs only those sections (in the order above), to spend a short GPU loan well.
The suite's own JAX does not preallocate the GPU's memory (XLA_PYTHON_CLIENT_PREALLOCATE=false
unless set), so the processes of the transformers section find it free.

Apart from train_py it imports nothing from the data stack: batches are synthetic.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from effattn_jax.cli import nonnegative_float, positive_float
from effattn_jax.config import load_config
from effattn_jax.ops.moba import BlockSizes, moba_attention
from effattn_jax.ops.platform import resolve_impl
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_train_step
from eval.bench import block_kernels, common, gpu_checks, gpu_dsa, gpu_routing, gpu_transformers, own_kernels
from eval.bench.attention import structured_inputs
from eval.bench.latent_kernel import latent_kernel_case
from eval.decoding import copy_bandwidth, latent_decode, moba_vs_dense_decode
from eval.timing import Carry, alternated, carried, seconds
from pallas_kernels import gpu_memory
from pallas_kernels.moba.schedule import GPU_TILES

ROOT = Path(__file__).resolve().parents[2]
GPU = "pallas_gpu"
TINY_TRAIN_PY = (
    "train.steps=2 train.log_every=1 train.warmup_steps=1 eval.max_batches=1 model.num_layers=1 "
    "model.d_model=32 model.num_heads=2 model.head_dim=16 model.mlp_dim=64 model.dtype=float32 "
    "data.seq_len=64 data.batch_size=2 moba.block_size=16 moba.q_tile=16 moba.kv_block=16 "
    "moba.past_q_tile=16 moba.impl=pallas_gpu attention.dense_impl=xla mesh.data=1 mesh.fsdp=1"
).split()
# (section, share of the budget)
SHARES = {
    "correctness": 0.1,
    "attention": 0.17,
    "routing": 0.05,
    "block_kernels": 0.05,
    "tiles": 0.06,
    "own_kernels": 0.05,
    "moba_decode": 0.08,
    "latent_decode": 0.07,
    "dsa": 0.06,
    "train": 0.09,
    "train_py": 0.14,
    "long_attention": 0.08,
    "transformers": 0.3,
}
# the GPU kernels the attention sections run: pallas_gpu is what users get (gpu_dispatch.py), timed
# beside the Mosaic GPU kernels (Hopper) and the Triton ones (every GPU) where it is not one of them
MOBA_GPU_IMPLS = {"moba_pallas": GPU, "moba_mosaic": "pallas_mosaic", "moba_triton": "pallas_triton"}
MOBA_CHECKS = [dict(heads=16, kv_heads=4, top_k=3, docs=3), dict(heads=16, kv_heads=16, top_k=1, docs=1),
               dict(heads=16, kv_heads=16, top_k=None, docs=1)]  # top_k None: every block  # fmt: skip

FULL = {
    "correctness": dict(
        moba=dict(seq=8192, head_dim=128, block=512, dtype=jnp.bfloat16, tiles=BlockSizes()),
        moba_impls=["pallas_mosaic", "pallas_triton"],
        decode_impls=["pallas_mosaic", "pallas_triton"],
        mla=dict(context=4096, batch=2, latent=512, rope=64, dtype=jnp.bfloat16),
        moba_decode=dict(context=8192, block=512, head_dim=128, dtype=jnp.bfloat16),
        heads=[16, 128],
        # DSA: V3.2's per-head widths with MLA's KV head per query head, GQA, and dsa.absorb's one
        # latent KV head (576, values 512); top-2,048 of 8K
        dsa=[dict(seq=8192, heads=16, kv_heads=kv, head_dim=d, v_head_dim=dv, top_k=2048, dtype=jnp.bfloat16)
             for kv, d, dv in ((16, 192, 128), (2, 128, 128), (1, 576, 512))],
        dsa_impls=["pallas_triton"],
        dsa_decode=dict(context=8192, batch=2, latent=512, rope=64, top_k=2048, dtype=jnp.bfloat16),
        dsa_select=dict(seq=8192, top_k=2048, index_heads=64, index_dim=128, dtype=jnp.bfloat16),
        tol=3e-2,
        dsa_select_tol=1e-5,  # the picks' float32 scores: only near-ties may part (a wrong rank is ~1e-4)
    ),
    "attention": dict(head_dim=128, dense="cudnn", tiles=BlockSizes(), repeats=3, long_repeats=1, shapes=[
        dict(name="mha", batch=1, heads=16, kv_heads=16, block=512, top_k=3, seqs=[8192, 32768, 131072],
             long_seqs=[262144, 524288, 1048576]),
        dict(name="gqa", batch=1, heads=16, kv_heads=4, block=512, top_k=3, seqs=[8192, 131072],
             long_seqs=[]),
        dict(name="flashmoba", batch=2, heads=16, kv_heads=16, block=128, top_k=8, seqs=[8192, 131072],
             long_seqs=[524288]),
    ]),
    "tiles": dict(seq=32768, sets=list(GPU_TILES[:3]) + [(128, 64, 64), (128, 64, 128), (128, 128, 256)]),
    "train_py": dict(configs=["dense_545m_8k", "moba_545m_8k", "dense_545m_32k", "moba_545m_32k",
                              "dsa_545m_32k"],
                     overrides=["train.steps=30", "train.log_every=10", "eval.every_steps=1000",
                                "eval.max_batches=1", "checkpoint.every_steps=1000"]),
    "own_kernels": own_kernels.FULL,
    "routing": gpu_routing.FULL,
    "moba_decode": dict(contexts=[32768, 131072], model=None),
    "latent_decode": dict(contexts=[32768], batches=[1, 16], overrides=(), copy_gib=1.0),
    "latent_kernel": dict(contexts=[32768], heads=[16, 128], batches=[1, 16], latent=512, rope=64,
                          dtype=jnp.bfloat16, impl=GPU, repeats=5),
    "transformers": dict(shapes=["llama_12l_d768", "qwen3_0.6b"], prompts=[4096, 32768], batches=[1, 16],
                         new_tokens=64, repeats=3, dtype="bfloat16"),
    "dsa": dict(
        # per head at 8K, dsa.absorb's one latent KV head at 8K (the two forms' price), per head at 32K
        attention=[
            dict(seq=seq, heads=16, kv_heads=kv, head_dim=d, v_head_dim=dv, top_k=2048, dtype=jnp.bfloat16)
            for seq, kv, d, dv in ((8192, 16, 192, 128), (8192, 1, 576, 512), (32768, 16, 192, 128))
        ],
        decode=[dict(context=32768, batch=batch, heads=heads, latent=512, rope=64, top_k=2048,
                     dtype=jnp.bfloat16) for heads in (16, 128) for batch in (1, 16)],
        select=[dict(seq=seq, top_k=2048, index_heads=64, index_dim=128, dtype=jnp.bfloat16)
                for seq in (8192, 32768)],
        repeats=3,
    ),
    "train": ["model.num_layers=4", "model.d_model=512", "model.num_heads=8", "model.mlp_dim=1408",
              "model.vocab_size=32768", "data.seq_len=8192", "data.batch_size=2", "moba.block_size=512",
              "moba.top_k=3", "model.dtype=float32", "train.lr=3e-4", "train.warmup_steps=5"],
    "train_steps": 30,
}  # fmt: skip
DRY = {
    "correctness": dict(
        moba=dict(seq=256, head_dim=16, block=32, dtype=jnp.float32, tiles=BlockSizes(16, 16, 16)),
        moba_impls=[GPU],  # interpreted: the Triton kernels (Mosaic's interpreter is tested in tests/)
        decode_impls=["pallas_triton"],
        mla=dict(context=64, batch=2, latent=16, rope=8, dtype=jnp.float32),
        moba_decode=dict(context=128, block=32, head_dim=16, dtype=jnp.float32),
        heads=[4, 8],
        dsa=[dict(seq=128, heads=4, kv_heads=kv, head_dim=16, v_head_dim=8, top_k=24, dtype=jnp.float32)
             for kv in (2, 1)],
        dsa_impls=["pallas_triton"],
        dsa_decode=dict(context=64, batch=2, latent=16, rope=16, top_k=24, dtype=jnp.float32),
        dsa_select=dict(seq=96, top_k=24, index_heads=4, index_dim=16, dtype=jnp.float32),
        tol=1e-4,
        dsa_select_tol=1e-5,
    ),
    "attention": dict(head_dim=16, dense="xla", tiles=BlockSizes(q_tile=16, kv_block=16, past_q_tile=16),
                      repeats=1, long_repeats=1, shapes=[
        dict(name="mha", batch=1, heads=2, kv_heads=2, block=32, top_k=3, seqs=[256], long_seqs=[]),
        dict(name="gqa", batch=1, heads=4, kv_heads=2, block=32, top_k=3, seqs=[128], long_seqs=[]),
        dict(name="flashmoba", batch=2, heads=2, kv_heads=2, block=16, top_k=8, seqs=[128], long_seqs=[]),
    ]),
    "tiles": dict(seq=256, sets=[(16, 16, 16), (32, 16, 32)]),
    "train_py": dict(configs=["moba_545m_8k"], overrides=TINY_TRAIN_PY),
    "own_kernels": own_kernels.DRY,
    "routing": gpu_routing.DRY,
    "moba_decode": dict(contexts=[128], model=["model.num_layers=2", "model.d_model=64", "model.num_heads=2",
                        "model.mlp_dim=128", "model.vocab_size=256", "model.dtype=float32",
                        "moba.block_size=32", "moba.top_k=3"]),
    "latent_decode": dict(contexts=[64], batches=[1], copy_gib=0.01,
                          overrides=("model.num_layers=1", "model.vocab_size=256")),
    "latent_kernel": dict(contexts=[64], heads=[4], batches=[1], latent=16, rope=8, dtype=jnp.float32,
                          impl=GPU, repeats=1),
    "transformers": dict(shapes=["tiny"], prompts=[32], batches=[2], new_tokens=8, repeats=1,
                         dtype="float32"),
    "dsa": dict(attention=[dict(seq=64, heads=4, kv_heads=2, head_dim=16, v_head_dim=8, top_k=12,
                                dtype=jnp.float32)],
                decode=[dict(context=64, batch=1, heads=4, latent=16, rope=16, top_k=12, dtype=jnp.float32)],
                select=[dict(seq=64, top_k=12, index_heads=4, index_dim=16, dtype=jnp.float32)],
                repeats=1),
    "train": ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.mlp_dim=64",
              "model.vocab_size=256", "data.seq_len=64", "data.batch_size=2", "moba.block_size=16",
              "moba.top_k=3", "model.dtype=float32", "moba.q_tile=16", "moba.kv_block=16",
              "moba.past_q_tile=16", "train.warmup_steps=1"],
    "train_steps": 2,
}  # fmt: skip


class Suite:
    """The JSON being built: each case is added and the file rewritten at once."""

    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.path = out / "gpu_suite.json"
        self.start, self.budget_s = time.perf_counter(), budget_s
        device = jax.devices()[0]
        self.data = {
            "date": datetime.date.today().isoformat(),
            "jax": jax.__version__,
            "device": device.device_kind,
            "backend": jax.default_backend(),
            "device_count": jax.device_count(),
            "dry": dry,
            "sections": {},
        }
        self.deadline = self.start
        self.write()

    def section(self, name: str) -> list:
        self.deadline = time.perf_counter() + SHARES[name] * self.budget_s
        print(f"== {name} (until {self.deadline - self.start:.0f} s)", flush=True)
        rows = self.data["sections"].setdefault(name, [])
        self.write()
        return rows

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline

    def add(self, rows: list, row: dict) -> None:
        row["at_s"] = round(time.perf_counter() - self.start, 1)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def _grad_fn(attn):
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _relative_difference(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def attention(suite: Suite, rows: list, p: dict, long: bool) -> None:
    """Each shape of `p["shapes"]` at its lengths (`long`: its long_seqs, one timed repeat): the GPU
    kernels of MOBA_GPU_IMPLS and dense attention, forward + backward, alternated. A contender that
    cannot run a shape (e.g. Mosaic kernels refusing it) says why in its row and the others go on;
    an error in a timed run (out of memory at the longest lengths) ends that shape's list."""
    for shape in p["shapes"]:
        for seq in shape["long_seqs" if long else "seqs"]:
            if not suite.time_left():
                suite.add(rows, {"shape": shape["name"], "seq": seq, "skipped": "time budget"})
                continue
            first = not long and seq == shape["seqs"][0]
            repeats = p["long_repeats" if long else "repeats"]
            row = _attention_case(shape, seq, p, repeats, compare_xla=first)
            suite.add(rows, row)
            if "error" in row:
                break


def _attention_case(shape: dict, seq: int, p: dict, repeats: int, compare_xla: bool) -> dict:
    moba = lambda impl: _grad_fn(
        lambda q, k, v: moba_attention(
            q, k, v, block_size=shape["block"], top_k=shape["top_k"], impl=impl, block_sizes=p["tiles"]
        )
    )
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=p["dense"])
    x = structured_inputs(
        seq, shape["heads"], p["head_dim"], jnp.bfloat16, batch=shape["batch"], kv_heads=shape["kv_heads"]
    )
    row = {"shape": shape["name"], "seq": seq, "batch": shape["batch"], "heads": shape["heads"],
           "kv_heads": shape["kv_heads"], "head_dim": p["head_dim"], "block": shape["block"],
           "top_k": shape["top_k"], "moba_pallas_kernels": _gpu_kernels(x, shape, p["tiles"])}  # fmt: skip
    fns = {name: moba(impl) for name, impl in MOBA_GPU_IMPLS.items()}
    fns.pop(f"moba_{row['moba_pallas_kernels']}")  # pallas_gpu is those kernels here: time them once
    fns["dense"] = _grad_fn(dense)
    try:
        for name in list(fns):
            t = time.perf_counter()
            try:
                jax.block_until_ready(fns[name](*x))
            except ValueError as e:  # refused before compiling (one line): the others still run
                row[f"{name}_refused"] = _error(e)
                fns.pop(name)
                continue
            row[f"{name}_first_call_s"] = round(time.perf_counter() - t, 2)
        ms = alternated({name: seconds(fn, *x) for name, fn in fns.items()}, repeats, warmup=0)
        row |= {f"{name}_ms": t * 1e3 for name, t in ms.items()}
        if "moba_pallas_ms" in row and "dense_ms" in row:
            row["dense_over_moba"] = row["dense_ms"] / row["moba_pallas_ms"]
        if compare_xla and "moba_pallas" in fns:
            got, want = (jax.tree.leaves(f(*x)) for f in (fns["moba_pallas"], moba("xla")))
            # loss and dq/dK/dV, each relative to its largest entry (bf16: about 1e-2 expected)
            row["pallas_vs_xla_max_rel_diff"] = max(
                _relative_difference(a, b) for a, b in zip(got, want, strict=True)
            )
    except Exception as e:  # noqa: BLE001 - out of memory at the longest lengths ends the list
        row["error"] = _error(e)
    return row


def _gpu_kernels(x, shape: dict, tiles: BlockSizes) -> str:
    """Which GPU kernels `pallas_gpu` runs for this shape on this machine ("mosaic" | "triton"),
    interpreted off a GPU."""
    from pallas_kernels.moba.parts import KernelCall

    _, kernel, interpret = resolve_impl(GPU)
    call = KernelCall.fitted(
        tiles, x[0], x[2], block_size=shape["block"], scale=1.0, backend=kernel, interpret=interpret
    )
    return call.gpu_kernels


def _train_steps(setup, batches: list, losses: list):
    """A contender for the timer: the seconds of the next train step over `batches` (its loss kept in
    `losses`), the state carried from step to step."""
    step, batches = make_train_step(setup), iter(batches)

    def one(state):
        state, metrics = step(state, jax.device_put(next(batches), setup.batch_sharding()))
        losses.append(float(metrics["loss"]))  # waits for the step
        return state, metrics

    return carried(one, Carry(init_state(setup)))


def train_pair(suite: Suite, rows: list, overrides: list[str], steps: int, loss_tol: float) -> None:
    """The same run with the GPU kernels and with the XLA path: losses per step, tokens/s."""
    losses, tok_s = {}, {}
    batches = None
    for impl in ("pallas_gpu", "xla"):
        if not suite.time_left():
            suite.add(rows, {"impl": impl, "skipped": "time budget"})
            return
        cfg = load_config(None, overrides + [f"moba.impl={impl}", "attention.core=moba"])
        setup = make_setup(cfg, make_mesh(1, 1, 1))
        b, s = cfg.data.batch_size, cfg.data.seq_len
        batches = batches or [
            common.synthetic_batch(b, s, cfg.model.vocab_size, seed=i) for i in range(steps)
        ]
        losses[impl] = []
        one_step = _train_steps(setup, batches, losses[impl])
        tok_s[impl] = b * s / alternated({"step": one_step}, steps - 1)["step"]  # the first step compiles
        first, last = losses[impl][0], losses[impl][-1]
        suite.add(
            rows,
            {
                "impl": impl,
                "steps": steps,
                "first_loss": first,
                "last_loss": last,
                "tokens_per_s": tok_s[impl],
            },
        )
    diff = float(np.max(np.abs(np.subtract(losses["pallas_gpu"], losses["xla"]))))
    suite.add(rows, {"max_loss_difference": diff, "loss_tol": loss_tol, "losses_agree": diff <= loss_tol,
                     "pallas_over_xla_tokens_per_s": tok_s["pallas_gpu"] / tok_s["xla"]})  # fmt: skip


def correctness(suite: Suite, rows: list, p: dict) -> None:
    """The compiled kernels against the references: MoBA at realistic shapes, the decode kernels at
    16 and 128 heads (eval/bench/gpu_checks.py); each row says whether it is within `tol`."""
    m = p["moba"]
    every = m["seq"] // m["block"]
    cases = [("moba", gpu_checks.moba_case, m | c | {"top_k": c["top_k"] or every, "impl": impl})
             for impl in p["moba_impls"] for c in MOBA_CHECKS]  # fmt: skip
    for impl in p["decode_impls"]:  # each GPU kernel by name: pallas_gpu runs only verified ones
        for heads in p["heads"]:
            cases.append(("mla_decode", gpu_checks.mla_decode_case, dict(p["mla"], heads=heads, impl=impl)))
            kw = dict(p["moba_decode"], heads=heads, impl=impl)
            cases.append(("moba_decode", gpu_checks.moba_decode_case, kw))
    cases += [("dsa", gpu_checks.dsa_case, c | {"impl": impl}) for impl in p["dsa_impls"] for c in p["dsa"]]
    cases += [("dsa_decode", gpu_checks.dsa_decode_case, dict(p["dsa_decode"], heads=heads, impl=impl))
              for impl in p["dsa_impls"] for heads in p["heads"]]  # fmt: skip
    cases += [
        ("dsa_select", gpu_checks.dsa_select_case, p["dsa_select"] | {"impl": impl})
        for impl in p["dsa_impls"]
    ]
    for name, check, kw in cases:
        if not suite.time_left():
            suite.add(rows, {"check": name, "skipped": "time budget"})
            continue
        try:
            row = check(**kw)
            row["ok"] = row["max_rel_diff"] <= p.get(f"{name}_tol", p["tol"])
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or run is the finding
            row = {"check": name, "heads": kw.get("heads"), "ok": False, "error": _error(e)}
        suite.add(rows, row)


def tile_sweep(suite: Suite, rows: list, attn: dict, p: dict) -> None:
    """Forward + backward ms of the Triton kernels (whose tile table this is) on the attention
    section's first shape at one length per tile set, with each set's estimated shared memory; a set
    over the device's limit is refused before compiling."""
    first = attn["shapes"][0]
    attn = dict(first, head_dim=attn["head_dim"], impl="pallas_triton")
    x = structured_inputs(p["seq"], attn["heads"], attn["head_dim"], jnp.bfloat16)
    limit = gpu_memory.device_limit()[0]
    for tiles in p["sets"]:
        sizes = BlockSizes(*tiles).resolve("gpu")
        kernel, need = sizes.gpu_smem(attn["head_dim"], attn["head_dim"], 2)
        row = {"tiles": list(tiles), "seq": p["seq"], "smem_estimate": need, "largest_kernel": kernel,
               "smem_limit": limit}  # fmt: skip
        if not suite.time_left():
            suite.add(rows, row | {"skipped": "time budget"})
            continue
        fn = _grad_fn(
            lambda q, k, v, sizes=sizes: moba_attention(
                q, k, v, block_size=attn["block"], top_k=attn["top_k"], impl=attn["impl"], block_sizes=sizes
            )
        )
        try:
            jax.block_until_ready(fn(*x))
            row["ms"] = alternated({"ms": seconds(fn, *x)}, 3, warmup=0)["ms"] * 1e3
        except Exception as e:  # noqa: BLE001 - refused (over the limit) or failed: recorded
            row["error"] = _error(e)
        suite.add(rows, row)


def train_py(suite: Suite, rows: list, p: dict, out: Path) -> None:
    """train.py on configs/gpu/ models, a subprocess each: tokens/s and MFU of the last logged interval
    (TensorBoard scalars), the exit status and the tail of stderr when it fails."""
    # the project first, then what was there (the wheels eval/bench/gpu_all.sh carries to a GPU machine)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path}
    if subprocess.run([sys.executable, "-c", "import grain"], env=env, capture_output=True).returncode:
        suite.add(rows, {"skipped": "grain does not import here (install it beside the image's packages)"})
        return
    from effattn_jax.train.metrics import read_scalars

    for name in p["configs"]:
        if not suite.time_left():
            suite.add(rows, {"config": name, "skipped": "time budget"})
            continue
        run_dir = out / "train_py" / name
        cmd = [sys.executable, "train.py", "--config", f"configs/gpu/{name}.yaml", f"train.run_dir={run_dir}",
               "train.resume=false", "train.progress=false", *p["overrides"]]  # fmt: skip
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        row = {"config": name, "exit": done.returncode, "wall_s": round(time.perf_counter() - t, 1)}
        if done.returncode:
            row["stderr_tail"] = done.stderr.strip().splitlines()[-3:]
        else:
            last = {tag: points[-1] for tag, points in read_scalars(run_dir).items()}
            mfu = last.get("mfu", (0, None))[1]  # None where the device's peak is not known (a CPU)
            row |= {"steps": last["loss"][0], "last_loss": last["loss"][1],
                    "tokens_per_s": last["tokens_per_sec"][1], "mfu": mfu}  # fmt: skip
        suite.add(rows, row)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_suite.json")
    p.add_argument(
        "--budget-s", type=positive_float, default=300.0, help="seconds for everything, compiles included"
    )
    p.add_argument("--dry", action="store_true", help="tiny shapes with interpreted kernels (a CPU check)")
    p.add_argument(
        "--loss-tol", type=nonnegative_float, default=2e-3, help="largest loss difference pallas vs xla"
    )
    p.add_argument(
        "--sections", default=",".join(SHARES), help=f"comma-separated, of: {', '.join(SHARES)} (default all)"
    )
    args = p.parse_args(argv)
    args.sections = args.sections.split(",")
    if unknown := [name for name in args.sections if name not in SHARES]:
        p.error(f"--sections: unknown {', '.join(unknown)}; allowed: {', '.join(SHARES)}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out {args.out}: a file; it takes a directory (for gpu_suite.json)")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX first opens the GPU
    with common.report(args, f"budget {args.budget_s:.0f} s" + (", dry" if args.dry else "")) as emit:
        suite = run(args)
        emit(suite.data)
    return 0


def run(args) -> Suite:
    """The sections asked for (all by default), in order, within the budget; the JSON is rewritten
    after every case."""
    plan = DRY if args.dry else FULL
    suite = Suite(args.out, args.budget_s, args.dry)
    for name in SHARES:
        if name in args.sections:
            SECTIONS[name](suite, suite.section(name), plan, args)
    print(f"done in {time.perf_counter() - suite.start:.0f} s: {suite.path}", flush=True)
    return suite


def _moba_decode(suite: Suite, rows: list, plan: dict, args) -> None:
    decode = plan["moba_decode"]
    for context in decode["contexts"]:
        if not suite.time_left():
            suite.add(rows, {"context": context, "skipped": "time budget"})
            continue
        model = {"overrides": decode["model"]} if decode["model"] else {}
        row = moba_vs_dense_decode(context, 1, repeats=3, **model)
        if context >= 131072:  # the goal at 128K: a MoBA step at most 1/4 of the dense one
            row |= {"goal_ratio_at_most": 0.25, "meets_goal": row["ratio"] <= 0.25}
        suite.add(rows, row)


def _latent_decode(suite: Suite, rows: list, plan: dict, args) -> None:
    latent = plan["latent_decode"]
    copy = copy_bandwidth(latent["copy_gib"])
    suite.add(rows, {"copy_bytes_per_s": copy})
    for context in latent["contexts"]:
        for batch in latent["batches"]:
            if not suite.time_left():
                suite.add(rows, {"context": context, "batch": batch, "skipped": "time budget"})
                continue
            for r in latent_decode(context, batch, repeats=3, overrides=latent["overrides"]):
                r["read_bytes_per_s"] = r["cache_bytes_read"] / (r["ms"] / 1e3)
                r["of_copy_bandwidth"] = r["read_bytes_per_s"] / copy
                suite.add(rows, r)
    kernel = plan["latent_kernel"]
    for context, heads, batch in itertools.product(kernel["contexts"], kernel["heads"], kernel["batches"]):
        case = dict(context=context, heads=heads, batch=batch)
        if not suite.time_left():
            suite.add(rows, case | {"kernel": "mla_decode_gpu", "skipped": "time budget"})
            continue
        params = {k: v for k, v in kernel.items() if k not in ("contexts", "heads", "batches")}
        try:
            suite.add(rows, latent_kernel_case(**case, **params, copy=copy))
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile at a shape is the finding
            suite.add(rows, case | {"kernel": "mla_decode_gpu", "error": _error(e)})


# section name -> what runs it: (suite, its rows, the plan, the arguments)
SECTIONS = {
    "correctness": lambda suite, rows, plan, args: correctness(suite, rows, plan["correctness"]),
    "attention": lambda suite, rows, plan, args: attention(suite, rows, plan["attention"], long=False),
    "routing": lambda suite, rows, plan, args: gpu_routing.routing_rows(
        plan["routing"], suite.time_left, lambda row: suite.add(rows, row), _error
    ),
    "block_kernels": lambda suite, rows, plan, args: block_kernels.block_kernels(
        suite, rows, block_kernels.DRY if args.dry else block_kernels.FULL, interpret=args.dry
    ),
    "tiles": lambda suite, rows, plan, args: tile_sweep(suite, rows, plan["attention"], plan["tiles"]),
    "own_kernels": lambda suite, rows, plan, args: own_kernels.section(suite, rows, plan["own_kernels"]),
    "moba_decode": _moba_decode,
    "latent_decode": _latent_decode,
    "dsa": lambda suite, rows, plan, args: gpu_dsa.section(suite, rows, plan["dsa"], _error),
    "train": lambda suite, rows, plan, args: train_pair(
        suite, rows, plan["train"], plan["train_steps"], args.loss_tol
    ),
    "train_py": lambda suite, rows, plan, args: train_py(suite, rows, plan["train_py"], args.out.resolve()),
    "long_attention": lambda suite, rows, plan, args: attention(suite, rows, plan["attention"], long=True),
    "transformers": lambda suite, rows, plan, args: gpu_transformers.section(
        suite, rows, plan["transformers"], args.out.resolve() / "traces"
    ),
}


if __name__ == "__main__":
    raise SystemExit(main())
