"""Front-end request intake: tokenize, validate against the model, fill engine-side defaults."""

from __future__ import annotations

import dataclasses
import operator
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.engine.tokenizer import generation_eos_token_ids
from pagedllm.lora.peft_files import AdapterSpec, check_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.structured_output.manager import make_grammar_compiler

# A prompt: text, token ids, or a dict with "prompt" or "prompt_token_ids" (and optionally
# "cache_salt": requests with different salts never share prefix-cache blocks).
PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.arch.vocab_size
        self.max_logprobs = config.model_config.max_logprobs
        self.scheduling_policy = config.scheduler_config.policy
        self.eos_token_id = default_eos_token_id(config, tokenizer)
        self.extra_eos_ids = generation_eos_token_ids(config.model_config.model)
        # Compiles each new constraint once, off the engine loop, to reject bad ones at intake.
        self.grammar_compiler = make_grammar_compiler(config, tokenizer)
        self.pooler_config = config.model_config.pooler_config  # None: a generation engine
        self._adapters: dict[LoRARequest, AdapterSpec] = {}  # adapters already checked

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

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
        lora_request: LoRARequest | None = None,
        tenant: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and build the core request. ``strict_max_tokens``: too-long max_tokens is an
        error (the server's behaviour) instead of being capped by max_model_len. ``check_grammar``:
        compile a structured-output constraint here, blocking (async callers use ``acheck``).
        ``cache_salt``: the prompt dict's ``"cache_salt"`` takes its place when present."""
        self._check_runner("generate")
        self._check_priority(priority)
        self._check_logprobs(params)
        if lora_request is not None:
            self.check_lora(lora_request)
        if check_grammar and params.structured_outputs is not None:
            self.grammar_compiler.check(params.structured_outputs)
        cache_salt = _cache_salt(prompt, cache_salt)
        text, token_ids = self.tokenize(prompt)
        token_ids = self._truncate(token_ids, params)
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
            lora_request=lora_request,
            tenant=tenant,
        )
        return request, text

    def check_lora(self, lora: LoRARequest) -> AdapterSpec:
        """The adapter checked against the base model (once per request object): ValueError
        naming it when LoRA is off, or its files, rank, targets or shapes do not fit."""
        spec = self._adapters.get(lora)
        if spec is not None:
            return spec
        lora_config = self.config.lora_config
        if lora_config is None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} was requested, but this engine runs without LoRA: start it "
                "with --enable-lora (LLM(..., enable_lora=True))"
            )
        spec = check_adapter(lora.lora_name, lora.lora_path, self.config.model_config.arch, lora_config.max_lora_rank)
        self._adapters[lora] = spec
        return spec

    def process_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and build a pooling (embedding) request: the whole prompt, up to
        max_model_len tokens, is embedded; nothing is generated."""
        self._check_runner("pooling")
        self._check_priority(priority)
        text, token_ids = self.tokenize(prompt)
        token_ids = self._truncate_for_pooling(token_ids, params)
        validate_prompt(token_ids, self.max_model_len, self.vocab_size, generates=False)
        request = EngineCoreRequest(
            request_id,
            token_ids,
            SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY),
            None,
            arrival_time if arrival_time is not None else time.monotonic(),
            priority,
            _cache_salt(prompt, None),
            self._finalize_pooling(params),
            tenant=tenant,
        )
        return request, text

    def _check_runner(self, wanted: str) -> None:
        """Generation on an embedding engine (and the reverse) is an error that says what to use."""
        pooling = self.pooler_config is not None
        if wanted == "generate" and pooling:
            raise ValueError(
                f"the model {self.config.model_config.served_model_name} runs as an embedding model (runner "
                "pooling): it embeds prompts (LLM.embed, /v1/embeddings) and cannot generate text; start the "
                "engine with --runner generate for generation, if the model has a language-model head"
            )
        if wanted == "pooling" and not pooling:
            raise ValueError(
                f"the model {self.config.model_config.served_model_name} runs as a generation model: it "
                "generates text (LLM.generate, /v1/completions, /v1/chat/completions) and does not embed; "
                "start the engine with --runner pooling (LLM(..., runner='pooling')) for embeddings"
            )

    def _truncate_for_pooling(self, token_ids: list[int], params: PoolingParams) -> list[int]:
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        elif keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={keep} is more than this model's maximum context length "
                f"(max_model_len) of {self.max_model_len}; pass at most {self.max_model_len}, or -1"
            )
        return token_ids[-keep:] if params.truncation_side == "left" else token_ids[:keep]

    def _finalize_pooling(self, params: PoolingParams) -> PoolingParams:
        """The request's copy, with the model's pooling type; ``dimensions`` within the model's."""
        config = self.pooler_config
        assert config is not None, "checked by _check_runner"
        if params.dimensions is not None and params.dimensions > config.hidden_size:
            raise ValueError(
                f"dimensions={params.dimensions} is more than this model's embedding size of {config.hidden_size}; "
                f"pass at most {config.hidden_size}, or leave dimensions out for the full embedding"
            )
        return dataclasses.replace(params, pooling_type=config.pooling_type)

    def _check_priority(self, priority: int) -> None:
        """A priority the scheduler would ignore is an error, offline and on the server alike."""
        if priority and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduler, but this engine schedules "
                f"{self.scheduling_policy}: start it with --scheduling-policy priority "
                "(LLM(..., scheduling_policy='priority')), or leave priority at 0"
            )

    def _check_logprobs(self, params: SamplingParams) -> None:
        """logprobs / prompt_logprobs above the engine's max_logprobs (-1: no cap) are errors;
        -1 asks for the whole vocabulary."""
        if self.max_logprobs < 0:
            return
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and self._num_logprobs(value) > self.max_logprobs:
                whole = f" (the whole vocabulary, {self.vocab_size})" if value == -1 else ""
                raise ValueError(
                    f"{name}={value}{whole} is more than this engine's max_logprobs={self.max_logprobs}; ask for "
                    f"at most {self.max_logprobs}, or start the engine with a larger --max-logprobs "
                    "(LLM(..., max_logprobs=N); -1 for no cap)"
                )

    def _num_logprobs(self, value: int) -> int:
        return self.vocab_size if value == -1 else value

    def _truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        """Keep ``truncate_prompt_tokens`` tokens: the last ones (left side) or the first (right)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:  # as many as leave room for max_tokens (at least one token)
            keep = self.max_model_len - (params.max_tokens or 1)
            if keep < 1:
                raise ValueError(
                    f"truncate_prompt_tokens=-1 keeps max_model_len ({self.max_model_len}) - max_tokens "
                    f"({params.max_tokens}) = {keep} prompt tokens; lower max_tokens"
                )
        elif keep >= self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={keep} leaves no room to generate within max_model_len="
                f"{self.max_model_len}; pass at most {self.max_model_len - 1}, or -1 for as many as fit"
            )
        return token_ids[-keep:] if params.truncation_side == "left" else token_ids[:keep]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _validate_prompt(self, token_ids: list[int]) -> None:
        validate_prompt(token_ids, self.max_model_len, self.vocab_size)

    def _finalize_params(self, params: SamplingParams, prompt_len: int, strict: bool) -> SamplingParams:
        params.verify_vocab(self.vocab_size)
        params = params.clone()
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            params.max_tokens = room
            # Set after SamplingParams' own checks: a min_tokens past it would reach the engine
            # process unchecked, fail its message decoding and stop the engine for everyone.
            if params.min_tokens > room:
                raise ValueError(
                    f"min_tokens ({params.min_tokens}) is more than the {room} tokens this prompt leaves room for "
                    f"(max_model_len {self.max_model_len} - {prompt_len} prompt tokens); lower min_tokens"
                )
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
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary, as a count the sampler takes
            if getattr(params, name) == -1:
                setattr(params, name, self.vocab_size)
        params.bad_words_token_ids = self._tokenize_bad_words(params.bad_words or [])
        return params

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's token sequences: as written (leading spaces stripped) and after a space,
        the form it takes inside a text. vLLM keeps the spaced form only when it has as many
        tokens as the bare one, which lets a mid-text word through whenever the space merges
        into its tokens differently; every distinct form is kept here."""
        sequences: list[list[int]] = []
        for word in words:
            bare, spaced = (self._encode(text) for text in (word.lstrip(), " " + word.lstrip()))
            if not bare:
                raise ValueError(f"bad_words entry {word!r} tokenizes to no tokens; remove it")
            for ids in (bare, spaced):
                if ids and ids not in sequences:
                    sequences.append(ids)
        bad = sorted({t for ids in sequences for t in ids if not 0 <= t < self.vocab_size})
        if bad:
            raise ValueError(
                f"bad_words tokenize to ids {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})"
            )
        return sequences


