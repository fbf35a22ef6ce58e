"""`train.dry_run`: the paper configs size themselves without allocating, and compile ahead of
time for a TPU slice."""

import jax
import pytest
from conftest import ROOT

from effattn_jax.config import ConfigError, load_config
from effattn_jax.train import tpu_memory
from effattn_jax.train.dry_run import dry_run
from pallas_kernels.moba import tpu_smem

pytestmark = pytest.mark.slow  # paper-size models and TPU compiles

PAPER = sorted(ROOT.glob("configs/*/paper/*.yaml"))
# docs/moba.md: the scaling-law models' non-embedding parameters
MOBA_SIZES = {"545m": 545e6, "822m": 822e6, "1.1b": 1.1e9, "1.5b": 1.5e9, "2.1b": 2.1e9}


def test_every_paper_config_loads():
    assert len(PAPER) >= 20
    for path in PAPER:
        load_config(path)


@pytest.mark.parametrize("size", sorted(MOBA_SIZES))
def test_moba_scaling_models_have_the_papers_sizes(size):
    for variant in ("moba", "full"):
        report = dry_run(load_config(ROOT / f"configs/moba/paper/{variant}_{size}.yaml"), compile=False)
        assert report["params_non_embedding"] == pytest.approx(MOBA_SIZES[size], rel=0.06)
        assert report["params_embedding_gate"] == 0


def test_smallest_of_each_family_dry_runs(capsys):
    moba = dry_run(load_config(ROOT / "configs/moba/paper/moba_545m.yaml"), compile=False)
    assert moba["tokens"] == pytest.approx(10.8e9, rel=0.01)
    assert moba["pflops_days_6nd"] == pytest.approx(
        6 * moba["params_non_embedding"] * moba["tokens"] / 8.64e19
    )
    eg = dry_run(load_config(ROOT / "configs/egmla/paper/eg_mla_kv64_emb64.yaml"), compile=False)
    assert eg["params_embedding_gate"] == 12 * 50304 * 64  # emb64: the paper's 38M tables
    assert eg["tokens"] == pytest.approx(50e9, rel=0.01)
    out = capsys.readouterr().out
    assert out.count("non-embedding") == 2 and out.count("PFLOP/s-days") == 2


def test_compiles_for_a_tpu_slice(capsys):
    """The default small model, compiled for a v5e 2x2 slice: the per-chip memory is reported
    against the chip's 16 GiB."""
    pytest.importorskip("libtpu")
    cfg = load_config(None, ["mesh.topology=v5e:2x2", "data.batch_size=8", "data.seq_len=128"])
    report = dry_run(cfg)
    assert report["chips"] == 4 and report["device_kind"] == "TPU v5 lite"
    assert 0 < report["bytes_per_chip"] < report["hbm_bytes"] == 16 * 2**30 and report["fits"]
    assert report["tpu_kernels"] >= 2 and "fits" in capsys.readouterr().out  # splash, forward and backward


def test_moba_compiles_its_real_tpu_kernels(capsys):
    """On a CPU host, `pallas` means the interpreted kernel; compiled for a TPU slice it must be
    the Mosaic kernels (forward and backward of the own and selected blocks)."""
    pytest.importorskip("libtpu")
    moba = ["attention.core=moba", "moba.block_size=128", "moba.top_k=2", "model.num_layers=1"]
    cfg = load_config(None, ["mesh.topology=v5e:2x2", "data.batch_size=4", "data.seq_len=512", *moba])
    report = dry_run(cfg)
    assert report["tpu_kernels"] >= 4 and report["fits"]
    # SMEM and VMEM per kernel, from the compiled program, printed beside HBM
    kernels = {k["kernel"]: k for k in report["kernel_memory"]}
    assert {"moba_own_fwd", "moba_own_bwd", "moba_block_fwd", "moba_block_bwd"} <= set(kernels)
    for name in ("moba_block_fwd", "moba_block_bwd"):
        assert 0 < kernels[name]["smem_bytes"] < 2**20 and kernels[name]["vmem_bytes"] >= 16 * 2**20
    out = capsys.readouterr().out
    assert "TPU kernel moba_block_fwd" in out and "SMEM tables" in out and "scoped VMEM" in out


def test_a_kernel_over_smem_is_refused_before_compiling(monkeypatch):
    """A program whose kernel tables overflow a core's SMEM (here a 64-byte core) is refused in
    one line naming the kernel, the memory and the knobs, before libtpu compiles anything."""
    pytest.importorskip("libtpu")
    monkeypatch.setattr(tpu_memory, "SMEM_BYTES", {"TPU v5 lite": 64})
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *_: pytest.fail("compiled"))
    moba = ["attention.core=moba", "moba.block_size=128", "moba.top_k=2", "model.num_layers=1"]
    cfg = load_config(None, ["mesh.topology=v5e:2x2", "data.batch_size=4", "data.seq_len=512", *moba])
    with pytest.raises(
        ConfigError, match=r"kernel moba_\w+ needs .* of SMEM .*mesh\.context.*moba\.block_size"
    ):
        dry_run(cfg)


def test_unknown_topology_is_a_config_error():
    pytest.importorskip("libtpu")
    with pytest.raises(ConfigError, match="mesh.topology"):
        dry_run(load_config(None, ["mesh.topology=v9z:1x1"]))


def test_a_slice_too_small_for_the_mesh_is_a_config_error():
    """The 1M paper config fixes fsdp 2: a one-chip slice is refused in one line naming the mesh and
    the slice. Catches: config_mesh's ValueError escaping as a traceback."""
    cfg = load_config(ROOT / "configs/moba/paper/moba_545m_1m.yaml", ["mesh.topology=v5p:1x1x1"])
    with pytest.raises(ConfigError, match=r"mesh \(dataxfsdpxcontextxtensor\)=.*v5p:1x1x1 has 1 chips"):
        dry_run(cfg)


def test_a_run_too_big_for_its_chips_is_reported_not_raised(capsys):
    pytest.importorskip("libtpu")
    cfg = load_config(None, ["mesh.topology=v5e:2x2", "data.batch_size=2048", "data.seq_len=2048"])
    report = dry_run(cfg)
    assert report["fits"] is False
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_moba_tpu_tables_without_a_topology(capsys):
    """Without mesh.topology, a MoBA config's TPU kernel tables per chip come from the shapes alone:
    the 1M config on 8 context shards, every call under the SMEM budget."""
    cfg = load_config(ROOT / "configs/moba/paper/moba_545m_1m.yaml", ["mesh.topology=", "mesh.context=8"])
    report = dry_run(cfg)
    calls = {c["kernel"]: c for c in report["moba_tpu_tables"]}
    assert calls["moba_block_fwd"]["calls"] == 4
    assert all(c["table_bytes"] <= tpu_smem.SMEM_BUDGET_BYTES for c in calls.values())
    assert "MoBA TPU kernel moba_block_fwd per layer and chip: 4 call(s)" in capsys.readouterr().out


@pytest.mark.slow  # a subprocess: libtpu's start-up writes to the process's own stderr
def test_a_dry_run_on_a_slice_prints_no_libtpu_noise(tmp_path):
    """A dry run that loads libtpu off a TPU VM ends in its one config error line, without libtpu's
    page of start-up warnings (they are written out only when loading the slice fails)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("libtpu")
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/moba/paper/moba_545m_1m.yaml", "train.dry_run=true",
         "mesh.topology=v5p:1x1x1", f"train.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "config error: mesh (dataxfsdpxcontextxtensor)='1x2x-1x1': v5p:1x1x1 has 1 chips: 1 devices do not "
        "divide by the fixed axes' product 2"
    ], out.stderr
