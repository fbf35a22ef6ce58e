"""KV-cache accounting of the EG-MLA paper configs, from the modules' own cache arrays."""

from pathlib import Path

import pytest

from effattn_jax.config import load_config
from eval.efficiency import kv_cache_report, main

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


def test_latency_and_train_cost_run_on_a_tiny_model():
    """Smoke test of the measuring code (numbers are benchmarks, not asserted)."""
    from eval.efficiency import decode_latency, train_cost

    tiny = [
        "model.vocab_size=128",
        "model.d_model=32",
        "model.num_layers=1",
        "model.num_heads=4",
        "model.mlp_dim=64",
        "attention.kind=eg_mla",
        "eg_mla.gate_at=latent",
        "mla.kv_lora_rank=16",
        "mla.qk_nope_head_dim=8",
        "mla.qk_rope_head_dim=4",
        "mla.v_head_dim=8",
        "data.seq_len=16",
        "data.batch_size=2",
    ]
    ms = decode_latency(load_config(None, tiny), [8, 32], absorb=True, repeats=1)
    assert set(ms) == {8, 32} and all(v > 0 for v in ms.values())
    r = train_cost(load_config(None, tiny), steps=1)
    assert r["tokens_per_s"] > 0 and r["memory_gib"] > 0
