"""Reading and checking a PEFT LoRA adapter directory without torch.

``adapter_config.json`` gives the rank, alpha, rsLoRA and target modules; the header of
``adapter_model.safetensors`` (8-byte length + JSON) gives every tensor's name and shape, which
is enough to check the adapter against the base model before it is ever loaded. Any problem is
a ``ValueError`` naming the adapter and saying what is wrong, raised at intake (or when the
server loads it), never in a step.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.model_arch import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The checkpoint projections an adapter may target -> (our fused module, its shard index).
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its rank, scale and the tensors (name -> (layer, projection, A|B))."""

    name: str
    rank: int
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    tensors: dict[str, tuple[int, str, str]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({proj for _, proj, _ in self.tensors.values()})


def projection_shape(arch: ModelArchConfig, proj: str) -> tuple[int, int]:
    """(in_features, out_features) of a checkpoint projection of the base model."""
    hidden, inner = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, arch.q_size),
        "k_proj": (hidden, arch.kv_size),
        "v_proj": (hidden, arch.kv_size),
        "o_proj": (arch.q_size, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }[proj]


def check_adapter(name: str, path: str, arch: ModelArchConfig, max_rank: int) -> AdapterSpec:
    """The adapter at ``path`` checked against the base model ``arch`` and ``max_rank``."""
    config = _read_config(name, Path(path))
    rank, alpha = _rank_and_alpha(name, config, max_rank)
    _check_config_targets(name, config)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensor_shapes(name, Path(path) / WEIGHTS_FILE)
    spec = AdapterSpec(name, rank, scale, _parse_keys(name, tensors))
    _check_shapes(spec, tensors, arch)
    return spec


def _read_config(name: str, path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory; pass a PEFT adapter directory")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {CONFIG_FILE} in {str(path)!r} ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object")
    return config


def _rank_and_alpha(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs a positive integer 'r', got {rank!r}")
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}; start the engine with "
            f"--max-lora-rank {rank} or more"
        )
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} needs a number 'lora_alpha', got {alpha!r}")
    for key, wanted in (("bias", "none"), ("use_dora", False), ("modules_to_save", None)):
        if config.get(key, wanted) not in (wanted, [], {}):
            raise ValueError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported (only {key}={wanted!r})")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {name!r}: per-module rank_pattern/alpha_pattern are not supported")
    return rank, float(alpha)


def _check_config_targets(name: str, config: dict[str, Any]) -> None:
    """A list of target modules must name projections this model has (a regex is checked by keys)."""
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(_unknown_target(name, unknown))


def _unknown_target(name: str, unknown: list[str]) -> str:
    return (
        f"LoRA adapter {name!r} targets modules {unknown} that this model has no LoRA support for; "
        f"the supported target modules are {', '.join(TARGET_MODULES)}"
    )


def _read_tensor_shapes(name: str, file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header alone."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file} ({e}); save the adapter with safetensors") from e
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _parse_keys(name: str, tensors: dict[str, list[int]]) -> dict[str, tuple[int, str, str]]:
    parsed, unknown = {}, []
    for key in tensors:
        match = _KEY.search(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            unknown.append(key)
        else:
            parsed[key] = (int(match.group(1)), match.group(2), match.group(3))
    if unknown:
        raise ValueError(_unknown_target(name, unknown[:3]))
    if not parsed:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return parsed


def _check_shapes(spec: AdapterSpec, tensors: dict[str, list[int]], arch: ModelArchConfig) -> None:
    """Every A is [r, in], every B [out, r] of the base's projection, in one of its layers."""
    for key, (layer, proj, kind) in spec.tensors.items():
        if layer >= arch.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: {key} is for layer {layer}, but the base model has "
                f"{arch.num_hidden_layers} layers; the adapter was trained for another model"
            )
        fan_in, fan_out = projection_shape(arch, proj)
        wanted = [spec.rank, fan_in] if kind == "A" else [fan_out, spec.rank]
        if tensors[key] != wanted:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: {key} has shape {tensors[key]}, but the base model needs "
                f"{wanted} (rank {spec.rank}); the adapter was trained for another model"
            )
