"""Speculative decoding in the scheduler: proposals are tokens under the one rule (torch-free).

The tests drive the scheduler by hand as the worker would: a step's output carries the
emitted tokens (accepted proposals + one) and the next proposals.
"""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 16
NGRAM = SpeculativeConfig("ngram", 3)
DRAFT = SpeculativeConfig("draft_model", 3, draft_model="unused")


def make_scheduler(
    spec: SpeculativeConfig = NGRAM, num_blocks: int = 32, budget: int = 512, caching: bool = True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256, policy="fcfs"),
        CacheConfig(BS, None, 0.9, caching),
        num_blocks,
        spec,
    )


def make_request(req_id: str, prompt_len: int, **sampling) -> Request:
    """Distinct prompts per request id, so nothing is shared through the prefix cache."""
    sampling.setdefault("max_tokens", 100)
    base = 1000 * (1 + ord(req_id[0]))
    return Request(req_id, list(range(base, base + prompt_len)), SamplingParams(ignore_eos=True, **sampling), 2)


def step(scheduler: Scheduler, emitted: dict[str, list[int]], proposals: dict[str, list[int]] | None = None):
    out = scheduler.schedule()
    result = scheduler.update_from_output(out, ModelRunnerOutput(dict(emitted), spec_token_ids=proposals or {}))
    return out, result


def test_proposals_are_scheduled_and_rejected_ones_rolled_back():
    scheduler = make_scheduler()
    request = make_request("a", 20)
    scheduler.add_request(request)
    out, _ = step(scheduler, {"a": [1]}, {"a": [5, 6, 7]})  # prefill, then three proposals
    assert out.num_scheduled_tokens == {"a": 20}
    assert request.num_computed_tokens == 20 and request.spec_token_ids == [5, 6, 7]

    # Verify: the last real token plus three proposals; the first is accepted, then 9 is sampled.
    out, result = step(scheduler, {"a": [5, 9]}, {"a": [4]})
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6, 7]}
    assert request.output_token_ids == [1, 5, 9]
    assert request.num_computed_tokens == 22  # 20 + the real token + one accepted proposal
    assert request.num_tokens == 23  # the sampled 9 has no KV yet
    (output,) = result.outputs
    assert (output.new_token_ids, output.num_draft_tokens, output.num_accepted_tokens) == ([5, 9], 3, 1)
    spec = result.scheduler_stats.spec_decoding
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 1)
    assert spec.num_accepted_tokens_per_pos == [1, 0, 0]
    scheduler.check_integrity()


def test_all_accepted_and_none_accepted():
    scheduler = make_scheduler()
    request = make_request("a", 16)
    scheduler.add_request(request)
    step(scheduler, {"a": [1]}, {"a": [5, 6]})
    step(scheduler, {"a": [5, 6, 8]})  # everything accepted + bonus
    assert request.num_computed_tokens == 19 and request.num_tokens == 20
    step(scheduler, {"a": [3]}, {"a": [7, 7, 7]})  # nothing proposed last time: a plain decode
    assert request.num_computed_tokens == 20
    out, _ = step(scheduler, {"a": [4]})  # all three rejected
    assert out.num_scheduled_tokens == {"a": 4}
    assert request.num_computed_tokens == 21 and request.spec_token_ids == []
    scheduler.check_integrity()


def test_budget_verifies_a_prefix_of_the_proposals():
    scheduler = make_scheduler(budget=6)
    a, b = make_request("a", 3), make_request("b", 3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, {"a": [1], "b": [1]}, {"a": [5, 6, 7], "b": [5, 6, 7]})
    out, _ = step(scheduler, {"a": [5, 6, 7, 8], "b": [5]})
    # a takes 4 of the 6 tokens; b gets the last real token and one proposal.
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6, 7], "b": [5]}
    assert b.spec_token_ids == [] and b.num_computed_tokens == 4  # its one proposal was rejected
    scheduler.check_integrity()


def test_blocks_and_prefix_hashes_cover_accepted_tokens_only():
    scheduler = make_scheduler()
    request = make_request("a", 15)
    scheduler.add_request(request)
    step(scheduler, {"a": [1]}, {"a": [5, 6, 7]})
    # Tokens 15..18 are computed: block 1 is needed for the proposals, but only 16 tokens are
    # accepted so far, so exactly one block is hashed.
    step(scheduler, {"a": [9]})  # all proposals rejected
    manager = scheduler.kv_cache_manager
    assert len(manager.req_to_blocks["a"]) == 2
    assert len(request.block_hashes) == 1 and manager.num_cached_block["a"] == 1
    assert request.num_computed_tokens == 16
    scheduler.check_integrity()


def test_draft_model_reserves_lookahead_slots():
    scheduler = make_scheduler(DRAFT)
    request = make_request("a", 14)
    scheduler.add_request(request)
    step(scheduler, {"a": [1]}, {"a": [5, 6, 7]})
    # 14 tokens + 3 lookahead slots need two blocks; without lookahead one would do.
    assert len(scheduler.kv_cache_manager.req_to_blocks["a"]) == 2
    step(scheduler, {"a": [5, 6, 7, 8]})
    # 15 + 3 scheduled, then 3 lookahead: 21 slots, still two blocks.
    assert len(scheduler.kv_cache_manager.req_to_blocks["a"]) == 2
    plain = make_scheduler(NGRAM)
    other = make_request("b", 14)
    plain.add_request(other)
    step(plain, {"b": [1]})
    assert len(plain.kv_cache_manager.req_to_blocks["b"]) == 1
    scheduler.check_integrity()


def test_preemption_drops_proposals_and_frees_every_block():
    # 5 usable blocks: two 31-token prompts take 4; verifying three proposals each needs 6.
    scheduler = make_scheduler(num_blocks=6)
    a, b = make_request("a", 31), make_request("b", 31)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, {"a": [1], "b": [1]}, {"a": [5, 6, 7], "b": [5, 6, 7]})
    out, _ = step(scheduler, {"a": [5, 6, 7, 8]})
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 4}
    assert b.spec_token_ids == [] and b.num_computed_tokens == 0
    out, _ = step(scheduler, {"a": [1]})
    assert "b" not in out.scheduled_spec_decode_tokens
    scheduler.finish_requests(["a", "b"], a.status.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.num_free_blocks == 5


def test_finished_requests_keep_no_proposals_or_blocks():
    scheduler = make_scheduler()
    request = make_request("a", 8, max_tokens=3)
    scheduler.add_request(request)
    step(scheduler, {"a": [1]}, {"a": [5, 6]})
    _, result = step(scheduler, {"a": [5, 6, 9]})  # max_tokens cuts at 3 output tokens
    (output,) = result.outputs
    assert output.new_token_ids == [5, 6] and output.finished
    assert not scheduler.has_unfinished_requests()
    scheduler.check_integrity()
