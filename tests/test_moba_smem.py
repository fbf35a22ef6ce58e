"""The MoBA TPU kernels' scalar-prefetched tables against a TPU core's SMEM: every call under the
budget at the 1M config's per-chip shapes (arithmetic on the schedule's shapes, nothing compiled),
the calls sliced small (interpreted against the reference; compiled with libtpu), and the SMEM and
VMEM per kernel read from a program's text, with the one-line refusal of an overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import v5e_arg
from test_moba_pallas import CASES, SMALL, _moba_grad_fn, check_against_reference

from effattn_jax.config import ConfigError, load_config
from effattn_jax.train.tpu_memory import KernelMemory, check_kernel_memory, kernel_memory, moba_tpu_tables
from pallas_kernels.moba import parts, tpu_smem
from pallas_kernels.moba.schedule import BlockSizes


def test_budget_is_a_fraction_of_each_generation():
    """The budget leaves room for Mosaic's own scalars on the smallest core of v5e, v5p, v6e."""
    assert set(tpu_smem.SMEM_BYTES) == {"TPU v5 lite", "TPU v5", "TPU v6 lite"}
    assert 0 < tpu_smem.SMEM_BUDGET_BYTES < min(tpu_smem.SMEM_BYTES.values())


def test_every_call_fits_smem_at_1m_on_16_chips():
    """moba_545m_1m.yaml at context 8 (131,072 queries per chip, 14 heads, block 4,096, top_k 12):
    each call's tables under the budget, and the forward in several calls: one call over all 82,432
    tiles held 5 x 82,432 int32 = 1.57 MiB, what libtpu refused for a v5p core ("Used 1.57M of
    1.00M smem"). Catches: a kernel call left unsliced, a slice sized without the tables' count."""
    cfg = load_config("configs/moba/paper/moba_545m_1m.yaml", ["mesh.context=8", "mesh.topology=v5p:2x2x4"])
    calls = {c.kernel: c for c in moba_tpu_tables(cfg, {"data": 1, "fsdp": 2, "context": 8, "tensor": 1})}
    assert set(calls) == set(tpu_smem.TABLES) - {"moba_decode_tpu"}
    for call in calls.values():
        assert 0 < call.table_bytes <= tpu_smem.SMEM_BUDGET_BYTES, call
    ntiles = 131072 * 14 * 11 // 256 + 14 * 256
    assert tpu_smem.table_bytes("moba_block_fwd", ntiles) == 1_648_640  # the 1.57 MiB libtpu refused
    assert calls["moba_block_fwd"].calls == 4 and calls["moba_block_bwd"].calls == 11
    assert calls["moba_own_fwd"].calls == 2  # a context shard's two runs


def test_slices_cover_the_schedule_once():
    """Slices of equal size, in order, every tile once, within the budget."""
    for ntiles, most in [(1, 1), (10, 3), (82432, 26214), (7, 100)]:
        cuts = tpu_smem.tile_slices(ntiles, most)
        assert [i for c in cuts for i in range(c.start, c.stop)] == list(range(ntiles))
        assert max(c.stop - c.start for c in cuts) <= most
    assert tpu_smem.tiles_per_call("moba_block_fwd", 10**6) == tpu_smem.SMEM_BUDGET_BYTES // 20


def test_own_tables_over_budget_refused_in_one_line():
    with pytest.raises(ValueError, match=r"moba_own_fwd.*SMEM.*mesh\.context.*moba\.block_size"):
        tpu_smem.check_own("moba_own_fwd", tpu_smem.SMEM_BUDGET_BYTES)


@pytest.mark.slow
def test_tpu_kernels_in_smem_sized_slices(monkeypatch):
    """The selected blocks' forward and backward with a budget of 7 tiles' tables a call (forward:
    5 tables, backward 6: 5 tiles a call), groups cut between calls, interpreted against the
    reference, forward and gradients. Catches: a slice's tiles written at the wrong offset of o or
    lse, a slice dropped or run twice."""
    monkeypatch.setattr(tpu_smem, "SMEM_BUDGET_BYTES", 7 * 5 * 4)
    seen = []
    slices = parts.tpu_past_slices
    monkeypatch.setattr(parts, "tpu_past_slices", lambda *a: seen.append(a[0]) or slices(*a))
    check_against_reference("tpu", True, *CASES["packed_documents"], block_sizes=SMALL)
    cuts = {k: slices(k, 100, SMALL.past_q_tile) for k in ("moba_block_fwd", "moba_block_bwd")}
    assert max(c.stop - c.start for c in cuts["moba_block_fwd"]) == 7
    assert max(c.stop - c.start for c in cuts["moba_block_bwd"]) == 5
    assert {"moba_block_fwd", "moba_block_bwd"} <= set(seen)


LOWERED = (
    "    %5 = stablehlo.custom_call @tpu_custom_call(%0, %1, %2) {backend_config = "
    '"{\\22custom_call_config\\22: {\\22body\\22: \\22TUzv\\22}, '
    "\\22scoped_memory_configs\\22: [{\\22memory_space\\22:1, \\22offset\\22: 0, "
    '\\22size\\22: 20971520}]}", kernel_name = "moba_block_fwd"} : (tensor<20608xi32>, '
    "tensor<20608xi32>, tensor<20608x256x128xbf16>) -> tensor<82432x256x128xf32>"
)
COMPILED = (
    "  %transpose_jvp_moba_block_bwd__.3 = (bf16[12,256,128]{2,1,0}) custom-call(%a, %b, %c), "
    'custom_call_target="tpu_custom_call", operand_layout_constraints={s32[12]{0}, s32[12]{0}, '
    'bf16[12,256,128]{2,1,0}}, backend_config={"flag_configs":[],"scoped_memory_configs":'
    '[{"memory_space":"1","offset":"0","size":"33554432"}],"custom_call_config":{"body":"TUzv"}}'
)


