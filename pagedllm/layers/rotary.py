"""Rotary position embeddings (RoPE), neox style (rotate-half), as Llama/Mistral/Qwen use.

The inverse frequencies follow transformers' ``modeling_rope_utils._compute_*_parameters``
operation for operation (float32), so cos/sin match Hugging Face bit for bit. They are
precomputed for every position up to ``max_position`` and looked up by position id, which is
what a flat varlen batch needs (each token carries its own position).
"""

from __future__ import annotations

import math

import torch

from pagedllm.layers.custom_op import CustomOp
from pagedllm.model_arch import RopeConfig


def _default_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    # Scaling positions by 1/factor is the same as scaling the frequencies.
    return _default_inv_freq(rope, dim) / rope.factor


def _llama3_inv_freq(rope: RopeConfig, dim: int, original_max: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    inv_freq = _default_inv_freq(rope, dim)
    low_freq_wavelen = original_max / rope.low_freq_factor
    high_freq_wavelen = original_max / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original_max / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_position: int) -> float:
    """The dimension whose wavelength makes ``num_rotations`` turns over ``max_position`` tokens."""
    return (dim * math.log(max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(rope: RopeConfig, dim: int, original_max: int) -> torch.Tensor:
    """YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between."""
    low = math.floor(_yarn_correction_dim(rope.beta_fast or 32, dim, rope.theta, original_max))
    high: float = math.ceil(_yarn_correction_dim(rope.beta_slow or 1, dim, rope.theta, original_max))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def compute_inv_freq(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], scale applied to cos/sin) for ``rope.rope_type``."""
    original_max = rope.original_max_position_embeddings or max_position
    if rope.rope_type == "default":
        return _default_inv_freq(rope, dim), 1.0
    if rope.rope_type == "linear":
        return _linear_inv_freq(rope, dim), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim, original_max), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim, original_max), _yarn_attention_factor(rope)
    raise ValueError(f"rope type {rope.rope_type!r} is not supported; supported: default, linear, llama3, yarn")


class RotaryEmbedding(CustomOp):
    """Rotates the first ``rotary_dim`` features of every q/k head by its token's position.

    ``forward(positions [T], q [T, H * head_dim], k [T, KVH * head_dim])`` -> rotated q, k (same
    shapes). It may rotate q and k in place (callers pass fresh views of the fused qkv output and
    use only the results): on CPU in float32 one C++ call replaces ~14 small torch ops per layer,
    whose dispatch costs more than their arithmetic at decode. Bitwise equal either way.
    """

    cos_sin_cache: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # [max_position, rotary_dim // 2]
        # HF scales cos/sin (YaRN's attention factor) in float32, then casts to the model dtype.
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        self.register_buffer("cos_sin_cache", torch.cat([cos, sin], dim=-1).to(dtype), persistent=False)

    def dispatch_key(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q  # positions are int64: q's dtype decides

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim // 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def forward_cpu(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cpu_ops.rotary_embedding_(positions, q, k, self.cos_sin_cache, self.head_dim)
        return q, k

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, self.head_dim)
        rot, passthrough = heads[..., : self.rotary_dim], heads[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): HF's x * cos + rotate_half(x) * sin.
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passthrough], dim=-1)
        return rotated.view_as(x)


def get_rope(head_dim: int, max_position: int, rope: RopeConfig, dtype: torch.dtype) -> RotaryEmbedding:
    """Build the rotary embedding for a model (one instance is shared by all its layers)."""
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"partial_rotary_factor={rope.partial_rotary_factor} gives rotary dim {rotary_dim} "
            f"for head_dim {head_dim}; it must be even and in (0, head_dim]"
        )
    inv_freq, attention_scaling = compute_inv_freq(rope, rotary_dim, max_position)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, attention_scaling, dtype)
