"""Tokenize a corpus once into ArrayRecord shards (format: effattn_jax/data/shards.py).

    python -m effattn_jax.data.prepare --input 'corpus/*.{txt,jsonl,jsonl.zst,parquet}' \\
        [--field text] [--val-input GLOB ... | --val-fraction 0.01] [--tokenizer gpt-neox-olmo] \\
        --out DIR|gs://BUCKET/PATH [--shard-tokens 100000000] [--workers N]
    python -m effattn_jax.data.prepare --verify DIR

Documents are read as a stream and tokenized by `--workers` processes (ordered, a bounded
number of batches in flight), so memory stays flat however large the corpus. The output is
deterministic: the same inputs, tokenizer and options give byte-identical shards, whatever the
number of workers. After each training shard (which ends at a document end) the position in
the input and the shards written so far are saved, so an interrupted prepare resumes from its
last shard; a finished one is never redone (and a different request for the same directory is
refused). Training reads the result with `data.source=prepared data.path=DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from effattn_jax import storage
from effattn_jax.data.corpus import DataError, Inputs, expand_globs
from effattn_jax.data.fetch import cache_root
from effattn_jax.data.shards import FORMAT, MANIFEST, Manifest, ShardWriter, file_sha256, token_dtype
from effattn_jax.data.tokenizer import load_tokenizer

PROGRESS = "progress.json"
CHUNK_TOKENS = 4096  # ids per record
DEFAULT_SHARD_TOKENS = 100_000_000
BATCH_CHARS = 1 << 20  # text per worker task


def tokenizer_info(name: str, eos_ids: Sequence[int] = ()) -> dict:
    """What a manifest records of the tokenizer (and, under "path", where its file is); with
    `eos_ids` (`data.eos_ids`) the first separates documents instead of the tokenizer's own."""
    tok, eos, path = load_tokenizer(name, eos_ids)
    info = {
        "name": name,
        "sha256": file_sha256(path),
        "vocab_size": tok.get_vocab_size(True),
        "eos_id": eos,
        "path": str(path),
    }
    return info | ({"eos_ids": list(eos_ids)} if eos_ids else {})


