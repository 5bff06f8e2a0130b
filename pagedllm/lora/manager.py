"""The worker's adapters: ``max_loras`` device slots (LRU) over up to ``max_cpu_loras`` host copies.

Adapters are loaded by path the first time a step uses them and cached by ``lora_int_id`` (one id,
one directory). A step needs at most ``max_loras`` distinct adapters (the scheduler's promise);
an adapter not in a slot takes a free one or the least recently used one that the step does not
need. ``prepare`` turns the step's per-token adapter ids into the ``LoRAStep`` mask the wrapped
linears read.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.layers.cpu_kernels import cpu_ops
from pagedllm.layers.linear import LinearBase
from pagedllm.lora.layers import LoRASlots, LoRAStep, make_step
from pagedllm.lora.peft_files import TARGET_MODULES, WEIGHTS_FILE, check_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.model_arch import ModelArchConfig

_WRAPPED = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")
# (layer, our fused module) -> projection index -> (A [r, in], scale * B [out, r])
AdapterWeights = dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def attach_lora_slots(
    model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device
) -> dict[tuple[int, str], LoRASlots]:
    """Give every decoder layer's qkv, o, gate_up and down linear its slots (``layer.lora``)."""
    lora_dtype = slot_dtype(config, dtype)
    kernel = delta_kernel(device, dtype, lora_dtype)
    slots = {}
    for name, module in model.named_modules():
        match = _WRAPPED.search(name)
        if match is None or not isinstance(module, LinearBase):
            continue
        module.lora = LoRASlots(
            module.input_size, module.output_sizes, config.max_loras, config.max_lora_rank, lora_dtype, device, kernel
        )
        slots[(int(match.group(1)), match.group(2))] = module.lora
    if not slots:
        raise ValueError(f"{type(model).__name__} has no LoRA-capable linear layers; serve it without --enable-lora")
    return slots


def slot_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the slots keep A and B in (``--lora-dtype``; auto: the model's)."""
    return model_dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)


def delta_kernel(device: torch.device, dtype: torch.dtype, lora_dtype: torch.dtype) -> Callable[..., Any] | None:
    """The LoRA delta kernel for the device: the C++ op on CPU for a float32 model with float32
    or bfloat16 slots, Triton on CUDA (slots in the model's dtype); None: the torch path
    (``LoRASlots.add_delta``)."""
    if device.type == "cpu":
        fits = dtype == torch.float32 and lora_dtype in (torch.float32, torch.bfloat16)
        ops = cpu_ops() if fits else None
        return None if ops is None else ops.lora_add_
    if device.type == "cuda" and lora_dtype == dtype:
        try:
            from pagedllm.lora.triton_lora import lora_add_
        except ImportError:
            return None
        return lora_add_
    return None


class LoRAModelManager:
    """Slots on the device, host copies, and the step's mapping."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config, self.arch, self.device = config, arch, device
        self.dtype = slot_dtype(config, dtype)
        self.layers = attach_lora_slots(model, config, dtype, device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # host copies, least recent first
        self.num_loads = 0  # adapters read from disk (for tests and logs)

    # ------------------------------------------------------------------ one step
    def prepare(self, token_lora_ids: np.ndarray, requests: dict[int, LoRARequest]) -> tuple[LoRAStep, dict[int, str]]:
        """Put the step's adapters in slots; the mask for its tokens (0 ids: the base model), and
        lora_int_id -> why, for adapters that failed to load (their rows run the base model and
        the caller fails their requests: their output is never reported)."""
        slot_table = np.full(max(requests) + 1, -1, dtype=np.int64)
        slots, failed = self.activate(requests)
        for lora_id, slot in slots.items():
            slot_table[lora_id] = slot
        token_slots = torch.from_numpy(slot_table[token_lora_ids]).to(self.device)
        return make_step(token_slots, self.config.max_loras, self.config.max_lora_rank, self.dtype), failed

    def activate(self, requests: dict[int, LoRARequest]) -> tuple[dict[int, int], dict[int, str]]:
        """lora_int_id -> slot for every adapter of the step, loading those not in a slot; and
        lora_int_id -> why for those whose files could not be read (changed since intake)."""
        if len(requests) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(requests)} adapters but max_loras is {self.config.max_loras}")
        for lora_id in requests:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        failed: dict[int, str] = {}
        for lora_id, request in requests.items():
            if lora_id not in self.slot_of:
                try:
                    self._load_into_slot(request, self._free_slot(requests))
                except (OSError, ValueError, KeyError, SafetensorError) as exc:
                    failed[lora_id] = f"LoRA adapter {request.lora_name!r} could not be loaded: {exc}"
        return {lora_id: self.slot_of[lora_id] for lora_id in requests if lora_id not in failed}, failed

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        """An empty slot, else the least recently used one whose adapter the step does not need."""
        used = set(self.slot_of.values())
        for slot in range(self.config.max_loras):
            if slot not in used:
                return slot
        victim = next(lora_id for lora_id in self.slot_of if lora_id not in needed)
        return self.slot_of.pop(victim)

    def _load_into_slot(self, request: LoRARequest, slot: int) -> None:
        weights = self._host_weights(request)
        for key, layer_slots in self.layers.items():
            layer_slots.set_slot(slot, weights.get(key, {}))
        self.slot_of[request.lora_int_id] = slot

    def _host_weights(self, request: LoRARequest) -> AdapterWeights:
        """The adapter's host copy (LRU over ``max_cpu_loras``), read from disk when missing."""
        weights = self.host.get(request.lora_int_id)
        if weights is None:
            weights = self.load(request)
            self.host[request.lora_int_id] = weights
            while len(self.host) > self.config.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(request.lora_int_id)
        return weights

    def load(self, request: LoRARequest) -> AdapterWeights:
        """Read and check an adapter: per wrapped layer, its projections' A and scaled B."""
        spec = check_adapter(request.lora_name, request.lora_path, self.arch, self.config.max_lora_rank)
        tensors = load_file(f"{request.lora_path}/{WEIGHTS_FILE}")
        weights: AdapterWeights = {}
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, (layer, proj, kind) in spec.tensors.items():
            pairs.setdefault((layer, proj), {})[kind] = tensors[key].float()
        for (layer, proj), pair in pairs.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"LoRA adapter {request.lora_name!r}: layer {layer} {proj} lacks lora_A or lora_B")
            fused, index = TARGET_MODULES[proj]
            # The scale folds into B before the cast to the slots' dtype (one rounding).
            weights.setdefault((layer, fused), {})[index] = (
                pair["A"].to(self.dtype),
                (pair["B"] * spec.scale).to(self.dtype),
            )
        self.num_loads += 1
        return weights
