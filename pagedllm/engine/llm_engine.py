"""LLMEngine: the synchronous front end (input processing, output processing) around an EngineCore."""

from __future__ import annotations

import itertools
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.tokenizer import load_tokenizer
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    """Runs the engine core in this process; ``step()`` returns finished and partial outputs."""

    def __init__(self, config: EngineConfig) -> None:
        check_offline_parallelism(config)
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.tokenizer, config.model_config.trust_remote_code)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config, self.input_processor.grammar_compiler)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue one request (n > 1 fans out into n child requests)."""
        request, text = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, cache_salt, lora_request=lora_request
        )
        for core_request in self.output_processor.fan_out(request, text):
            self.engine_core.add_request(core_request)

    def add_pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, arrival_time: float | None = None
    ) -> None:
        """Validate, tokenize and queue one pooling (embedding) request."""
        request, text = self.input_processor.process_pooling(request_id, prompt, params, arrival_time)
        self.output_processor.add_request(request, text)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(ids)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached prefix block (the in-process engine core's); False while requests
        hold blocks, unless ``reset_running_requests`` preempts them first."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def check_integrity(self) -> None:
        self.engine_core.check_integrity()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also done at exit."""
        self.engine_core.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def check_offline_parallelism(config: EngineConfig) -> None:
    """Offline, one engine core runs in this process: data parallelism is the server's (vLLM too
    runs offline data parallelism as separate processes), so say how to get it."""
    dp = config.parallel_config.data_parallel_size
    if dp > 1:
        raise ValueError(
            f"data_parallel_size={dp} is not supported by the offline LLM/LLMEngine (one engine core in this "
            f"process): serve the model with `pagedllm serve MODEL --data-parallel-size {dp}` (one API server "
            f"over {dp} engine cores), or run {dp} LLM instances in separate processes, each on its share of the "
            "prompts, with data_parallel_size=1"
        )
