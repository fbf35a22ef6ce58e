"""MoBA Pallas kernels on CPU: TPU and GPU kernels interpreted against the reference,
real TPU lowering (ahead-of-time compile with libtpu), GPU lowering (jax.export for
CUDA), and the kernels inside a sharded train step."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import quick_or_slow, rand_qkv, random_batch, segments, tiny_overrides, v5e_arg
from jax.experimental.pallas import tpu as pltpu

from effattn_jax.config import load_config
from effattn_jax.model import REMAT_POLICY
from effattn_jax.ops.moba import moba_attention, moba_reference, moba_reference_mask
from effattn_jax.ops.platform import resolve_impl
from effattn_jax.ops.routing import moba_routing
from effattn_jax.sharding import make_mesh
from effattn_jax.train.state import init_state, make_setup
from effattn_jax.train.step import make_train_step
from pallas_kernels.common import ALIGN, gpu_lowering_target
from pallas_kernels.moba import parts
from pallas_kernels.moba.attention import forward, moba_pallas
from pallas_kernels.moba.parts import KernelCall, layout, padded_length, past_schedule
from pallas_kernels.moba.schedule import BlockSizes, past_tiles, prefix_scan
from pallas_kernels.moba.tpu_own import own_tile

SMALL = BlockSizes(q_tile=8, kv_block=8, past_q_tile=8)  # groups of several tiles: dK/dV accumulate
CASES = {
    # name: (batch, seq, q_heads, kv_heads, block, top_k, segment lengths or None)
    "partial_last_block": (1, 45, 2, 2, 8, 3, None),
    "packed_documents": (2, 50, 2, 1, 8, 3, [13, 20, 17]),
    "gqa_4x": (1, 40, 8, 2, 16, 2, None),
    "top_k_1": (1, 40, 2, 2, 8, 1, None),
    "top_k_covers_all": (1, 40, 2, 2, 8, 6, [25, 15]),
    "shorter_than_a_block": (1, 6, 2, 1, 8, 3, None),
}


def check_against_reference(kernel, interpret, b, s, hq, hkv, c, top_k, lengths, block_sizes=SMALL, d=8):
    q, k, v = rand_qkv(4, b, s, hq, hkv, d)
    seg = None if lengths is None else segments(b, lengths)
    r = moba_routing(q, k, block_size=c, top_k=top_k, segment_ids=seg)
    args = (c, d**-0.5, kernel, interpret, block_sizes)
    pallas = lambda q, k, v: moba_pallas(q, k, v, r.own_start, r.past_start, *args)
    ref = lambda q, k, v: moba_attention(
        q, k, v, block_size=c, top_k=top_k, segment_ids=seg, impl="reference"
    )
    # forward output and log-sum-exp
    call = KernelCall.fitted(
        block_sizes, q, v, block_size=c, scale=d**-0.5, backend=kernel, interpret=interpret
    )
    past = past_schedule(r.past_start, hkv=hkv, call=call)
    out, lse = jax.jit(lambda q, k, v: forward(q, k, v, r.own_start, past, call))(q, k, v)
    mask = moba_reference_mask(r, block_size=c, segment_ids=seg)
    logits = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, hq // hkv, axis=2)) * d**-0.5
    ref_lse = jnp.moveaxis(jax.nn.logsumexp(jnp.where(mask, logits, -jnp.inf), axis=-1), 1, 2)
    np.testing.assert_allclose(out, ref(q, k, v), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # gradients
    w = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
    grad = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(grad(pallas), grad(ref), strict=True):
        np.testing.assert_allclose(a, e, atol=1e-4, rtol=1e-4)


QUICK = {("gpu", "top_k_1"), ("gpu", "shorter_than_a_block")}  # the cases `make test-fast` runs


@pytest.mark.parametrize(
    "kernel, name",
    quick_or_slow([(k, n) for k in ("tpu", "gpu") for n in CASES], QUICK),
)
def test_kernels_interpreted_match_reference(kernel, name):
    """Each backend's kernels, interpreted, against the dense-mask reference: output, lse and dq/dK/dV
    over a partial last block, packed documents, GQA, top_k 1 and top_k covering every block. Catches: a
    causal mask off by one in the own block, a selected block's window shifted, a document boundary
    ignored, a TPU dK/dV accumulator not zeroed at a group's first tile (group_first: tried, the tpu
    packed case fails), a query head mapped to the wrong KV head."""
    check_against_reference(kernel, True, *CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_merge_by_chunks_and_backward_by_slices(kernel, monkeypatch):
    """What long sequences take: the parts merged (and dq gathered) a few positions at a time, the last
    chunk overlapping the one before (50 positions in chunks of 7), and on TPU the selected blocks'
    backward in calls of 7 tiles, two groups cut between calls. Catches: a chunk or slice boundary dropped
    or counted twice."""
    monkeypatch.setattr(parts, "MERGE_ROWS", 7 * 2 * 2)  # batch 2 x 2 heads per position
    monkeypatch.setattr(parts, "MERGE_WHOLE_ROWS", 0)
    monkeypatch.setattr(parts, "BWD_SLICE_ROWS", 7 * SMALL.past_q_tile)
    check_against_reference(kernel, True, *CASES["packed_documents"])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernels_take_bfloat16(kernel):
    """bf16 inputs, float32 accumulation: output and gradients within bf16 rounding of the float32
    reference (inputs to each matmul are rounded to 8 mantissa bits, and each part's gradient once before
    the parts are added; values are O(1)). Catches: an accumulation in bf16 instead of float32."""
    q, k, v = rand_qkv(6, 1, 40, 4, 2, 8, dtype=jnp.bfloat16)
    seg = segments(1, [17, 23])
    r = moba_routing(q, k, block_size=8, top_k=3, segment_ids=seg)
    pallas = lambda q, k, v: moba_pallas(q, k, v, r.own_start, r.past_start, 8, 8**-0.5, kernel, True, SMALL)
    ref = lambda q, k, v: moba_reference(
        q, k, v, r, block_size=8, segment_ids=seg, scale=8**-0.5
    )  # same routing
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out = jax.jit(pallas)(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref(*f32), atol=3e-2, rtol=2e-2)
    w = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss(pallas), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(grads, jax.grad(loss(ref), argnums=(0, 1, 2))(*f32), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(a.astype(jnp.float32), e, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("n", [1, 100, 128, 129, 5000])
def test_prefix_scan_equals_cumsum_and_cummax(n):
    """The schedule's scan against numpy's, at lengths around its row width. Catches: a row total carried
    into the wrong row, a shift past a row's end."""
    x = np.random.default_rng(n).integers(-50, 50, n).astype(np.int32)
    np.testing.assert_array_equal(prefix_scan(jnp.asarray(x), jnp.add, 0), np.cumsum(x))
    low = np.iinfo(np.int32).min
    np.testing.assert_array_equal(prefix_scan(jnp.asarray(x), jnp.maximum, low), np.maximum.accumulate(x))


