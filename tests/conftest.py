"""Shared fixtures. Eight host CPU devices are simulated for the whole suite so the
sharding tests can build a (data=2, fsdp=2, tensor=2) mesh; every other test pins
its mesh to one device."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# libtpu (the `tpu` extra, for ahead-of-time TPU compiles) must not probe for TPU hardware here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # AOT compiles only; no TPU is opened
# Many tests compile the same tiny programs (train steps of the same tiny model, also in the
# subprocesses they start): jax's persistent compilation cache, fresh for each test session,
# compiles each once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="effattn-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the repository: configs and docs resolve from here

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no what up out who them some"
).split()


# Config overrides of a tiny model (and its MLA / EG-MLA widths) shared by the model tests.
TINY_MODEL = [
    "model.vocab_size=128",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.mlp_dim=64",
]
TINY_MLA = TINY_MODEL + [
    "mla.kv_lora_rank=16",
    "mla.qk_nope_head_dim=8",
    "mla.qk_rope_head_dim=4",
    "mla.v_head_dim=6",
    "eg_mla.gate_dim=8",
]


def write_corpus(root, n_docs=8, words_per_doc=(40, 400), seed=0):
    """Small deterministic text files: train/*.txt and val/*.txt."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_docs), ("val", 2)):
        d = root / split
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            k = int(rng.integers(*words_per_doc))
            # a repeating pattern plus noise, so a tiny model can learn something
            text = " ".join(
                WORDS[(j * 7 + i) % len(WORDS)]
                if rng.random() < 0.8
                else WORDS[int(rng.integers(len(WORDS)))]
                for j in range(k)
            )
            (d / f"doc{i}.txt").write_text(text + ".\n")
    return root


def tiny_overrides(root, run_dir, **extra):
    """Overrides for a tiny model on the tiny corpus, one device, fast."""
    o = {
        "data.source": "files",
        "data.train_files": f"[{root}/train/*.txt]",
        "data.val_files": f"[{root}/val/*.txt]",
        "data.seq_len": 32,
        "data.batch_size": 4,
        "model.d_model": 32,
        "model.num_layers": 2,
        "model.num_heads": 4,
        "model.num_kv_heads": 2,
        "model.mlp_dim": 64,
        "train.run_dir": str(run_dir),
        "train.steps": 6,
        "train.warmup_steps": 2,
        "train.lr": 1e-2,
        "train.log_every": 1,
        "train.progress": False,
        "checkpoint.every_steps": 2,
        "checkpoint.async_save": False,
        "eval.every_steps": 3,
        "eval.max_batches": 2,
        "mesh.data": 1,
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def saved_fresh_run(run_dir, overrides: list[str]) -> None:
    """A run directory holding one step (0) of a fresh model of `overrides` (the tiny model at
    context 32, the default tokenizer's vocabulary): what readers of runs need, without the
    cost of compiling a training step."""
    from flax import nnx

    from effattn_jax import checkpoint
    from effattn_jax.config import load_config
    from effattn_jax.model import new_model

    small = [o for o in TINY_MODEL if not o.startswith("model.vocab_size")]  # its tokenizer's rows
    cfg = load_config(None, [*small, "data.seq_len=32", f"train.run_dir={run_dir}", *overrides])
    saver = checkpoint.Checkpoints(run_dir, async_save=False)
    saver.save(0, {"params": nnx.to_pure_dict(nnx.split(new_model(cfg))[1])}, None, cfg.to_dict())
    saver.close()


def random_batch(seed=0, batch=4, seq=32, mask_keep=1.0):
    """A synthetic training batch: two packed documents per row (20 + 12 tokens at seq 32)."""
    rng = np.random.default_rng(seed)
    split = seq * 5 // 8
    return {
        "inputs": rng.integers(0, 50000, (batch, seq), dtype=np.int32),
        "targets": rng.integers(0, 50000, (batch, seq), dtype=np.int32),
        "segment_ids": np.repeat(np.array([[1] * split + [2] * (seq - split)]), batch, 0).astype(np.int32),
        "loss_mask": (rng.random((batch, seq)) < mask_keep).astype(np.float32),
    }


@pytest.fixture
def corpus_dir(tmp_path):
    return write_corpus(tmp_path / "corpus")


def corrupt_step(step_dir, how, drop_manifest=False):
    """Damages the largest file of a checkpoint step: flip 16 bytes, truncate, or delete it;
    `drop_manifest` also removes the step's checksum manifest (nothing left to catch it by)."""
    if drop_manifest:
        (step_dir / "checksums.json").unlink()
    f = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    if how == "flip":
        data[len(data) // 2 : len(data) // 2 + 16] = bytes(
            b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 16]
        )
        f.write_bytes(bytes(data))
    elif how == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    else:
        f.unlink()


def jaxpr_outputs(jaxpr):
    """(primitive name, output shape) of every equation, sub-jaxprs (loops, maps, conds) included:
    for tests that bound or forbid the arrays a function builds."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            if hasattr(var.aval, "shape"):
                yield eqn.primitive.name, tuple(var.aval.shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from jaxpr_outputs(sub)


def v5e_arg():
    """A maker of abstract arguments placed on one chip of a v5e:2x2 slice, `arg(shape,
    dtype=bf16)`, for Mosaic lowering plus a libtpu ahead-of-time compile (no TPU needed);
    skips the test where libtpu (the `tpu` extra) is not installed."""
    import jax
    import jax.numpy as jnp

    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu", reason="libtpu (the `tpu` extra) is not installed")
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",))
    place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=place)


def rand_qkv(seed, b, s, hq, hkv, d, dv=None, dtype=jnp.float32):
    """Random q [b, s, hq, d], k [b, s, hkv, d], v [b, s, hkv, dv or d]."""
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    return f(b, s, hq, d), f(b, s, hkv, d), f(b, s, hkv, dv or d)


def random_selection(rng, b, t, s, picks):
    """[b, t, picks] int32 DSA picks: distinct keys per query (shared across queries at random), the
    first query with three picks (-1: unused) and the last row's third query with none."""
    idx = np.stack([np.stack([rng.choice(s, picks, replace=False) for _ in range(t)]) for _ in range(b)])
    idx[0, 0, 3:] = -1
    idx[-1, 2, :] = -1
    import jax.numpy as jnp

    return jnp.asarray(idx.astype(np.int32))


def assert_attention_over_selection(run, q, k, v, idx, w, *, tol=1e-5, out_atol=0.0):
    """run(q, k, v, idx, scale=) equals DSA's XLA path (`sparse_attention`, on q, k, v in float32) in
    its output and in dq, dk, dv of sum(output * w): the output within rtol `tol` (and `out_atol`),
    each gradient within rtol and atol `tol`."""
    import jax
    import jax.numpy as jnp

    from effattn_jax.ops.dsa import sparse_attention

    objective = lambda attend: lambda *x: jnp.sum(attend(*x, idx, scale=0.3).astype(jnp.float32) * w)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_grads = jax.value_and_grad(objective(sparse_attention), (0, 1, 2))(*f32)
    got, got_grads = jax.value_and_grad(objective(run), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=tol, atol=out_atol)
    for name, g, ref in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), ref, rtol=tol, atol=tol, err_msg=name)


def segments(b, lengths):
    """[b, sum(lengths)] segment ids 1, 2, ... of documents of these lengths, the same in every row."""
    return jnp.asarray(np.stack([np.repeat(np.arange(1, len(lengths) + 1), lengths)] * b), jnp.int32)


def quick_or_slow(cases, quick):
    """pytest params of `cases` (values or tuples of values), marked slow unless in `quick`."""
    as_tuple = lambda c: c if isinstance(c, tuple) else (c,)
    return [pytest.param(*as_tuple(c), marks=() if c in quick else pytest.mark.slow) for c in cases]


@pytest.fixture
def verified(monkeypatch):
    """verified(*pairs) lists (family, backend) pairs in gpu_dispatch.VERIFIED as if a GPU suite run
    had passed on them, and nothing else: the dispatch as it will be once they have."""
    from pallas_kernels import gpu_dispatch

    def use(*pairs, **entry):
        run = gpu_dispatch.Verified(**({"device": "test", "date": "-", "commit": "-"} | entry))
        monkeypatch.setattr(gpu_dispatch, "VERIFIED", {pair: run for pair in pairs})

    return use


@pytest.fixture
def mosaic_by_default(verified):
    """Every Mosaic GPU kernel family listed as verified (pallas_gpu takes them on a Hopper)."""
    from pallas_kernels import gpu_dispatch

    verified(*((family, "mosaic") for family in gpu_dispatch.FAMILIES))


COLLECTED: set[str] = set()  # every test case collected, before -m deselects any (test_lanes reads it)


def pytest_collection_modifyitems(items):
    """Marks the long lane's tests (tests/lanes.py) `long`, and the cases it takes out of the quick
    loop `slow`."""
    from lanes import LONG, QUICK_OUT

    for item in items:
        COLLECTED.add(f"{item.path.name}::{item.name}")
        function = f"{item.path.name}::{item.originalname}"
        if function in LONG:
            item.add_marker(pytest.mark.long)
        if function in QUICK_OUT or f"{item.path.name}::{item.name}" in QUICK_OUT:
            item.add_marker(pytest.mark.slow)
