"""Parallel sampling (``n > 1``): one request fans out into n child requests, one per sample,
whose outputs ``OutputProcessor`` gathers back under the parent's id."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec

from pagedllm.engine.protocol import EngineCoreRequest
from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

DELTA = RequestOutputKind.DELTA


class ParentRequest:
    """A request with n > 1: the caller fans it out into n child requests (one per sample),
    and this gathers the children's outputs into one ``RequestOutput`` under the parent id."""

    def __init__(
        self,
        request_id: str,
        n: int,
        output_kind: RequestOutputKind,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.n = n
        self.output_kind = output_kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.metrics = RequestMetrics(arrival_time or time.monotonic())
        self.running: set[str] = set()  # child ids not yet finished or aborted
        self.num_done = 0
        self.latest: dict[int, CompletionOutput] = {}  # by index; unused for DELTA
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.queue: Any = None

    @staticmethod
    def child_request(request: EngineCoreRequest, index: int) -> EngineCoreRequest:
        """Child ``index`` of a request: id ``f"{index}_{parent_id}"``, n=1, its own seed."""
        params = request.sampling_params.clone(n=1, best_of=None)
        if params.seed is not None:
            params.seed += index  # same seed in every child would give n identical samples
        child_id = f"{index}_{request.request_id}"
        return msgspec.structs.replace(request, request_id=child_id, sampling_params=params)

    @property
    def finished(self) -> bool:
        return self.num_done == self.n

    def child_done(self, child_id: str) -> None:
        self.running.discard(child_id)
        self.num_done += 1

    def take_prompt_logprobs(self, from_child: PromptLogprobs | None) -> PromptLogprobs | None:
        """All children share the prompt: report the first child's prompt logprobs."""
        if self.output_kind == DELTA:
            if self.prompt_logprobs_sent or from_child is None:
                return None
            self.prompt_logprobs_sent = True
            return from_child
        if self.prompt_logprobs is None:
            self.prompt_logprobs = from_child
        return self.prompt_logprobs

    def make_aggregate_output(self) -> RequestOutput:
        """The latest output of every child seen so far, in index order."""
        outputs = [self.latest[index] for index in sorted(self.latest)]
        return self.make_output(outputs, self.prompt_logprobs)

    def make_output(self, outputs: list[CompletionOutput], prompt_logprobs: PromptLogprobs | None) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            prompt_logprobs,
            outputs,
            self.finished,
            dataclasses.replace(self.metrics),
            self.num_cached_tokens,
        )
