"""The machine's limits, measured in the same run, and what a model step costs against them.

Floors: a decode step must at least read every weight once (plus the KV it attends over) and
do ``2 x params x batch`` flops; a prefill must do its matmul and attention flops. The floor time
is the larger of bytes / bandwidth and flops / GEMM rate (a roofline), measured with plain torch
ops on this machine, so "achieved / floor" is comparable across machines and runs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pagedllm.config.choices import DTYPE_BYTES, canonical_dtype


def _dtype_bytes(name: str | None, default: int) -> int:
    """Bytes per value of a --dtype / --kv-cache-dtype name (aliases included); ``default`` for auto."""
    return DTYPE_BYTES.get(canonical_dtype(name or "auto"), default)


@dataclass(frozen=True)
class MachineLimits:
    copy_gbps: float  # a large Tensor.copy_, counting bytes read + written (the STREAM "copy" convention)
    read_gbps: float  # a large Tensor.sum, bytes read
    gemm_gflops: float  # a large square torch.mm in the model's dtype
    bandwidth: str  # which of the two bandwidths the floors use: "copy" or "read"

    @property
    def floor_gbps(self) -> float:
        return self.copy_gbps if self.bandwidth == "copy" else self.read_gbps

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "floor_gbps": self.floor_gbps}


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # first touch / allocator / kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_limits(
    dtype: Any = None, copy_mib: int = 512, gemm_n: int = 2048, repeats: int = 5, bandwidth: str = "copy"
) -> MachineLimits:
    """Best of ``repeats``: the floor is what the machine *can* do, not what it did on average.
    ``dtype`` (a torch dtype, default float32) is the model's; the GEMM rate is the best of
    ``_gemm_dtypes(dtype)``."""
    import torch

    copy_gbps, read_gbps = _bandwidths(copy_mib, repeats)
    best_s = float("inf")
    for gemm_dtype in _gemm_dtypes(dtype or torch.float32):
        operands = (torch.randn(gemm_n, gemm_n).to(gemm_dtype), torch.randn(gemm_n, gemm_n).to(gemm_dtype))
        best_s = min(best_s, _best_seconds(functools.partial(torch.mm, *operands), repeats))
    return MachineLimits(
        copy_gbps=copy_gbps, read_gbps=read_gbps, gemm_gflops=2 * gemm_n**3 / best_s / 1e9, bandwidth=bandwidth
    )


def _gemm_dtypes(dtype: Any) -> list[Any]:
    """The probe's GEMM dtypes for a model in ``dtype``: its own, and float32 for a 16-bit model,
    whose packed CPU linears compute in float32. A 16-bit dtype this CPU has no native dot
    products for is left out: torch converts per call there (minutes for the probe, a rate no
    engine path runs at)."""
    import torch

    from pagedllm import cpu_info

    if dtype not in (torch.bfloat16, torch.float16):
        return [dtype]
    native = cpu_info.native_16_bit(dtype)
    return [dtype, torch.float32] if native else [torch.float32]


def _bandwidths(copy_mib: int, repeats: int) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, read GB/s) over ``copy_mib`` MiB of fp32."""
    import torch

    src = torch.ones(copy_mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    read_s = _best_seconds(lambda: src.sum(), repeats)
    return 2 * nbytes / copy_s / 1e9, nbytes / read_s / 1e9


@dataclass(frozen=True)
class ModelCost:
    """Bytes and flops of one model step, from the HF config (independent of how the engine
    stores its weights, so packing or fusing does not change the yardstick)."""

    layer_params: int  # linear weights (and biases) of all decoder layers
    lm_head_params: int  # vocab x hidden: the LM head is read every step, tied or not
    norm_params: int
    dtype_bytes: int
    kv_bytes_per_token: int  # K and V of one token over all layers
    attn_flops_per_pair: int  # flops per (query token, context token) pair over all layers

    @property
    def weight_bytes(self) -> int:
        """Weights one decode step reads (the input embedding rows are negligible)."""
        return (self.layer_params + self.lm_head_params + self.norm_params) * self.dtype_bytes

    @property
    def params(self) -> int:
        return self.layer_params + self.lm_head_params


def model_cost(config: dict[str, Any], dtype: str, kv_cache_dtype: str | None = None) -> ModelCost:
    """The step's cost with weights in ``dtype`` and K/V in ``kv_cache_dtype`` (None or auto: ``dtype``)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if config.get("attention_bias") else 0)
    mlp = 3 * h * inter
    nbytes = _dtype_bytes(dtype, 4)
    return ModelCost(
        layer_params=layers * (attn + mlp),
        lm_head_params=config["vocab_size"] * h,
        norm_params=(2 * layers + 1) * h,
        dtype_bytes=nbytes,
        kv_bytes_per_token=2 * layers * kv * _dtype_bytes(kv_cache_dtype, nbytes),
        attn_flops_per_pair=4 * layers * q,
    )


def held_step_bytes(model: Any) -> int:
    """The bytes of weights a decode step of ``model`` reads as the engine holds them (packed,
    quantized: every layer with a ``quant_method``, i.e. the linears and the LM head, with their
    scales), each tensor once: the yardstick of "its own bandwidth floor" for a quantized method."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is None or t.numel() == 0 or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_cost(cost: ModelCost, context_lens: list[int]) -> tuple[int, int]:
    """(bytes read, flops) of one decode step over sequences with these context lengths."""
    ctx = sum(context_lens)
    nbytes = cost.weight_bytes + cost.kv_bytes_per_token * ctx
    flops = 2 * cost.params * len(context_lens) + cost.attn_flops_per_pair * ctx
    return nbytes, flops


def prefill_flops(cost: ModelCost, prompt_len: int) -> int:
    """Flops of a causal prefill that computes logits for the last token only."""
    pairs = prompt_len * (prompt_len + 1) // 2
    return 2 * cost.layer_params * prompt_len + 2 * cost.lm_head_params + cost.attn_flops_per_pair * pairs


def floor_seconds(limits: MachineLimits, nbytes: int, flops: int) -> float:
    """Roofline: a step can be no faster than its memory traffic or its arithmetic allows."""
    return max(nbytes / (limits.floor_gbps * 1e9), flops / (limits.gemm_gflops * 1e9))


def workload_floor_seconds(
    cost: ModelCost, limits: MachineLimits, prompt_lens: list[int], output_lens: list[int]
) -> float:
    """Ideal time for a batch of requests all running at once: every prompt prefilled at the GEMM
    rate, then decode step k (k >= 1) over the requests still generating, each step at its floor."""
    prefill = sum(prefill_flops(cost, p) for p in prompt_lens) / (limits.gemm_gflops * 1e9)
    decode = 0.0
    for k in range(1, max(output_lens)):
        ctx = [p + k for p, o in zip(prompt_lens, output_lens) if o > k]
        decode += floor_seconds(limits, *decode_cost(cost, ctx))
    return prefill + decode


def describe(limits: MachineLimits, cost: ModelCost) -> str:
    return (
        f"machine: copy {limits.copy_gbps:.1f} GB/s (read+write), read {limits.read_gbps:.1f} GB/s, "
        f"GEMM {limits.gemm_gflops:.0f} GFLOP/s; floors use the {limits.bandwidth} bandwidth. "
        f"model: {cost.params / 1e6:.1f} M matmul params, {cost.weight_bytes / 1e6:.0f} MB read per decode step"
    )
