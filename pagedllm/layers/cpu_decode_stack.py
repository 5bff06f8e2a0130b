"""A Llama-family decoder stack's decode step as one C++ call (``csrc/cpu_decode_stack.cpp``).

At decode each layer's kernels take microseconds besides the GEMMs, but the Python that calls
them (module calls, views, dispatch) ran ~20 ms per step on SmolLM-135M's 30 layers at batch 1
on an AVX2 machine, a third of the step. The op runs the same kernels in the same order, so its
result is bitwise the modules'; it only replaces the Python between them.

It applies when everything the modules would do on the step is what the op does: CPU float32
with the kernels built; every linear of the layers in a method the op runs, packed fp32,
``int8``, ``w8a8``, the int4 kernel (``int4``, AWQ, GPTQ, GGUF's 4-bit; act-order GPTQ with its input permutation),
``w4a8``, int8 groups (GGUF's other block types) or int4 codes in a table (bitsandbytes NF4 /
FP4), each linear its own (a bias only
on qkv); one rank, or tensor-parallel ranks joined by the shared-memory
all-reduce (``distributed/shm_allreduce.py``: the op sums o_proj's and down_proj's outputs over the
ranks with its C++ protocol, where the modules' RowParallelLinear calls the same op, and a step
whose hidden states exceed a slot runs the modules); the attention layers' own Llama q/k path
(Qwen3's per-head q/k norm is not); and an attention step whose every token is one query row on
the paged decode kernel (decodes, speculative verification). Anything else runs the modules.
The KV cache may be float32, bfloat16 or float16 (``--kv-cache-dtype``).
``PAGEDLLM_CPU_DECODE_STACK=0`` always runs the modules. With LoRA slots on the linears (CPU
float32, the LoRA kernel built) the op adds the step's adapter deltas after each linear, with the
same kernel (``lora_add_``) the modules call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from pagedllm import envs
from pagedllm.distributed.shm_allreduce import ShmAllReduce
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention.backends.torch_sdpa import TorchAttentionBackend, TorchAttentionMetadata
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.quantization.int4 import Int4KernelMethod
from pagedllm.layers.quantization.int8 import Int8LinearMethod
from pagedllm.layers.quantization.int8_groups import GroupedInt8Method
from pagedllm.layers.quantization.unquantized import PACKED, UnquantizedLinearMethod
from pagedllm.layers.quantization.w8a8 import W8A8LinearMethod
from pagedllm.lora.context import current_lora_step

logger = logging.getLogger(__name__)


@dataclass
class DecodeStack:
    """The per-layer tensors the op takes, collected once from the modules."""

    op: Any
    input_norm: list[torch.Tensor]
    post_norm: list[torch.Tensor]
    linears: list[torch.Tensor]  # 4 per layer: qkv, o, gate_up, down
    scales: list[torch.Tensor | None]  # each linear's weight_scale (int8, w8a8, int4)
    comps: list[torch.Tensor | None]  # each linear's weight_comp (w8a8), weight_zero (int4) or weight_table
    perms: list[torch.Tensor | None]  # each int4 linear's weight_perm (GPTQ act-order: x[..., perm] is multiplied)
    qkv_bias: list[torch.Tensor | None]
    # Per linear: 0 packed fp32, 1 int8, 2 w8a8, 3 int4, 4 w4a8, 5 int8 groups, 6 / 7 int4 / w4a8 with
    # offsets, 8 int4 codes in a table (csrc/cpu_decode_stack.cpp's Method); a GGUF file's layers may
    # mix them (4-bit linears beside int8-group ones).
    methods: list[int]
    kv_cache: list[torch.Tensor]
    windows: list[int]
    final_norm: torch.Tensor
    cos_sin_cache: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float
    # LoRA (empty without): per linear its slots' stacked A, per projection its B (lora/layers.py)
    lora_a: list[torch.Tensor] = field(default_factory=list)
    lora_b: list[torch.Tensor] = field(default_factory=list)
    max_loras: int = 0
    max_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    shm: ShmAllReduce | None = None  # with tp_size > 1: the group's shared-memory all-reduce

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether the op can run this step: under TP, the step's hidden states fit a slot (its all-reduces)."""
        return self.shm is None or self.shm.fits(hidden)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: TorchAttentionMetadata) -> torch.Tensor:
        """The stack's final hidden states for the embedded tokens ``hidden`` [T, H] (consumed);
        with LoRA adapter rows in the step, each linear adds their deltas."""
        lora = current_lora_step()
        return self.op(
            hidden,
            positions,
            self.input_norm,
            self.post_norm,
            self.linears,
            self.scales,
            self.comps,
            self.perms,
            self.qkv_bias,
            self.methods,
            0,  # w8a8 path: the best this build compiled, as W8A8LinearMethod.apply uses
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
            self.lora_a,
            self.lora_b,
            None if lora is None else lora.token_slots,
            self.max_loras,
            self.max_rank,
            *self._tp_args(),
        )

    def _tp_args(self) -> tuple[Any, ...]:
        if self.shm is None:
            return None, None, 0, 1, 0, 0.0
        return self.shm.segment, self.shm.state, self.tp_rank, self.tp_size, self.shm.slot_bytes, self.shm.timeout_s


