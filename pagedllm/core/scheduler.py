"""The scheduler: one rule, no prefill/decode phases (torch-free).

Every request has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (tokens
whose KV is in the cache). Each step gives requests ``num_new_tokens`` so that computed catches
up with total, under the token budget and the sequence cap. Running requests go first, then
waiting ones. When blocks run out the lowest-priority (or, FCFS, the latest) running request
is preempted: its blocks are freed, its computed count reset, and it goes back to the front.
A constrained request whose grammar is still compiling waits in ``compiling`` (status
WAITING_FOR_FSM) and joins the queue once its grammar is ready; the others run meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.engine.protocol import (EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats,
                                      SpecDecodingStats)
from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed: set[str] = field(default_factory=set)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = block_ids
        self.token_budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Undo ``add`` for a request preempted later in the same step."""
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.new_block_ids.pop(request.request_id)
        self.spec_tokens.pop(request.request_id, None)
        self.cached_reqs.remove(request)


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self.config = scheduler_config
        # Slots past the scheduled tokens that a draft model writes its own KV into.
        self.num_lookahead_tokens = 0 if speculative_config is None else speculative_config.num_lookahead_tokens
        self.spec_stats = SpecDecodingStats() if speculative_config is not None else None
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               enable_caching=cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.compiling: list[Request] = []  # WAITING_FOR_FSM: grammar not ready yet
        self._pending_outputs: list[EngineCoreOutput] = []  # requests that failed outside a step
        self.num_preemptions = 0  # since the last stats snapshot
        self.total_preemptions = 0

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, request: Request) -> None:
        """Queue a request; it is scheduled from the next step on."""
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING_FOR_FSM:
            self.compiling.append(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, request_ids: list[str] | set[str], status: RequestStatus) -> None:
        """Abort or finish requests from outside the step loop; their blocks return at once."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                self.compiling.remove(request)
            else:
                self.waiting.remove(request)
            self._free_request(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.compiling)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.compiling)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._admit_compiled()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        output = self._build_output(plan)
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return output

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; fail those whose compile failed or timed out."""
        if not self.compiling:
            return
        now = time.monotonic()
        still_compiling = []
        for request in self.compiling:
            if request.structured_output.poll(now):
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
            elif request.structured_output.error is not None:
                self._fail(request, request.structured_output.error)
            else:
                still_compiling.append(request)
        self.compiling = still_compiling

    def _fail(self, request: Request, message: str) -> None:
        """Finish a request that never ran with an error the front end reports."""
        request.stop_reason = message
        self._free_request(request, RequestStatus.FINISHED_ERROR)
        self._pending_outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                                      stop_reason=message))

    def _schedule_running(self, plan: _StepPlan) -> None:
        # A snapshot: preemption removes entries from self.running as we go.
        for request in list(self.running):
            if plan.token_budget <= 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request.num_tokens_with_spec - request.num_computed_tokens, plan)
            if num_new <= 0:
                continue
            # None: the request preempted itself. Under FCFS it was the last one; under the
            # priority policy the requests after it outrank it and may still fit.
            block_ids = self._allocate_or_preempt(request, num_new, plan)
            if block_ids is not None:
                plan.add(request, num_new, block_ids)
                plan.cached_reqs.append(request)
                self._take_spec_tokens(request, num_new, plan)

    @staticmethod
    def _take_spec_tokens(request: Request, num_new: int, plan: _StepPlan) -> None:
        """Move the proposals that fit this step's share into the plan; a smaller share (budget,
        chunk cap) verifies only a prefix of them, and the rest are dropped, never carried over."""
        num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
        if num_spec > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
        request.spec_token_ids = []

    def _num_new_tokens(self, num_uncomputed: int, plan: _StepPlan) -> int:
        """The one rule: catch up with the token count, within the budget and the chunk cap."""
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_uncomputed = min(num_uncomputed, threshold)
        return min(num_uncomputed, plan.token_budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> list[int] | None:
        """Allocate slots, preempting other running requests until they fit."""
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new,
                                                             num_lookahead_tokens=self.num_lookahead_tokens)
            if block_ids is not None:
                return block_ids
            victim = self._pick_victim()
            if victim.request_id in plan.num_scheduled_tokens:
                plan.drop(victim)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.prepend(request)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while len(self.waiting) and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_computed = self._lookup_prefix(request)
            num_new = self._num_new_tokens(request.num_tokens - num_computed, plan)
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks,
                                                             self.num_lookahead_tokens)
            if block_ids is None:
                return  # head-of-line request does not fit; keep the order
            self.waiting.pop()
            self._admit(request, num_computed, plan)
            plan.add(request, num_new, block_ids)

    def _lookup_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if request.sampling_params.prompt_logprobs is not None:
            blocks, num_computed = [], 0  # prompt logprobs need every prompt position computed
        else:
            blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
        return blocks, num_computed

    def _admit(self, request: Request, num_computed: int, plan: _StepPlan) -> None:
        if request.status == RequestStatus.PREEMPTED:
            plan.resumed.add(request.request_id)
            plan.cached_reqs.append(request)
        else:
            plan.new_reqs.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            # Reported once, at the first admission: a lookup that then failed to get blocks
            # may have seen fewer hits than the admission that follows it.
            request.num_cached_tokens = num_computed
        self.running.append(request)

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs = [
            NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params,
                           plan.new_block_ids[r.request_id], r.num_computed_tokens)
            for r in plan.new_reqs
        ]
        cached = CachedRequestData()
        for r in plan.cached_reqs:
            resumed = r.request_id in plan.resumed
            block_ids = (self.kv_cache_manager.get_block_ids(r.request_id) if resumed
                         else plan.new_block_ids[r.request_id])
            cached.add(r.request_id, resumed, block_ids, r.num_computed_tokens)
        return SchedulerOutput(new_reqs, cached, dict(plan.num_scheduled_tokens),
                               sum(plan.num_scheduled_tokens.values()), set(self.finished_req_ids),
                               {r.request_id for r in plan.preempted}, self._structured_rows(plan),
                               scheduled_spec_decode_tokens=plan.spec_tokens)

    def _structured_rows(self, plan: _StepPlan) -> list[str]:
        """Constrained requests that sample this step (their computed count reaches their end)."""
        rows = []
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if (request.structured_output is not None
                    and request.num_computed_tokens + num_tokens == request.num_tokens):
                rows.append(req_id)
        return rows

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs, self._pending_outputs = self._pending_outputs, []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # aborted while the step ran
            new_ids = runner_output.sampled_token_ids.get(req_id, [])
            num_drafts, num_accepted = self._settle_spec_tokens(request, scheduler_output, new_ids)
            new_ids = self._append_and_check_stop(request, new_ids)
            request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            prompt_lp = runner_output.prompt_logprobs.get(req_id)
            if not new_ids and prompt_lp is None and not request.is_finished:
                continue
            output = self._make_output(request, new_ids, runner_output, prompt_lp)
            if num_drafts:
                output.num_draft_tokens, output.num_accepted_tokens = num_drafts, num_accepted
            outputs.append(output)
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request, request.status)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def _settle_spec_tokens(self, request: Request, sched: SchedulerOutput,
                            new_ids: list[int]) -> tuple[int, int]:
        """Roll ``num_computed_tokens`` back past the rejected proposals: their KV slots are simply
        overwritten later (no block is freed or leaked, and hashes only ever cover accepted
        tokens). Returns (proposals verified, accepted) this step; (0, 0) without speculation."""
        drafts = sched.scheduled_spec_decode_tokens.get(request.request_id)
        if not drafts or not new_ids:
            return 0, 0
        num_accepted = len(new_ids) - 1  # accepted proposals, then one sampled token
        request.num_computed_tokens -= len(drafts) - num_accepted
        self.spec_stats.observe(len(drafts), num_accepted)
        return len(drafts), num_accepted

    def _append_and_check_stop(self, request: Request, new_ids: list[int]) -> list[int]:
        for i, token in enumerate(new_ids):
            request.append_output_token_ids([token])
            status = self._check_stop(request, token)
            if status is not None:
                request.status = status
                return new_ids[:i + 1]
        return new_ids

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
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
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _make_output(self, request: Request, new_ids: list[int], runner_output: ModelRunnerOutput,
                     prompt_logprobs) -> EngineCoreOutput:
        logprobs = runner_output.logprobs.get(request.request_id)
        if logprobs is not None and len(new_ids) < len(logprobs.sampled_token_ranks):
            n = len(new_ids)
            logprobs = type(logprobs)(logprobs.logprob_token_ids[:n], logprobs.logprobs[:n],
                                      logprobs.sampled_token_ranks[:n])
        return EngineCoreOutput(request.request_id, new_ids, logprobs, prompt_logprobs,
                                request.status.finish_reason, request.stop_reason,
                                max(request.num_cached_tokens, 0))

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(len(self.running), len(self.waiting) + len(self.compiling), self.kv_cache_manager.usage,
                               queries, hits, self.num_preemptions)
        self.num_preemptions = 0
        if self.spec_stats is not None and self.spec_stats.num_drafts:
            stats.spec_decoding, self.spec_stats = self.spec_stats, SpecDecodingStats()
        return stats

    def check_integrity(self) -> None:
        """The block pool's invariants hold and no finished request keeps blocks."""
        self.kv_cache_manager.check_integrity()
        # Only running requests hold blocks: admission allocates all-or-nothing, and preempting,
        # finishing or aborting a request frees its blocks at once.
        live = {r.request_id for r in self.running}
        leaked = [rid for rid in self.kv_cache_manager.req_to_blocks if rid not in live]
        if leaked:
            raise RuntimeError(f"blocks still held by requests that are not running: {leaked}")