def request_of(inputs: Inputs, tokenizer: dict, shard_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """Everything the output depends on; a directory holds the result of exactly one request."""
    return {
        "format": FORMAT,
        "inputs": [[str(p.absolute()), p.stat().st_size] for p in inputs.files],
        "val_files": sorted(str(p.absolute()) for p in inputs.val_files),
        "val_fraction": inputs.val_fraction,
        "field": inputs.field,
        "tokenizer_sha256": tokenizer["sha256"],
        **({"eos_id": tokenizer["eos_id"]} if "eos_ids" in tokenizer else {}),  # a declared EOS
        "chunk_tokens": chunk_tokens,
        "shard_tokens": shard_tokens,
    }


def prepare(
    inputs: Inputs,
    out: str | Path,
    *,
    tokenizer: str | dict,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 0,
    progress: bool = True,
    chunk_tokens: int = CHUNK_TOKENS,
) -> Manifest:
    """Prepares `inputs` into `out` (or returns the finished result already there, silently).
    `tokenizer`: a name (as `data.tokenizer`) or its `tokenizer_info`.

    `out` may be a `gs://` URL: the corpus is prepared in a local staging directory (under the
    cache, where an interrupted prepare resumes), each finished shard is uploaded and deleted
    there, and the manifest is uploaded last (the corpus in the store is complete once it is)."""
    if shard_tokens < 1 or chunk_tokens < 1:
        raise DataError(f"--shard-tokens={shard_tokens}, chunk {chunk_tokens}: must be positive")
    info = tokenizer_info(tokenizer) if isinstance(tokenizer, str) else tokenizer
    request = request_of(inputs, info, shard_tokens, chunk_tokens)
    target = storage.path(out)
    staging = cache_root() / "prepare-staging" / hashlib.sha256(str(target).encode()).hexdigest()[:16]
    with storage.staged(out, staging) as stage, _exclusive(stage.dir):
        if (target / MANIFEST).exists():
            stage.discard()  # what an interrupted prepare left here is not wanted
            done = Manifest.load(target)
            _same_request(target, done.data["request"], request, "a prepared corpus")
            return done
        state = _resume(stage.dir, request, progress)
        return _run(inputs, stage, info, request, state, workers, progress)


def _same_request(out: Path, old: dict, new: dict, what: str) -> None:
    if old != new:
        differ = ", ".join(k for k in new if old.get(k) != new[k])
        raise DataError(
            f"{out}: holds {what} of another request ({differ} differ); use another --out or delete it"
        )


@contextlib.contextmanager
def _exclusive(out: Path):
    """One prepare per directory (processes of one training job prepare the corpus once)."""
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{out}: waiting for another prepare of this directory", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _resume(out: Path, request: dict, progress: bool) -> dict:
    """The saved state of an interrupted prepare (after removing what it wrote since), or a fresh one."""
    state = {"next": [0, 0], "shards": {"train": [], "val": []}, "documents": {"train": 0, "val": 0}}
    if (out / PROGRESS).exists():
        saved = json.loads((out / PROGRESS).read_text())
        _same_request(out, saved["request"], request, "an unfinished prepare")
        state = saved["state"]
        if progress:
            print(f"{out}: resuming after {len(state['shards']['train'])} training shards", flush=True)
    keep = {s["file"] for split in state["shards"].values() for s in split}
    for f in out.iterdir():
        if ".arrayrecord" in f.name and f.name not in keep:
            f.unlink()
    return state


def _save_progress(out: Path, request: dict, state: dict, counts: np.ndarray) -> None:
    storage.write_atomic(out / "progress_counts.npy", _npy(counts))
    storage.write_atomic(out / PROGRESS, json.dumps({"request": request, "state": state}))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _run(
    inputs: Inputs, stage: storage.Stage, info: dict, request: dict, state: dict, workers: int, progress: bool
) -> Manifest:
    """Tokenizes from `state` on into the stage, publishing each shard as it is closed and the
    manifest last (the corpus in the store is complete once it is there)."""
    out = stage.dir
    dtype = token_dtype(info["vocab_size"])
    writers = {
        split: ShardWriter(
            out, split, dtype, request["chunk_tokens"], first_shard=len(state["shards"][split])
        )
        for split in ("train", "val")
    }
    counts = (
        np.load(out / "progress_counts.npy")
        if state["shards"]["train"]
        else np.zeros(info["vocab_size"], np.int64)
    )
    tty_only = None if progress else True  # tqdm: None shows the bar on a terminal only
    bar = tqdm(desc="prepare", unit=" docs", disable=tty_only, dynamic_ncols=True)
    started, tokens, counted = time.perf_counter(), 0, []

    def count():  # training ids since the last call -> counts, in one bincount
        if counted:
            counts[:] += np.bincount(np.concatenate(counted), minlength=len(counts))
            counted.clear()

    try:
        for meta, flat, lengths in _tokenized(inputs, state["next"], info, workers):
            docs = np.split(flat, np.cumsum(lengths)[:-1])
            for (file_index, doc_index, held_out), ids in zip(meta, docs, strict=True):
                split = "val" if held_out else "train"
                writers[split].add(ids)
                state["documents"][split] += 1
                if not held_out:
                    counted.append(ids)
                if writers["train"].tokens >= request["shard_tokens"]:
                    state["next"] = [file_index, doc_index + 1]
                    _close_shards(writers, state, stage)
                    count()
                    _save_progress(out, request, state, counts)
                    if progress and bar.disable:  # no terminal: one line per shard instead of the bar
                        rate = tokens / (time.perf_counter() - started)
                        print(f"{out}: {len(state['shards']['train'])} training shards, {rate:,.0f} tokens/s")
            count()
            tokens += len(flat)
            bar.update(len(meta))
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):,.0f} tokens/s", refresh=False)
        _close_shards(writers, state, stage)
    finally:
        for w in writers.values():
            w.abandon()
        bar.close()
    storage.write_atomic(out / "train_token_counts.npy", _npy(counts))
    manifest = {
        "format": FORMAT,
        "request": request,
        "tokenizer": {k: v for k, v in info.items() if k != "path"},
        "dtype": dtype.str,
        "chunk_tokens": request["chunk_tokens"],
        "train_token_counts": "train_token_counts.npy",
        **{
            split: {
                "documents": state["documents"][split],
                "tokens": sum(s["tokens"] for s in state["shards"][split]),
                "shards": state["shards"][split],
            }
            for split in ("train", "val")
        },
    }
    storage.write_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    stage.publish(out / "train_token_counts.npy")
    stage.publish(out / MANIFEST)  # the manifest last
    for f in (PROGRESS, "progress_counts.npy"):
        (out / f).unlink(missing_ok=True)
    if progress:
        seconds, where = time.perf_counter() - started, stage.target
        print(
            f"prepared {where}: {state['documents']['train']:,} + {state['documents']['val']:,} documents, "
            f"{manifest['train']['tokens']:,} training + {manifest['val']['tokens']:,} validation tokens "
            f"in {len(state['shards']['train'])} + {len(state['shards']['val'])} shards; "
            f"{tokens / seconds:,.0f} tokens/s this run"
        )
    return Manifest(stage.target, manifest)


def _close_shards(writers: dict, state: dict, stage: storage.Stage) -> None:
    for split, w in writers.items():
        if (entry := w.close_shard()) is not None:
            state["shards"][split].append(entry)
            stage.publish(w.out / entry["file"])


