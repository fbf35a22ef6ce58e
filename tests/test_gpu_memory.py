"""GPU kernels' shared memory: the estimate against every request measured on an H200, `auto` tiles per
backend, and the one-line refusal of a set that cannot fit, before anything compiles."""

import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import ROOT

from effattn_jax.config import ConfigError, load_config
from effattn_jax.ops.mla_decode import absorbed_attention
from effattn_jax.train.gpu_kernels import check_gpu_kernels
from pallas_kernels import gpu_memory
from pallas_kernels.mla_decode import gpu as mla_gpu
from pallas_kernels.moba.schedule import BlockSizes

H200 = gpu_memory.SMEM_LIMITS["9.0"]
assert H200 == 232_448  # what Triton reported as available on the H200

# Measured on one H200 (CUDA 13, jax 0.11.2, Triton num_warps 4, num_stages 2): MoBA tiles
# (q_tile, kv_block, past_q_tile), head dim, element bytes, and the bytes Triton asked for when the
# run failed (None: every kernel ran).
MOBA_POINTS = [
    ((128, 128, 256), 128, 2, 262_144),  # the suite's attention section, fwd + bwd, bf16
    ((128, 128, 256), 64, 4, 263_680),  # its train section, float32
    ((64, 64, 64), 128, 2, None),
    ((64, 64, 64), 64, 4, None),
    ((128, 64, 64), 128, 2, None),  # the tile sweep at 128K, bf16
    ((64, 64, 128), 128, 2, None),
    ((128, 64, 128), 128, 2, None),
    ((64, 32, 64), 128, 2, None),
    ((128, 32, 128), 128, 2, None),
    ((32, 64, 64), 128, 2, None),
]
# The absorbed MLA decode kernel, latent 512 + RoPE 64, one group of every head (as measured): heads
# (padded), latent tile, element bytes, bytes asked (None: it ran).
MLA_POINTS = [(128, 64, 4, 573_440), (128, 64, 2, 294_912), (16, 64, 4, None)]


@pytest.mark.parametrize("tiles, head_dim, itemsize, asked", MOBA_POINTS)
def test_moba_estimate_matches_what_triton_asked(tiles, head_dim, itemsize, asked):
    """Catches: an estimate that passes a set the H200 refused, refuses one that ran, or drifts from the
    bytes Triton reported (the first kernel over the limit reports; one kernel must be within 3 %)."""
    sizes = BlockSizes(*tiles).resolve("gpu")
    kernel, most = sizes.gpu_smem(head_dim, head_dim, itemsize)
    if asked is None:
        assert most <= H200, (kernel, most)
        return
    assert most > H200
    q_tile, kv_block, past_q_tile = tiles
    each = gpu_memory.moba_smem(q_tile, past_q_tile, kv_block, 2, head_dim, head_dim, itemsize)
    assert min(abs(v - asked) / asked for v in each.values() if v > H200) < 0.03, each


@pytest.mark.parametrize("heads, tile, itemsize, asked", MLA_POINTS)
def test_mla_decode_estimate_matches_what_triton_asked(heads, tile, itemsize, asked):
    est = mla_gpu.smem_bytes(heads, tile, 512, 64, itemsize)
    if asked is None:
        assert est <= H200
    else:
        assert est > H200 and abs(est - asked) / asked < 0.03


@pytest.mark.parametrize("itemsize", [2, 4])
def test_mla_decode_groups_heads_so_128_fit(itemsize):
    """DeepSeek-V2/V3's 128 heads asked 294,912 bytes (bf16) in one program; the chosen group and tile
    fit an H200 and an A10-class GPU."""
    for capability in ("9.0", "8.6"):
        limit = gpu_memory.smem_limit(capability)
        group, tile = mla_gpu.head_group(128, 512, 64, itemsize, limit)
        assert mla_gpu.smem_bytes(group, tile, 512, 64, itemsize) <= limit
        assert group >= mla_gpu.MIN_ROWS and tile >= 16


def test_mla_decode_head_groups_equal_xla():
    """40 heads in groups of 16 (three programs per row, the last padded), partial last tile, rows of
    different lengths, interpreted. Catches: a group's block index that reads another group's heads."""
    keys = jax.random.split(jax.random.key(1), 4)
    q_lat, q_rope = jax.random.normal(keys[0], (2, 1, 40, 16)), jax.random.normal(keys[1], (2, 1, 40, 8))
    lat, kr = jax.random.normal(keys[2], (2, 40, 16)), jax.random.normal(keys[3], (2, 40, 8))
    positions = jax.numpy.array([[9], [39]])
    out = mla_gpu.mla_decode_gpu(
        q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, 0.3, tile=16, group=16, interpret=True
    )
    want = absorbed_attention(q_lat, q_rope, lat, kr, positions, 0.3, "xla")[:, 0]
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_auto_tiles_resolve_per_backend():
    """TPU and the XLA path keep their tiles; GPU takes the largest set that fits the device at this head
    dim and dtype; a number the user sets wins. Catches: GPU getting the TPU tiles (the H200 crash)."""
    tpu = (128, 128, 256, 512, 4, 2)
    for backend in ("tpu", "xla"):
        sizes = BlockSizes().resolve(backend, head_dim=128)
        assert (sizes.q_tile, sizes.kv_block, sizes.past_q_tile, sizes.key_tile) == tpu[:4]
    gpu = lambda **kw: BlockSizes(**kw.pop("fixed", {})).resolve("gpu", head_dim=128, **kw)
    assert gpu().tiles_text() == "moba.q_tile=64 moba.kv_block=64 moba.past_q_tile=64"
    assert (gpu().num_warps, gpu().num_stages) == (4, 2)
    assert gpu(fixed={"q_tile": 32}).q_tile == 32
    assert gpu(block_size=32).kv_block == 32  # a block is whole kv_block steps
    small = gpu(smem_limit=gpu_memory.smem_limit("8.6"))
    assert small.gpu_smem(128, 128, 2)[1] <= 101_376 < gpu().gpu_smem(128, 128, 2)[1]
    big = BlockSizes().resolve("gpu", head_dim=256, itemsize=4)
    assert big.gpu_smem(256, 256, 4)[1] <= H200


