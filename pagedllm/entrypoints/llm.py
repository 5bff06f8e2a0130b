"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from pagedllm.beam_search import BeamSearchInstance, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedllm.config import EngineArgs
from pagedllm.demo.demo_model import with_demo_model
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat_utils import render_chat_ids
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Generate text for batches of prompts with continuous batching on a paged KV cache.

    ``model`` is a local Hugging Face-format directory, or None for the built-in demo model.
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
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is text, token ids, or a dict with
        ``"prompt"`` or ``"prompt_token_ids"`` and optionally ``"cache_salt"`` (prompts with
        different salts never share prefix-cache blocks; equal salts do)."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = _per_prompt(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        if any(p.use_beam_search for p in params):
            return self._generate_with_beams(prompts, params, priorities, use_tqdm)
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priorities):
                ids.append(self.llm_engine.next_request_id())
                self.llm_engine.add_request(ids[-1], prompt, p, priority=prio)
        except Exception:
            self.llm_engine.abort_request(ids)  # one bad prompt must not leave the others queued
            raise
        return self._run_engine(ids, use_tqdm)

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
            self._decode_beams(beams, params.include_stop_str_in_output, skip_special_tokens=True)
        return [BeamSearchOutput(beams) for beams in searched]

    def _check_beam_width(self, beam_width: int) -> None:
        max_logprobs = self.llm_engine.config.model_config.max_logprobs
        if 0 <= max_logprobs < 2 * beam_width:
            raise ValueError(
                f"beam_width={beam_width} needs 2 * beam_width logprobs per step, more than this "
                f"engine's max_logprobs={max_logprobs}; use beam_width <= {max_logprobs // 2} or start the "
                "engine with a larger max_logprobs (LLM(..., max_logprobs=N); -1 for no cap)"
            )

    def _run_beam_search(self, prompts: list[PromptType], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        processor = self.llm_engine.input_processor
        instances = [BeamSearchInstance(processor.tokenize(p)[1], params, processor.eos_token_id) for p in prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        step_params = SamplingParams(
            n=1, max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width, detokenize=False
        )
        for _ in range(params.max_tokens):
            if not self._beam_search_step(instances, salts, step_params):
                break
        return [inst.best() for inst in instances]

    def _decode_beams(self, beams: list[BeamSearchSequence], include_stop: bool, skip_special_tokens: bool) -> None:
        """The generated part; an EOS that ended a beam is spelled out only with include_stop
        (it is a special token, which skip_special_tokens would otherwise drop)."""
        tokenizer = self.get_tokenizer()
        for beam in beams:
            ids = beam.output_token_ids
            stopped = beam.finish_reason == "stop"
            beam.text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=skip_special_tokens)
            if stopped and include_stop:
                beam.text += tokenizer.decode(ids[-1:], skip_special_tokens=False)

    def _beam_search_step(
        self, instances: list[BeamSearchInstance], salts: list[str | None], step_params: SamplingParams
    ) -> bool:
        """One token for every live beam; False when no beam is left to extend."""
        max_model_len = self.llm_engine.config.model_config.max_model_len
        live: list[tuple[BeamSearchInstance, BeamSearchSequence, str | None]] = []
        for inst, salt in zip(instances, salts):
            inst.finish_at_length_limit(max_model_len)
            live.extend((inst, beam, salt) for beam in inst.beams)
        if not live:
            return False
        prompts: list[PromptType] = [_beam_prompt(beam, salt) for _, beam, salt in live]
        outputs = self.generate(prompts, step_params, use_tqdm=False)
        for (inst, beam, _), output in zip(live, outputs):
            step_logprobs = output.outputs[0].logprobs
            assert step_logprobs, "a one-token request with logprobs reports one logprobs row"
            inst.expand(beam, step_logprobs[0])
        for inst in instances:
            inst.prune()
        return True

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
        beam_params = BeamSearchParams(
            beam_width=sp.beam_width,
            max_tokens=sp.max_tokens or self.llm_engine.config.model_config.max_model_len,
            ignore_eos=sp.ignore_eos,
            length_penalty=sp.length_penalty,
            include_stop_str_in_output=sp.include_stop_str_in_output,
        )
        self._check_beam_width(beam_params.beam_width)
        outputs = []
        for prompt, beams in zip(prompts, self._run_beam_search(prompts, beam_params)):
            self._decode_beams(beams[: sp.n], sp.include_stop_str_in_output, sp.skip_special_tokens)
            text, prompt_ids = self.llm_engine.input_processor.tokenize(prompt)
            completions = [_completion(i, beam, sp) for i, beam in enumerate(beams[: sp.n])]
            outputs.append(
                RequestOutput(self.llm_engine.next_request_id(), text, prompt_ids, None, completions, finished=True)
            )
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

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
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


def _beam_prompt(beam: BeamSearchSequence, salt: str | None) -> PromptType:
    prompt: dict[str, Any] = {"prompt_token_ids": beam.tokens}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def _beam_key(sp: SamplingParams) -> tuple:
    """Requests with equal keys can share one beam search."""
    fields = ("beam_width", "max_tokens", "ignore_eos", "length_penalty", "include_stop_str_in_output")
    return tuple(getattr(sp, name) for name in fields) + (sp.n, sp.logprobs, sp.skip_special_tokens)


def _completion(index: int, beam: BeamSearchSequence, sp: SamplingParams) -> CompletionOutput:
    logprobs = None
    if sp.logprobs is not None:
        logprobs = [_trim_logprobs(row, token, sp.logprobs) for row, token in zip(beam.logprobs, beam.output_token_ids)]
    return CompletionOutput(
        index=index,
        text=beam.text or "",
        token_ids=beam.output_token_ids,
        cumulative_logprob=beam.cum_logprob,
        logprobs=logprobs,
        finish_reason=beam.finish_reason,
        stop_reason=beam.stop_reason,
    )


def _trim_logprobs(row: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """The step's candidates cut to what the request asked for: the chosen token and the top k."""
    return {t: lp for t, lp in row.items() if t == token or k < 0 or (lp.rank is not None and lp.rank <= k)}


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


def _per_prompt(value: Any, n: int, name: str) -> list:
    if value is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts; pass one or one per prompt")
        return list(value)
    return [value] * n


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
