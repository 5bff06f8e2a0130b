"""Engine configuration: user-facing ``EngineArgs`` turned into one frozen ``EngineConfig``.

Torch-free (torch is imported lazily only to detect a GPU). Impossible settings fail here, at
start-up, with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pagedllm import envs
from pagedllm.hf_config import load_hf_config, normalize_hf_config
from pagedllm.model_arch import ModelArchConfig
from pagedllm.models.registry import supported_architectures

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_POLICIES = ("fcfs", "priority")
_QUANTIZATIONS = ("int8",)  # layers/quantization.py (kept here too: this module is torch-free)
_STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar",)
GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local Hugging Face-format directory
    tokenizer: str
    arch: ModelArchConfig
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    load_format: str
    seed: int
    trust_remote_code: bool
    served_model_name: str
    quantization: str | None = None  # None | int8 (weight-only, CPU float32)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_bytes: int | None  # CPU: the KV pool's size
    gpu_memory_utilization: float  # CUDA: share of device memory for weights + activations + KV
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str  # fcfs | priority
    # Most prompt tokens one request computes in a step (0: no cap beyond the budget). A cap keeps
    # a long prompt's prefill from stalling the decodes that share its steps.
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "xgrammar"
    compile_timeout_s: float = 30.0  # a constraint that takes longer to compile fails its request


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses ``num_speculative_tokens`` tokens per step and
    the target model verifies them in the same forward (output unchanged, see spec_decode/)."""

    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 4  # ngram: longest suffix matched (tried first)
    draft_model: str | None = None  # draft_model: a local HF directory
    draft_arch: ModelArchConfig | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a step must own: a draft model writes its own KV for
        the bonus token and its k-1 fed-back proposals, up to k positions beyond the target's."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str  # cpu | cuda
    attention_backend: str | None = None
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs (decode runs eagerly, as on CPU)

    def kv_bytes_per_block(self) -> int:
        """Target layers plus, with a draft model, its layers: both share every block table."""
        archs = [self.model_config.arch]
        if self.speculative_config is not None and self.speculative_config.draft_arch is not None:
            archs.append(self.speculative_config.draft_arch)
        per_token = sum(2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim for a in archs)
        return per_token * self.cache_config.block_size * self.model_config.dtype_bytes

    def blocks_per_max_len_request(self) -> int:
        lookahead = 0 if self.speculative_config is None else self.speculative_config.num_lookahead_tokens
        return -(-(self.model_config.max_model_len + lookahead) // self.cache_config.block_size)


@dataclass
class EngineArgs:
    """Every engine option, spelled as vLLM spells it."""

    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB, CPU only; default 4
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    trust_remote_code: bool = False
    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_gpu_blocks_override: int | None = None
    attention_backend: str | None = None
    structured_outputs_backend: str = "xgrammar"
    structured_outputs_compile_timeout: float = 30.0  # seconds
    # vLLM's JSON spelling, e.g. {"method": "ngram", "num_speculative_tokens": 4}; a dict or a JSON string.
    speculative_config: dict | str | None = None
    speculative_model: str | None = None  # older spelling: a draft model directory, or "[ngram]"
    num_speculative_tokens: int | None = None
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    quantization: str | None = None  # "int8": weight-only int8 linears (CPU, float32)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def create_engine_config(self, usage_context: str = "llm") -> EngineConfig:
        """The checked configuration. ``usage_context`` ("llm": offline batches, "serve": the
        OpenAI server) picks defaults that depend on the workload (the step token budget)."""
        if usage_context not in _USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {sorted(_USAGE_CONTEXTS)}, got {usage_context!r}")
        model_dir = self._resolve_model_dir()
        arch = normalize_hf_config(load_hf_config(model_dir))
        _check_architecture(arch)
        device = _resolve_device(self.device)
        model_config = self._model_config(model_dir, arch, device)
        scheduler_config = self._scheduler_config(model_config.max_model_len, device, usage_context)
        config = EngineConfig(model_config, self._cache_config(), scheduler_config,
                              self._parallel_config(), device, self.attention_backend,
                              self._structured_outputs_config(),
                              self._speculative_config(arch, model_config.max_model_len),
                              enforce_eager=bool(self.enforce_eager))
        _check_kv_budget(config)
        return config

    # ------------------------------------------------------------------ pieces
    def _resolve_model_dir(self) -> str:
        if self.model is None or self.model == "pagedllm-demo":
            from pagedllm.demo.tiny import ensure_demo_model
            return str(ensure_demo_model())
        path = Path(self.model).expanduser()
        if not path.is_dir():
            raise ValueError(f"model {self.model!r} is not a local directory. pagedllm loads Hugging Face-format "
                             "directories (config.json + *.safetensors + tokenizer) and never downloads; "
                             "pass a path, or omit the model to use the built-in demo model")
        return str(path)

    def _model_config(self, model_dir: str, arch: ModelArchConfig, device: str) -> ModelConfig:
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        dtype = _resolve_dtype(self.dtype, arch, device)
        _check_quantization(self.quantization, device, dtype)
        return ModelConfig(
            model=model_dir, tokenizer=self.tokenizer or model_dir, arch=arch, dtype=dtype,
            max_model_len=_resolve_max_model_len(self.max_model_len, arch),
            load_format=self.load_format, seed=self.seed, trust_remote_code=self.trust_remote_code,
            served_model_name=self.served_model_name or (self.model or "pagedllm-demo"),
            quantization=self.quantization)

    def _cache_config(self) -> CacheConfig:
        _positive("block_size", self.block_size)
        if self.block_size % 8:
            raise ValueError(f"block_size must be a multiple of 8 (16 is the default), got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        memory = None if self.kv_cache_memory is None else int(self.kv_cache_memory * GiB)
        return CacheConfig(self.block_size, memory, self.gpu_memory_utilization, self.enable_prefix_caching,
                           self.num_gpu_blocks_override)

    def _scheduler_config(self, max_model_len: int, device: str, usage_context: str) -> SchedulerConfig:
        _positive("max_num_seqs", self.max_num_seqs)
        _choice("scheduling_policy", self.scheduling_policy, _POLICIES)
        batched = self.max_num_batched_tokens
        if batched is None:  # chunked prefill is always on: long prompts are split across steps
            batched = default_max_num_batched_tokens(device, usage_context)
        _positive("max_num_batched_tokens", batched)
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0 = off), got {threshold!r}")
        return SchedulerConfig(self.max_num_seqs, batched, max_model_len, self.scheduling_policy, threshold)

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        _choice("structured_outputs_backend", self.structured_outputs_backend, _STRUCTURED_OUTPUTS_BACKENDS)
        timeout = self.structured_outputs_compile_timeout
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0 seconds, got {timeout!r}")
        return StructuredOutputsConfig(self.structured_outputs_backend, float(timeout))

    def _speculative_config(self, target: ModelArchConfig, max_model_len: int) -> SpeculativeConfig | None:
        from pagedllm.spec_decode.config import build_speculative_config

        return build_speculative_config(self.speculative_config, self.speculative_model,
                                        self.num_speculative_tokens, target, max_model_len)

    def _parallel_config(self) -> ParallelConfig:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError("tensor/pipeline parallelism is not available yet: use tensor_parallel_size=1 "
                             "and pipeline_parallel_size=1")
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_architecture(arch: ModelArchConfig) -> None:
    supported = supported_architectures()
    if arch.architecture not in supported:
        raise ValueError(f"architecture {arch.architecture!r} is not supported; supported: {', '.join(supported)}")


_USAGE_CONTEXTS = {"llm", "serve"}
# A CPU server's step budget. On a CPU a step carrying a 2,048-token prefill chunk takes seconds
# and stalls every running stream for that long. Measured at concurrency 32 with long prompts
# arriving (docs/benchmarks.md, "Online serving"): 128 tokens keeps p99 inter-token latency
# within 2x its median (1.71) at the same output rate as 256 (7.6x) and 2,048 (65x, and a lower
# rate); the price is a longer time to first token. Offline batches keep 2,048: only throughput
# counts there.
CPU_SERVING_MAX_NUM_BATCHED_TOKENS = 128


def default_max_num_batched_tokens(device: str, usage_context: str) -> int:
    """The step token budget when ``max_num_batched_tokens`` is not given."""
    if device == "cpu" and usage_context == "serve":
        return CPU_SERVING_MAX_NUM_BATCHED_TOKENS
    return 2048


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    if device != "auto":
        return device
    override = envs.device_override()
    if override is not None:
        return override
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: str, arch: ModelArchConfig, device: str) -> str:
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    _choice("dtype", dtype, _DTYPES)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"  # bf16/fp16 matmuls are several times slower than fp32 on CPUs without AMX
    checkpoint = _DTYPE_ALIASES.get(arch.torch_dtype or "", arch.torch_dtype)
    return "bfloat16" if checkpoint in (None, "float32") else checkpoint


