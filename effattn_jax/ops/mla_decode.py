"""MLA's absorbed decoding over the cached latent (docs/mla.md), and its one dispatch: XLA, or
the Pallas kernels that read each latent tile once for all heads
(pallas_kernels/mla_decode/: tpu.py; on GPU mgpu.py, Mosaic GPU, on Hopper, or gpu.py, Triton, as
pallas_kernels/gpu_dispatch.py chooses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from effattn_jax.ops.platform import resolve_impl


def gpu_choice(impl: str, q_lat, q_rope, lat, kr):
    """gpu_dispatch.choose for a single-token step (q_lat [B, H, d], q_rope [B, H, d_R] over the
    latent [B, L, d] and k^R [B, L, d_R]): the Mosaic GPU kernel (mgpu.supports, every operand in the
    latent's dtype), the Triton one (power-of-two widths), or XLA. impl: "auto", "pallas_gpu",
    "pallas_mosaic" or "pallas_triton"."""
    from pallas_kernels import gpu_dispatch
    from pallas_kernels.mla_decode import mgpu

    def mosaic():
        heads, d, dr, length = q_lat.shape[-2], lat.shape[-1], kr.shape[-1], lat.shape[1]
        reason = mgpu.supports(heads=heads, d=d, dr=dr, length=length, dtype=lat.dtype, q_dtype=q_lat.dtype)
        if reason is None and not q_rope.dtype == kr.dtype == lat.dtype:
            reason = (
                f"q_rope and k^R must be in the latent's dtype {lat.dtype}, got {q_rope.dtype}, {kr.dtype}"
            )
        return reason

    def triton():
        widths = (lat.shape[-1], kr.shape[-1])
        if all(w & (w - 1) == 0 for w in widths):
            return None
        return f"the Triton decode kernel needs power-of-two latent and RoPE widths, got {widths}"

    shape = dict(batch=q_lat.shape[0], heads=q_lat.shape[-2], length=lat.shape[1])
    return gpu_dispatch.choose("mla_decode", impl, {"mosaic": mosaic, "triton": triton}, shape=shape)


def absorbed_attention(q_lat, q_rope, lat, kr, positions, scale: float, impl: str = "xla"):
    """Causal attention in latent space: q_lat [B, T, H, d] (W_UK already folded in), q_rope
    [B, T, H, d_R] over the latent [B, L, d] and k^R [B, L, d_R] up to each query's position
    -> [B, T, H, d] float32 (W_UV applies after). impl (`mla.decode_impl`), as `moba.impl`
    resolves it: "auto" (the kernel on TPU and GPU, XLA elsewhere), "xla", "pallas" (this
    backend's kernel, the TPU one interpreted on CPU), "pallas_tpu" / "pallas_gpu" (on GPU what
    `gpu_choice` answers: a verified kernel that takes the step, else XLA) / "pallas_mosaic" /
    "pallas_triton" (that kernel, or one line on why not). A kernel runs a single-token step (more
    tokens: XLA)."""
    path, kernel, interpret = resolve_impl(impl)
    if path == "pallas" and q_lat.shape[1] == 1:
        if kernel != "tpu":
            kernel = gpu_choice(impl, q_lat[:, 0], q_rope[:, 0], lat, kr).kernel
        if kernel is not None:
            from pallas_kernels import registry

            decode = registry.kernel("mla", "decode", kernel)
            out = decode(q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, scale, interpret=interpret)
            return out[:, None]
    logits = jnp.einsum("bthd,bsd->bhts", q_lat, lat, preferred_element_type=jnp.float32)
    logits += jnp.einsum("bthr,bsr->bhts", q_rope, kr, preferred_element_type=jnp.float32)
    mask = jnp.arange(lat.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(mask, logits * scale, -jnp.inf), axis=-1)
    # the cache as the first operand: XLA CPU's product runs faster this way round (BENCHMARKS.md)
    return jnp.einsum("bsd,bhts->bthd", lat.astype(jnp.float32), probs)
