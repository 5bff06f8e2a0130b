"""The model's architecture as plain data (torch-free): what both the control plane (config,
memory plan) and the model side (models/, layers/) read.

``hf_config.normalize_hf_config`` fills it from a Hugging Face ``config.json``; nothing past
that boundary reads the checkpoint's config or ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: ``rope_type`` is default, linear, llama3 or yarn."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    partial_rotary_factor: float = 1.0


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything a decoder-only model file needs to build itself."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: the sliding window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    encoder_only: bool = False  # bidirectional attention, no KV cache (BERT-style encoders)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


# The Hugging Face ``architectures[0]`` names pagedllm runs; models/registry.py maps each to its
# class (tests/test_config_choices.py checks that the two agree). Here, so that the torch-free
# config can reject an unknown model without reaching into models/.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Architectures without an LM head (bare decoders, encoders): they serve the pooling runner only.
POOLING_ONLY_ARCHITECTURES = (
    "BertModel",
    "RobertaModel",
    "XLMRobertaModel",
    "LlamaModel",
    "MistralModel",
    "Qwen2Model",
    "Qwen3Model",
)
