"""Per-request logprobs: engine-core ``LogprobsLists`` rows -> vLLM-shaped ``Logprob`` dicts."""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.engine.protocol import LogprobsLists
from pagedllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from pagedllm.sampling_params import SamplingParams

# token id -> its text on its own, or None when the request produces no text.
TokenDecoder = Callable[[int], "str | None"]


class LogprobsProcessor:
    """Accumulates the sample and prompt logprobs of one request.

    Each row of ``LogprobsLists`` is one position: column 0 is the chosen token (with its rank
    in ``sampled_token_ranks``), then the top-k in order. The batch may carry more top-k
    columns than this request asked for (the engine sends the batch maximum), so only the
    first ``params.logprobs`` are kept.
    """

    def __init__(self, params: SamplingParams, decode: TokenDecoder | None = None) -> None:
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self._decode: TokenDecoder = decode or (lambda token_id: None)
        wants_sample = params.logprobs is not None
        self.logprobs: SampleLogprobs | None = [] if wants_sample else None
        self.cumulative_logprob: float | None = 0.0 if wants_sample else None
        # Nothing predicts the first prompt token, hence the leading None.
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None

    def update_from_output(self, new_logprobs: LogprobsLists | None, new_prompt_logprobs: LogprobsLists | None) -> None:
        """Take one engine step's rows for this request."""
        if new_logprobs is not None and self.logprobs is not None:
            self._add_sample_rows(new_logprobs)
        if new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            assert self.num_prompt_logprobs is not None
            self.prompt_logprobs.extend(self._rows(new_prompt_logprobs, self.num_prompt_logprobs))

    def _add_sample_rows(self, lists: LogprobsLists) -> None:
        assert self.logprobs is not None and self.num_logprobs is not None
        self.logprobs.extend(self._rows(lists, self.num_logprobs))
        # The sum of the chosen tokens' logprobs: the sequence's log-likelihood.
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(row[0] for row in lists.logprobs)

    def _rows(self, lists: LogprobsLists, num_top: int) -> list[dict[int, Logprob]]:
        rows = zip(lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks)
        return [self._position(ids, lps, rank, num_top) for ids, lps, rank in rows]

    def _position(self, token_ids: list[int], logprobs: list[float], rank: int, num_top: int) -> dict[int, Logprob]:
        """One position: the chosen token first, then the top-k ranked 1..k."""
        chosen = token_ids[0]
        entry = {chosen: Logprob(logprobs[0], rank, self._decode(chosen))}
        top = zip(token_ids[1 : num_top + 1], logprobs[1 : num_top + 1])
        for top_rank, (token_id, logprob) in enumerate(top, start=1):
            if token_id not in entry:  # the chosen token may be in the top-k: list it once
                entry[token_id] = Logprob(logprob, top_rank, self._decode(token_id))
        return entry

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """All prompt logprobs gathered so far, then forget them (DELTA reports them once)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs:
            self.prompt_logprobs = []
        return prompt_logprobs or None
