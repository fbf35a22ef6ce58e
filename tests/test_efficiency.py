"""KV-cache accounting of the EG-MLA paper configs, from the modules' own cache arrays."""

from pathlib import Path

import pytest

from effattn_jax.config import load_config
from eval.bench.efficiency import main, train_cost
from eval.decoding import decode_bytes_accessed, decode_latency, decode_latency_alternated, kv_cache_report

PAPER = Path(__file__).resolve().parents[1] / "configs" / "egmla" / "paper"


def test_paper_kv_cache_sizes():
    mha, mla, eg = (
        kv_cache_report(load_config(PAPER / f"{n}.yaml"))
        for n in ("mha_base", "mla_base", "eg_mla_kv64_emb256")
    )
    assert (mha["kv_elements_per_token"], mla["kv_elements_per_token"], eg["kv_elements_per_token"]) == (
        18_432,
        3_840,
        1_536,
    )
    assert 1 - eg["kv_elements_per_token"] / mha["kv_elements_per_token"] == pytest.approx(0.9167, abs=1e-4)
    assert 1 - eg["kv_elements_per_token"] / mla["kv_elements_per_token"] == pytest.approx(0.600, abs=1e-4)
    assert eg["integer_entries_per_token"] > 0 and mla["integer_entries_per_token"] == 0
    assert eg["kv_bytes_per_token"] == 4 * 1_536  # float32 cache


@pytest.mark.parametrize("emb, params", [(64, 38_633_472), (2048, 1_236_271_104)])
def test_gate_table_sizes(emb, params):
    r = kv_cache_report(load_config(PAPER / f"eg_mla_kv64_emb{emb}.yaml"))
    assert r["params_embedding_gate"] == params == 12 * 50_304 * emb


def test_cli(capsys):
    assert main(["kv-cache", "--config", str(PAPER / "mla_base.yaml")]) == 0
    assert "3,840 elements/token" in capsys.readouterr().out
    assert main(["kv-cache", "--config", str(PAPER / "mla_base.yaml"), "mla.bogus=1"]) == 2
    with pytest.raises(SystemExit):  # it compares --config models
        main(["decode-latency", "--alternate"])
    assert "--alternate compares the --config models" in capsys.readouterr().err


@pytest.mark.slow
def test_decode_latency_alternates_the_named_models(capsys):
    cpu = PAPER.parent / "cpu"
    configs = [str(cpu / "mla.yaml"), str(cpu / "eg_mla_proj_emb16.yaml")]
    args = ["decode-latency", "--alternate", "--repeats", "1", "--context", "32,64"]
    assert main(args + [a for c in configs for a in ("--config", c)]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "ctx" not in line
    ]
    assert [row.split(" | ")[0][2:] for row in rows] == configs  # one row per model, two contexts
    assert all(len(row.split(" | ")) == 3 for row in rows)


TINY_LATENT = [
    "model.vocab_size=128",
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=4",
    "model.mlp_dim=64",
    "mla.kv_lora_rank=16",
    "mla.qk_nope_head_dim=8",
    "mla.qk_rope_head_dim=4",
    "mla.v_head_dim=8",
    "data.seq_len=16",
    "data.batch_size=2",
]


@pytest.mark.slow
def test_absorbed_decode_reads_less_than_naive():
    """Absorbed MLA attends over the cached latent (d_c + d_R = 20 per token); the naive path
    rebuilds 4 heads x (8 + 4 + 8) per token first, so a step moves more bytes, and more per extra
    cached token. EG-MLA's latent placement recomputes c~ on both paths: there only the bytes per
    extra cached token must be lower. Timing runs on the same compiled steps."""
    moved = {}  # (kind, absorbed) -> bytes at context 64 and 512
    for kind in ("mla", "eg_mla"):
        cfg = load_config(None, TINY_LATENT + [f"attention.kind={kind}"])
        for absorb in (True, False):
            moved[kind, absorb] = [decode_bytes_accessed(cfg, ctx, absorb=absorb) for ctx in (64, 512)]
    per_token = {key: (long - short) / (512 - 64) for key, (short, long) in moved.items()}
    assert moved["mla", False][0] > moved["mla", True][0]
    assert per_token["mla", False] > per_token["mla", True]
    assert per_token["eg_mla", False] > per_token["eg_mla", True]
    ms = decode_latency(cfg, [64, 128], absorb=True, repeats=1)
    assert list(ms) == [64, 128]  # one median per context asked, in order
    cfgs = {kind: load_config(None, TINY_LATENT + [f"attention.kind={kind}"]) for kind in ("mla", "eg_mla")}
    ms = decode_latency_alternated(cfgs, 64, rounds=2)  # each model's donated cache carried over
    assert list(ms) == ["mla", "eg_mla"] and all(v > 0 for v in ms.values())


@pytest.mark.slow
def test_train_cost_counts_the_gate_table():
    """A 64-wide gate table on a 2048-word vocabulary is 131K parameters with gradients and two
    Adam moments: the compiled step must need more memory than plain MLA's."""
    big_vocab = ["model.vocab_size=2048", "eg_mla.gate_dim=64"]
    cfgs = [load_config(None, TINY_LATENT + big_vocab + [f"attention.kind={k}"]) for k in ("mla", "eg_mla")]
    mla, eg = (train_cost(cfg, steps=1) for cfg in cfgs)
    assert eg["memory_gib"] - mla["memory_gib"] > 3 * 2048 * 64 * 4 / 2**30
    tokens = cfgs[0].data.batch_size * cfgs[0].data.seq_len  # tokens/s counts a step's tokens
    assert [r["tokens_per_s"] * r["step_s"] for r in (mla, eg)] == pytest.approx([tokens, tokens])
