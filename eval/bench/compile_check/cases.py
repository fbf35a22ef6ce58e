"""What the compile check compiles: each GPU kernel family in each Pallas GPU backend, at the tiles
`auto` picks for the paper configs' head dims and dtypes ("auto" rows) and at the edges of what the
kernels' checks accept ("edge" rows), plus the train steps of configs/gpu/.

A case is data (a name and keyword arguments), so a child process can rebuild it: `build(case)`
returns the function and its argument shapes, and `accepted(case)` what the project's own checks
(`supports()`, `BlockSizes.check_backend`, the dispatch) say of it before anything compiles."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[3]
GPU_CONFIGS = sorted((ROOT / "configs/gpu").glob("[!b]*.yaml"))  # base.yaml is not a model
TRAIN_LAYERS = 2  # a train step's layers (dense ones in XLA): every kernel of the step, compiled fast


@dataclasses.dataclass(frozen=True)
class Case:
    # moba_attention | moba_routing | moba_decode | mla_decode | dsa_attention | dsa_decode | dsa_select
    # | train_step
    family: str
    backend: str  # mosaic | triton | auto (a train step: what `auto` picks)
    kind: str  # auto | edge | planted
    shape: tuple = ()  # the family's sizes, as key/value pairs
    targets: tuple = ("h100",)  # h100 (sm_90a) and/or a100 (sm_80)

    @property
    def sizes(self) -> dict:
        return dict(self.shape)

    @property
    def name(self) -> str:
        return f"{self.family}/{self.backend}/" + ",".join(f"{k}={v}" for k, v in self.shape)


def _case(family, backend, kind, **shape) -> Case:
    # the A100 too for the Triton kernels at the tiles `auto` picks (the edges are chosen for an H100)
    targets = ("h100", "a100") if backend == "triton" and kind == "auto" else ("h100",)
    return Case(family, backend, kind, tuple(shape.items()), targets)


def cases() -> list[Case]:
    """Every case of the check, in order."""
    out = []
    for backend in ("triton", "mosaic"):
        # MoBA attention: the MoBA paper configs (head dim 128, bf16, blocks 512 and 4096) at auto tiles
        for block in (512, 4096):
            out.append(_case("moba_attention", backend, "auto", d=128, dv=128, dtype="bfloat16", block=block))
        out.append(_case("moba_attention", backend, "edge", d=64, dv=64, dtype="bfloat16", block=512))
        out.append(_case("moba_attention", backend, "edge", d=256, dv=256, dtype="bfloat16", block=512))
        out.append(_case("moba_routing", backend, "auto", d=128, dtype="bfloat16", block=512))
        out.append(_case("moba_decode", backend, "auto", d=128, dtype="bfloat16", block=512, length=8192))
        # MLA decode: the EG-MLA paper configs (float32, latent 16-256, RoPE 64, 12 heads) and
        # DeepSeek's latent 512 + 64 in bf16 at 16 and 128 heads (the GPU suite's)
        for latent in (16, 64, 256):
            out.append(
                _case("mla_decode", backend, "auto", heads=12, latent=latent, rope=64, dtype="float32")
            )
        for heads in (16, 128):
            out.append(
                _case("mla_decode", backend, "edge", heads=heads, latent=512, rope=64, dtype="bfloat16")
            )
    # the Triton kernels' largest tiles at head dim 128 that the shared-memory check accepts
    out.append(_case("moba_attention", "triton", "edge", d=128, dv=128, dtype="bfloat16", block=512,
                     tiles=(128, 64, 64)))  # fmt: skip
    # the Mosaic GPU kernels' other tile sets their checks accept or refuse
    for tiles, stages, d, dv in [((128, 64, 128), 3, 64, 128), ((64, 128, 64), 2, 64, 64),
                                 ((128, 64, 128), 2, 128, 64), ((64, 128, 128), 2, 128, 128)]:  # fmt: skip
        out.append(_case("moba_attention", "mosaic", "edge", d=d, dv=dv, dtype="bfloat16", block=512,
                         tiles=tiles, stages=stages))  # fmt: skip
    # DSA's sparse attention (Triton only): V3.2's per-head q/k width 128 + 64 and v 128, MLA's KV
    # head per query head, top-2,048; and GQA at head dim 128, 8 query heads a KV head
    out.append(
        _case("dsa_attention", "triton", "auto", d=192, dv=128, heads=16, kv_heads=16, dtype="bfloat16")
    )
    out.append(
        _case("dsa_attention", "triton", "edge", d=128, dv=128, heads=16, kv_heads=2, dtype="bfloat16")
    )
    # dsa.absorb's form: one latent KV head of 512 + 64 (values 512) for the paper config's 16 heads
    out.append(
        _case("dsa_attention", "triton", "edge", d=576, dv=512, heads=16, kv_heads=1, dtype="bfloat16")
    )
    # DSA's decode over the selected latent rows: V3.2's latent 512 + 64 at 128 and 16 heads, top-2,048
    for heads in (128, 16):
        out.append(_case("dsa_decode", "triton", "auto" if heads == 128 else "edge", heads=heads, latent=512,
                         rope=64, dtype="bfloat16"))  # fmt: skip
    # DSA's fused selection: V3.2's indexer (64 heads of 128, bf16, top-2,048)
    out.append(_case("dsa_select", "triton", "auto", heads=64, d=128, dtype="bfloat16"))
    for config in GPU_CONFIGS:
        out.append(_case("train_step", "auto", "auto", config=config.stem))
    return out


def planted() -> list[Case]:
    """Configurations the check must fail: shared memory over the device's (the Triton MLA decode
    kernel with 64 heads a program on 256-slot tiles) and a spill (the Triton dK/dV kernels at head
    dim 128 with 4 warps, half what they take)."""
    return [
        _case("mla_decode", "triton", "planted", heads=64, latent=512, rope=64, dtype="bfloat16", tile=256,
              group=64),
        _case("moba_attention", "triton", "planted", d=128, dv=128, dtype="bfloat16", block=512,
              tiles=(64, 64, 64), warps=2),
    ]  # fmt: skip


def _block_sizes(s: dict):
    from effattn_jax.ops.moba import BlockSizes

    tiles = s.get("tiles", (None, None, None))
    return BlockSizes(*tiles, num_stages=s.get("stages"), num_warps=s.get("warps"))


def accepted(case: Case) -> str | None:
    """None where the project's checks let this configuration through to a compiler, else why not."""
    s = case.sizes
    try:
        if case.family == "moba_attention":
            from effattn_jax.ops.moba import gpu_kernels

            q = jax.ShapeDtypeStruct((1, 2 * s["block"], 2, s["d"]), jnp.dtype(s["dtype"]))
            v = jax.ShapeDtypeStruct((1, 2 * s["block"], 2, s["dv"]), jnp.dtype(s["dtype"]))
            if case.backend == "triton":
                from effattn_jax.ops.moba import gpu_tiles_fit

                gpu_tiles_fit(_block_sizes(s), block_size=s["block"], head_dim=s["d"], v_head_dim=s["dv"],
                              itemsize=q.dtype.itemsize)  # fmt: skip
            gpu_kernels(f"pallas_{case.backend}", _block_sizes(s), q, v, block_size=s["block"])
        elif case.family == "moba_routing" and case.backend == "mosaic":
            from pallas_kernels.moba.routing_mgpu import supports

            return supports(
                jax.ShapeDtypeStruct((1, 4 * s["block"], 4, s["d"]), s["dtype"]), s["dtype"], 4 * s["block"]
            )
        elif case.family == "moba_decode" and case.backend == "mosaic":
            from pallas_kernels.moba.mgpu_decode import supports

            return supports(
                head_dim=s["d"], v_head_dim=s["d"], size=s["block"], length=s["length"], dtype=s["dtype"]
            )
        elif case.family == "mla_decode" and case.backend == "mosaic":
            from pallas_kernels.mla_decode.mgpu import supports

            return supports(heads=s["heads"], d=s["latent"], dr=s["rope"], length=4096, dtype=s["dtype"])
    except ValueError as e:
        return str(e)
    return None


