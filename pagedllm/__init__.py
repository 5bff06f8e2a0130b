"""pagedllm: a high-throughput LLM inference and serving engine.

The heavy parts (torch, transformers) load on first use, so the torch-free control plane
(``pagedllm.core``, ``pagedllm.kv_cache``) imports without them.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "BeamSearchParams": "pagedllm.beam_search",
    "BeamSearchOutput": "pagedllm.beam_search",
    "BeamSearchSequence": "pagedllm.beam_search",
    "EngineArgs": "pagedllm.config",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "LoRARequest": "pagedllm.lora.request",
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