def _batches(inputs: Inputs, start: list[int]):
    """(meta [(file, doc, held out?)], texts) of about BATCH_CHARS text, from document `start`."""
    meta, texts, chars = [], [], 0
    for file_index, doc_index, doc, held_out in inputs.documents(tuple(start)):
        meta.append((file_index, doc_index, held_out))
        texts.append(doc.text)
        chars += len(doc.text)
        if chars >= BATCH_CHARS:
            yield meta, texts
            meta, texts, chars = [], [], 0
    if meta:
        yield meta, texts


def _tokenized(inputs: Inputs, start: list[int], info: dict, workers: int):
    """(meta, flat ids, lengths) per batch, in input order; `workers` processes (0: this one)."""
    path = info["path"]
    if workers <= 0:
        _init_worker(path, info["eos_id"], in_pool=False)
        for meta, texts in _batches(inputs, start):
            yield (meta, *_encode(texts))
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (path, info["eos_id"])) as pool:
        pending = deque()
        for meta, texts in _batches(inputs, start):
            pending.append((meta, pool.apply_async(_encode, (texts,))))
            if len(pending) >= 2 * workers:  # bounded read-ahead: memory stays flat
                meta0, result = pending.popleft()
                yield (meta0, *result.get())
        while pending:
            meta0, result = pending.popleft()
            yield (meta0, *result.get())


_WORKER: dict = {}


def _init_worker(tokenizer_path: str, eos_id: int, in_pool: bool = True) -> None:
    if in_pool:  # one thread per worker process; alone, the tokenizer uses every core
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_file(tokenizer_path), eos=eos_id)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids of all documents, each followed by EOS, as one uint32 array; lengths)."""
    encoded = _WORKER["tokenizer"].encode_batch(texts, add_special_tokens=False)
    lengths = np.asarray([len(e.ids) + 1 for e in encoded], np.int64)
    flat = np.empty(int(lengths.sum()), np.uint32)
    ends = np.cumsum(lengths)
    for e, end, n in zip(encoded, ends, lengths, strict=True):
        flat[end - n : end - 1] = e.ids
        flat[end - 1] = _WORKER["eos"]
    return flat, lengths


def expand_braces(pattern: str) -> list[str]:
    """'a/*.{txt,jsonl}' -> ['a/*.txt', 'a/*.jsonl'] (shell brace expansion, which glob lacks)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        q
        for alt in m.group(1).split(",")
        for q in expand_braces(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m effattn_jax.data.prepare", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--input", nargs="+", help="globs of .txt, .jsonl, .jsonl.zst, .parquet files ({a,b} allowed)"
    )
    ap.add_argument("--val-input", nargs="+", default=[], help="globs of files held out whole for validation")
    ap.add_argument(
        "--val-fraction", type=float, default=0.01, help="else documents held out by a hash of their id"
    )
    ap.add_argument("--field", default="text", help="the text field of jsonl records and Parquet rows")
    ap.add_argument("--tokenizer", default="gpt-neox-olmo", help="a built-in name or a tokenizers .json file")
    ap.add_argument(
        "--eos-ids",
        type=_ids,
        default=[],
        help="comma-separated end-of-text ids, the first between documents (a converted run's "
        "data.eos_ids); default: the tokenizer's own",
    )
    ap.add_argument("--out", help="the output directory, or a gs://bucket/path")
    ap.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="training tokens per shard"
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (0: none)")
    ap.add_argument("--verify", metavar="DIR", help="check a prepared directory's checksums and exit")
    args = ap.parse_args(argv)
    try:
        if args.verify:
            m = Manifest.load(args.verify)
            m.verify()
            print(f"{args.verify}: {sum(len(m.data[s]['shards']) for s in ('train', 'val'))} shards verified")
            return 0
        if not args.input or not args.out:
            ap.error("--input and --out are required")
        glob = lambda pats, key: expand_globs([q for p in pats for q in expand_braces(p)], key)
        if not 0.0 <= args.val_fraction < 1.0:
            ap.error(f"--val-fraction={args.val_fraction}: must be in [0, 1)")
        val = glob(args.val_input, "--val-input") if args.val_input else []
        inputs = Inputs.of(glob(args.input, "--input"), val, args.val_fraction, args.field)
        done = (storage.path(args.out) / MANIFEST).exists()
        tokenizer = tokenizer_info(args.tokenizer, args.eos_ids)
        m = prepare(
            inputs, args.out, tokenizer=tokenizer, shard_tokens=args.shard_tokens, workers=args.workers
        )
        if done:
            print(f"{args.out}: already prepared ({m.data['train']['tokens']:,} training tokens); not redone")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = [-1]
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 2 or 1,2")
    return ids


if __name__ == "__main__":
    sys.exit(main())