@pytest.mark.parametrize("s", [6, 100, 512, 1000])
def test_padded_length_holds_every_window(s):
    """The whole-block kernels fetch the block plus at most ALIGN keys per step, also on the padding steps
    of a sequence shorter than a block (no earlier blocks): the padded length must hold one. Catches:
    padding to the block without the slack."""
    bs = BlockSizes().resolve("tpu")
    pad = padded_length(s, 512, bs)
    assert pad % 512 == 0 and pad >= max(s, 512) + ALIGN


@pytest.mark.slow
def test_tpu_kernels_read_whole_lane_heads_in_place():
    """With every head 128 lanes wide and S a multiple of the block, the TPU kernels read q, K, V and dO
    as [B, S, H*D] (no head-major copies) and write dq, dK, dV so: packed documents (a chunk needing the
    previous one), GQA, against the reference. Catches: an in-place index map that reads the wrong head or
    chunk."""
    b, s, hq, hkv, c, top_k, lengths = 2, 128, 4, 2, 32, 3, [40, 50, 38]
    q = jnp.zeros((b, s, hq, 128))
    for backend, natural in (("tpu", True), ("gpu", False)):
        call = KernelCall(backend, True, SMALL.resolve(backend), c, 1.0)
        assert layout(q, q[:, :, :hkv], q[:, :, :hkv], call)[1].natural == natural
    check_against_reference("tpu", True, b, s, hq, hkv, c, top_k, lengths, d=128)


