"""Beam search on an asyncio engine (the server's ``EngineClient``), vLLM's server behaviour.

The step loop is ``pagedllm.beam_search.BeamSearch``'s, which the offline ``LLM`` drives too:
each step every live beam runs as a one-token request with ``logprobs = 2 * width``, here one
``engine.generate`` per beam, all awaited together and each consumed to its end. Cancelling the
search (the client went away) cancels those consumers, and each ``generate`` aborts its request
on the way out, so no step request stays in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any

from pagedllm.beam_search import BeamSearch, BeamSearchParams, beams_output
from pagedllm.engine.input_processor import PromptType, default_eos_token_id, tokenize_prompt, validate_prompt
from pagedllm.entrypoints.openai.engine_client import EngineClient
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


async def beam_search(
    engine: EngineClient,
    prompt: PromptType,
    sp: SamplingParams,
    params: BeamSearchParams,
    request_id: str,
    priority: int = 0,
    cache_salt: str | None = None,
    tenant: str | None = None,
) -> AsyncIterator[RequestOutput]:
    """Search from one prompt; yields one finished output with its best ``sp.n`` beams (as
    ``engine.generate`` would, so the server's streams take it as they take any request's).
    ValueError for a prompt the engine would refuse, before anything runs."""
    model_config = engine.config.model_config
    text, prompt_ids = tokenize_prompt(engine.tokenizer, prompt)
    validate_prompt(prompt_ids, model_config.max_model_len, model_config.arch.vocab_size)
    eos = default_eos_token_id(engine.config, engine.tokenizer)
    search = BeamSearch([prompt_ids], params, eos, model_config.max_model_len, salts=[cache_salt])
    num_cached_tokens = None
    who: dict[str, Any] = {"tenant": tenant} if tenant is not None else {}  # only when set, as the handlers pass it
    for step, step_prompts in enumerate(search.steps()):
        outputs = await _all_or_none(
            _final(engine.generate(p, search.step_params, f"{request_id}-{step}-{i}", priority=priority, **who))
            for i, p in enumerate(step_prompts)
        )
        if num_cached_tokens is None:
            num_cached_tokens = outputs[0].num_cached_tokens  # the prompt's own prefix-cache hit
        search.advance(outputs)
    (beams,) = search.best()
    yield beams_output(request_id, text, prompt_ids, beams, sp, engine.tokenizer, num_cached_tokens or 0)


async def _final(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Consume one request's stream to its end: its last (finished) output."""
    last = None
    async for output in outputs:
        last = output
    assert last is not None, "a request's stream ends with its finished output"
    return last


async def _all_or_none(coros: Iterable[Coroutine[Any, Any, RequestOutput]]) -> list[RequestOutput]:
    """Run the step's requests together; when one fails or the search is cancelled, cancel
    the others and wait for them, so each has aborted its request before this returns."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        raise
