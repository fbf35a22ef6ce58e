"""Local paths and Cloud Storage URLs (`gs://bucket/...`) behind one interface: etils `epath`
(what Orbax uses) for remote paths, `pathlib` for local ones, and the few operations whose
semantics differ between a filesystem and an object store (no rename, no append, no directory).
Callers do not branch on the two: they call what is here (the shard reader alone asks
`is_remote`, to read a remote corpus through a bounded cache of its shards).

Credentials are the Google Cloud client libraries' own (Application Default Credentials: a TPU
VM's service account, `gcloud auth application-default login`, GOOGLE_APPLICATION_CREDENTIALS);
nothing here stores them. Tests point the libraries at an emulator through their documented
settings (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Union

from etils import epath

REMOTE_SCHEMES = ("gs://",)
AnyPath = Union[Path, epath.Path]  # noqa: UP007 - a runtime alias
_configured = False
PROBE_SECONDS = 5.0  # how long a bucket is tried before it is called unreachable


def is_remote(p: str | os.PathLike) -> bool:
    return str(p).startswith(REMOTE_SCHEMES)


def path(p: str | os.PathLike) -> AnyPath:
    """An absolute local `Path`, or an `epath.Path` for a `gs://` URL."""
    if is_remote(p):
        _configure()
        return epath.Path(str(p))
    return Path(p).absolute()


def _configure() -> None:
    """Object listings are read fresh (another process's writes must be seen: gcsfs caches
    listings by default); against an emulator gcsfs's zonal-bucket probe is skipped (it waits a
    minute on a gRPC endpoint an emulator does not serve)."""
    global _configured
    if _configured:
        return
    import fsspec

    fsspec.config.conf.setdefault("gs", {})["use_listings_cache"] = False
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    _configured = True


def glob(pattern: str) -> list[AnyPath]:
    """What a glob matches, sorted: locally with `**`; on an object store `*`, `?` and `[...]`
    within each level (a recursive listing of a bucket could be millions of requests)."""
    if not is_remote(pattern):
        return sorted(Path(p) for p in globlib.glob(pattern, recursive=True))  # as written: relative stays
    first = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    base = pattern[: pattern.rfind("/", 0, first)]
    return sorted(path(base).glob(pattern[len(base) + 1 :]), key=str)


def sort_key(p: AnyPath) -> tuple:
    """Local paths first, in the order of their parts; then objects, in the order of their URLs."""
    return (True, str(p)) if is_remote(p) else (False, p.parts)


def local_copy(p: AnyPath, under: Path) -> Path:
    """A local file holding `p`: a local path as it is; an object fetched once per version of it
    (`under/<version>/<name>`)."""
    if not is_remote(p):
        return p
    blob = _blob(p)
    blob.reload()
    dst = under / hashlib.sha256(f"{p}#{blob.generation}".encode()).hexdigest()[:16] / p.name
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        download(p, dst)
    return dst


def files_under(root: AnyPath) -> list[AnyPath]:
    """Every file below `root` (recursively), sorted; an object store's listing has no `**`."""

    def walk(d: AnyPath) -> Iterator[AnyPath]:
        for p in d.iterdir():
            if p.is_dir():
                yield from walk(p)
            else:
                yield p

    return sorted(walk(root), key=str)