def test_kernel_memory_read_from_the_program_text():
    """Lowered StableHLO and compiled HLO: the kernel's name (AD's prefixes dropped), its leading
    integer operands (the scalar-prefetched tables) and its scoped VMEM (memory space 1)."""
    assert kernel_memory(LOWERED + "\n" + LOWERED) == [
        KernelMemory("moba_block_fwd", 2, 2 * 20608 * 4, 20 << 20)
    ]
    assert kernel_memory(COMPILED) == [KernelMemory("moba_block_bwd", 1, 2 * 12 * 4, 32 << 20)]
    # a table of several dims: its last dim padded to 128 entries, as Mosaic lays it out in SMEM
    tables = COMPILED.replace("s32[12]{0}, s32[12]{0}", "s32[64,16,3]{2,1,0}")
    assert kernel_memory(tables)[0].smem_bytes == 64 * 16 * 128 * 4
    assert not kernel_memory(tables)[0].smem_exact


def test_kernel_over_smem_or_vmem_refused_in_one_line():
    """Against a v5p core (1 MiB SMEM, 64 MiB VMEM, libtpu's capacities): named kernel, memory and knobs."""
    fits = [KernelMemory("moba_block_fwd", 4, 412_160, 20 << 20)]
    check_kernel_memory(fits, "TPU v5", "v5p:2x2x4")
    smem = [KernelMemory("moba_block_fwd", 1, 1_648_640, 20 << 20)]
    with pytest.raises(
        ConfigError, match=r"moba_block_fwd needs 1\.57 MiB of SMEM.*mesh\.context.*moba\.block_size"
    ):
        check_kernel_memory(smem, "TPU v5", "v5p:2x2x4")
    vmem = [KernelMemory("moba_own_bwd", 1, 136, 80 << 20)]
    with pytest.raises(ConfigError, match=r"moba_own_bwd needs 80\.00 MiB of VMEM.*moba\.block_size"):
        check_kernel_memory(vmem, "TPU v5", "v5p:2x2x4")
    check_kernel_memory(vmem, "TPU v6 lite", "v6e:4x4")  # 128 MiB there
    # an estimate (tables of several dims, padding inferred) is left to libtpu, not refused
    check_kernel_memory([smem[0]._replace(smem_exact=False)], "TPU v5", "v5p:2x2x4")


@pytest.mark.slow
def test_sliced_kernels_compile_for_a_real_tpu(monkeypatch):
    """The selected blocks' calls sliced (12 tiles, 4 a call: the forward's o and lse and the
    backward's dq written into the previous call's, aliased) lower with Mosaic and compile with
    libtpu; the program's text reports each call's tables. Catches: an alias or an out-of-slice
    block index Mosaic rejects (interpret mode would accept it)."""
    x = v5e_arg()((1, 1024, 2, 128))
    monkeypatch.setattr(tpu_smem, "SMEM_BUDGET_BYTES", 100)  # 4 tiles: forward 80 bytes, backward 96
    lowered = _moba_grad_fn("tpu", BlockSizes(), 1024, 128).lower(x, x, x)
    expected = {
        "moba_block_fwd": (3, 80),
        "moba_block_bwd": (3, 96),
        "moba_own_fwd": (1, 16),
        "moba_own_bwd": (1, 16),
    }
    for text in (lowered.as_text(), lowered.compile().as_text()):
        assert {k.kernel: (k.calls, k.smem_bytes) for k in kernel_memory(text)} == expected


def test_tpu_decode_in_row_slices(monkeypatch):
    """The decode step's tables with a budget of one row a call (2 rows: 2 calls, each reading its
    rows of the whole caches), interpreted, equal the XLA step. Catches: a call's rows offset wrongly
    into the caches or the flat tables."""
    from test_moba_decode import _kernel_case

    from pallas_kernels.moba import tpu_decode

    step = _kernel_case(160, 32)
    want = step("xla")
    monkeypatch.setattr(tpu_smem, "SMEM_BUDGET_BYTES", 3 * 4 * 4 * 4)  # 4 heads x 4 picks: one row
    assert tpu_smem.rows_per_call("moba_decode_tpu", 2, 16) == 1
    calls = str(jax.make_jaxpr(lambda: step("pallas_tpu"))()).count("name=moba_decode_tpu")
    assert calls == 2
    np.testing.assert_allclose(step("pallas_tpu"), want, atol=1e-5, rtol=1e-5)
    assert tpu_decode.fits(160, 32)


@pytest.mark.slow
def test_tpu_decode_tables_fit_smem_at_64_rows():
    """64 rows x 16 heads x 3 picks compile with libtpu: as [64, 16, 3] tables Mosaic padded each to
    512 KiB of SMEM and libtpu refused the call (1.5 MiB of 1 MiB); flat, they take 36 KiB. Catches:
    tables passed with more than one dim."""
    from pallas_kernels.moba.tpu_decode import moba_decode_tpu

    arg = v5e_arg()
    step = jax.jit(lambda q, k, v, *tables: moba_decode_tpu(q, k, v, *tables, 512, 0.125))
    cache = arg((64, 4, 1024, 128))
    lowered = step.lower(arg((64, 16, 128)), cache, cache, *[arg((64, 16, 3), jnp.int32)] * 3)
    assert kernel_memory(lowered.as_text())[0].smem_bytes == 3 * 64 * 16 * 3 * 4
    lowered.compile()
