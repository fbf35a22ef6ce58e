"""MLA's absorbed decoding over the cached latent (docs/mla.md), and its one dispatch: XLA, or
the Pallas TPU kernel that reads each latent tile once for all heads
(pallas_kernels/mla_decode/tpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def absorbed_attention(q_lat, q_rope, lat, kr, positions, scale: float, impl: str = "xla"):
    """Causal attention in latent space: q_lat [B, T, H, d] (W_UK already folded in), q_rope
    [B, T, H, d_R] over the latent [B, L, d] and k^R [B, L, d_R] up to each query's position
    -> [B, T, H, d] float32 (W_UV applies after). impl: "xla", "pallas" (the TPU kernel for a
    single-token step, interpreted off TPU; XLA for more tokens) or "auto" (the kernel on TPU)."""
    on_tpu = jax.default_backend() == "tpu"
    if (impl == "pallas" or (impl == "auto" and on_tpu)) and q_lat.shape[1] == 1:
        from pallas_kernels.mla_decode.tpu import mla_decode_tpu

        out = mla_decode_tpu(
            q_lat[:, 0], q_rope[:, 0], lat, kr, positions[:, 0] + 1, scale, interpret=not on_tpu
        )
        return out[:, None]
    logits = jnp.einsum("bthd,bsd->bhts", q_lat, lat, preferred_element_type=jnp.float32)
    logits += jnp.einsum("bthr,bsr->bhts", q_rope, kr, preferred_element_type=jnp.float32)
    mask = jnp.arange(lat.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(mask, logits * scale, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bsd->bthd", probs, lat.astype(jnp.float32))
