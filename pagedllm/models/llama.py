"""Llama, and Mistral (Llama with a sliding attention window, which the config carries).

A pre-norm decoder: x += Attention(RMSNorm(x)); x += SwiGLU-MLP(RMSNorm(x)); with grouped-query
attention and rotary position embeddings. Inputs are one flat variable-length batch of tokens
([T]); the paged KV cache sits behind ``Attention`` and per-step ``attn_metadata``.

Qwen2 and Qwen3 reuse these blocks: they swap in their own attention class through
``LlamaForCausalLM.attention_cls``. The module tree mirrors Hugging Face's, so checkpoint names
map onto ours one to one except for the fused projections in ``packed_modules_mapping``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from pagedllm.distributed.pipeline import get_pp_group
from pagedllm.layers import cpu_decode_stack as decode_stack
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.cpu_decode_stack import DecodeStack
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.stage import IntermediateTensors, PPMissingLayer, make_layers
from pagedllm.models.weight_utils import load_packed_weights


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inner, inner], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inner, hidden, bias=config.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE; q, k, v come from one fused projection.

    The biases default to ``config.attention_bias`` (Llama puts it on all four projections).
    """

    def __init__(
        self,
        config: ModelArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
    ) -> None:
        super().__init__()
        head_dim = self.head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias if qkv_bias is None else qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=bias if o_bias is None else o_bias)
        self.rotary_emb = rotary_emb
        # This rank's share of the heads (all of them without tensor parallelism).
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.attn = Attention(
            heads,
            head_dim,
            kv_heads,
            scale=head_dim**-0.5,
            sliding_window=_sliding_window(config, layer_idx),
            layer_idx=layer_idx,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, *self.normalize_qk(q, k))
        return self.o_proj(self.attn(q, k, v, attn_metadata))

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook between projection and RoPE: identity for Llama (Qwen3 normalises each head)."""
        return q, k


def _sliding_window(config: ModelArchConfig, layer_idx: int) -> int | None:
    return config.sliding_windows[layer_idx] if config.sliding_windows else None


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding, attention_cls: type[LlamaAttention]
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, attn_metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before it): the next norm adds them,
        which saves a separate elementwise pass per sub-layer."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelArchConfig, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        pp = get_pp_group()  # a pipeline stage builds only what it runs (models/stage.py)
        self.is_last_stage = pp.is_last
        # The last stage keeps a tied table too: its LM head shares it.
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            if pp.is_first or (pp.is_last and config.tie_word_embeddings)
            else PPMissingLayer()
        )
        # One cos/sin table shared by every layer (in the dtype the model is being built in).
        self.rotary_emb = get_rope(
            config.head_dim, config.max_position_embeddings, config.rope, torch.get_default_dtype()
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: LlamaDecoderLayer(config, i, self.rotary_emb, attention_cls)
        )
        self.whole = pp.size == 1
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()
        # The whole stack as one C++ call at CPU decode steps (layers/cpu_decode_stack.py), built
        # on the first step after the KV caches are bound, rebuilt if they are bound again.
        self._decode_stack: DecodeStack | None = None
        self._decode_stack_cache: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Final hidden states; a pipeline stage before the last returns its IntermediateTensors,
        one after the first starts from the previous stage's instead of ``input_ids``."""
        if intermediate_tensors is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate_tensors.hidden_states, intermediate_tensors.residual
        if (
            self.whole
            and decode_stack.applies(attn_metadata, hidden_states)
            and (stack := self.decode_stack()) is not None
            and stack.takes(hidden_states)
        ):
            return stack(hidden_states, positions, attn_metadata)
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        if not self.is_last_stage:
            assert residual is not None, "every stage runs at least one layer"
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def decode_stack(self) -> DecodeStack | None:
        """The one-call decode op for the bound KV caches, or None where it does not apply."""
        cache = cast(LlamaDecoderLayer, self.layers[0]).self_attn.attn.kv_cache
        if cache is not self._decode_stack_cache:
            self._decode_stack = decode_stack.build_decode_stack(self, LlamaAttention, LlamaMLP)
            self._decode_stack_cache = cache
        return self._decode_stack


class LlamaForCausalLM(nn.Module):
    """The model runner's entry point: ``forward`` -> hidden states, ``compute_logits`` -> logits."""

    # Our fused module -> the checkpoint modules packed into it, in shard order.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    attention_cls: type[LlamaAttention] = LlamaAttention
    has_lm_head: bool = True

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported by {type(self).__name__}; "
                "only 'silu' (SwiGLU) is implemented"
            )
        self.config = config
        self.model = LlamaModel(config, self.attention_cls)
        if self.has_lm_head:  # a pipeline stage before the last has none
            self.lm_head = self._lm_head(config) if self.model.is_last_stage else PPMissingLayer()

    def _lm_head(self, config: ModelArchConfig) -> ParallelLMHead:
        head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            head.tie_weights(cast(VocabParallelEmbedding, self.model.embed_tokens))
        return head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden_size] after the final norm
        (a pipeline stage: see ``LlamaModel.forward``)."""
        return self.model(input_ids, positions, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32; pass only the rows that need sampling."""
        return self.lm_head(hidden_states).float()

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Our name for a checkpoint tensor: a body saved by ``AutoModel`` (no ``model.`` prefix)
        gets one, so both layouts load."""
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns our parameter names that were fully loaded."""
        return load_packed_weights(self, weights)


class LlamaEmbeddingModel(LlamaForCausalLM):
    """HF ``LlamaModel`` / ``MistralModel``, what ``AutoModel`` saves: the decoder body without an
    LM head, whose final hidden states are pooled (embedding models such as Qwen3-Embedding)."""

    has_lm_head = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(
            f"{self.config.architecture} has no LM head, so it cannot generate text; "
            "serve it for embeddings (pooling) or use a *ForCausalLM checkpoint"
        )

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        # An LM head in the checkpoint is not needed to pool hidden states.
        return None if name.startswith("lm_head.") else LlamaForCausalLM.checkpoint_name(name)