def test_over_the_limit_is_refused_in_one_line_with_a_set_that_fits():
    with pytest.raises(ValueError, match="moba.num_warps must be 1, 2, 4, 8 or 16"):
        BlockSizes(num_warps=3).check_backend("gpu", 512, head_dim=128)
    with pytest.raises(ValueError) as e:
        BlockSizes(128, 128, 256).check_backend(
            "gpu", 512, head_dim=128, itemsize=2, smem_limit=H200, device="NVIDIA H200"
        )
    msg = str(e.value)
    assert "\n" not in msg and "moba.q_tile=128 moba.kv_block=128 moba.past_q_tile=256" in msg
    assert "a set that fits: moba.q_tile=64 moba.kv_block=64 moba.past_q_tile=64" in msg
    assert "395,264 bytes of shared memory per block in moba_block_dkv_gpu" in msg  # the largest
    assert "232,448 of NVIDIA H200" in msg
    # a config on a smaller GPU: ConfigError naming the keys, before anything compiles
    cfg = load_config(
        ROOT / "configs/gpu/moba_545m_8k.yaml", ["moba.q_tile=64", "moba.kv_block=64", "moba.past_q_tile=64"]
    )
    a10 = SimpleNamespace(platform="gpu", compute_capability="8.6", device_kind="NVIDIA A10")
    with pytest.raises(
        ConfigError, match=r"moba.q_tile/kv_block/past_q_tile.*NVIDIA A10 \(compute capability 8.6"
    ):
        check_gpu_kernels(cfg, a10)
    (line,) = check_gpu_kernels(load_config(ROOT / "configs/gpu/moba_545m_8k.yaml"), a10)
    assert "mha layers: triton attention kernels, xla routing; moba.q_tile=" in line
    assert "of 101,376 bytes on NVIDIA A10" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, starts",
    [
        (["moba.q_tile=128", "moba.kv_block=128", "moba.past_q_tile=256"],
         "config error: moba.q_tile/kv_block/past_q_tile='128/128/256'"),
        (["moba.impl=pallas_mosaic", "model.dtype=float32"], "config error: moba.impl='pallas_mosaic'"),
    ],
)  # fmt: skip
def test_dry_run_refuses_what_the_gpu_kernels_cannot_take(tmp_path, overrides, starts):
    """train.py's dry run checks the kernels and tiles against an H100/H200 on a host without a GPU:
    exit 2, one line naming the keys, nothing written."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/gpu/moba_545m_8k.yaml", "train.dry_run=true",
         f"train.run_dir={run_dir}", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(starts)
    if "moba.q_tile" in starts:
        assert "a set that fits: moba.q_tile=64 moba.kv_block=64 moba.past_q_tile=64" in line
    else:
        assert "bfloat16 or float16 inputs, got float32; use pallas_triton" in line
    assert not run_dir.exists()


def test_named_kernels_are_checked_against_the_config():
    """A named GPU kernel that cannot take the config is refused in one line naming moba.impl (dtype,
    head dim) or the tile keys (tiles the kernels reject: compiled, and interpreted where results
    would be wrong); what can run is said in a line per layer kind."""
    cfg = lambda *o: load_config(
        ROOT / "configs/cpu/default.yaml", ["attention.core=moba", "moba.block_size=64", *o]
    )
    for overrides, key, why in [
        (["moba.impl=pallas_mosaic"], "moba.impl", "got float32; use pallas_triton"),
        (["moba.impl=pallas_mosaic", "model.dtype=bfloat16"], "moba.impl", "head dim a multiple of 64"),
        (["moba.impl=pallas_gpu", "moba.kv_block=24"], "moba.q_tile", "multiple of moba.kv_block 24"),
        (
            ["moba.impl=pallas_triton", "moba.block_size=48", "moba.kv_block=24"],
            "moba.q_tile",
            "power of two",
        ),
    ]:
        with pytest.raises(ConfigError, match=f"{key}.*{why}"):
            check_gpu_kernels(cfg(*overrides))
    interpreted = cfg("moba.impl=pallas_triton", "moba.block_size=48", "moba.kv_block=24")
    (line,) = check_gpu_kernels(interpreted, interpret=True)
    assert line.startswith("mha layers: triton attention kernels, gpu_triton routing".replace("gpu_", ""))
    (line,) = check_gpu_kernels(cfg("moba.impl=pallas_mosaic", "model.dtype=bfloat16", "model.head_dim=64"))
    assert line.startswith("mha layers: mosaic attention kernels, mosaic routing; moba.q_tile=64")


def test_config_takes_auto_or_an_int_for_the_tiles():
    """Catches: `auto` refused, or a word other than auto let through to the kernels."""
    assert load_config(None, ["moba.q_tile=auto", "moba.num_stages=3"]).moba.num_stages == 3
    for bad, why in [("moba.q_tile=big", "integer or auto"), ("moba.kv_block=12", "multiple of 8"),
                     ("moba.num_warps=0", "> 0 or auto")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            load_config(None, [bad])
