"""Would exchanging only the selected blocks pay under context parallelism? How much of the
gathered keys a context shard's queries use, on a small trained MoBA model.

    python -m eval.bench.context_blocks [--run DIR] [--shards 8] [--steps 60] [--json]

Without `--run`, trains a small MoBA model at the paper's 8K geometry (rows of 8,192 tokens,
block 512, top-3: 16 blocks per row; 2 layers of 2 heads of 32, on the built-in corpus) into a
temporary directory. Then, on packed validation rows of 8K, computes each layer's routing (the
model's own gate) and, for each of N context shards (chunks i and 2N-1-i of 2N), the keys some
local query (any head) reads: its own block's and its selected blocks'. Of the keys the other
shards hold, the fraction needed is what a selected-block exchange would still have to move
(1 = it saves nothing over the all-gather). Prints the mean and worst shard per layer and a
`context_blocks {json}` line; `--json` prints that JSON alone: {shards, seq_len, block_size,
top_k, rows, step, layers: [{mean, worst_shard, least_shard}]}.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from effattn_jax import checkpoint
from effattn_jax.cli import positive_int
from effattn_jax.config import load_config
from effattn_jax.data.shards import row_to_example
from effattn_jax.ops.context_parallel import balanced_order
from effattn_jax.ops.routing import moba_routing
from effattn_jax.ops.segments import segment_positions
from effattn_jax.train.loop import run
from eval.bench import common
from eval.lm_loss import validation_documents

ROOT = common.ROOT
MODEL = [
    "attention.core=moba", "moba.block_size=512", "moba.top_k=3", "data.seq_len=8192",
    "data.batch_size=1", "model.vocab_size=4096", "data.tokenizer=sotu-bpe-4k", "model.d_model=64",
    "model.num_layers=2", "model.num_heads=2", "model.mlp_dim=128", "train.lr=3e-3",
    "train.warmup_steps=6", "train.progress=false", "eval.every_steps=100000",
]  # fmt: skip


def packed_rows(docs: list[np.ndarray], seq_len: int, rows: int) -> dict[str, np.ndarray]:
    """The validation documents end to end, cut into `rows` rows as training packs them."""
    ids = np.concatenate(docs)
    starts = np.zeros(len(ids), bool)
    starts[np.cumsum([0] + [len(d) for d in docs])[:-1]] = True
    ids, starts = ids[: rows * seq_len + 1], starts[: rows * seq_len + 1]
    cut = lambda x, i: x[i * seq_len : (i + 1) * seq_len + 1]
    out = [
        row_to_example(cut(ids, i), np.cumsum(cut(starts, i)) + 1) for i in range((len(ids) - 1) // seq_len)
    ]
    return {k: np.stack([o[k] for o in out]) for k in out[0]}


def layer_routings(graphdef, params, tokens, segment_ids, block_size: int, top_k: int):
    """Each layer's MoBA routing over the rows (the post-RoPE queries and keys of the layer)."""
    model = nnx.merge(graphdef, params)
    positions = segment_positions(segment_ids)
    x = jnp.take(model.embed[...], tokens, axis=0).astype(model.dtype)
    routings = []
    for block in model.layers():
        q, k, _ = block.attn.qkv(block.attn_norm(x), positions)
        routings.append(moba_routing(q, k, block_size=block_size, top_k=top_k, segment_ids=segment_ids))
        x = block(x, positions, segment_ids, tokens)
    return routings


def remote_fraction(routing, shards: int, block_size: int) -> np.ndarray:
    """[rows, shards]: of the keys the other shards hold, the fraction the shard's queries read."""
    own, past = np.asarray(routing.own_start), np.asarray(routing.past_start)  # [B, S], [B, S, H, K']
    b, s = own.shape
    order = balanced_order(s, shards).reshape(shards, -1)
    out = np.zeros((b, shards))
    for row in range(b):
        for i, local in enumerate(order):
            need = np.zeros(s + 1, np.int32)  # difference array over key positions
            starts = np.concatenate([own[row, local], past[row, local].reshape(-1)])
            ends = np.concatenate([local + 1, past[row, local].reshape(-1) + block_size])
            keep = starts >= 0
            np.add.at(need, starts[keep], 1)
            np.add.at(need, ends[keep], -1)
            read = np.cumsum(need)[:s] > 0
            remote = np.ones(s, bool)
            remote[local] = False
            out[row, i] = read[remote].mean()
    return out


def main(argv=None) -> int:
    p = common.parser(__doc__, __file__)
    p.add_argument("--run", default=None, help="a trained MoBA run (default: train one here)")
    p.add_argument("--shards", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=60, help="training steps when training here")
    p.add_argument("--rows", type=positive_int, default=4, help="validation rows to route")
    args = p.parse_args(argv)
    with common.report(args, f"{args.shards} context shards") as emit:
        report = measure(args)
        print("context_blocks " + json.dumps(report))
        emit(report)
    return 0


def measure(args) -> dict:
    """Train (unless --run) and route; each layer's line printed as it is known."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run or tmp)
        if not args.run:
            overrides = [*MODEL, f"train.steps={args.steps}", f"train.run_dir={run_dir}",
                         f"checkpoint.every_steps={args.steps}"]  # fmt: skip
            run(load_config(ROOT / "configs/base.yaml", overrides))
        step = checkpoint.select_steps(run_dir, "latest")[0]
        cfg, graphdef, params = checkpoint.load_params(run_dir, step)
        rows = packed_rows(validation_documents(cfg), cfg.data.seq_len, args.rows)
        routings = jax.jit(layer_routings, static_argnums=(0, 4, 5))(
            graphdef, params, rows["inputs"], rows["segment_ids"], cfg.moba.block_size, cfg.moba.top_k
        )
    report = {
        "shards": args.shards, "seq_len": cfg.data.seq_len, "block_size": cfg.moba.block_size,
        "top_k": cfg.moba.top_k, "rows": int(rows["inputs"].shape[0]), "step": step, "layers": [],
    }  # fmt: skip
    for layer, routing in enumerate(routings):
        frac = remote_fraction(routing, args.shards, cfg.moba.block_size)
        per_shard = frac.mean(axis=0)
        report["layers"].append({"mean": float(frac.mean()), "worst_shard": float(per_shard.max()),
                                 "least_shard": float(per_shard.min())})  # fmt: skip
        print(
            f"layer {layer}: of the keys other shards hold, the shard's queries read "
            f"{frac.mean():.1%} (mean), {per_shard.max():.1%} (worst shard), {per_shard.min():.1%} (least)"
        )
    return report


if __name__ == "__main__":
    raise SystemExit(main())
