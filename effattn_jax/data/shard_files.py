"""Where a token stream's records are read from: local shard files, or the shards of a corpus
on Cloud Storage fetched into a bounded local cache (the ArrayRecord reader opens local files
only: a `gs://` path is not one it can open)."""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from pathlib import Path

from effattn_jax import storage
from effattn_jax.data.corpus import DataError
from effattn_jax.data.fetch import cache_root


def _source(paths: list[str]):
    import grain

    return grain.sources.ArrayRecordDataSource(paths)


class LocalShards:
    """The shard files of a local corpus, behind one ArrayRecord source (opened on first read);
    a file missing or of another size than the manifest's is refused at once."""

    def __init__(self, root: Path, shards: list[dict], record_start):
        for s in shards:
            path = root / s["file"]
            size = f"{path.stat().st_size} bytes" if path.exists() else "missing"
            if size != f"{s['bytes']} bytes":
                raise DataError(f"{path}: {size}, the manifest says {s['bytes']} bytes")
        self.paths = [str(root / s["file"]) for s in shards]
        self._record_start, self._source = record_start, None

    def read(self, shard: int, record: int) -> bytes:
        if self._source is None:
            self._source = _source(self.paths)
        return self._source[int(self._record_start[shard]) + record]


class RemoteShards:
    """The shards of a corpus on an object store, each fetched whole on its first read into
    `<cache>/remote-shards/<corpus>/process-<i>/` and checked then against the manifest's size
    and sha256 (not at start-up: that would cost two requests per shard). At most
    `budget_bytes` of shards are kept (the least recently read go first, always keeping the one
    being read), so disk and memory stay flat. Rows are read in a global shuffle: a corpus larger
    than the budget fetches evicted shards again (warned once at the start)."""

    def __init__(self, root, shards: list[dict], budget_bytes: int):
        import jax

        process_index = jax.process_index()
        corpus = hashlib.sha256(str(root).encode()).hexdigest()[:16]
        self.dir = cache_root() / "remote-shards" / corpus / f"process-{process_index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.root, self.shards, self.budget = root, shards, budget_bytes
        self.paths = [str(root / s["file"]) for s in shards]
        self._index = {s["file"]: i for i, s in enumerate(shards)}
        self._open: OrderedDict[int, object] = OrderedDict()  # shard -> its source, least recent first
        self._lock = threading.Lock()
        total = sum(s["bytes"] for s in shards)
        if total > budget_bytes:
            print(
                f"data: {root}'s shards hold {total / 2**30:.1f} GiB, more than the "
                f"{budget_bytes / 2**30:.1f} GiB shard cache (data.shard_cache_gb): evicted shards are "
                "fetched again",
                file=sys.stderr,
            )

    def read(self, shard: int, record: int) -> bytes:
        with self._lock:  # reads too: another thread's fetch may evict (close) any other shard
            source = self._open.pop(shard, None) or self._fetch(shard)
            self._open[shard] = source
            return source[record]

    def _fetch(self, shard: int):
        entry, local = self.shards[shard], self.dir / self.shards[shard]["file"]
        self._evict(keep_bytes=self.budget - entry["bytes"], sparing=entry["file"])
        if not (local.exists() and local.stat().st_size == entry["bytes"]):
            size, digest = storage.download(self.root / entry["file"], local)
            if (size, digest) != (entry["bytes"], entry["sha256"]):
                local.unlink()
                raise DataError(
                    f"{self.paths[shard]}: {size} bytes, sha256 {digest[:12]}…; the manifest says "
                    f"{entry['bytes']} bytes, {entry['sha256'][:12]}…: corrupt or replaced in the store"
                )
        return _source([str(local)])

    def _evict(self, keep_bytes: int, sparing: str) -> None:
        """Deletes cached copies, copies of an earlier launch first and then the least recently
        read shards (closing them), until the rest fit in `keep_bytes`."""
        on_disk = {f.name: f.stat().st_size for f in self.dir.iterdir() if f.is_file() and f.name != sparing}
        opened = [self.shards[s]["file"] for s in self._open]
        total = sum(on_disk.values())
        for name in [n for n in on_disk if n not in opened] + opened:
            if total <= keep_bytes:
                break
            if (shard := self._index.get(name)) in self._open:
                self._open.pop(shard).__exit__(None, None, None)
            (self.dir / name).unlink(missing_ok=True)
            total -= on_disk[name]


def shard_files(root, shards: list[dict], record_start, budget_bytes: int):
    """The reader of a corpus's shards: local files, or a cache of a remote corpus's."""
    if storage.is_remote(root):
        return RemoteShards(root, shards, budget_bytes)
    return LocalShards(Path(root), shards, record_start)