@pytest.mark.slow
@pytest.mark.parametrize("q_tile, kv_block", [(16, 8), (8, 16)])
def test_gpu_own_block_with_query_tiles_unlike_key_steps(q_tile, kv_block):
    """The GPU own-block kernel's tables (first key step per query tile, last query tile per key step)
    with tiles that straddle blocks and documents, under GQA. Catches: a key step skipped at a straddling
    tile."""
    sizes = BlockSizes(q_tile=q_tile, kv_block=kv_block, past_q_tile=8)
    check_against_reference("gpu", True, 1, 50, 4, 2, 16, 3, [13, 20, 17], block_sizes=sizes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["packed_documents"])
def test_tpu_kernel_in_tpu_interpret_mode(name):
    """The TPU interpreter (TPU semantics on CPU: DMAs, semaphores) against the reference, with its
    happens-before race detector. With packed documents neighbouring blocks' dK/dV windows overlap, and
    the selected blocks' kernel reads, adds and writes each back by DMAs it must finish within the step.
    Values alone do not show a race there: a read started before the previous write-back was awaited still
    gave the right gradients here; the detector found it. Catches: a DMA not awaited, two writes to one
    dK/dV window racing."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    check_against_reference("tpu", pltpu.InterpretParams(detect_races=True), *CASES[name])
    assert interpreter.races is not None and not interpreter.races.races_found


def test_selected_blocks_share_one_kv_fetch_across_query_heads():
    """GQA: the selections are grouped by (batch, KV head, block), so a tile holds the rows of every query
    head of its KV head that chose its block, and a group's tiles are consecutive (the kernels keep one
    K/V window and one dK/dV accumulator for them). Catches: grouping by query head instead of KV head."""
    q, k, _ = rand_qkv(1, 1, 64, 4, 1, 8)
    r = moba_routing(q, k, block_size=8, top_k=3)
    past = past_tiles(r.past_start, num_kv_heads=1, block_size=8, q_tile=8)
    rows, group = np.asarray(past.tiles.rows), np.asarray(past.tile_group)
    real = rows >= 0
    assert max(len(set(rows[t][real[t]] % 4)) for t in range(len(rows))) > 1  # query heads mixed
    chosen = np.asarray(r.past_start)
    assert (np.asarray(past.group_tiles) > 0).sum() == len(np.unique(chosen[chosen >= 0]))
    starts = np.asarray(past.tiles.key_start)
    for g in np.unique(group[real.any(1)]):
        tiles = np.flatnonzero(group == g)
        assert np.all(np.diff(tiles) == 1) and len(set(starts[tiles])) == 1
    assert np.asarray(past.group_first)[np.flatnonzero(np.diff(group, prepend=-1))].all()


def test_block_sizes_are_checked_and_impls_resolve():
    """Tile sizes a compiler would reject fail at construction or `check_backend`, naming the field;
    `resolve_impl` maps each impl and backend to its path. Catches: a check dropped, auto taking an
    interpreted kernel on CPU."""
    with pytest.raises(ValueError, match="q_tile"):
        BlockSizes(q_tile=0)
    with pytest.raises(ValueError, match="kv_block"):
        BlockSizes(kv_block=12)  # Mosaic rejects a K/V block whose rows are not a multiple of 8
    with pytest.raises(ValueError, match="past_q_tile"):
        BlockSizes(past_q_tile=0)
    BlockSizes(q_tile=12, kv_block=8, past_q_tile=12).check_backend("tpu", 512)  # any tile compiles
    with pytest.raises(ValueError, match="moba.block_size must be a multiple of 128"):
        BlockSizes().check_backend("tpu", 200)  # the own-block kernel's lane-dense lse rows
    with pytest.raises(ValueError, match="multiple of moba.kv_block 64 on GPU"):
        BlockSizes(64, 64, past_q_tile=64).check_backend("gpu", 96)
    with pytest.raises(ValueError, match=r"BlockSizes.q_tile \(moba.q_tile\) must be a power of two >= 16"):
        BlockSizes(q_tile=24, kv_block=64).check_backend("gpu")
    with pytest.raises(ValueError, match="kv_block"):
        BlockSizes(q_tile=64, kv_block=8).check_backend("gpu")
    # checked when compiling for the hardware, before anything is traced (interpret mode, which
    # accepts any size, is what the interpreted tests above run with q_tile = kv_block = 8)
    q = jnp.zeros((1, 32, 2, 8))
    r = moba_routing(q, q, block_size=8, top_k=2)
    with pytest.raises(ValueError, match="power of two >= 16"):
        moba_pallas(
            q, q, q, r.own_start, r.past_start, 8, 1.0, "gpu", False, BlockSizes(q_tile=8, kv_block=8)
        )
    # ... except a GPU block that is not whole kv_block steps: wrong results, interpreted too
    r = moba_routing(q, q, block_size=24, top_k=2)
    with pytest.raises(ValueError, match="multiple of moba.kv_block 16 on GPU"):
        moba_pallas(q, q, q, r.own_start, r.past_start, 24, 1.0, "gpu", True, BlockSizes(8, 16, 8))
    assert resolve_impl("auto", "cpu") == ("xla", None, False)
    assert resolve_impl("auto", "tpu") == ("pallas", "tpu", False)
    assert resolve_impl("auto", "gpu") == ("pallas", "gpu", False)
    assert resolve_impl("pallas", "cpu") == ("pallas", "tpu", True)
    assert resolve_impl("pallas_gpu", "cpu") == ("pallas", "gpu", True)


def _moba_grad_fn(kernel, block_sizes, s, d, wrap=lambda loss: loss, block_size=512, top_k=3, grad=jax.grad):
    def loss(q, k, v):
        r = moba_routing(q, k, block_size=block_size, top_k=top_k)
        out = moba_pallas(q, k, v, r.own_start, r.past_start, block_size, d**-0.5, kernel, False, block_sizes)
        return out.astype(jnp.float32).sum()

    return jax.jit(grad(wrap(loss), argnums=(0, 1, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("seq", [1024, 1000], ids=["lane_heads", "head_major"])
def test_tpu_kernels_compile_for_a_real_tpu(seq):
    """Mosaic lowering and libtpu compile (no TPU needed): forward + backward, bf16, the benchmark's head
    dim and block, with q/K/V read in place (S a multiple of the block) and through head-major copies; the
    full benchmark shapes are in eval/bench/aot_compile.py. Catches: a block shape Mosaic rejects
    (interpret mode would accept it)."""
    x = v5e_arg()((1, seq, 2, 128))
    lowered = _moba_grad_fn("tpu", BlockSizes(), seq, 128).lower(x, x, x)
    text = lowered.as_text()
    # own block and selected blocks: a forward and one fused backward each
    assert text.count("tpu_custom_call") == 4
    # what libtpu compiles slowly: the backward reuses the forward's sort of the pairs, and no
    # scan over the pairs (2,048 here) is a reduce_window (schedule.prefix_scan); those left scan
    # the groups and chunks
    assert text.count("stablehlo.sort") == 1
    windows = re.findall(r"window_dimensions = array<i64: ([\d, ]+)>", text)
    assert max(int(w) for dims in windows for w in dims.split(",")) < 128
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # the kernels' CostEstimates reach XLA: at least a causal forward's matmuls (every query sees
    # its whole past at S = 2 blocks); without them XLA counts ~12 MFLOP here
    assert cost["flops"] >= 2 * 2 * seq * seq / 2 * 128 * 2


@pytest.mark.slow
def test_tpu_kernels_compile_at_the_1m_block():
    """The paper's 1M setting, block 4,096: libtpu compiles forward + backward within each kernel's
    scoped VMEM. Catches: a kernel holding a whole block's [keys, rows] scores in one step (83 MiB of
    VMEM for the own block), a scoped limit left at Mosaic's 16 MiB default (the own block needs ~26
    MiB forward, the selected blocks' backward ~20 MiB)."""
    x = v5e_arg()((1, 8192, 1, 128))
    _moba_grad_fn("tpu", BlockSizes(), 8192, 128, block_size=4096, top_k=2).lower(x, x, x).compile()


