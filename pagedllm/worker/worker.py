"""Worker: one per device (one per TP rank later). Sets up the device, sizes the KV pool."""

from __future__ import annotations

import logging

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_GIB = 4.0


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.device)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit in the memory budget (the null block included)."""
        needed = self.config.blocks_per_max_len_request() + 1  # + the null block
        override = self.config.cache_config.num_gpu_blocks_override
        if override is not None:
            if override < needed:
                raise ValueError(f"num_gpu_blocks_override={override} cannot hold one request of max_model_len="
                                 f"{self.config.model_config.max_model_len} ({needed} blocks incl. the null block)")
            return override
        per_block = self.config.kv_bytes_per_block()
        budget = self._kv_memory_budget()
        if budget < per_block * needed:
            raise ValueError(f"the KV cache budget ({budget / (1 << 30):.3g} GiB) cannot hold one request of "
                             f"max_model_len={self.config.model_config.max_model_len}; lower max_model_len or "
                             "raise kv_cache_memory / gpu_memory_utilization")
        # More blocks than every sequence at full length could use only lengthens start-up;
        # what is left over still serves the prefix cache, so keep a generous cap.
        useful = self.config.scheduler_config.max_num_seqs * self.config.blocks_per_max_len_request() + 1
        return int(min(budget // per_block, useful))

    def _kv_memory_budget(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            return int(total * self.config.cache_config.gpu_memory_utilization - used)
        memory = self.config.cache_config.kv_cache_memory_bytes
        return memory if memory is not None else int(_DEFAULT_CPU_KV_GIB * (1 << 30))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)
