"""The GPU suite (eval/bench/gpu_suite.py) runs end to end in its CPU dry mode, without the data
stack, so it is known to work before a GPU is lent."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # a subprocess that compiles every section

BLOCK_DATA_STACK = "import sys; sys.modules['grain'] = None; sys.modules['array_record'] = None\n"


def test_dry_run_writes_every_section_without_the_data_stack(tmp_path):
    """Catches: an import of grain reaching the suite, a section that fails, keys scripts read renamed."""
    code = BLOCK_DATA_STACK + "from eval.bench.gpu_suite import main; raise SystemExit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "--out", str(tmp_path), "--dry", "--budget-s", "900"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    sections = result["sections"]
    assert result["dry"] and set(sections) == {
        "correctness",
        "attention",
        "routing",
        "tiles",
        "moba_decode",
        "latent_decode",
        "train",
        "train_py",
        "long_attention",
    }
    checks = sections["correctness"]
    assert {c["check"] for c in checks} == {"moba", "mla_decode", "moba_decode"} and len(checks) == 7
    assert all(c["ok"] for c in checks), checks
    assert all(row["ms"] > 0 and row["smem_estimate"] <= row["smem_limit"] for row in sections["tiles"])
    (trained,) = sections["train_py"]  # train.py itself, in a subprocess that has the data stack
    assert trained["exit"] == 0 and trained["steps"] == 2 and trained["tokens_per_s"] > 0
    (attn,) = sections["attention"]
    assert {"moba_pallas_ms", "dense_ms", "dense_over_moba"} <= set(attn)
    assert attn["pallas_vs_xla_max_rel_diff"] < 0.05  # bf16 loss and gradients, kernels vs XLA path
    (routing,) = sections["routing"]  # interpreted kernel: its picks equal XLA's
    assert routing["picks_equal"] and routing["routing_kernel_ms"] > 0 and routing["floor_ms"] > 0
    assert {"kernel_over_floor", "xla_over_floor", "kernel_share_of_forward", "moba_forward_ms"} <= set(
        routing
    )
    assert {"moba_ms", "dense_ms", "ratio"} <= set(sections["moba_decode"][0])
    latent = sections["latent_decode"]
    assert "copy_bytes_per_s" in latent[0] and {r["model"] for r in latent[1:]} == {
        "MLA-Base",
        "EG-MLA kv64 emb256",
    }
    assert sections["train"][-1]["losses_agree"] and sections["train"][-1]["max_loss_difference"] < 1e-4
