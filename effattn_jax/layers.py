"""Small building blocks shared by every model: Dense, RMSNorm, LayerNorm, RoPE, SwiGLU."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], std: float) -> nnx.Param:
    """A float32 parameter with logical axis names (see effattn_jax.sharding)."""
    value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value, logical_axes=tuple(axes))


class Dense(nnx.Module):
    """y = einsum(x, W) (+ b) with W of shape [*in_shape, *out_shape] and, with `bias`, b of
    shape out_shape (zeros at init); computes in `dtype`."""

    def __init__(self, in_shape, out_shape, axes, *, rngs, std=0.02, dtype=jnp.float32, bias=False):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.kernel = param(rngs, in_shape + out_shape, axes, std)
        self.bias = (
            nnx.Param(jnp.zeros(out_shape, jnp.float32), logical_axes=tuple(axes[len(in_shape) :]))
            if bias
            else None
        )
        self.n_in = len(in_shape)
        self.dtype = dtype

    def __call__(self, x):
        w = self.kernel[...].astype(self.dtype)
        n = self.n_in
        y = jax.lax.dot_general(
            x.astype(self.dtype), w, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
        )
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6, axis_name: str = "norm"):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axis_name,))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor, 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


@dataclass(frozen=True)
class Rope:
    """The rotary embedding's frequencies: base `theta`, and a rescaling for a context beyond the
    `original_max_positions` trained on. `scaling="llama3"`: Llama 3's (the low frequencies
    divided by `factor`, a smooth band between `low_freq_factor` and `high_freq_factor`);
    `"yarn"`: YaRN's (interpolation blended into extrapolation between the dimensions that turn
    `beta_fast` and `beta_slow` times over the original context; the rotated channels scaled by
    mscale(factor, `mscale`) / mscale(factor, `mscale_all_dim`))."""

    theta: float = 10000.0
    scaling: str = ""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def frequencies(self, d: int) -> jax.Array:
        """[d / 2] float32 angular frequencies of a head of width d."""
        freq = self.theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        if self.scaling == "yarn":
            return self._yarn(freq, d)
        if self.scaling != "llama3":
            return freq
        wavelen, trained = 2 * jnp.pi / freq, self.original_max_positions
        low, high = trained / self.low_freq_factor, trained / self.high_freq_factor  # wavelength bounds
        scaled = jnp.where(wavelen > low, freq / self.factor, freq)
        smooth = (trained / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        medium = (wavelen >= high) & (wavelen <= low)
        return jnp.where(medium, (1 - smooth) * scaled / self.factor + smooth * scaled, scaled)

    def _yarn(self, freq: jax.Array, d: int) -> jax.Array:
        def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times over the context
            turns = self.original_max_positions / (rotations * 2 * math.pi)
            return d * math.log(turns) / (2 * math.log(self.theta))

        low = max(math.floor(dim_of(self.beta_fast)), 0)
        high = min(math.ceil(dim_of(self.beta_slow)), d - 1)
        high = high + 0.001 if high == low else high
        ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        extrapolate = 1.0 - ramp
        return freq / self.factor * (1.0 - extrapolate) + freq * extrapolate

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies the rotated channels by (1 otherwise)."""
        if self.scaling != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What MLA (DeepSeek) multiplies its softmax scale by under YaRN: mscale(factor,
        mscale_all_dim)², for the channels RoPE does not touch too (1 otherwise)."""
        if self.scaling != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def apply_rope(x: jax.Array, positions: jax.Array, rope: Rope | float) -> jax.Array:
    """Rotary embedding (rotate-half form). x: [B, S, H, D], positions: [B, S]; `rope`: a Rope,
    or its base theta."""
    d = x.shape[-1]
    rope = rope if isinstance(rope, Rope) else Rope(theta=rope)
    freq = rope.frequencies(d)  # [D/2]
    ang = positions.astype(jnp.float32)[..., None] * freq  # [B, S, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, hidden: int, *, rngs, std: float, out_std: float, dtype):
        self.gate = Dense([d_model], [hidden], ("embed", "mlp"), rngs=rngs, std=std, dtype=dtype)
        self.up = Dense([d_model], [hidden], ("embed", "mlp"), rngs=rngs, std=std, dtype=dtype)
        self.down = Dense([hidden], [d_model], ("mlp", "embed"), rngs=rngs, std=out_std, dtype=dtype)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis (mean and variance), learnable scale and bias, float32 statistics."""

    def __init__(self, dim: int, *, eps: float = 1e-6, axis_name: str = "norm"):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=(axis_name,))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), logical_axes=(axis_name,))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


def rope_of(m) -> Rope:
    """The Rope of a model config (`cfg.model`)."""
    return Rope(
        theta=m.rope_theta,
        scaling=m.rope_scaling,
        factor=m.rope_scaling_factor,
        low_freq_factor=m.rope_low_freq_factor,
        high_freq_factor=m.rope_high_freq_factor,
        original_max_positions=m.rope_original_max_positions,
        beta_fast=m.rope_beta_fast,
        beta_slow=m.rope_beta_slow,
        mscale=m.rope_mscale,
        mscale_all_dim=m.rope_mscale_all_dim,
    )
