"""Build a model on its device in its dtype and fill its weights (safetensors, GGUF or random)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from pagedllm.config.choices import LOAD_FORMATS
from pagedllm.config.model import resolve_quantization
from pagedllm.gguf_config import is_gguf_file, read_metadata, resolve_checkpoint
from pagedllm.layers.quantization import QuantizationConfig, building_with, get_quantization_config
from pagedllm.layers.quantization.prequantized import PrequantizedConfig, for_checkpoint
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.gguf_loader import iterate_gguf
from pagedllm.models.registry import resolve_model_cls
from pagedllm.models.stage import missing_prefixes
from pagedllm.models.weight_utils import (
    iterate_safetensors,
    map_checkpoint_name,
    name_maps,
    owned_by,
    safetensors_files,
)

_MAX_LISTED = 10


class _LoadsWeights(Protocol):
    """The model classes' ``load_weights`` (``nn.Module`` types an attribute as a tensor or module)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


def load_model(
    model_dir: str | None,
    arch: ModelArchConfig,
    *,
    load_format: str = "auto",
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    """The model for ``arch`` in eval mode without gradients, its weights from ``model_dir``
    ("auto"/"safetensors"; "auto"/"gguf" for a .gguf file, dequantized to ``dtype``) or random
    ("dummy", seeded by ``seed``; no files needed). ``quantization`` names the weight format
    (``layers/quantization``; None: float), e.g. "int8": applied after loading, GGUF included.
    A pre-quantized checkpoint (config.json's quantization_config) loads in its own format."""
    quantization = resolve_quantization(quantization, arch)
    # Random weights of a GGUF file's shape read no file: no blocks to keep (w4a8 quantizes them instead).
    file_facts = {k: v for k, v in arch.extra.items() if load_format != "dummy" or not k.startswith("gguf")}
    quant_config = get_quantization_config(quantization, arch.extra.get("quantization_config"), file_facts)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of: {', '.join(LOAD_FORMATS)}")
    # awq / gptq dummy weights are random packed bits; the converting formats need real tensors.
    if load_format == "dummy" and isinstance(quant_config, PrequantizedConfig):
        raise ValueError(
            f"load_format='dummy' cannot fill the layers of a pre-quantized ({quantization}) checkpoint; "
            "load its weights, or use a float config.json for random weights"
        )
    weights = None if load_format == "dummy" else _checkpoint_weights(model_dir, load_format, arch, quantization)
    if weights is not None:  # e.g. int8 quantizes each float tensor as it streams in
        quant_config = for_checkpoint(quant_config)
    model = build_model(arch, dtype, device, quant_config)
    if weights is None:
        init_dummy_weights(model, seed)
    else:
        stream = weights(owned_by(model, missing_prefixes(model)))
        _load_checkpoint(model, quant_config.convert_checkpoint(stream), model_dir)
    process_weights_after_loading(model)
    return model.eval().requires_grad_(False)


_Stream = Callable[[Callable[[str], bool] | None], Iterator[tuple[str, torch.Tensor]]]


def _checkpoint_weights(
    model_dir: str | None, load_format: str, arch: ModelArchConfig, quantization: str | None
) -> _Stream:
    """The checkpoint's (name, tensor) stream given a name filter (None: every tensor; a pipeline
    stage reads only its own), its files checked now, before any memory is allocated."""
    if model_dir is not None and (load_format == "gguf" or is_gguf_file(model_dir)):
        path = resolve_checkpoint(model_dir, load_format)
        header = read_metadata(path)  # a bad file is refused before the model is allocated
        return lambda keep: iterate_gguf(path, arch, keep, header, keep_blocks=quantization in ("gguf", "w4a8"))
    files = _checkpoint_files(model_dir)
    return lambda keep: iterate_safetensors(files, keep)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer's ``quant_method`` convert its loaded weights once (quantize, pack for the
    CPU GEMM, reorder for oneDNN): every linear layer and the LM head have one."""
    for module in model.modules():
        if (method := getattr(module, "quant_method", None)) is not None:
            method.process_weights_after_loading(module)


def build_model(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """Allocate the parameters directly on ``device`` in ``dtype`` (uninitialised), each linear
    layer's in the format of ``quant_config`` (None: float)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type (float32, bfloat16, float16), got {dtype}")
    model_cls = resolve_model_cls(arch.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building_with(quant_config or get_quantization_config(None)):
            return model_cls(arch)
    finally:
        torch.set_default_dtype(previous)


def _checkpoint_files(model_dir: str | None) -> list[Path]:
    if model_dir is None:
        raise ValueError("loading weights needs a model directory; pass load_format='dummy' for random weights")
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir}; pass load_format='dummy' for random weights")
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"model.safetensors.index.json in {model_dir} names missing files: {', '.join(absent)}")
    return files


def _load_checkpoint(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], model_dir: str | None) -> None:
    seen: list[str] = []

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            seen.append(name)
            yield name, tensor

    with torch.no_grad():
        loaded = cast(_LoadsWeights, model).load_weights(tracked())
    check_loaded(model, loaded, seen, where=str(model_dir))


def check_loaded(model: nn.Module, loaded: set[str], checkpoint_names: Iterable[str], where: str) -> None:
    """ValueError listing our parameters that got no weights and checkpoint tensors we don't know."""
    # named_parameters() dedups shared tensors, so a tied lm_head is not reported missing.
    # load_optional: one of several forms a layer takes (GGUF's float or 4-bit parts); its method checks.
    params = model.named_parameters()
    missing = sorted({n for n, p in params if not getattr(p, "load_optional", False)} - loaded)
    known = set(dict(model.named_parameters(remove_duplicate=False)))
    mapping, rename = name_maps(model)
    unexpected = sorted(
        n
        for n in checkpoint_names
        if (target := map_checkpoint_name(n, mapping, rename)) is not None and target[0] not in known
    )
    if not missing and not unexpected:
        return
    problems = [
        f"{label} ({len(names)}): {_listing(names)}"
        for label, names in (("missing parameters", missing), ("unexpected checkpoint tensors", unexpected))
        if names
    ]
    raise ValueError(
        f"the checkpoint in {where} does not match {type(model).__name__}: {'; '.join(problems)}. "
        "Check that config.json belongs to these weights."
    )


def _listing(names: list[str]) -> str:
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f", ... and {more} more" if more > 0 else "")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights that keep activations O(1) (benchmarks, no checkpoint): matrices ~ N(0, 1/fan_in),
    norm weights 1, biases 0."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.dim() == 1:
            # lower(): BERT's norms are named LayerNorm.
            param.fill_(1.0 if "norm" in name.lower() else 0.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        if not param.dtype.is_floating_point:  # a quantized checkpoint's packed words: any bits
            param.random_(generator=generators[param.device])
            continue
        param.normal_(0.0, param.shape[-1] ** -0.5, generator=generators[param.device])
