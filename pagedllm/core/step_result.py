"""Applying one step's results to one request: speculative proposals settled, sampled tokens
appended, stop conditions checked, the request's ``EngineCoreOutput`` built (torch-free)."""

from __future__ import annotations

from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.engine.protocol import EngineCoreOutput, LogprobsLists, SpecDecodingStats
from pagedllm.request import Request, RequestStatus


def settle_spec_tokens(
    request: Request, drafts: list[int] | None, new_ids: list[int], spec_stats: SpecDecodingStats | None
) -> tuple[int, int]:
    """Roll ``num_computed_tokens`` back past the rejected proposals: their KV slots are simply
    overwritten later (no block is freed or leaked, and hashes only ever cover accepted
    tokens). Returns (proposals verified, accepted) this step; (0, 0) without speculation."""
    if not drafts or not new_ids:
        return 0, 0
    num_accepted = len(new_ids) - 1  # accepted proposals, then one sampled token
    request.num_computed_tokens -= len(drafts) - num_accepted
    assert spec_stats is not None, "proposals are only scheduled with speculation on"
    spec_stats.observe(len(drafts), num_accepted)
    return len(drafts), num_accepted


def append_and_check_stop(request: Request, new_ids: list[int], max_model_len: int) -> list[int]:
    """Append the sampled tokens up to the first that stops the request; returns those kept."""
    for i, token in enumerate(new_ids):
        request.append_output_token_ids([token])
        status = check_stop(request, token, max_model_len)
        if status is not None:
            request.status = status
            return new_ids[: i + 1]
    return new_ids


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status ``token`` (just appended) puts the request in, or None to go on."""
    params = request.sampling_params
    grammar = request.structured_output
    if grammar is not None and not grammar.accept(token):
        # Only when another constraint (e.g. allowed_token_ids) left the grammar no token.
        request.stop_reason = f"the sampled token {token} is not allowed by the request's grammar"
        return RequestStatus.FINISHED_ERROR
    if request.num_output_tokens >= params.min_tokens:
        if token == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in params.all_stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if grammar is not None and grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # its end token even with ignore_eos
    if request.max_tokens is not None and request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def make_output(
    request: Request, new_ids: list[int], runner_output: ModelRunnerOutput, prompt_logprobs: LogprobsLists | None
) -> EngineCoreOutput:
    """The request's output of this step; logprobs rows past a stop are cut off with the tokens."""
    logprobs = runner_output.logprobs.get(request.request_id)
    if logprobs is not None and len(new_ids) < len(logprobs.sampled_token_ranks):
        n = len(new_ids)
        logprobs = type(logprobs)(
            logprobs.logprob_token_ids[:n], logprobs.logprobs[:n], logprobs.sampled_token_ranks[:n]
        )
    return EngineCoreOutput(
        request.request_id,
        new_ids,
        logprobs,
        prompt_logprobs,
        request.status.finish_reason,
        request.stop_reason,
        max(request.num_cached_tokens, 0),
    )
