"""``EngineArgs`` (every engine option, one dataclass per topic) -> one frozen ``EngineConfig``.

Torch-free (torch is imported lazily only to detect a GPU). Impossible settings fail here, at
start-up, with a message that says what to change. ``EngineArgs`` is the union of the topic
dataclasses' fields, so its keyword names, ``LLM(...)``'s and the CLI flags come from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from pagedllm.config.cache import DEFAULT_CPU_KV_CACHE_GIB, CacheArgs, CacheConfig
from pagedllm.config.choices import DTYPE_BYTES, USAGE_CONTEXTS
from pagedllm.config.device import DeviceArgs
from pagedllm.config.lora import LoRAArgs, LoRAConfig
from pagedllm.config.model import LoadArgs, ModelArgs, ModelConfig
from pagedllm.config.options import GiB
from pagedllm.config.parallel import (
    ParallelArgs,
    ParallelConfig,
    check_data_parallel,
    check_pipeline_parallel,
    check_tensor_parallel,
    kv_heads_per_rank,
)
from pagedllm.config.pooler import PoolerArgs
from pagedllm.config.scheduler import SchedulerArgs, SchedulerConfig
from pagedllm.config.speculative import SpeculativeArgs, SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsArgs, StructuredOutputsConfig
from pagedllm.gguf_config import resolve_checkpoint
from pagedllm.hf_config import load_arch_config


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str  # cpu | cuda
    attention_backend: str | None = None  # None or auto: the device's default
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative_config: SpeculativeConfig | None = None
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs (decode runs eagerly, as on CPU)
    lora_config: LoRAConfig | None = None  # None: LoRA off

    def kv_bytes_per_block(self, stage_layers: int | None = None) -> int:
        """Target layers plus, with a draft model, its layers: both share every block table. An
        encoder keeps no KV: its blocks are bookkeeping only (0 bytes). ``stage_layers``: a
        pipeline stage's share of the target's layers (None: all of them)."""
        if self.model_config.arch.encoder_only:
            return 0
        target = self.model_config.arch
        layers = [(target, target.num_hidden_layers if stage_layers is None else stage_layers)]
        if self.speculative_config is not None and self.speculative_config.draft_arch is not None:
            draft = self.speculative_config.draft_arch
            layers.append((draft, draft.num_hidden_layers))
        # Per rank: each tensor-parallel rank caches only its KV heads (kv_cache_memory is per rank).
        tp = self.parallel_config.tensor_parallel_size
        per_token = sum(2 * n * kv_heads_per_rank(a.num_key_value_heads, tp) * a.head_dim for a, n in layers)
        return per_token * self.cache_config.block_size * DTYPE_BYTES[self.cache_config.kv_cache_dtype]

    def num_swap_blocks(self) -> int:
        """Slots of the swap tier: --swap-space over the bytes of one block (0: no tier; an
        encoder keeps no KV and has nothing to swap)."""
        per_block = self.kv_bytes_per_block()
        return self.cache_config.swap_space_bytes // per_block if per_block else 0

    def blocks_per_max_len_request(self) -> int:
        lookahead = 0 if self.speculative_config is None else self.speculative_config.num_lookahead_tokens
        return -(-(self.model_config.max_model_len + lookahead) // self.cache_config.block_size)


# The topics in the order their fields (and flags) appear: dataclasses collect base-class fields
# from the last base to the first, so ModelArgs (model first) is listed last.
ENGINE_TOPICS: tuple[type, ...] = (
    ModelArgs,
    LoadArgs,
    PoolerArgs,
    CacheArgs,
    SchedulerArgs,
    ParallelArgs,
    DeviceArgs,
    StructuredOutputsArgs,
    SpeculativeArgs,
    LoRAArgs,
)


@dataclass
class EngineArgs(
    LoRAArgs,
    SpeculativeArgs,
    StructuredOutputsArgs,
    DeviceArgs,
    ParallelArgs,
    SchedulerArgs,
    CacheArgs,
    PoolerArgs,
    LoadArgs,
    ModelArgs,
):
    """Every engine option, spelled as vLLM spells it: the fields of the topic dataclasses."""

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def check_combinations(self, runner: str) -> None:
        """Options that each make sense alone but not together: a ValueError naming what to drop."""
        errors = _combination_errors(self, runner)
        if errors:
            raise ValueError("; ".join(errors))

    def create_engine_config(self, usage_context: str = "llm") -> EngineConfig:
        """The checked configuration. ``usage_context`` ("llm": offline batches, "serve": the
        OpenAI server) picks defaults that depend on the workload (the step token budget)."""
        if usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {sorted(USAGE_CONTEXTS)}, got {usage_context!r}")
        if self.headless:
            raise ValueError(
                "headless runs only a node's worker ranks, not an engine: use `pagedllm serve MODEL --headless "
                "--nnodes N --node-rank R --distributed-init-method tcp://HOST:PORT` on that node"
            )
        self.check_load()
        model_dir = resolve_checkpoint(self.model_dir(), self.load_format)
        arch = load_arch_config(model_dir)
        self.check_attention_backend()
        device = self.resolve_device()
        model_config = self.create_model_config(model_dir, arch, device, self.load_format)
        runner = self.resolve_runner(arch)
        self.check_combinations(runner)
        if runner == "pooling":
            model_config = replace(
                model_config, runner=runner, pooler_config=self.create_pooler_config(model_dir, arch)
            )
        scheduler_config = self.create_scheduler_config(model_config.max_model_len, device, usage_context)
        cache_config = self.create_cache_config(device, model_config.dtype)
        if arch.encoder_only:
            scheduler_config, cache_config = encoder_only_configs(scheduler_config, cache_config)
        config = EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            self.create_parallel_config(),
            device,
            self.attention_backend,
            self.create_structured_outputs_config(),
            self.create_speculative_config(arch, model_config.max_model_len),
            enforce_eager=bool(self.enforce_eager),
            lora_config=self.create_lora_config(),
        )
        check_pipeline_parallel(config.parallel_config.pipeline_parallel_size, arch.num_hidden_layers, device)
        spec = config.speculative_config
        for a in (arch, spec.draft_arch if spec is not None else None):  # a draft model is split too
            if a is not None:
                check_tensor_parallel(
                    config.parallel_config.tensor_parallel_size, a.num_attention_heads, a.num_key_value_heads, device
                )
        check_data_parallel(config.parallel_config.data_parallel_size, device)
        check_kv_budget(config)
        return config


def _combination_errors(args: EngineArgs, runner: str) -> list[str]:
    errors = []
    if runner == "pooling" and args.speculative_config is not None:
        errors.append(
            "speculative decoding speeds up generation; an embedding (pooling) engine generates nothing: "
            "drop --speculative-config"
        )
    if runner == "pooling" and args.enable_lora:
        errors.append("LoRA adapters serve generation; an embedding (pooling) engine cannot: drop --enable-lora")
    if args.pipeline_parallel_size != 1:
        errors += _pipeline_errors(args, runner)
    if args.enable_lora and args.tensor_parallel_size != 1:
        errors.append(
            "LoRA adapters are not split across tensor-parallel ranks yet: use --tensor-parallel-size 1 "
            "with --enable-lora"
        )
    return errors


def _pipeline_errors(args: EngineArgs, runner: str) -> list[str]:
    """What pipeline stages do not run yet: each stage would need its share of these."""
    unsupported = {
        "--runner pooling (embeddings)": runner == "pooling",
        "--speculative-config": args.speculative_config is not None,
        "--enable-lora": bool(args.enable_lora),
    }
    return [
        f"{what} is not supported with pipeline parallelism yet: use --pipeline-parallel-size 1"
        for what, used in unsupported.items()
        if used
    ]


def encoder_only_configs(scheduler: SchedulerConfig, cache: CacheConfig) -> tuple[SchedulerConfig, CacheConfig]:
    """An encoder attends over the whole prompt at once and keeps no KV: every prompt runs in one
    step (the step budget holds the longest one) and there is no prefix cache to hit."""
    budget = max(scheduler.max_num_batched_tokens, scheduler.max_model_len)
    return (
        replace(scheduler, max_num_batched_tokens=budget, chunked_prefill=False),
        replace(cache, enable_prefix_caching=False),
    )


def check_kv_budget(config: EngineConfig) -> None:
    """The one check that a fixed KV pool (CPU) holds a request of max_model_len."""
    memory = config.cache_config.kv_cache_memory_bytes
    if config.kv_bytes_per_block() == 0:
        return  # an encoder: no KV memory at all
    if memory is None or config.device != "cpu" or config.cache_config.num_gpu_blocks_override is not None:
        return  # CUDA: the worker sizes the pool from the free memory; an override: it checks the count
    blocks = memory // config.kv_bytes_per_block()
    needed = config.blocks_per_max_len_request() + 1  # + the null block, as the worker counts it
    if blocks < needed:
        need_gib = needed * config.kv_bytes_per_block() / GiB
        default = " (the CPU default)" if memory == int(DEFAULT_CPU_KV_CACHE_GIB * GiB) else ""
        raise ValueError(
            f"kv_cache_memory={memory / GiB:.3g} GiB{default} holds {blocks} blocks of "
            f"{config.cache_config.block_size} tokens, but one request of max_model_len="
            f"{config.model_config.max_model_len} needs {needed} blocks ({need_gib:.3g} GiB); "
            "raise kv_cache_memory or lower max_model_len"
        )