def _cache_salt(prompt: PromptType, cache_salt: str | None) -> str | None:
    """The prompt dict's ``"cache_salt"`` if it has one, else ``cache_salt``; a non-empty string."""
    if isinstance(prompt, dict) and "cache_salt" in prompt:
        cache_salt = prompt["cache_salt"]
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string (or left out), got {cache_salt!r}")
    return cache_salt


def default_eos_token_id(config: EngineConfig, tokenizer: Any) -> int | None:
    """The tokenizer's EOS, else the model config's first."""
    if tokenizer.eos_token_id is not None or not config.model_config.arch.eos_token_ids:
        return tokenizer.eos_token_id
    return config.model_config.arch.eos_token_ids[0]


def tokenize_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids only) and token ids."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"])
        raise ValueError("a dict prompt needs a 'prompt' or 'prompt_token_ids' key")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")


def _is_integer(value: Any) -> bool:
    """An int, a NumPy integer or a 0-d integer tensor: anything ``operator.index`` takes."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def validate_prompt(token_ids: list[int], max_model_len: int, vocab_size: int, generates: bool = True) -> None:
    """ValueError unless the prompt is non-empty, fits (leaving room for a token when it
    ``generates``) and is in the vocabulary."""
    if not token_ids:
        raise ValueError("the prompt is empty; pass at least one token")
    if len(token_ids) > max_model_len - generates:
        room = " and at least one token must be generated" if generates else ""
        advice = "shorten the prompt" if generates else "shorten the input or pass truncate_prompt_tokens"
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, but this model's maximum context length "
            f"(max_model_len) is {max_model_len}{room}; {advice}"
        )
    wrong_type = [t for t in token_ids if isinstance(t, bool) or not _is_integer(t)]
    if wrong_type:
        raise ValueError(f"prompt token ids must be integers; got {wrong_type[:5]!r}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