def test_own_block_tiles():
    """The TPU own-block kernel's square tiles: half the chunk up to key_tile, then the largest divisor
    of the chunk that is a multiple of 128 (Mosaic's lanes), any divisor in interpreted test sizes."""
    assert [own_tile(c, 512) for c in (512, 1024, 4096, 1152, 9, 8)] == [256, 512, 512, 384, 9, 4]
    assert own_tile(32, 8) == 8 and own_tile(36, 8) == 6


@pytest.mark.slow
def test_tpu_own_block_in_tiles():
    """The own-block kernel walking a block of 32 in 4 x 4 tiles of 8 (as a block of 4,096 goes in
    tiles of 512), interpreted against the reference with packed documents whose own blocks start in
    the previous chunk. Catches: a row tile reading key tiles past its diagonal or short of it, the
    online softmax of a row that has seen no key yet (NaN), a key tile's dK/dV added at the wrong
    rows."""
    sizes = BlockSizes(q_tile=8, kv_block=8, past_q_tile=8, key_tile=8)
    check_against_reference("tpu", True, 1, 100, 2, 2, 32, 3, [45, 55], block_sizes=sizes)


def test_remat_keeps_the_schedule():
    """Under the model's remat policy a layer's backward recomputes the forward but not the named
    schedule: one sort of the pairs in the program (two with a save-nothing remat). Catches: the schedule
    left out of the remat policy."""
    x = v5e_arg()((1, 1024, 2, 128))

    def sorts(policy):
        remat = functools.partial(jax.checkpoint, policy=policy)
        # the loss too, as a train step returns it: jax drops a forward that nothing uses
        grad = jax.value_and_grad
        lowered = _moba_grad_fn("tpu", BlockSizes(), 1024, 128, wrap=remat, grad=grad).lower(x, x, x)
        return lowered.as_text().count("stablehlo.sort")

    assert sorts(REMAT_POLICY) == 1 and sorts(None) == 2


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_gpu_kernels_lower_for_cuda(kernel):
    """Forward + backward lower for CUDA (jax.export, no GPU) with the shipped `auto` tiles, each kernel
    once: `mosaic` (three own-block and three selected-block kernel calls) and `triton` (the six
    Triton kernels, by name). Catches: a shape or op a lowering rejects, a kernel
    replaced by an XLA fallback, auto tiles that the shared-memory check (against an H100/H200 here)
    refuses, pallas_gpu not taking the Mosaic kernels on Hopper."""
    x = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # not a stable-ABI call
    with gpu_lowering_target():
        exported = jax.export.export(
            _moba_grad_fn(kernel, BlockSizes(), 1024, 128), platforms=["cuda"], disabled_checks=[triton]
        )(x, x, x)
    text = exported.mlir_module()
    names = re.findall(r'name = "(moba_\w+_gpu)"', text)
    parts = ("fwd", "dq", "dkv")
    if kernel == "triton":
        assert sorted(names) == sorted([f"moba_{k}_{p}_gpu" for k in ("own", "block") for p in parts])
    else:
        assert not names and "triton" not in text
        assert len(re.findall(r"stablehlo.custom_call @mosaic_gpu", text)) == 6, text.count("mosaic_gpu")


