"""The GPU compile check's reading of the compilers and its verdicts (eval/bench/compile_check/reading.py),
on text the compilers wrote: no CUDA wheels needed. `make gpu-compile` runs the compiles themselves,
and its --self-test checks that a planted shared-memory overflow and a planted spill fail."""

from eval.bench.compile_check import reading
from eval.bench.compile_check.cases import accepted, cases, planted

PTXAS = """I1205 12:43:56.032876   29974 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'moba_own_dkv_gpu' for 'sm_90a'
ptxas info    : Function properties for moba_own_dkv_gpu
    80 bytes stack frame, 160 bytes spill stores, 120 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 80 bytes cumulative stack size
ptxas info    : Compiling entry function 'moba_own_fwd_gpu' for 'sm_90a'
ptxas info    : Function properties for moba_own_fwd_gpu
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""
MOSAIC = """ptxas warning : (C7504) 'setmaxnreg' ignored to maintain compatibility across compilation units
ptxas info    : Compiling entry function 'mla_decode_mgpu_mosaic_gpu_kernel' for 'sm_90a'
    0 bytes stack frame, 512 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 2 barriers, 1 bytes smem
"""
THUNKS = (
    "049: kCustomKernel [prev=048 (1)  | next=054 (5) ] moba_own_fwd_gpu grid: [2, 24, 1] threads: "
    "[128, 1, 1]  shared_memory: 81920 bytes\n"
    "001: kCustomKernel [source        | next=037 (26)] loop_broadcast_fusion_4 grid: [1, 1, 1] threads: "
    "[36, 1, 1]  shared_memory: 0 bytes\n"
)


def test_ptxas_reports_registers_spills_and_warnings_per_kernel():
    report = reading.ptxas_report(PTXAS)
    assert report["moba_own_dkv_gpu"] == {"registers": 255, "spill_bytes": 280, "warnings": []}
    assert report["moba_own_fwd_gpu"] == {"registers": 168, "spill_bytes": 0, "warnings": []}
    (kernel,) = reading.ptxas_report(MOSAIC).values()
    assert kernel == {"registers": 168, "spill_bytes": 512, "warnings": ["C7504"]}


def test_xla_thunks_and_mosaic_logs_give_shared_memory():
    assert reading.thunk_kernels(THUNKS)["moba_own_fwd_gpu"] == {"threads": 128, "smem": 81920}
    assert reading.mosaic_smem("... smem_bytes = 35856 : i32} {") == 35856
    assert reading.mosaic_smem("nothing") is None


def test_verdicts():
    """Fails: an error or shared memory over the limit where accepted; a spill or C7504/C7512 where
    auto picks it (and, strict, in an accepted edge); a refused row never fails."""
    row = lambda **kw: {"kind": "auto", "backend": "mosaic", "accepted": True, "spill_bytes": 0} | kw
    limit = 232_448
    assert reading.verdict(row(), limit) is None
    assert "compile fails" in reading.verdict(row(error="RESOURCE_EXHAUSTED: ..."), limit)
    assert "over the 232,448" in reading.verdict(row(smem=663_552), limit)
    assert "spills 8 bytes" in reading.verdict(row(spill_bytes=8, registers=255), limit)
    assert reading.verdict(row(warnings=["C7512"]), limit) == "ptxas C7512"
    assert reading.verdict(row(kind="edge", warnings=["C7504"]), limit) is None
    assert reading.verdict(row(kind="edge", spill_bytes=8), limit, strict_edges=False) is None
    assert "spills" in reading.verdict(row(kind="edge", spill_bytes=8), limit)
    assert reading.verdict(row(kind="edge", backend="triton", spill_bytes=8), limit) is None  # reported
    assert reading.verdict(row(accepted=False, error="x", spill_bytes=8), limit) is None


def test_cases_cover_every_family_and_backend_and_the_planted_ones_are_accepted():
    """Every family in both backends (and the train steps); the planted failures are configurations
    the checks accept, so the compile is what must catch them."""
    covered = {(c.family, c.backend) for c in cases()}
    families = ("moba_attention", "moba_routing", "moba_decode", "mla_decode")
    assert {(f, b) for f in families for b in ("mosaic", "triton")} | {("train_step", "auto")} <= covered
    assert all(accepted(c) is None for c in planted())
    assert any(c.kind == "auto" and "a100" in c.targets for c in cases() if c.backend == "triton")
