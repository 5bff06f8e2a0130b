"""Front-end request intake: tokenize, validate against the model, fill engine-side defaults."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.engine.tokenizer import generation_eos_token_ids
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import make_grammar_compiler

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.arch.vocab_size
        self.scheduling_policy = config.scheduler_config.policy
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None and config.model_config.arch.eos_token_ids:
            self.eos_token_id = config.model_config.arch.eos_token_ids[0]
        self.extra_eos_ids = generation_eos_token_ids(config.model_config.model)
        # Compiles each new constraint once, off the engine loop, to reject bad ones at intake.
        self.grammar_compiler = make_grammar_compiler(config, tokenizer)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        strict_max_tokens: bool = False,
        check_grammar: bool = True,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and build the core request. ``strict_max_tokens``: too-long max_tokens is an
        error (the server's behaviour) instead of being capped by max_model_len. ``check_grammar``:
        compile a structured-output constraint here, blocking (async callers use ``acheck``)."""
        self._check_priority(priority)
        if check_grammar and params.structured_outputs is not None:
            self.grammar_compiler.check(params.structured_outputs)
        text, token_ids = self.tokenize(prompt)
        self._validate_prompt(token_ids)
        params = self._finalize_params(params, len(token_ids), strict_max_tokens)
        request = EngineCoreRequest(
            request_id,
            token_ids,
            params,
            self.eos_token_id,
            arrival_time if arrival_time is not None else time.monotonic(),
            priority,
            cache_salt,
        )
        return request, text

    def _check_priority(self, priority: int) -> None:
        """A priority the scheduler would ignore is an error, offline and on the server alike."""
        if priority and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduler, but this engine schedules "
                f"{self.scheduling_policy}: start it with --scheduling-policy priority "
                "(LLM(..., scheduling_policy='priority')), or leave priority at 0"
            )

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty; pass at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} and at least one token must be "
                "generated; shorten the prompt"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _finalize_params(self, params: SamplingParams, prompt_len: int, strict: bool) -> SamplingParams:
        params.verify_vocab(self.vocab_size)
        params = params.clone()
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room and strict:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce max_tokens to at most {room}."
            )
        stops = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stops |= self.extra_eos_ids | ({self.eos_token_id} if self.eos_token_id is not None else set())
        params.all_stop_token_ids = stops
        return params