def _check_quantization(quantization: str | None, device: str, dtype: str) -> None:
    """int8 is weight-only for the CPU float32 kernels (decode there is bound by weight bytes)."""
    if quantization is None:
        return
    if quantization not in _QUANTIZATIONS:
        raise ValueError(f"quantization must be None (off) or one of {', '.join(_QUANTIZATIONS)}; "
                         f"got {quantization!r}")
    if device != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only, the device is {device}; "
                         "pass device='cpu' (--device cpu) or drop the quantization")
    if dtype != "float32":
        raise ValueError(f"quantization={quantization!r} needs dtype float32 (activations stay float32), got "
                         f"{dtype}; pass dtype='float32' (or 'auto') or drop the quantization")


def _resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    _positive("max_model_len", requested)
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is larger than the model supports "
                         f"(max_position_embeddings={limit}); lower max_model_len to at most {limit}")
    return requested


def _check_kv_budget(config: EngineConfig) -> None:
    memory = config.cache_config.kv_cache_memory_bytes
    if memory is None or config.device != "cpu":
        return
    blocks = memory // config.kv_bytes_per_block()
    needed = config.blocks_per_max_len_request() + 1  # + the null block, as the worker counts it
    if blocks < needed:
        need_gib = needed * config.kv_bytes_per_block() / GiB
        raise ValueError(f"kv_cache_memory={memory / GiB:.3g} GiB holds {blocks} blocks of "
                         f"{config.cache_config.block_size} tokens, but one request of max_model_len="
                         f"{config.model_config.max_model_len} needs {needed} blocks ({need_gib:.3g} GiB); "
                         "raise kv_cache_memory or lower max_model_len")