def test_gpu_kernel_choice(verified):
    """pallas_gpu takes the Triton kernels (verified on a GPU) and the Mosaic GPU ones once the table
    lists them, where they run (compiled for a Hopper, bf16, tiles of 64 rows), else Triton (float32);
    with neither listed, Triton (the measured kernels); pallas_mosaic refuses in one line what its
    kernels cannot run."""
    bf16, f32 = (jnp.zeros((1, 128, 2, 128), t) for t in (jnp.bfloat16, jnp.float32))
    fit = lambda x, backend, interpret=False: (
        KernelCall.fitted(
            BlockSizes(), x, x, block_size=512, scale=1.0, backend=backend, interpret=interpret
        ).gpu_kernels
    )
    assert fit(bf16, "gpu") == "triton" and fit(bf16, "mosaic") == "mosaic"
    verified(("moba_attention", "mosaic"))
    assert fit(bf16, "gpu") == "mosaic" and fit(bf16, "triton") == "triton"
    assert fit(f32, "gpu") == "triton" and fit(bf16, "gpu", interpret=True) == "mosaic"
    verified()
    assert fit(bf16, "gpu") == "triton"
    assert fit(bf16, "tpu") == ""
    with pytest.raises(
        ValueError, match="pallas_mosaic cannot run MoBA attention here: .*float32.*use pallas_triton"
    ):
        fit(f32, "mosaic")
    assert resolve_impl("pallas_mosaic", "cpu") == ("pallas", "mosaic", True)
    assert resolve_impl("pallas_triton", "gpu") == ("pallas", "triton", False)