# The phases ``decode_stack_phases`` times, in its tensor's order (csrc/cpu_decode_stack.cpp's Phase).
STACK_PHASES = (
    "norms",
    "qkv_proj",
    "rope",
    "kv_write",
    "attention",
    "o_proj",
    "gate_up_proj",
    "silu_and_mul",
    "down_proj",
    "all_reduce",
)


def stack_phase_seconds(on: bool, level: str | None = None) -> tuple[dict[str, float], int]:
    """The seconds each phase of the decode stack's steps took since the last call (in this
    process, the ``level`` build's op), and how many steps that was; clears them, and times the
    steps that follow when ``on`` (a clock read per phase; off by default)."""
    ops = cpu_ops(level)
    if ops is None:
        raise RuntimeError("the CPU kernels are not built (or PAGEDLLM_CPU_KERNELS=0): no decode stack to time")
    times = ops.decode_stack_phases(on).tolist()
    return dict(zip(STACK_PHASES, times[:-1], strict=True)), int(times[-1])


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
    linears = [lin for la in layers for lin in _linears(la)]
    methods = [cast(int, _method(lin)) for lin in linears]  # no None: every layer fit
    lora, tp = _lora_tensors(linears), _tp(linears)
    if lora is None or tp is None:
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
    where = f"tensor-parallel rank {tp['tp_rank']} of {tp['tp_size']}, shared-memory all-reduce" if tp else "one rank"
    logger.info("CPU decode stack: %d layers as one C++ call per decode step (%s)", len(layers), where)
    return DecodeStack(
        op=ops.decode_stack_.default,
        input_norm=[la.input_layernorm.weight for la in layers],
        post_norm=[la.post_attention_layernorm.weight for la in layers],
        linears=[lin.weight for lin in linears],
        scales=[getattr(lin, "weight_scale", None) if method else None for lin, method in zip(linears, methods)],
        comps=[_comp(lin, method) for lin, method in zip(linears, methods)],
        perms=[_perm(lin) for lin in linears],
        qkv_bias=[la.self_attn.qkv_proj.bias for la in layers],
        methods=methods,
        kv_cache=[la.self_attn.attn.kv_cache for la in layers],
        windows=[la.self_attn.attn.sliding_window or 0 for la in layers],
        final_norm=model.norm.weight,
        cos_sin_cache=rope.cos_sin_cache,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scale=scale,
        eps=model.norm.eps,
        **lora,
        **tp,
    )