def build(case: Case, mesh=None):
    """(function, argument ShapeDtypeStructs) of a case, each argument replicated on `mesh` (None:
    no sharding: a lowering without devices)."""
    s = case.sizes
    sharding = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    if case.family == "moba_attention":
        from effattn_jax.ops.moba import moba_attention

        seq = 2 * s["block"]
        impl, sizes = f"pallas_{case.backend}", _block_sizes(s)

        def loss(q, k, v):
            out = moba_attention(q, k, v, block_size=s["block"], top_k=3, impl=impl, block_sizes=sizes)
            return out.astype(jnp.float32).sum()

        fn = jax.grad(loss, argnums=(0, 1, 2))
        qk = sd((1, seq, 2, s["d"]), s["dtype"])
        return fn, (qk, qk, sd((1, seq, 2, s["dv"]), s["dtype"]))
    if case.family == "moba_routing":
        from effattn_jax.ops.routing import moba_routing

        seq = 4 * s["block"]
        fn = lambda q, k: (
            moba_routing(q, k, block_size=s["block"], top_k=3, kernel=f"gpu_{case.backend}").past_start
        )
        return fn, (sd((1, seq, 4, s["d"]), s["dtype"]), sd((1, seq, 2, s["d"]), s["dtype"]))
    if case.family == "moba_decode":
        from pallas_kernels.moba.gpu_decode import moba_decode_gpu
        from pallas_kernels.moba.mgpu_decode import moba_decode_mgpu

        kernel = moba_decode_mgpu if case.backend == "mosaic" else moba_decode_gpu
        fn = lambda q, k, v, *tables: kernel(q, k, v, *tables, s["block"], s["d"] ** -0.5)
        cache = sd((2, 2, s["length"], s["d"]), s["dtype"])
        return fn, (sd((2, 8, s["d"]), s["dtype"]), cache, cache, *[sd((2, 8, 3), "int32")] * 3)
    if case.family == "mla_decode":
        from pallas_kernels.mla_decode.gpu import mla_decode_gpu
        from pallas_kernels.mla_decode.mgpu import mla_decode_mgpu

        if case.backend == "mosaic":
            fn = lambda *x: mla_decode_mgpu(*x, 0.1)
        else:
            fn = lambda *x: mla_decode_gpu(*x, 0.1, tile=s.get("tile"), group=s.get("group"))
        b, h, length, dt = 2, s["heads"], 4096, s["dtype"]
        args = (sd((b, h, s["latent"]), dt), sd((b, h, s["rope"]), dt), sd((b, length, s["latent"]), dt),
                sd((b, length, s["rope"]), dt), sd((b,), "int32"))  # fmt: skip
        return fn, args
    if case.family == "dsa_attention":
        from pallas_kernels.dsa.triton import sparse_attention_gpu

        seq, picks = 4096, 2048

        def loss(q, k, v, indices):
            return sparse_attention_gpu(q, k, v, indices).astype(jnp.float32).sum()

        fn = jax.grad(loss, argnums=(0, 1, 2))
        heads = lambda n, width: sd((1, seq, n, width), s["dtype"])
        q, k, v = heads(s["heads"], s["d"]), heads(s["kv_heads"], s["d"]), heads(s["kv_heads"], s["dv"])
        return fn, (q, k, v, sd((1, seq, picks), "int32"))
    if case.family == "dsa_decode":
        from pallas_kernels.dsa.triton_decode import sparse_latent_decode_gpu

        b, h, length, dt = 2, s["heads"], 8192, s["dtype"]
        fn = lambda *x: sparse_latent_decode_gpu(*x, scale=0.1)
        query, cache = (lambda w: sd((b, 1, h, w), dt)), (lambda w: sd((b, length, w), dt))
        widths = (s["latent"], s["rope"])
        return fn, (*map(query, widths), *map(cache, widths), sd((b, 1, 2048), "int32"))
    if case.family == "dsa_select":
        from pallas_kernels.dsa.triton_select import index_topk_gpu

        b, seq = 1, 4096
        fn = lambda q, k, w, seg: index_topk_gpu(q, k, w, top_k=2048, segment_ids=seg)
        return fn, (sd((b, seq, s["heads"], s["d"]), s["dtype"]), sd((b, seq, s["d"]), s["dtype"]),
                    sd((b, seq, s["heads"]), "float32"), sd((b, seq), "int32"))  # fmt: skip
    raise ValueError(f"no function for {case.family}")


def train_step(case: Case, devices):
    """(lowered train step) of a configs/gpu/ model, reduced to TRAIN_LAYERS layers, on `devices`."""
    from effattn_jax.config import load_config
    from effattn_jax.sharding import config_mesh
    from effattn_jax.train.state import make_setup
    from effattn_jax.train.step import make_train_step

    # XLA's attention, not cuDNN's, in the dense layers: cuDNN's needs the cuDNN library to compile
    layers = [f"model.num_layers={TRAIN_LAYERS}", "attention.dense_impl=xla"]
    cfg = load_config(ROOT / f"configs/gpu/{case.sizes['config']}.yaml", layers)
    setup = make_setup(cfg, config_mesh(cfg.mesh, devices))
    return make_train_step(setup).lower(setup.abstract_state, setup.abstract_batch())
