"""An engine on a dummy model with a batch of requests decoding, for the decode-step benchmarks."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.bench.common import read_hf_config
from pagedllm.entrypoints.bench.machine import model_cost
from pagedllm.sampling_params import SamplingParams


def decoding_engine(
    model_dir: Path,
    batch: int,
    context: int,
    seed: int,
    max_tokens: int,
    lora_requests: Sequence[Any] = (None,),
    pool_tokens: int | None = None,
    **engine_args: Any,
) -> Any:
    """An ``LLMEngine`` on ``model_dir``'s dummy weights (float32 unless ``engine_args`` say; a
    ``load_format`` there reads the directory's checkpoint instead)
    holding ``batch`` greedy requests of ``context`` random prompt tokens, each already past its
    prefill (in chunks where it must) and three decode steps (the first builds the decode stack);
    requests ``"0"`` .. ``str(batch - 1)``, each for at most ``max_tokens`` tokens, request i
    under ``lora_requests[i % len(lora_requests)]``. ``pool_tokens``: a KV pool just big enough for
    that many tokens a request (``max_model_len`` too), so the prefaulter has it all faulted in
    soon after start (on a VM a first touch of fresh pages costs more than a step's writes)."""
    if pool_tokens is not None:
        kv = engine_args.get("kv_cache_dtype") or "auto"
        per_token = model_cost(read_hf_config(model_dir), "float32", kv).kv_bytes_per_token
        engine_args.setdefault("max_model_len", pool_tokens)
        engine_args.setdefault("max_num_batched_tokens", max(2048, pool_tokens))
        engine_args.setdefault("kv_cache_memory", 1.1 * batch * pool_tokens * per_token / 2**30 + 0.01)
    engine_args.setdefault("load_format", "dummy")
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            dtype="float32",
            enable_prefix_caching=False,
            max_num_seqs=batch,
            **engine_args,
        )
    )
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i in range(batch):
        prompt = {"prompt_token_ids": [rng.randrange(10, 40_000) for _ in range(context)]}
        engine.add_request(str(i), prompt, params, lora_request=lora_requests[i % len(lora_requests)])
    started: set[str] = set()
    while len(started) < batch:  # prefill (in chunks) until every request has its first token
        started.update(out.request_id for out in engine.step() if _has_token(out))
    for _ in range(3):
        engine.step()
    return engine


def _has_token(out: Any) -> bool:
    return isinstance(out.outputs, list) and bool(out.outputs) and bool(out.outputs[0].token_ids)
