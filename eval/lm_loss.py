"""Validation loss of a checkpoint: overall, position-wise and trailing (the MoBA paper's
definitions, docs/moba.md).

Documents are evaluated unpacked, one per row from its first token, cut to the context
length L (`--seq-len`, default the run's `data.seq_len`). The position of a prediction is the
in-document index i (0-based) of the token that predicts token i + 1. Bucket [a, b) averages
the predictions at positions a..b-1 over the documents long enough to have them, and reports
how many tokens (and documents) that was. Trailing loss is the last bucket of the documents
that fill the whole context (at least L + 1 tokens). Those figures read each document's first
window; `every_token` scores every token of every document, in consecutive windows of L
predictions (each predicted from the tokens before it in its window), for the validation loss
over the whole documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from effattn_jax import storage
from effattn_jax.cli import positive_int
from effattn_jax.config import context_split_error, moba_block_size
from effattn_jax.data.pipeline import cache_bytes, corpus_manifest
from effattn_jax.memory import fit_checked
from effattn_jax.ops.context_parallel import balanced_batch, sequence_order
from effattn_jax.sharding import logical_to_spec, sharding_rules
from eval.processes import share, total, writes

LOGITS_BUDGET = 1 << 26  # float32 logits per batch (256 MiB): sets the rows per batch


def validation_documents(cfg) -> list[np.ndarray]:
    """The run's validation documents from its prepared corpus, as in training (each ends with EOS)."""
    return corpus_manifest(cfg.data).stream("val", cache_bytes(cfg.data)).documents()


def document_rows(docs: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n, seq_len + 1] int32 zero-padded, predictions per row [n]); one row per document."""
    tokens = np.zeros((len(docs), seq_len + 1), np.int32)
    counts = np.zeros(len(docs), np.int64)
    for i, d in enumerate(docs):
        d = d[: seq_len + 1]
        tokens[i, : len(d)] = d
        counts[i] = max(len(d) - 1, 0)
    return tokens, counts


def window_rows(docs: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`document_rows` of every document cut into consecutive windows of seq_len predictions
    (window k holds tokens k*L .. (k+1)*L): every token after each document's first is predicted
    exactly once."""
    pieces = [d[start : start + seq_len + 1] for d in docs for start in range(0, max(len(d) - 1, 1), seq_len)]
    return document_rows(pieces, seq_len)


def token_nll(nll_fn, tokens: np.ndarray, counts: np.ndarray, batch_size: int, progress: bool = True):
    """(nll, mask), both [n, seq_len]: per-prediction NLL from `nll_fn(inputs, targets)` (any
    [B, L] int32 -> [B, L] float fn) and which predictions exist. In a multi-process run each
    process runs its share of the rows (eval/processes.py)."""
    n, seq_len = tokens.shape[0], tokens.shape[1] - 1
    mask = np.arange(seq_len)[None, :] < counts[:, None]
    mine = share(n)
    out = np.zeros((n, seq_len), np.float64)
    for start in tqdm(range(0, len(mine), batch_size), desc="lm-loss", disable=not progress, leave=False):
        at = mine[start : start + batch_size]
        rows = tokens[at]
        pad = batch_size - len(rows)
        rows = np.concatenate([rows, np.zeros((pad, seq_len + 1), np.int32)]) if pad else rows
        out[at] = np.asarray(nll_fn(rows[:, :-1], rows[:, 1:]))[: batch_size - pad]
    return np.where(mask, total(out), 0.0), mask


def position_report(nll: np.ndarray, mask: np.ndarray, bucket: int) -> dict:
    """Overall, per-bucket and trailing losses (nats/token) with their token and document counts."""
    seq_len = nll.shape[1]

    def mean(rows, a, b):
        m = mask[rows, a:b]
        return (float(nll[rows, a:b][m].mean()) if m.any() else float("nan")), int(m.sum())

    every = np.arange(len(nll))
    buckets = []
    for a in range(0, seq_len, bucket):
        b = min(a + bucket, seq_len)
        loss, tokens = mean(every, a, b)
        buckets.append(
            {"start": a, "end": b, "loss": loss, "tokens": tokens, "documents": int(mask[:, a].sum())}
        )
    full = np.flatnonzero(mask[:, -1])  # documents that fill the context
    a = max(seq_len - bucket, 0)
    trailing, trailing_tokens = mean(full, a, seq_len)
    overall, tokens = mean(every, 0, seq_len)
    return {
        "loss": overall,
        "tokens": tokens,
        "documents": len(nll),
        "seq_len": seq_len,
        "bucket": bucket,
        "buckets": buckets,
        "trailing": {
            "start": a,
            "end": seq_len,
            "loss": trailing,
            "tokens": trailing_tokens,
            "documents": len(full),
        },
    }


def make_nll_fn(cfg, graphdef, params, mesh, batch_size: int, seq_len: int):
    """A jitted (inputs, targets) -> per-token NLL of the model, run over `mesh`."""
    rules = sharding_rules(cfg)
    spec = logical_to_spec(("batch", "length"), (batch_size, seq_len), mesh.shape, rules)
    rows = NamedSharding(mesh, spec)

    def nll(params, inputs, targets):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # a context axis: balanced layout
            batch = balanced_batch(
                {"inputs": inputs, "targets": targets, "segment_ids": jnp.ones_like(inputs)}
            )
            logits = nnx.merge(graphdef, params)(batch["inputs"], batch["segment_ids"], batch["positions"])
            lp = jax.nn.log_softmax(logits, axis=-1)
            return sequence_order(-jnp.take_along_axis(lp, batch["targets"][..., None], axis=-1)[..., 0])

    nll = fit_checked(jax.jit(nll), "the loss of a batch", "a smaller --seq-len, or more devices (--mesh)")
    replicated = NamedSharding(mesh, PartitionSpec())
    place = lambda x: jax.device_put(x, rows)
    return lambda inputs, targets: jax.device_put(nll(params, place(inputs), place(targets)), replicated)


