import subprocess
import sys

import pytest
from conftest import ROOT

from effattn_jax.config import ConfigError, config_from_dict, load_config, to_yaml


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.bogus=1", "model.bogus"),
        ("nosection.x=1", "nosection"),
        ("model.d_model=abc", "model.d_model"),
        ("model.num_layers=-2", "model.num_layers"),
        ("model.num_heads=3", "model.num_heads"),  # does not divide d_model=128
        ("model.num_kv_heads=3", "model.num_kv_heads"),  # does not divide num_heads=4
        ("attention.kind=gqa", "attention.kind"),
        ("attention.core=sparse", "attention.core"),
        ("train.grad_accum=3", "train.grad_accum"),  # does not divide batch 16
        ("train.tie=true", "train.tie"),
        ("data.seq_len=0", "data.seq_len"),
        ("mesh.data=0", "mesh.data"),
        ("model.remat=yes please", "model.remat"),
        ("eg_mla.gate_at=middle", "eg_mla.gate_at"),
        ("eg_mla.gate_at=projected", "eg_mla.projected_dim"),
        ("eg_mla.projected_dim=16", "eg_mla.projected_dim"),
        ("mla.decode_impl=triton", "mla.decode_impl"),
        ("moba.kv_block=12", "moba.kv_block"),
        ("moba.key_tile=0", "moba.key_tile"),
        ("train.nonfinite=maybe", "train.nonfinite"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/cpu/default.yaml", [override])
    assert e.value.key == key
    msg = str(e.value)
    assert "\n" not in msg and key in msg


def test_inheritance_and_overrides(tmp_path):
    (tmp_path / "child.yaml").write_text(f"base: {ROOT}/configs/base.yaml\nmodel:\n  num_layers: 3\n")
    cfg = load_config(
        tmp_path / "child.yaml", ["train.steps=7", "attention.layers=[mha:dense, mha:dense, mha:dense]"]
    )
    assert cfg.model.num_layers == 3 and cfg.model.d_model == 128  # child wins, base fills in
    assert cfg.train.steps == 7 and len(cfg.attention.layers) == 3
    assert load_config(None, [f"train.run_dir={tmp_path}"]).train.run_dir == str(tmp_path)
    # the resolved config round-trips through YAML
    (tmp_path / "resolved.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_scientific_notation_is_a_number_in_files_and_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  lr: 1e-3\n  min_lr_ratio: 5E-2\n  weight_decay: .5e-1\n")
    cfg = load_config(tmp_path / "c.yaml", ["train.grad_clip=2e+0"])
    assert (cfg.train.lr, cfg.train.min_lr_ratio, cfg.train.weight_decay, cfg.train.grad_clip) == (
        1e-3,
        5e-2,
        5e-2,
        2.0,
    )
    assert load_config(None, ["train.run_dir=1e3x"]).train.run_dir == "1e3x"  # still a string


@pytest.mark.slow  # a subprocess
def test_cli_exits_2_with_one_line(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--config",
            str(ROOT / "configs/cpu/default.yaml"),
            "model.num_kv_heads=3",
            f"train.run_dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.num_kv_heads=3" in lines[0] and "must divide" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_batch_must_split_over_the_batch_axes():
    """Checked once the mesh is built (after the devices it needs are known to exist), against its real
    sizes: a -1 (fill) axis takes the device count. Catches: micro-batches that silently run unsharded."""
    from effattn_jax.config import check_batch_divides

    cfg = load_config(ROOT / "configs/cpu/default.yaml", ["mesh.data=-1", "train.grad_accum=8"])
    check_batch_divides(cfg, {"data": 2, "fsdp": 1, "tensor": 1})  # 16 rows, 8 micro-batches of 2
    with pytest.raises(
        ConfigError, match=r"data.batch_size / train.grad_accum = 2 .* \(mesh.data \* mesh.fsdp = 4\)"
    ):
        check_batch_divides(cfg, {"data": 2, "fsdp": 2, "tensor": 1})


def test_unsplittable_dims_warn_once_naming_axis_and_sizes():
    from effattn_jax.sharding import logical_to_spec

    rules = (("heads", ("tensor",)), ("embed", ("fsdp",)))
    with pytest.warns(UserWarning, match=r"'heads' \(size 6\) is not split over mesh axis 'tensor' \(size 4"):
        spec = logical_to_spec(("embed", "heads"), (32, 6), {"data": 1, "fsdp": 2, "tensor": 4}, rules)
    assert tuple(spec) == ("fsdp", None)


def test_layer_spec_and_switch():
    cfg = load_config(
        None,
        [
            "attention.core=moba",
            "moba.block_size=64",
            "attention.last_layers.n=1",
            "attention.last_layers.kind=mla",
        ],
    )
    assert [cfg.layer_spec(i) for i in range(4)] == [("mha", "moba")] * 3 + [("mla", "moba")]
    dense = cfg.with_full_attention()
    assert [dense.layer_spec(i) for i in range(4)] == [("mha", "dense")] * 3 + [("mla", "dense")]


def test_a_saved_config_with_a_retired_key_still_loads():
    """Runs saved by an earlier version carry keys since retired (moba.bwd_tile_chunk); they
    resume and evaluate, while a user's file that sets one is told it is unknown."""
    saved = load_config().to_dict()
    saved["moba"]["bwd_tile_chunk"] = 1024
    assert config_from_dict(saved).to_dict() == load_config().to_dict()
    with pytest.raises(ConfigError, match="moba.bwd_tile_chunk"):
        load_config(None, ["moba.bwd_tile_chunk=8"])


def test_continual_configs_start_from_the_base_models_shapes():
    """configs/continual/: each names its base run in train.init_from and keeps that model's
    parameter shapes (the contract), changing only the attention core, context and RoPE base."""
    import jax
    from flax import nnx

    from effattn_jax.model import new_model

    shapes = lambda cfg: jax.tree.map(
        lambda x: x.shape, jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(new_model(cfg))[1]))
    )
    base = load_config(ROOT / "configs/cpu/default.yaml", [])
    continual = sorted((ROOT / "configs/continual").glob("*.yaml"))
    assert continual
    for path in continual:
        cfg = load_config(path, [])
        assert cfg.train.init_from == base.train.run_dir and cfg.data.seq_len == 4 * base.data.seq_len
        assert shapes(cfg) == shapes(base), path.name


