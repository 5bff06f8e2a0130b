"""Rotary embeddings against transformers' own RoPE for every supported rope type."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.hf_config import normalize_hf_config
from pagedllm.layers.rotary import get_rope
from pagedllm.model_arch import RopeConfig

HEAD_DIM, HEADS, KV_HEADS, MAX_POS = 32, 4, 2, 512
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-betas": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 0.8,
    },
}


def hf_config(params: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * HEADS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_theta": 10000.0, **params},
        architectures=["LlamaForCausalLM"],
    )


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(name, dtype):
    config = hf_config(ROPES[name])
    ours = get_rope(HEAD_DIM, MAX_POS, normalize_hf_config(config.to_dict()).rope, dtype)
    positions = torch.tensor([0, 1, 2, 3, 17, 100, 255, 511])
    q = torch.randn(len(positions), HEADS * HEAD_DIM).to(dtype)
    k = torch.randn(len(positions), KV_HEADS * HEAD_DIM).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    # HF wants [batch, heads, seq, dim].
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, -1, HEADS, HEAD_DIM).transpose(1, 2), k.view(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin
    )
    out_q, out_k = ours(positions, q.clone(), k.clone())  # the CPU kernel rotates in place
    assert out_q.shape == q.shape and out_q.dtype == dtype
    torch.testing.assert_close(out_q, ref_q.transpose(1, 2).reshape(q.shape), rtol=0, atol=0)
    torch.testing.assert_close(out_k, ref_k.transpose(1, 2).reshape(k.shape), rtol=0, atol=0)


def test_scaling_changes_rotation():
    """Each scaled type really differs from the default (guards the parametrised test above)."""
    base = get_rope(HEAD_DIM, MAX_POS, RopeConfig(), torch.float32).cos_sin_cache
    for name in ("linear", "llama3", "yarn"):
        rope = normalize_hf_config(hf_config(ROPES[name]).to_dict()).rope
        assert not torch.allclose(get_rope(HEAD_DIM, MAX_POS, rope, torch.float32).cos_sin_cache, base)


def test_partial_rotary_rotates_only_the_leading_dims():
    full = get_rope(HEAD_DIM, MAX_POS, RopeConfig(partial_rotary_factor=0.5), torch.float32)
    half = get_rope(HEAD_DIM // 2, MAX_POS, RopeConfig(), torch.float32)
    positions = torch.arange(10)
    q, k = torch.randn(10, 2 * HEAD_DIM), torch.randn(10, HEAD_DIM)
    out_q, out_k = full(positions, q.clone(), k.clone())  # the CPU kernel rotates in place
    heads = q.view(10, 2, HEAD_DIM)
    ref_q, ref_k = half(positions, heads[..., : HEAD_DIM // 2].reshape(10, -1), k[:, : HEAD_DIM // 2])
    torch.testing.assert_close(out_q.view(10, 2, HEAD_DIM)[..., : HEAD_DIM // 2], ref_q.view(10, 2, -1))
    torch.testing.assert_close(out_q.view(10, 2, HEAD_DIM)[..., HEAD_DIM // 2 :], heads[..., HEAD_DIM // 2 :])
    torch.testing.assert_close(out_k[:, : HEAD_DIM // 2], ref_k)
    torch.testing.assert_close(out_k[:, HEAD_DIM // 2 :], k[:, HEAD_DIM // 2 :])


def test_bad_partial_rotary_factor_is_a_value_error():
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        get_rope(HEAD_DIM, MAX_POS, RopeConfig(partial_rotary_factor=0.3), torch.float32)