def size_and_sha256(p: AnyPath) -> tuple[int, str]:
    """One streaming read of a file or object: (bytes, sha256 hex)."""
    h, n = hashlib.sha256(), 0
    with _blob(p).open("rb") if is_remote(p) else open(p, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def size(p: AnyPath) -> int:
    return p.stat().length if isinstance(p, epath.Path) else p.stat().st_size


def free_bytes(p: AnyPath) -> int | None:
    """The free space of the filesystem holding the directory `p`; None on an object store (its
    room is its quota's)."""
    return None if is_remote(p) else shutil.disk_usage(p).free


def read_bytes(p: AnyPath) -> bytes:
    """The content of a file or object (FileNotFoundError when there is none)."""
    if not is_remote(p):
        return p.read_bytes()
    from google.api_core.exceptions import NotFound

    try:
        return _blob(p).download_as_bytes()
    except NotFound:
        raise FileNotFoundError(str(p)) from None


def read_text(p: AnyPath) -> str:
    return read_bytes(p).decode()


def write_atomic(p: AnyPath, data: str | bytes) -> None:
    """A reader sees the old content or the new, never a part: a local file is written beside and
    renamed; an object's upload is atomic by itself."""
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(p):
        _blob(p).upload_from_string(raw)
        return
    tmp = p.with_name(f".{hashlib.sha256(p.name.encode()).hexdigest()[:16]}.tmp")  # not named like p
    tmp.write_bytes(raw)
    os.replace(tmp, p)


def move(src: AnyPath, dst: AnyPath) -> None:
    """A local rename; on an object store (no rename) a copy of every object, then the source's
    deletion. Cut short, the copy may be partial and the source partly deleted; what reads
    either side (checkpoint manifests, corpus manifests) finds that before using it."""
    if not is_remote(src):
        shutil.move(src, dst)
        return
    if not src.is_dir():
        src.copy(dst)
        src.unlink()
        return
    for f in files_under(src):
        f.copy(dst / str(f)[len(str(src)) + 1 :])
    src.rmtree()


def download(src: AnyPath, dst: Path) -> tuple[int, str]:
    """Copies an object to a local file (written beside and renamed); (bytes, sha256) of it."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    _blob(src).download_to_filename(str(tmp))
    os.replace(tmp, dst)
    return size_and_sha256(dst)


def copy_file(src: Path, dst: AnyPath) -> None:
    """A local file copied to a local path or to an object."""
    if is_remote(dst):
        _blob(dst).upload_from_filename(str(src))
    else:
        shutil.copyfile(src, dst)


def remove_tree(p: AnyPath) -> None:
    """Deletes a directory and everything below it; gone already is fine."""
    if is_remote(p):
        p.rmtree(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


class Stage:
    """A local directory whose files are bound for `target` (see `staged`)."""

    def __init__(self, directory: Path, target: AnyPath):
        self.dir, self.target = directory, target
        self.remote = is_remote(target)
        self.discarded = False

    def publish(self, f: Path) -> None:
        """Uploads a finished file now, under its name relative to the stage, and deletes it here;
        nothing for a local target (the file is already there)."""
        if self.remote:
            copy_file(f, self.target / str(f.relative_to(self.dir)))
            f.unlink()

    def discard(self) -> None:
        """Nothing more is uploaded when the block ends (a gs:// target's staging directory is
        removed all the same); a local target keeps what is there."""
        self.discarded = True

    def _publish_rest(self) -> None:
        """Every file left, in name order; hidden names (locks, partial writes) stay local."""
        for f in sorted(self.dir.rglob("*")):
            hidden = any(part.startswith(".") for part in f.relative_to(self.dir).parts)
            if f.is_file() and not hidden:
                self.publish(f)


@contextlib.contextmanager
def staged(dst: str | os.PathLike, staging: Path | None = None) -> Iterator[Stage]:
    """Files for `dst` written locally (profiler traces, figures, corpus shards: writers that
    open local files). A local `dst` is the stage itself. For a gs:// URL files are written in a
    local directory (`staging`, kept when the block fails so that a rerun resumes there; else a
    temporary one) and uploaded when the block ends (or earlier, by `Stage.publish`), then the
    directory is removed."""
    if not is_remote(dst):
        Path(dst).mkdir(parents=True, exist_ok=True)
        yield Stage(Path(dst), Path(dst))
        return
    local = staging or Path(tempfile.mkdtemp(prefix="effattn-staged-"))
    local.mkdir(parents=True, exist_ok=True)
    stage = Stage(local, path(dst))
    try:
        yield stage
    except BaseException:
        if staging is None:
            shutil.rmtree(local, ignore_errors=True)
        raise
    if not stage.discarded:
        stage._publish_rest()
    shutil.rmtree(local, ignore_errors=True)


def create_exclusive(p: AnyPath, text: str) -> bool:
    """Creates `p` holding `text` unless it exists; whether this call created it. Locally
    O_CREAT|O_EXCL; on Cloud Storage an upload conditioned on no live object (ifGenerationMatch=0),
    so of two concurrent creators exactly one succeeds."""
    if not is_remote(p):
        try:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    from google.api_core.exceptions import PreconditionFailed

    try:
        _blob(p).upload_from_string(text, if_generation_match=0)
    except PreconditionFailed:
        return False
    return True


def read_versioned(p: AnyPath) -> tuple[str | None, int | None]:
    """(text, generation) of a file or object; (None, None) when it is gone. A local file has no
    generation (None)."""
    if not is_remote(p):
        try:
            return p.read_text(), None
        except OSError:
            return None, None
    from google.api_core.exceptions import NotFound

    blob = _blob(p)
    try:
        text = blob.download_as_text()
    except NotFound:
        return None, None
    return text, blob.generation


def remove_version(p: AnyPath, generation: int | None) -> None:
    """Deletes `p` if it is still the version read (on Cloud Storage: ifGenerationMatch), so a
    file another process created since is left alone; gone already is fine."""
    if not is_remote(p):
        p.unlink(missing_ok=True)
        return
    from google.api_core.exceptions import NotFound, PreconditionFailed

    with contextlib.suppress(NotFound, PreconditionFailed):
        _blob(p).delete(if_generation_match=generation)


_CLIENTS = threading.local()  # a client per thread (checksums are written from a background thread)
_VERDICTS: dict[str, str | None] = {}  # bucket -> why it cannot be used (None: it can)


def _client():
    if getattr(_CLIENTS, "client", None) is None:
        from google.cloud import storage as gcs

        _CLIENTS.client = gcs.Client()
    return _CLIENTS.client


def _blob(p: AnyPath):
    """The google-cloud-storage blob of a gs:// path. Objects are read and written whole through it
    (and conditionally, which epath cannot do); epath lists, copies and deletes them."""
    bucket, _, name = str(p)[len("gs://") :].partition("/")
    return _client().bucket(bucket).blob(name)


def unreachable(p: str | os.PathLike) -> str | None:
    """Why the bucket of a gs:// path cannot be used from here (no credentials, no network, no
    such bucket, no access), found within a few seconds: the libraries alone retry for minutes,
    logging tracebacks. None when it can, and for a local path. Asked once per bucket."""
    if not is_remote(p):
        return None
    bucket = str(p)[len("gs://") :].partition("/")[0]
    if bucket not in _VERDICTS:
        found: list[str | None] = []
        probe = threading.Thread(target=lambda: found.append(_probe(bucket)), daemon=True)
        probe.start()
        probe.join(2 * PROBE_SECONDS)  # a bound whatever the libraries do inside
        late = f"gs://{bucket}: no answer from Cloud Storage in {2 * PROBE_SECONDS:g} s; check the network"
        _VERDICTS[bucket] = found[0] if found else late
    return _VERDICTS[bucket]


def _probe(bucket: str) -> str | None:
    """One listing of at most one object of the bucket, retried for PROBE_SECONDS."""
    import google.auth.exceptions
    from google.api_core import exceptions
    from google.cloud.storage.retry import DEFAULT_RETRY

    where = f"gs://{bucket}"
    try:
        client = _client()
        retry = DEFAULT_RETRY.with_timeout(PROBE_SECONDS).with_delay(initial=0.25, maximum=1.0)
        list(client.list_blobs(bucket, max_results=1, timeout=PROBE_SECONDS, retry=retry))
    except google.auth.exceptions.DefaultCredentialsError as e:
        found = str(e).split(". ")[0].rstrip(".")[:200]
        return (
            f"{where}: no Google Cloud credentials ({found}); set up Application Default Credentials "
            "(gcloud auth application-default login, GOOGLE_APPLICATION_CREDENTIALS, "
            "or a VM's service account)"
        )
    except google.auth.exceptions.GoogleAuthError as e:
        return f"{where}: the Google Cloud credentials cannot be used ({_first_line(e)})"
    except exceptions.NotFound:
        return f"{where}: no such bucket"
    except exceptions.Forbidden as e:
        return f"{where}: access denied ({_first_line(e)})"
    except exceptions.GoogleAPICallError as e:
        return f"{where}: {_first_line(e)}"
    except Exception as e:  # noqa: BLE001 - the network's failures come in many types
        return f"{where}: cannot reach Cloud Storage within {PROBE_SECONDS:g} s ({_network_reason(e)})"
    return None


def _network_reason(e: BaseException) -> str:
    """What failed, in words, from a connection error and the errors it chains from."""
    text = " ".join(str(x) for x in (e, getattr(e, "cause", None), e.__cause__) if x is not None)
    host = (os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com").split("://")[-1]
    dns = ("Name or service not known", "Failed to resolve", "name resolution", "nodename nor servname")
    if any(s in text for s in dns):
        return f"DNS: the name {host.split(':')[0]} does not resolve"
    if "Connection refused" in text:
        return f"network: {host} refused the connection"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"network: {host} did not answer"
    return f"network: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def reset_clients() -> None:
    """Forgets this thread's client and the buckets' verdicts (after the emulator or credentials
    changed)."""
    _CLIENTS.client = None
    _VERDICTS.clear()
