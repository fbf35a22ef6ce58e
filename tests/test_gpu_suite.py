"""The GPU suite (eval/bench/gpu_suite.py) runs end to end in its CPU dry mode, without the data
stack, so it is known to work before a GPU is lent."""

import json
import re
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
        "block_kernels",
        "tiles",
        "own_kernels",
        "moba_decode",
        "latent_decode",
        "dsa",
        "train",
        "train_py",
        "long_attention",
        "transformers",
    }
    dsa = sections["dsa"]  # interpreted kernels, timed once: every case ran and has its ratio
    assert [r["case"] for r in dsa] == ["attention", "decode", "select"], dsa
    assert dsa[0]["xla_over_kernel"] > 0 and dsa[1]["mla_over_dsa"] > 0 and dsa[2]["xla_over_kernel"] > 0
    checks = sections["correctness"]
    dsa_checks = {"dsa", "dsa_decode", "dsa_select"}
    assert {c["check"] for c in checks} == {"moba", "mla_decode", "moba_decode"} | dsa_checks
    assert len(checks) == 12  # dsa: GQA and one KV head (dsa.absorb's form); the fused selection
    (select,) = [c for c in checks if c["check"] == "dsa_select"]  # interpreted: the same picks
    assert select["picks_differing_fraction"] == 0.0, select
    assert all(c["ok"] for c in checks), checks
    assert all(row["ms"] > 0 and row["smem_estimate"] <= row["smem_limit"] for row in sections["tiles"])
    (own,) = sections["own_kernels"]  # Mosaic GPU against Triton own-block kernels, interpreted
    assert own["ok"] and own["mosaic_fwd_ms"] > 0, own
    (trained,) = sections["train_py"]  # train.py itself, in a subprocess that has the data stack
    assert trained["exit"] == 0 and trained["steps"] == 2 and trained["tokens_per_s"] > 0
    attn = sections["attention"]  # pallas_gpu is the Triton kernels when interpreted: timed once
    assert [a["shape"] for a in attn] == ["mha", "gqa", "flashmoba"]
    assert all(a["moba_pallas_kernels"] == "triton" and "moba_triton_ms" not in a for a in attn)
    assert all("pallas_mosaic cannot run MoBA" in a["moba_mosaic_refused"] for a in attn)  # head dim 16
    assert all({"moba_pallas_ms", "dense_ms", "dense_over_moba"} <= set(a) for a in attn), attn
    # bf16 loss and gradients, kernels vs XLA path
    assert all(a["pallas_vs_xla_max_rel_diff"] < 0.05 for a in attn)
    (routing,) = sections["routing"]  # interpreted kernel: its picks equal XLA's
    assert routing["picks_equal"] and routing["routing_kernel_ms"] > 0 and routing["floor_ms"] > 0
    assert {"kernel_over_floor", "xla_over_floor", "kernel_share_of_forward", "moba_forward_ms"} <= set(
        routing
    )
    (blocks,) = sections["block_kernels"]  # Mosaic GPU against Triton, both interpreted
    assert blocks["dq_rel_diff"] < 0.05 and blocks["dk_rel_diff"] < 0.05 and blocks["mosaic_bwd_ms"] > 0
    assert {"moba_ms", "dense_ms", "ratio"} <= set(sections["moba_decode"][0])
    latent = sections["latent_decode"]
    assert "copy_bytes_per_s" in latent[0] and {r.get("model") for r in latent[1:]} == {
        "MLA-Base",
        "EG-MLA kv64 emb256",
        None,  # the kernel alone against XLA
    }
    (kernel,) = [r for r in latent if r.get("kernel") == "mla_decode_gpu"]
    assert kernel["kernel_ms"] > 0 and kernel["xla_ms"] > 0 and kernel["slices"] == 1
    # transformers: our side runs (tiny, in its own process); theirs says why it does not here
    ours, theirs = sections["transformers"][:2]
    assert ours["side"] == "ours" and "decode_tokens_per_s" in ours and ours["batch"] == 2
    assert ours["step_ops"].get("fusion", 0) > 0 and ours["step_bytes_accessed"] > 0
    assert list((tmp_path / "traces").rglob("*.xplane.pb"))  # the profiler trace of our generation
    assert theirs["side"] == "transformers" and ("skipped" in theirs or "decode_tokens_per_s" in theirs)
    assert sections["train"][-1]["losses_agree"] and sections["train"][-1]["max_loss_difference"] < 1e-4


@pytest.mark.parametrize(
    "args, says",
    [
        (["--budget-s", "-1"], "--budget-s: '-1': must be a positive number"),
        (["--budget-s", "0"], "--budget-s: '0': must be a positive number"),
        (["--budget-s", "nan"], "--budget-s: 'nan': must be a positive number"),
        (["--loss-tol", "-1"], "--loss-tol: '-1': must be a finite number >= 0"),
    ],
)
def test_bad_arguments_end_in_one_line_before_a_gpu_is_used(tmp_path, capsys, args, says):
    """A budget that would skip every case, or a tolerance that nothing meets, wastes a GPU loan: one
    line, exit 2, nothing written."""
    from eval.bench import gpu_suite

    with pytest.raises(SystemExit) as e:
        gpu_suite.main(["--out", str(tmp_path / "out"), "--dry", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


def test_out_at_a_file_ends_in_one_line(tmp_path, capsys):
    from eval.bench import gpu_suite

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        gpu_suite.main(["--out", str(tmp_path / "file"), "--dry"])
    assert e.value.code == 2 and "a file; it takes a directory" in capsys.readouterr().err


def test_the_gpu_script_parses_and_names_only_known_sections():
    """eval/bench/gpu_all.sh (run on a GPU machine): bash accepts it, and every section its parts
    name is one of the suite's. Its --dry run takes minutes; the sections' dry runs are above."""
    from eval.bench import gpu_suite

    script = ROOT / "eval/bench/gpu_all.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    parts = re.findall(r"^part (\w+) \S+ ([\w,]+)$", script.read_text(), re.M)
    assert [name for name, _ in parts] == ["checks", "speed"]
    named = [section for _, sections in parts for section in sections.split(",")]
    assert set(named) <= set(gpu_suite.SHARES) and "correctness" in named and "dsa" in named
