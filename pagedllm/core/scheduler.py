"""The scheduler: one rule, no prefill/decode phases (torch-free).

Every request has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (tokens
whose KV is in the cache). Each step gives requests ``num_new_tokens`` so that computed catches
up with total, under the token budget and the sequence cap. Running requests go first, then
waiting ones. When blocks run out the lowest-priority (or, FCFS, the latest) running request
is preempted: its blocks are freed, its computed count reset, and it goes back to the front.
A constrained request whose grammar is still compiling waits in ``compiling`` (status
WAITING_FOR_FSM) and joins the queue once its grammar is ready; the others run meanwhile.

``step_plan`` holds a step's decisions and turns them into the ``SchedulerOutput``;
``step_result`` applies the worker's results to each request (proposals, stops, outputs).
"""

from __future__ import annotations

import time

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.core.request_events import RequestEvents
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.step_plan import ONE_STAGE, PipelineShape, StepPlan, build_scheduler_output
from pagedllm.core.step_result import append_and_check_stop, make_output, settle_spec_tokens
from pagedllm.engine.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
    SpecDecodingStats,
)
from pagedllm.kv_cache.block import KVCacheBlock
from pagedllm.kv_cache.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus
from pagedllm.spec_decode.adaptive import SpeculationPolicy


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        speculative_config: SpeculativeConfig | None = None,
        num_swap_blocks: int = 0,
        max_loras: int | None = None,
        pipeline: PipelineShape = ONE_STAGE,
    ) -> None:
        """``pipeline``: the workers' pipeline stages and the batches the engine keeps in flight."""
        self.config = scheduler_config
        self.pipeline = pipeline
        self.max_loras = max_loras  # distinct LoRA adapters the running requests may use; None: LoRA off
        # Slots past the scheduled tokens that a draft model writes its own KV into.
        self.num_lookahead_tokens = 0 if speculative_config is None else speculative_config.num_lookahead_tokens
        self.spec_stats = SpecDecodingStats() if speculative_config is not None else None
        self.spec_policy: SpeculationPolicy | None = None  # per-request proposal limits (adaptive)
        if speculative_config is not None and speculative_config.adaptive:
            self.spec_policy = SpeculationPolicy(speculative_config.num_speculative_tokens)
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, num_swap_blocks
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.compiling: list[Request] = []  # WAITING_FOR_FSM: grammar not ready yet
        self._pending_outputs: list[EngineCoreOutput] = []  # requests that failed outside a step
        self.num_preemptions = 0  # since the last stats snapshot
        self.total_preemptions = 0
        self.events = RequestEvents()  # queued/scheduled timestamps on their way to the front end

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, request: Request) -> None:
        """Queue a request; it is scheduled from the next step on."""
        self.requests[request.request_id] = request
        self.events.record(request.request_id, EngineCoreEventType.QUEUED)
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
            self._release(request, status)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix block, so no later lookup hits (vLLM's semantics). Refused
        (False) while requests hold blocks, unless ``reset_running_requests``: then every running
        request is preempted first (back to the front of the queue, in order; it recomputes)."""
        if reset_running_requests:
            for request in reversed(list(self.running)):
                self._preempt(request)
        return self.kv_cache_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.compiling)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.compiling)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones."""
        self._admit_compiled()
        plan = StepPlan(self.config.max_num_batched_tokens, self._batch_seqs())
        self._schedule_running(plan)
        if not plan.short_of_blocks:
            self._schedule_waiting(plan)
        output = build_scheduler_output(
            plan, self.requests, self.kv_cache_manager, self.finished_req_ids, self.pipeline.num_stages > 1
        )
        if self.spec_policy is not None:
            output.spec_token_limits = self.spec_policy.limits(plan.num_scheduled_tokens, plan.spec_tokens)
        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            request.num_in_flight += 1
        self.finished_req_ids = set()
        return output

    def _batch_seqs(self) -> int:
        """The requests one batch may take: all of them with one batch in flight; with k, about
        1/k, so that while batch i runs on the last stage batch i+1 (other requests) runs on the
        first. A request in flight is skipped anyway: its next token is not known yet, so its
        computed count has caught up with its tokens."""
        total = len(self.running) + len(self.waiting)
        return -(-total // self.pipeline.max_batches_in_flight)

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
        self._pending_outputs.append(
            EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message)
        )

    def _schedule_running(self, plan: StepPlan) -> None:
        # A snapshot: preemption removes entries from self.running as we go.
        for request in list(self.running):
            if plan.token_budget <= 0 or plan.is_full:
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
                plan.take_spec_tokens(request, num_new)

    def _num_new_tokens(self, num_uncomputed: int, plan: StepPlan) -> int:
        """The one rule: catch up with the token count, within the budget and the chunk cap."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and self.config.chunked_prefill:
            num_uncomputed = min(num_uncomputed, threshold)
        return min(num_uncomputed, plan.token_budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> list[int] | None:
        """Allocate slots, preempting other running requests until they fit."""
        while True:
            block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
            )
            if block_ids is not None:
                return block_ids
            victim = self._pick_victim()
            if victim.num_in_flight:
                # Its batch still runs on the workers: its blocks are not ours to take yet. The
                # engine collects that batch when nothing can be scheduled, so this ends.
                plan.blocked = True
                return None
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

    def _schedule_waiting(self, plan: StepPlan) -> None:
        lora_waits: list[Request] = []  # adapter requests set aside: no slot for their adapter
        try:
            self._admit_waiting(plan, lora_waits)
        finally:
            for request in reversed(lora_waits):  # back in front, in their order
                self.waiting.prepend(request)

    def _admit_waiting(self, plan: StepPlan, lora_waits: list[Request]) -> None:
        while (
            len(self.waiting)
            and plan.token_budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not plan.is_full
        ):
            request = self.waiting.peek()
            if not self._lora_fits(request, lora_waits):
                lora_waits.append(self.waiting.pop())
                continue
            computed_blocks, num_computed = self._lookup_prefix(request)
            num_new = self._num_new_tokens(request.num_tokens - num_computed, plan)
            if not self.config.chunked_prefill and num_new < request.num_tokens - num_computed:
                return  # an encoder's prompt runs whole: it waits for a step with room for all of it
            block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, computed_blocks, self.num_lookahead_tokens
            )
            if block_ids is None:
                return  # head-of-line request does not fit; keep the order
            self.waiting.pop()
            self._admit(request, num_computed, plan)
            plan.add(request, num_new, block_ids)

    def _lora_fits(self, request: Request, lora_waits: list[Request]) -> bool:
        """Whether admitting ``request`` keeps the running adapters within ``max_loras``. Once an
        adapter request waits for a slot, no later adapter request overtakes it (base-model ones
        may): the running adapters drain and it gets the next free slot, so none starves."""
        if self.max_loras is None or request.lora_request is None:
            return True
        if lora_waits:
            return False
        running = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return request.lora_int_id in running or len(running) < self.max_loras

    def _lookup_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if request.needs_every_prompt_position:
            return [], 0
        return self.kv_cache_manager.get_computed_blocks(request)

    def _admit(self, request: Request, num_computed: int, plan: StepPlan) -> None:
        if request.status == RequestStatus.PREEMPTED:
            plan.resumed.add(request.request_id)
            plan.cached_reqs.append(request)
        else:
            plan.new_reqs.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        self.events.record(request.request_id, EngineCoreEventType.SCHEDULED)
        if request.num_cached_tokens < 0:
            # Reported once, at the first admission: a lookup that then failed to get blocks
            # may have seen fewer hits than the admission that follows it.
            request.num_cached_tokens = num_computed
        self.running.append(request)

    # ------------------------------------------------------------------ update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        if self.spec_policy is not None:
            self.spec_policy.end_step(
                scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
            )
        outputs, self._pending_outputs = self._pending_outputs, []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.num_in_flight -= 1
            if request.is_finished:  # aborted while its batch ran: its blocks are free to go now
                self._release(request, request.status)
                continue
            output = self._update_request(request, scheduler_output, runner_output)
            if output is not None:
                outputs.append(output)
            if request.is_finished:
                self.running.remove(request)
                self._release(request, request.status)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(scheduler_output.total_num_scheduled_tokens)
        )

    def _update_request(
        self, request: Request, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        """One scheduled request's results; None when it has nothing to report this step."""
        req_id = request.request_id
        error = runner_output.errors.get(req_id)
        if error is not None:
            request.status, request.stop_reason = RequestStatus.FINISHED_ERROR, error
            return make_output(request, [], runner_output, None)
        pooled = runner_output.pooler_output.get(req_id)
        if pooled is not None:
            return self._pooled_output(request, pooled)
        new_ids = runner_output.sampled_token_ids.get(req_id, [])
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        num_drafts, num_accepted = settle_spec_tokens(request, drafts, new_ids, self.spec_stats)
        if num_drafts and self.spec_policy is not None:
            self.spec_policy.observe(req_id, num_drafts, num_accepted)
        new_ids = append_and_check_stop(request, new_ids, self.max_model_len)
        request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
        prompt_lp = runner_output.prompt_logprobs.get(req_id)
        if not new_ids and prompt_lp is None and not request.is_finished:
            return None
        output = make_output(request, new_ids, runner_output, prompt_lp)
        output.events = self.events.take(req_id)
        if num_drafts:
            output.num_draft_tokens, output.num_accepted_tokens = num_drafts, num_accepted
        return output

    def _pooled_output(self, request: Request, pooled: bytes) -> EngineCoreOutput:
        """A pooling request ends with its embedding, the step its prompt was computed."""
        request.status = RequestStatus.FINISHED_STOPPED
        output = make_output(request, [], ModelRunnerOutput(sampled_token_ids={}), None)
        output.pooling_output = pooled
        output.events = self.events.take(request.request_id)
        return output

    def _release(self, request: Request, status: RequestStatus) -> None:
        """Finish a request that has left the queues; its blocks go back once no batch that
        computes into them is still in flight (``update_from_output`` frees it then)."""
        request.status = status
        if not request.num_in_flight:
            self._free_request(request, status)

    def in_flight_ids(self) -> set[str]:
        """Finished requests whose blocks wait for a batch in flight."""
        return {r.request_id for r in self.requests.values() if r.num_in_flight and r.is_finished}

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        # An errored request's KV may be wrong (its step ran without what it needed): uncache it.
        self.kv_cache_manager.free(request, discard=status == RequestStatus.FINISHED_ERROR)
        if self.spec_policy is not None:
            self.spec_policy.forget(request.request_id)
        self.finished_req_ids.add(request.request_id)
        self.events.forget(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ stats
    def make_stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        """The snapshot after a step that computed ``num_scheduled_tokens`` (0: no model step).
        Requests waiting for their grammar are deferred; the rest of the queue waits for capacity."""
        queries, hits = self.kv_cache_manager.make_prefix_cache_stats()
        swapped_out, swapped_in = self.kv_cache_manager.make_swap_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.compiling),
            num_deferred_reqs=len(self.compiling),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=num_scheduled_tokens,
            kv_swap_out_blocks=swapped_out,
            kv_swap_in_blocks=swapped_in,
        )
        self.num_preemptions = 0
        if self.max_loras is not None:
            stats.running_lora_adapters = _adapter_counts(self.running)
            stats.waiting_lora_adapters = _adapter_counts([*self.waiting, *self.compiling])
        if self.spec_stats is not None and self.spec_stats.num_drafts:
            stats.spec_decoding, self.spec_stats = self.spec_stats, SpecDecodingStats()
        return stats

    def check_integrity(self) -> None:
        """The block pool's invariants hold and no finished request keeps blocks."""
        self.kv_cache_manager.check_integrity()
        # Only running requests hold blocks: admission allocates all-or-nothing, and preempting,
        # finishing or aborting a request frees its blocks at once, or (pipeline stages) when the
        # last batch in flight that holds it comes back.
        live = {r.request_id for r in self.running} | self.in_flight_ids()
        leaked = [rid for rid in self.kv_cache_manager.req_to_blocks if rid not in live]
        if leaked:
            raise RuntimeError(f"blocks still held by requests that are not running: {leaked}")


def _adapter_counts(requests: list[Request]) -> dict[str, int]:
    """LoRA adapter name -> how many of ``requests`` run with it."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            counts[request.lora_request.lora_name] = counts.get(request.lora_request.lora_name, 0) + 1
    return counts