def _tp(linears: list[Any]) -> dict[str, Any] | None:
    """The linears' tensor-parallel group as the op takes it ({} at one rank), or None when the op
    cannot join it: the ranks sum through gloo (no shared memory between them: other hosts, not
    x86, the kernels off) or the linears do not share one group."""
    tp = linears[0].tp
    if any(lin.tp != tp for lin in linears):
        return None
    if tp.size == 1:
        return {}
    if tp.shm is None or tp.shm.ops is None:
        return None
    return {"tp_rank": tp.rank, "tp_size": tp.size, "shm": tp.shm}


def _lora_tensors(linears: list[Any]) -> dict[str, Any] | None:
    """The linears' LoRA slots as the op takes them ({} without LoRA), or None when some linear
    has slots the op cannot run (no C++ LoRA kernel: not CPU float32)."""
    maybe_slots = [getattr(lin, "lora", None) for lin in linears]
    if all(s is None for s in maybe_slots):
        return {}
    slots = [s for s in maybe_slots if s is not None and s.kernel is not None]
    if len(slots) != len(maybe_slots):
        return None
    return {
        "lora_a": [s.a for s in slots],
        "lora_b": [b for s in slots for b in s.b],
        "max_loras": slots[0].max_loras,
        "max_rank": slots[0].max_rank,
    }


# The caches the op's K/V write and attention take under float32 activations (--kv-cache-dtype).
_KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpu_fp32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32


_PACKED, _INT8, _W8A8, _INT4, _W4A8, _INT8_GROUPS, _INT4_OFFSET, _W4A8_OFFSET, _INT4_TABLE = range(9)


def _comp(linear: Any, method: int) -> torch.Tensor | None:
    """The op's second per-linear tensor: w8a8's compensation, the zero points (or, methods 6 / 7,
    the offsets) of int4, w4a8 and int8 groups (None for symmetric groups), the code table of
    method 8 (bitsandbytes NF4 / FP4)."""
    zero = getattr(linear, "weight_zero", None)
    if method == _W8A8:
        return cast(torch.Tensor | None, getattr(linear, "weight_comp", None))
    if method == _INT4_TABLE:
        return cast(torch.Tensor, linear.weight_table)
    return zero if method in (_INT4, _W4A8, _INT8_GROUPS, _INT4_OFFSET, _W4A8_OFFSET) else None


def _perm(linear: Any) -> torch.Tensor | None:
    """The input permutation an int4 linear's apply gathers x by (GPTQ act-order), else None."""
    if isinstance(getattr(linear, "quant_method", None), Int4KernelMethod):
        return cast(torch.Tensor | None, linear.weight_perm)
    return None


def _method(linear: Any) -> int | None:
    """The op's method code for the layer's weights, or None when the op cannot apply it."""
    method = getattr(linear, "quant_method", None)
    if isinstance(method, UnquantizedLinearMethod):
        return _PACKED if method.layout is PACKED else None
    if isinstance(method, GroupedInt8Method):
        return _INT8_GROUPS if method.quantized else None
    if isinstance(method, W8A8LinearMethod):
        return _W8A8 if method.quantized else None
    if isinstance(method, Int8LinearMethod):
        return _INT8 if method.quantized else None
    if isinstance(method, Int4KernelMethod):  # packed (not fallen back); an act-order permutation goes along
        if method.code_table:  # codes in a table (bitsandbytes NF4 / FP4, GGUF IQ4)
            code = _INT4_TABLE
        elif method.zero_offset:  # its zero tensor holds offsets (GGUF Q4_1's m)
            code = _W4A8_OFFSET if method.int8_activations else _INT4_OFFSET
        else:
            code = _W4A8 if method.int8_activations else _INT4
        return code if linear.weight.dtype == torch.uint8 else None
    return None


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _supported(linear: Any, bias_allowed: bool) -> bool:
    return bool(
        _method(linear) is not None
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
        and attn.attn.kv_cache.device.type == "cpu"
        and attn.attn.kv_cache.dtype in _KV_CACHE_DTYPES
        and type(mlp.act_fn) is SiluAndMul
        and all(_supported(lin, bias_allowed=lin is attn.qkv_proj) for lin in _linears(layer))
    )