def test_the_readme_first_step_config_loads():
    """README's first next step trains MoBA on configs/moba/cpu/default.yaml, whose block fits its rows.
    Catches: the step naming a config that is refused at start-up (block 512 on 256-token rows)."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("python train.py") and "runs/exp1" in x)
    config = line.split("--config ")[1].split()[0]
    cfg = load_config(ROOT / config, [a for a in line.split("#")[0].split()[4:] if "=" in a])
    assert cfg.attention.core == "moba" and cfg.moba.block_size < cfg.data.seq_len


def test_start_notices_say_what_runs_otherwise_than_expected():
    """One line each: MoBA kernels interpreted off their device, a top-k that covers every block."""
    from effattn_jax.train.notices import start_notices

    cpu = lambda *o: load_config(ROOT / "configs/moba/cpu/default.yaml", o)
    assert start_notices(cpu()) == [] and start_notices(load_config(ROOT / "configs/cpu/default.yaml")) == []
    assert cpu().moba.block_size == 64 and cpu().data.seq_len == 256
    (line,) = start_notices(cpu("moba.impl=pallas_triton"))
    assert line.startswith("notice: moba.impl=pallas_triton runs the triton kernels interpreted on this cpu")
    (line,) = start_notices(cpu("moba.top_k=4"))
    assert "moba.top_k=4 covers all 4 blocks of a 256-token row" in line


def test_a_dense_run_resumes_whatever_moba_block_its_config_names():
    """moba.* is compared on resume only where a layer runs MoBA (in the saved run or the new one):
    the CPU config names a block for `attention.core=moba`, and runs saved before it still resume.
    Catches: a dense run refused for a key it never used, or a MoBA run resumed with another block."""
    from effattn_jax.train.run_dir import config_changes

    cfg = lambda *o: load_config(ROOT / "configs/cpu/default.yaml", list(o))
    assert config_changes(cfg("moba.block_size=512").to_dict(), cfg()) == []
    assert config_changes(
        cfg("moba.block_size=128", "attention.core=moba").to_dict(), cfg("attention.core=moba")
    )
    assert config_changes(cfg().to_dict(), cfg("attention.core=moba"))  # dense -> MoBA is refused