@pytest.mark.slow
def test_kernels_inside_a_sharded_train_step(tmp_path, corpus_dir):
    """impl=pallas under a (data=2, fsdp=2, tensor=2) mesh runs through shard_map and matches the single-
    XLA path. Catches: a shard_map spec that splits heads or batch wrongly."""
    batch = random_batch(0)
    metrics = []
    for impl, mesh_shape in (("xla", (1, 1, 1)), ("pallas", (2, 2, 2))):
        cfg = load_config(
            None,
            tiny_overrides(
                corpus_dir,
                tmp_path / "r",
                **{
                    "attention.core": "moba",
                    "moba.block_size": 8,
                    "moba.top_k": 2,
                    "moba.impl": impl,
                    "moba.q_tile": 8,
                    "moba.kv_block": 8,
                },
            ),
        )
        setup = make_setup(cfg, make_mesh(*mesh_shape))
        _, m = make_train_step(setup)(init_state(setup), jax.device_put(batch, setup.batch_sharding()))
        metrics.append({k: float(v) for k, v in m.items()})
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)
    assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_mosaic_gpu_kernels_through_the_op():
    """moba_attention with impl=pallas_mosaic (the Mosaic GPU kernels, interpreted) matches the dense
    reference, forward and gradients, through the same schedule, merge and custom_vjp as every
    backend: packed documents with a partial block, GQA, the own block and two chosen blocks."""
    q, k, v = rand_qkv(3, 1, 320, 2, 1, 64, dtype=jnp.bfloat16)
    seg = segments(1, [197, 123])  # blocks start off the 8-row tiles in the second document
    w = jax.random.normal(jax.random.key(0), q.shape, jnp.float32)

    def grads(impl):
        def loss(q, k, v):
            out = moba_attention(
                q,
                k,
                v,
                block_size=64,
                top_k=3,
                segment_ids=seg,
                impl=impl,
                block_sizes=BlockSizes(64, 64, 64),
            )
            return jnp.sum(out.astype(jnp.float32) * w)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(
        jax.tree.leaves(grads("pallas_mosaic")), jax.tree.leaves(grads("reference")), strict=True
    ):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