def lm_loss(
    cfg, graphdef, params, mesh, *, seq_len: int, bucket: int, progress: bool = True, limit: int | None = None
) -> dict:
    """The position report of one checkpoint on the run's validation documents (the first `limit`
    of them when given: a quick look, not the validation loss)."""
    docs = validation_documents(cfg)[:limit]
    tokens, counts = document_rows(docs, seq_len)
    context = dict(mesh.shape).get("context", 1)
    if why := context_split_error(seq_len, context, moba_block_size(cfg)):
        raise ValueError(f"--seq-len={seq_len} over {context} context shards: {why}")
    rows = mesh.devices.size // context  # a batch row is split over the context axis
    batch = max(1, LOGITS_BUDGET * context // (seq_len * cfg.model.vocab_size))
    batch = -(-batch // rows) * rows
    nll_fn = make_nll_fn(cfg, graphdef, params, mesh, batch, seq_len)
    nll, mask = token_nll(nll_fn, tokens, counts, batch, progress)
    report = position_report(nll, mask, bucket)
    tokens, counts = window_rows(docs, seq_len)
    nll, mask = token_nll(nll_fn, tokens, counts, batch, progress)
    report["every_token"] = {
        "loss": float(nll[mask].mean()),
        "tokens": int(mask.sum()),
        "windows": len(tokens),
    }
    return report


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--step", default="latest", help="N, latest or all (kept checkpoints)")
    p.add_argument("--bucket", type=int, default=2048, help="positions per bucket")
    p.add_argument(
        "--seq-len", type=int, default=None, help="context length (default: the run's data.seq_len)"
    )
    p.add_argument(
        "--mesh",
        default="1,1,1",
        help="data,fsdp,tensor[,context] mesh to evaluate on (default one device); context > 1 "
        "splits each document over that many devices (docs/context_parallel.md)",
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="the first K validation documents only (a quick look)",
    )
    p.add_argument("--json", default=None, help="write every figure to this file")


def parse_mesh(spec: str):
    from effattn_jax.sharding import make_mesh

    try:
        sizes = [int(x) for x in spec.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (3, 4) or min(sizes) < 1:
        raise ValueError(f"--mesh={spec!r}: expected data,fsdp,tensor[,context] sizes, e.g. 1,1,1 or 1,1,1,4")
    data, fsdp, tensor, context = [*sizes, 1][:4]
    return make_mesh(data, fsdp, tensor, jax.local_devices(), context=context)  # each process on its own


def checkpoint_lm_loss(run_dir, step: int, *, seq_len: int, bucket: int) -> dict:
    """The position report of one kept step on one device, cached in <run>/eval/ (shared by
    `curves` and `scaling`)."""
    from effattn_jax import checkpoint
    from effattn_jax.sharding import make_mesh
    from eval.runs import cached

    def evaluate():
        mesh = make_mesh(1, 1, 1, devices=jax.local_devices())
        cfg, graphdef, params = checkpoint.load_params(run_dir, step, mesh)
        return lm_loss(cfg, graphdef, params, mesh, seq_len=seq_len, bucket=bucket, progress=False)

    key = {"seq_len": seq_len, "bucket": bucket, "every_token": True}  # older caches lack it
    return cached(run_dir, step, "lm_loss", key, evaluate)


def command(args) -> int:
    import json

    from effattn_jax import checkpoint

    if args.bucket <= 0 or (args.seq_len is not None and args.seq_len <= 0):
        raise ValueError("--bucket and --seq-len must be positive")
    mesh = parse_mesh(args.mesh)
    reports = []
    for step in checkpoint.select_steps(args.run, args.step):
        cfg, graphdef, params = checkpoint.load_params(args.run, step, mesh)
        seq_len = args.seq_len or cfg.data.seq_len
        r = lm_loss(
            cfg,
            graphdef,
            params,
            mesh,
            seq_len=seq_len,
            bucket=args.bucket,
            progress=writes(),
            limit=args.limit,
        )
        r["step"] = step
        reports.append(r)
        print(f"step {step}: {r['documents']} documents, context {seq_len}")
        print(f"{'positions':>13} {'loss':>8} {'tokens':>9} {'documents':>9}")
        for b in [*r["buckets"], r["trailing"] | {"label": "trailing"}]:
            label = b.get("label", f"{b['start']}-{b['end']}")
            print(f"{label:>13} {b['loss']:8.4f} {b['tokens']:9d} {b['documents']:9d}")
        every = r["every_token"]
        print(
            f"every token, {every['windows']} windows: loss {every['loss']:.4f} over {every['tokens']} tokens"
        )
        print(
            f"loss={r['loss']:.4f} trailing_loss={r['trailing']['loss']:.4f} tokens={r['tokens']} step={step}"
        )
    if args.json and writes():
        storage.write_atomic(storage.path(args.json), json.dumps(reports, indent=1))
    return 0
