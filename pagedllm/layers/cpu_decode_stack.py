"""A Llama-family decoder stack's decode step as one C++ call (``csrc/cpu_decode_stack.cpp``).

At decode each layer's kernels take microseconds besides the GEMMs, but the Python that calls
them (module calls, views, dispatch) ran ~20 ms per step on SmolLM-135M's 30 layers at batch 1
on an AVX2 machine, a third of the step. The op runs the same kernels in the same order, so its
result is bitwise the modules'; it only replaces the Python between them.

It applies when everything the modules would do on the step is what the op does: CPU float32
with the kernels built, every linear in the packed fp32 layout (a bias only on qkv), no tensor
parallelism, the attention layers' own Llama q/k path (Qwen3's per-head q/k norm is not), and
an attention step whose every token is one query row on the paged decode kernel (decodes,
speculative verification). Anything else runs the modules. ``PAGEDLLM_CPU_DECODE_STACK=0`` always
runs the modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention.backends.torch_sdpa import TorchAttentionBackend, TorchAttentionMetadata
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization.unquantized import PACKED, UnquantizedLinearMethod


@dataclass
class DecodeStack:
    """The per-layer tensors the op takes, collected once from the modules."""

    op: Any
    input_norm: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    kv_cache: list[torch.Tensor]
    windows: list[int]
    final_norm: torch.Tensor
    cos_sin_cache: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """The stack's final hidden states for the embedded tokens ``hidden`` [T, H] (consumed)."""
        return self.op(
            hidden,
            positions,
            self.input_norm,
            self.qkv,
            self.qkv_bias,
            self.o,
            self.post_norm,
            self.gate_up,
            self.down,
            self.kv_cache,
            self.windows,
            self.final_norm,
            self.cos_sin_cache,
            metadata.slot_mapping,
            metadata.decode_table,
            metadata.decode_seq_lens,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.scale,
            self.eps,
        )


def applies(metadata: Any, hidden: torch.Tensor) -> bool:
    """Whether this step's batch can take the op: every token a row-wise query on the kernel."""
    return (
        isinstance(metadata, TorchAttentionMetadata)
        and metadata.all_rowwise
        and metadata.decode_table is not None
        and hidden.dim() == 2
        and hidden.is_contiguous()
    )


def build_decode_stack(model: Any, attention_cls: Any, mlp_cls: type[nn.Module]) -> DecodeStack | None:
    """The op's view of a ``LlamaModel`` (``layers``, ``norm``; its Llama attention and MLP
    classes, whose forward the op reproduces), or None when it does not apply to this model on
    this device (see the module doc)."""
    if not envs.enabled("PAGEDLLM_CPU_DECODE_STACK"):
        return None
    ops = cpu_ops()
    if ops is None or not hasattr(ops, "decode_stack_"):
        return None
    layers = list(model.layers)
    if not layers or not all(_layer_fits(layer, attention_cls, mlp_cls) for layer in layers):
        return None
    attn = layers[0].self_attn
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.norm]
    if len({n.eps for n in norms}) != 1 or any(not _cpu_fp32(n.weight) for n in norms):
        return None
    rope = attn.rotary_emb
    if not _cpu_fp32(rope.cos_sin_cache) or any(layer.self_attn.rotary_emb is not rope for layer in layers):
        return None
    shapes = {(la.self_attn.attn.num_heads, la.self_attn.attn.num_kv_heads, la.self_attn.head_dim) for la in layers}
    scales = {la.self_attn.attn.scale for la in layers}
    if len(shapes) != 1 or len(scales) != 1:
        return None
    (heads, kv_heads, head_dim), (scale,) = shapes.pop(), scales
    if rope.head_dim != head_dim:  # the op rotates and attends with one head size
        return None
    return DecodeStack(
        op=ops.decode_stack_.default,
        input_norm=[la.input_layernorm.weight for la in layers],
        qkv=[la.self_attn.qkv_proj.weight for la in layers],
        qkv_bias=[la.self_attn.qkv_proj.bias for la in layers],
        o=[la.self_attn.o_proj.weight for la in layers],
        post_norm=[la.post_attention_layernorm.weight for la in layers],
        gate_up=[la.mlp.gate_up_proj.weight for la in layers],
        down=[la.mlp.down_proj.weight for la in layers],
        kv_cache=[la.self_attn.attn.kv_cache for la in layers],
        windows=[la.self_attn.attn.sliding_window or 0 for la in layers],
        final_norm=model.norm.weight,
        cos_sin_cache=rope.cos_sin_cache,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scale=scale,
        eps=model.norm.eps,
    )


def _cpu_fp32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


def _packed(linear: Any, bias_allowed: bool) -> bool:
    method = getattr(linear, "quant_method", None)
    return bool(
        isinstance(method, UnquantizedLinearMethod)
        and method.layout is PACKED
        and linear.tp.size == 1
        and (bias_allowed or linear.bias is None)
        and (linear.bias is None or _cpu_fp32(cast(torch.Tensor, linear.bias)))
    )


def _layer_fits(layer: Any, attention_cls: Any, mlp_cls: type[nn.Module]) -> bool:
    """A Llama decoder layer whose every step the op reproduces."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    if not isinstance(attn, attention_cls) or type(mlp) is not mlp_cls:
        return False
    if type(attn).forward is not attention_cls.forward or type(attn).normalize_qk is not attention_cls.normalize_qk:
        return False  # a q/k path of its own (Qwen3's per-head norm)
    backend = attn.attn.backend
    return (
        isinstance(backend, TorchAttentionBackend)
        and backend.use_cpu_kernels
        and attn.attn.kv_cache is not None
        and _cpu_fp32(attn.attn.kv_cache)
        and type(mlp.act_fn) is SiluAndMul
        and _packed(attn.qkv_proj, bias_allowed=True)
        and all(_packed(lin, bias_allowed=False) for lin in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    )
