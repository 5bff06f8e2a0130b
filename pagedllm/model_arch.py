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
    """Everything a model file needs to build itself: a decoder, or (``encoder_only``) a
    BERT-family encoder, which runs without a KV cache and attends both ways."""

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
    # BERT family: no KV cache, bidirectional attention, whole sequences per step (the engine
    # reads this to pick the no-KV, no-chunking path and a zero-byte KV pool).
    encoder_only: bool = False
    # Encoders: LayerNorm epsilon, token-type table rows (all inputs use type 0), and where
    # learned absolute positions start (RoBERTa: pad_token_id + 1; BERT: 0).
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0
    pad_token_id: int | None = None
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
CAUSAL_LM_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# What ``AutoModel`` saves for a decoder: the body without ``model.`` on its tensor names and
# no LM head (e.g. Qwen3-Embedding-style checkpoints).
BARE_DECODER_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel")
# No LM head: these can only pool hidden states (the pooling runner is their default).
POOLING_ONLY_ARCHITECTURES = BARE_DECODER_ARCHITECTURES + ENCODER_ARCHITECTURES
SUPPORTED_ARCHITECTURES = CAUSAL_LM_ARCHITECTURES + POOLING_ONLY_ARCHITECTURES


def is_pooling_only(architecture: str) -> bool:
    """Whether ``architecture`` has no LM head, so it can embed/pool but not generate."""
    return architecture in POOLING_ONLY_ARCHITECTURES
