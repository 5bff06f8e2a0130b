"""Engine configuration (torch-free): one dataclass per topic, each validating its own fields.

``EngineArgs`` gathers the topics' fields (``model``, ``dtype``, ``block_size``, ...) and turns
them into one frozen ``EngineConfig`` of frozen sub-configs. Each field is declared once with
``options.option()`` (default, choices, help); the CLI flags (``entrypoints/cli_args.py``) and
``LLM(...)``'s keywords are generated from those fields. Name tables live in ``choices``.
"""

from pagedllm.config.cache import DEFAULT_CPU_KV_CACHE_GIB, CacheArgs, CacheConfig
from pagedllm.config.device import DeviceArgs
from pagedllm.config.engine import ENGINE_TOPICS, EngineArgs, EngineConfig, check_kv_budget
from pagedllm.config.frontend import FrontendArgs
from pagedllm.config.lora import LoRAArgs, LoRAConfig
from pagedllm.config.model import DEMO_MODEL_NAME, LoadArgs, ModelArgs, ModelConfig
from pagedllm.config.options import GiB
from pagedllm.config.parallel import ParallelArgs, ParallelConfig
from pagedllm.config.scheduler import (
    CPU_SERVING_MAX_NUM_BATCHED_TOKENS,
    SchedulerArgs,
    SchedulerConfig,
    default_max_num_batched_tokens,
)
from pagedllm.config.speculative import SpeculativeArgs, SpeculativeConfig
from pagedllm.config.structured_outputs import StructuredOutputsArgs, StructuredOutputsConfig

__all__ = [
    "CPU_SERVING_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_CPU_KV_CACHE_GIB",
    "DEMO_MODEL_NAME",
    "ENGINE_TOPICS",
    "GiB",
    "CacheArgs",
    "CacheConfig",
    "DeviceArgs",
    "EngineArgs",
    "EngineConfig",
    "FrontendArgs",
    "LoadArgs",
    "LoRAArgs",
    "LoRAConfig",
    "ModelArgs",
    "ModelConfig",
    "ParallelArgs",
    "ParallelConfig",
    "SchedulerArgs",
    "SchedulerConfig",
    "SpeculativeArgs",
    "SpeculativeConfig",
    "StructuredOutputsArgs",
    "StructuredOutputsConfig",
    "check_kv_budget",
    "default_max_num_batched_tokens",
]
