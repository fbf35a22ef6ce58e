"""MLA's absorbed decoding over the cached latent (docs/mla.md), and its one dispatch: XLA, or
the Pallas kernels that read each latent tile once for all heads
(pallas_kernels/mla_decode/: tpu.py; on GPU mgpu.py, Mosaic GPU, on Hopper, or gpu.py, Triton,
where Mosaic does not run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.platform import resolve_impl

# Where XLA's step beats the GPU kernel, from the GPU suite's latent_decode section (BENCHMARKS.md):
# each entry (heads, most rows, most cache slots) sends an "auto" step with that many heads, at most
# that batch and that cache length, to XLA. Empty until the split kernel is measured: "auto" runs
# the kernel at every GPU shape (an explicit "pallas_gpu" always does).
GPU_XLA_FASTER: tuple[tuple[int, int, int], ...] = ()


def xla_faster_on_gpu(heads: int, batch: int, length: int, table=None) -> bool:
    """Whether GPU_XLA_FASTER (or `table`) sends this single-token step to XLA."""
    table = GPU_XLA_FASTER if table is None else table
    return any(heads == h and batch <= b and length <= n for h, b, n in table)


def gpu_kernel_for(kernel: str, interpret, q_lat, q_rope, lat, kr) -> str:
    """ "mosaic" or "triton": which GPU kernel runs a step (kernel: resolve_impl's "gpu", "mosaic" or
    "triton"): the Mosaic kernel where `gpu_backend.asks_mosaic` and the kernel supports the shapes
    and dtypes, else Triton; "mosaic" gets a ValueError where it cannot run."""
    from pallas_kernels import gpu_backend

    if not gpu_backend.asks_mosaic(kernel, interpret):
        return "triton"
    from pallas_kernels.mla_decode import mgpu

    reason = mgpu.supports(
        heads=q_lat.shape[-2],
        d=lat.shape[-1],
        dr=kr.shape[-1],
        length=lat.shape[1],
        dtype=lat.dtype,
        q_dtype=q_lat.dtype,
    )
    if reason is None and not q_rope.dtype == kr.dtype == lat.dtype:
        reason = f"q_rope and k^R must be in the latent's dtype {lat.dtype}, got {q_rope.dtype}, {kr.dtype}"
    if reason is None:
        return "mosaic"
    if kernel == "mosaic":
        raise ValueError(f"mla.decode_impl=pallas_mosaic cannot run here: {reason}; use pallas_triton")
    return "triton"


def absorbed_attention(q_lat, q_rope, lat, kr, positions, scale: float, impl: str = "xla"):
    """Causal attention in latent space: q_lat [B, T, H, d] (W_UK already folded in), q_rope
    [B, T, H, d_R] over the latent [B, L, d] and k^R [B, L, d_R] up to each query's position
    -> [B, T, H, d] float32 (W_UV applies after). impl (`mla.decode_impl`), as `moba.impl`
    resolves it: "auto" (the kernel on TPU and GPU, XLA elsewhere), "xla", "pallas" (this
    backend's kernel, the TPU one interpreted on CPU), "pallas_tpu" / "pallas_gpu" (on GPU the
    Mosaic or the Triton kernel: gpu_kernel_for) / "pallas_mosaic" / "pallas_triton". A kernel
    runs a single-token step (more tokens: XLA); the Triton one needs power-of-two widths (else
    XLA), and under "auto" the GPU kernels give way to XLA where GPU_XLA_FASTER says XLA is faster."""
    path, kernel, interpret = resolve_impl(impl)
    b, _, h, _ = q_lat.shape
    if impl == "auto" and kernel == "gpu" and xla_faster_on_gpu(h, b, lat.shape[1]):
        path = "xla"
    if path == "pallas" and q_lat.shape[1] == 1:
        if kernel != "tpu":
            kernel = gpu_kernel_for(kernel, interpret, q_lat[:, 0], q_rope[:, 0], lat, kr)
        if kernel == "tpu":
            from pallas_kernels.mla_decode.tpu import mla_decode_tpu as decode
        elif kernel == "mosaic":
            from pallas_kernels.mla_decode.mgpu import mla_decode_mgpu as decode
        elif all(w & (w - 1) == 0 for w in (lat.shape[-1], kr.shape[-1])):
            from pallas_kernels.mla_decode.gpu import mla_decode_gpu as decode
        else:
            decode = None  # the Triton kernel's widths are powers of two: XLA below
        if decode is not None:
            out = decode(q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, scale, interpret=interpret)
            return out[:, None]
    logits = jnp.einsum("bthd,bsd->bhts", q_lat, lat, preferred_element_type=jnp.float32)
    logits += jnp.einsum("bthr,bsr->bhts", q_rope, kr, preferred_element_type=jnp.float32)
    mask = jnp.arange(lat.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(mask, logits * scale, -jnp.inf), axis=-1)
    # the cache as the first operand: XLA CPU's product runs faster this way round (BENCHMARKS.md)
    return jnp.einsum("bsd,bhts->bthd", lat.astype(jnp.float32), probs)
