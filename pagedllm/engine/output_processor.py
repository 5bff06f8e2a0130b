"""Front-end output path: engine-core outputs -> ``RequestOutput``s.

Runs once per engine step for every request that produced something, so the per-request work
is incremental: new tokens are detokenized, new logprob rows formatted, and stop strings
searched only in the new text. Stop strings are handled here, not in the engine core: a
request that hits one is finished here and its id returned in ``reqs_to_abort`` so the caller
aborts it in the core.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from pagedllm.engine.logprobs import LogprobsProcessor
from pagedllm.engine.parallel_sampling import ParentRequest
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # finished here by a stop string


class RequestState:
    """Front-end state of one engine-core request (a plain request or one child)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Any,
        token_texts: TokenTextCache | None,
        parent: ParentRequest | None,
        index: int,
        queue: Any,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent, self.index, self.queue = parent, index, queue
        self.output_kind = params.output_kind
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params, token_texts)
        self.logprobs = LogprobsProcessor(params, self.detokenizer.decode_token)
        self.output_token_ids: list[int] = []
        self.metrics = RequestMetrics(request.arrival_time or time.monotonic())
        self.num_cached_tokens = 0
        self._num_sent_tokens = 0  # output tokens already reported (for DELTA)
        self.pooling = request.pooling_params is not None  # reported once, with its embedding

    def update(self, out: EngineCoreOutput) -> str | None:
        """Take one step's output; return the stop string that finished it, if any."""
        self.output_token_ids.extend(out.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.num_draft_tokens:
            self.metrics.spec_num_drafts += 1
            self.metrics.spec_num_draft_tokens += out.num_draft_tokens
            self.metrics.spec_num_accepted_tokens += out.num_accepted_tokens
        self.logprobs.update_from_output(out.new_logprobs, out.new_prompt_logprobs)
        stop_terminated = out.finish_reason == FinishReason.STOP
        return self.detokenizer.update(out.new_token_ids, stop_terminated)

    def update_metrics(self, out: EngineCoreOutput, now: float, finished: bool) -> None:
        if out.new_token_ids:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = now
            self.metrics.last_token_time = now
        if finished:
            self.metrics.finished_time = now

    def make_completion(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> CompletionOutput | None:
        """What to report now, or None when there is nothing (new) to report."""
        finished = finish_reason is not None
        nothing_new = len(self.output_token_ids) == self._num_sent_tokens
        if not finished and (self.output_kind == FINAL_ONLY or nothing_new):
            return None
        delta = self.output_kind == DELTA
        start = self._num_sent_tokens if delta else 0
        self._num_sent_tokens = len(self.output_token_ids)
        text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = self.logprobs.logprobs
        return CompletionOutput(
            self.index,
            text,
            self.output_token_ids[start:],
            self.logprobs.cumulative_logprob,
            None if logprobs is None else logprobs[start:],
            str(finish_reason) if finished else None,
            stop_reason if finished else None,
        )

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """DELTA reports the prompt logprobs once; the other kinds every time."""
        if self.output_kind == DELTA:
            return self.logprobs.pop_prompt_logprobs()
        return self.logprobs.prompt_logprobs

    def make_pooling_output(self, out: EngineCoreOutput) -> PoolingRequestOutput:
        """The pooling request's one output: its embedding, or why it has none."""
        error = str(out.stop_reason) if out.finish_reason == FinishReason.ERROR else None
        return PoolingRequestOutput(
            self.request_id,
            PoolingOutput(out.pooling_output) if out.pooling_output is not None else None,
            self.prompt_token_ids,
            True,
            out.num_cached_tokens,
            str(out.finish_reason),
            error,
        )

    def make_output(self, completion: CompletionOutput) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            self.take_prompt_logprobs(),
            [completion],
            completion.finished(),
            dataclasses.replace(self.metrics),
            self.num_cached_tokens,
        )


class OutputProcessor:
    """Turns each engine step's ``EngineCoreOutput``s into ``RequestOutput``s."""

    def __init__(self, tokenizer: Any, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats  # False: skip per-token timestamps (metrics keep arrival)
        self._token_texts = TokenTextCache(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        """Track a request (or child ``index`` of ``parent``); ``queue`` gets its outputs."""
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.request_states[request.request_id] = RequestState(
            request, prompt, self.tokenizer, self._token_texts, parent, index, queue
        )
        if parent is not None:
            parent.running.add(request.request_id)
            parent.queue = queue if queue is not None else parent.queue
            self.parents[parent.request_id] = parent

    def fan_out(self, request: EngineCoreRequest, prompt: str | None, queue: Any = None) -> list[EngineCoreRequest]:
        """Track a new request; n > 1 fans out into n child requests under one ``ParentRequest``
        (the one place both LLMEngine and AsyncLLM do it). Returns what to send to the core."""
        n = request.sampling_params.n
        if n == 1:
            self.add_request(request, prompt, queue=queue)
            return [request]
        parent = ParentRequest(
            request.request_id,
            n,
            request.sampling_params.output_kind,
            prompt,
            request.prompt_token_ids,
            request.arrival_time,
        )
        children = [ParentRequest.child_request(request, index) for index in range(n)]
        for index, child in enumerate(children):
            self.add_request(child, prompt, parent, index, queue=queue)
        return children

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget these requests; return the engine-core ids (a parent's children) it knew."""
        aborted: list[str] = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            child_ids = list(parent.running) if parent is not None else [request_id]
            for child_id in child_ids:
                state = self.request_states.pop(child_id, None)
                if state is not None:
                    aborted.append(child_id)
                    self._detach(state)
        return aborted

    def _detach(self, state: RequestState) -> None:
        """A request ended: drop its parent too once every child has ended."""
        parent = state.parent
        if parent is None:
            return
        parent.child_done(state.request_id)
        if parent.finished:
            self.parents.pop(parent.request_id, None)

    # ------------------------------------------------------------------ per step
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Handle one engine step; outputs of requests with a queue go to that queue."""
        result = OutputProcessorOutput()
        touched: dict[str, ParentRequest] = {}  # non-DELTA parents: one output per step
        now = time.monotonic()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is not None:  # None: aborted while the step ran
                self._process_one(state, out, now, result, touched)
        for parent in touched.values():
            if parent.output_kind != FINAL_ONLY or parent.finished:
                self._emit(parent.queue, parent.make_aggregate_output(), result)
        return result

    def _process_one(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
        touched: dict[str, ParentRequest],
    ) -> None:
        if state.pooling:
            self._process_pooling(state, out, now, result)
            return
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        stop_string = state.update(out)
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
            if not out.finished:  # the core doesn't know stop strings: the caller aborts it
                result.reqs_to_abort.append(state.request_id)
        elif finish_reason is not None:
            state.detokenizer.flush()
        if self.log_stats:
            state.update_metrics(out, now, finish_reason is not None)
        if finish_reason is not None:
            del self.request_states[state.request_id]
            self._detach(state)
        completion = state.make_completion(finish_reason, stop_reason)
        if completion is None:
            return
        if state.parent is None:
            self._emit(state.queue, state.make_output(completion), result)
        else:
            self._to_parent(state, completion, result, touched)

    def _process_pooling(
        self, state: RequestState, out: EngineCoreOutput, now: float, result: OutputProcessorOutput
    ) -> None:
        if not out.finished:
            return  # a prompt chunk: the request reports once, when its embedding is done
        if self.log_stats:
            state.update_metrics(out, now, True)
        del self.request_states[state.request_id]
        self._emit(state.queue, state.make_pooling_output(out), result)

    def _to_parent(
        self,
        state: RequestState,
        completion: CompletionOutput,
        result: OutputProcessorOutput,
        touched: dict[str, ParentRequest],
    ) -> None:
        parent = state.parent
        assert parent is not None
        _merge_metrics(parent.metrics, state.metrics, parent.finished)
        parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
        prompt_logprobs = parent.take_prompt_logprobs(state.take_prompt_logprobs())
        if parent.output_kind == DELTA:  # stream each child's delta as it comes
            self._emit(parent.queue, parent.make_output([completion], prompt_logprobs), result)
        else:
            parent.latest[completion.index] = completion
            touched[parent.request_id] = parent

    @staticmethod
    def _emit(queue: Any, output: RequestOutput | PoolingRequestOutput, result: OutputProcessorOutput) -> None:
        if queue is not None:
            queue.put_nowait(output)
        else:
            result.request_outputs.append(output)


def _merge_metrics(parent: RequestMetrics, child: RequestMetrics, finished: bool) -> None:
    """The parent's first token is its first child's; it finishes with its last child."""
    if parent.first_token_time is None:
        parent.first_token_time = child.first_token_time
    parent.last_token_time = child.last_token_time or parent.last_token_time
    if finished:
        parent.finished_time = child.finished_time
    parent.spec_num_drafts += child.spec_num_drafts
    parent.spec_num_draft_tokens += child.spec_num_draft_tokens
    parent.spec_num_accepted_tokens += child.spec_num_accepted_tokens
