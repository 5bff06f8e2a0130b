"""``EngineClient``: what the HTTP server needs from its engine (``AsyncLLM`` implements it).

The routes and handlers are typed against this, not against ``AsyncLLM``, so a test can serve
the real app on a small fake engine, and another engine front end (several engine processes,
a remote engine) only has to provide these members.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.input_processor import PromptType
    from pagedllm.lora.request import LoRARequest
    from pagedllm.metrics.stats import StatLogger
    from pagedllm.outputs import PoolingRequestOutput, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """An asyncio engine: requests in, streams of ``RequestOutput`` out."""

    config: EngineConfig  # model_config (max_model_len, vocab), scheduler_config (max_num_seqs), device
    tokenizer: Any  # the HF tokenizer the engine detokenizes with: /tokenize, chat templates
    stat_loggers: list[StatLogger]  # the server adds its Prometheus logger here

    @property
    def is_running(self) -> bool:
        """False once the engine is gone (died or shut down)."""
        ...

    @property
    def capacity(self) -> dict:
        """What the KV cache holds (``summary``, ``startup_seconds``), for the start-up banner."""
        ...

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = True,
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; ValueError for input it rejects; closing it aborts.
        ``tenant``: the API key's name (never the key), for the engine's fair share."""
        ...

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        tenant: str | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Embed one prompt (a pooling engine): yields its one output; ValueError for bad input."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError naming the adapter unless it fits the engine's base model and LoRA settings."""
        ...

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError if the request's output constraint is invalid (compiles it, cached)."""
        ...

    async def check_health(self) -> None:
        """Raise (EngineDeadError) unless the engine answers."""
        ...

    def get_num_unfinished_requests(self) -> int: ...

    def shutdown(self) -> None: ...
