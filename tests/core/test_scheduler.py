"""Scheduler unit tests with exact block ids and queue order: no model, no torch.

``FakeModel`` plays the worker. It keeps its own copy of every request from the SchedulerOutput
diffs (full data for new requests, new block ids for the others, a whole table on resume),
samples a token for a request iff the step brings its computed count up to its token count
(partial prefill chunks sample nothing), and simulates the KV cache itself: every scheduled
token writes (position, token) into its slot, and every position a request attends to must
hold that request's own token. So a prefix-cache hit on stale or uncomputed KV, or a block
table that disagrees with the scheduler's, fails the test it happens in.

The free queue starts as [1, 2, ..., num_blocks - 1] (block 0 is the null block), new blocks
come from its head, and a freed request's blocks join the tail in reverse table order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

BS = 16
EOS = 2
TOKEN = 7  # what the fake model samples unless a test scripts otherwise
_prompt_bases = itertools.count(1)


# ---- helpers -------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(
    request_id: str,
    prompt: int | list[int],
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = EOS,
    **sampling: object,
) -> Request:
    """``prompt``: explicit ids, or a length (distinct ids >= 10000, so no accidental sharing)."""
    if isinstance(prompt, int):
        base = 10_000 * next(_prompt_bases)
        prompt = list(range(base, base + prompt))
    return Request(
        request_id, prompt, SamplingParams(**sampling), eos_token_id, arrival_time=arrival_time, priority=priority
    )


class FakeModel:
    """The worker side of the protocol, with a simulated KV cache (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, scripts: dict[str, list[int]] | None = None) -> None:
        self.scheduler = scheduler
        self.scripts = scripts or {}  # req_id -> tokens to sample, in order; then TOKEN
        self.tokens: dict[str, list[int]] = {}  # prompt + sampled, as the worker knows them
        self.num_prompt: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.kv: dict[int, list[tuple[int, int] | None]] = {}  # block id -> (position, token) per slot

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_kv(out)
        self._apply_diffs(out)
        for req_id, n in out.num_scheduled_tokens.items():
            self._write_kv(req_id, self.computed[req_id], n)
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            self.computed[req_id] += n
            self._check_kv(req_id)
            if self.computed[req_id] == len(self.tokens[req_id]):
                sampled[req_id] = [self._next_token(req_id)]
                self.tokens[req_id].append(sampled[req_id][0])
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def copy_kv(self, out: SchedulerOutput) -> None:
        """The step's copy-on-write block copies, all sources read before any write (as the worker)."""
        sources = [list(self.kv.get(src, [None] * BS)) for src, _ in out.kv_block_copies]
        for (_, dst), content in zip(out.kv_block_copies, sources):
            self.kv[dst] = content

    def _apply_diffs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            for state in (self.tokens, self.num_prompt, self.computed, self.tables):
                state.pop(req_id, None)  # may never have been scheduled (aborted while waiting)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.num_prompt[new.req_id] = len(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.tables[new.req_id] = list(new.block_ids)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, block_ids, num_computed in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, cached.num_computed_tokens
        ):
            if resumed:
                self.tables[req_id] = list(block_ids)
            else:
                assert num_computed == self.computed[req_id], req_id
                self.tables[req_id] += block_ids
            self.computed[req_id] = num_computed
        scheduled_ids = [r.req_id for r in out.scheduled_new_reqs] + cached.req_ids
        assert sorted(scheduled_ids) == sorted(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)

    def _write_kv(self, req_id: str, start: int, n: int) -> None:
        assert n > 0 and start + n <= len(self.tokens[req_id]), (req_id, start, n)
        table = self.tables[req_id]
        assert len(table) == cdiv(start + n, BS), (req_id, table, start + n)
        for pos in range(start, start + n):
            slots = self.kv.setdefault(table[pos // BS], [None] * BS)
            slots[pos % BS] = (pos, self.tokens[req_id][pos])

    def _check_kv(self, req_id: str) -> None:
        # Runs after every request of the step has written: a layer writes the whole batch's KV
        # before any attention reads it, so same-step prefix hits are fine.
        table, tokens = self.tables[req_id], self.tokens[req_id]
        assert table == self.scheduler.kv_cache_manager.get_block_ids(req_id), req_id
        for pos in range(self.computed[req_id]):
            held = self.kv.get(table[pos // BS], [None] * BS)[pos % BS]
            assert held == (pos, tokens[pos]), f"{req_id} reads stale KV at position {pos}: {held}"

    def _next_token(self, req_id: str) -> int:
        index = len(self.tokens[req_id]) - self.num_prompt[req_id]
        script = self.scripts.get(req_id, [])
        return script[index] if index < len(script) else TOKEN


def step(scheduler: Scheduler, model: FakeModel) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, model.execute(out))
    scheduler.check_integrity()
    return out, outputs


def run_to_completion(
    scheduler: Scheduler, model: FakeModel, max_steps: int = 500
) -> dict[str, list[EngineCoreOutput]]:
    by_request: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return by_request
        _, outputs = step(scheduler, model)
        for output in outputs.outputs:
            by_request.setdefault(output.request_id, []).append(output)
    raise AssertionError("requests did not finish")


def tokens_of(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def new_reqs(out: SchedulerOutput) -> list[tuple[str, list[int], int]]:
    return [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs]


def cached_reqs(out: SchedulerOutput) -> list[tuple[str, bool, list[int], int]]:
    c = out.scheduled_cached_reqs
    return list(zip(c.req_ids, c.resumed_from_preemption, c.new_block_ids, c.num_computed_tokens))


def summary(outputs: EngineCoreOutputs) -> list[tuple[str, list[int], FinishReason | None]]:
    return [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs.outputs]


def waiting_ids(scheduler: Scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def free_ids(scheduler: Scheduler) -> list[int]:
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    return [b.block_id for b in queue.get_all_free_blocks()]


MakeScheduler = Callable[..., Scheduler]


@pytest.fixture
def make_scheduler() -> Iterator[MakeScheduler]:
    """Builds schedulers; after the test each passes its integrity check and, when idle, holds
    no block at all."""
    made: list[tuple[Scheduler, int]] = []

    def make(
        num_blocks: int = 100,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 1024,
        policy: str = "fcfs",
        caching: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy, long_prefill_token_threshold),
            CacheConfig(
                block_size=BS, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, enable_prefix_caching=caching
            ),
            num_blocks,
        )
        made.append((scheduler, num_blocks))
        return scheduler

    yield make
    for scheduler, num_blocks in made:
        scheduler.check_integrity()
        if not scheduler.has_unfinished_requests():
            assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1
            assert scheduler.kv_cache_manager.req_to_blocks == {}
            assert scheduler.requests == {}


# ---- 1. basic ------------------------------------------------------------------------------


def test_basic_prefill_then_decode_with_exact_block_ids(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 30, max_tokens=4))
    sched.add_request(make_request("B", 16, max_tokens=4))

    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 30, "B": 16} and out.total_num_scheduled_tokens == 46
    assert new_reqs(out) == [("A", [1, 2], 0), ("B", [3], 0)]
    assert cached_reqs(out) == [] and out.finished_req_ids == set() and out.preempted_req_ids == set()
    assert summary(outputs) == [("A", [TOKEN], None), ("B", [TOKEN], None)]
    assert free_ids(sched) == [4, 5, 6, 7, 8, 9]

    # Decode: one token each; new block ids only when a block boundary is crossed.
    out, _ = step(sched, model)  # A: 30 -> 31 tokens; B: 16 -> 17 needs a second block
    assert out.num_scheduled_tokens == {"A": 1, "B": 1} and new_reqs(out) == []
    assert cached_reqs(out) == [("A", False, [], 30), ("B", False, [4], 16)]
    out, _ = step(sched, model)
    assert cached_reqs(out) == [("A", False, [], 31), ("B", False, [], 17)]
    out, outputs = step(sched, model)  # A's token 33 needs a third block
    assert cached_reqs(out) == [("A", False, [5], 32), ("B", False, [], 18)]
    assert summary(outputs) == [("A", [TOKEN], FinishReason.LENGTH), ("B", [TOKEN], FinishReason.LENGTH)]

    # Finished at update: blocks back at once, ids reported to the workers in the next step only.
    assert sched.kv_cache_manager.num_free_blocks == 9 and not sched.has_unfinished_requests()
    out, _ = step(sched, model)
    assert out.is_empty and out.finished_req_ids == {"A", "B"}
    assert sched.schedule().finished_req_ids == set()


def test_prompt_filling_exact_blocks_and_no_caching(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10, caching=False)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 32, max_tokens=2))
    out, _ = step(sched, model)
    assert new_reqs(out) == [("A", [1, 2], 0)]
    out, _ = step(sched, model)
    assert cached_reqs(out) == [("A", False, [3], 32)]
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}


# ---- 2. chunked prefill and mixed batches --------------------------------------------------


def test_long_prefill_threshold_caps_each_chunk(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 20, max_tokens=4))
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 20}
    sched.add_request(make_request("B", 60, max_tokens=2))
    sched.add_request(make_request("C", 30, max_tokens=2))
    # A decodes; B and C get at most 24 prompt tokens each although the budget has room for more.
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 24), ("C", 24)]
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 24), ("C", 6)]
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 12), ("C", 1)]
    while sched.has_unfinished_requests():
        step(sched, model)


def test_chunked_prefill_and_mixed_batch(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=20, max_num_batched_tokens=32)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 100, max_tokens=3))
    sched.add_request(make_request("B", 20, max_tokens=3))

    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 32} and new_reqs(out) == [("A", [1, 2], 0)]
    assert outputs.outputs == [] and waiting_ids(sched) == ["B"]  # partial chunk: nothing sampled
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 32} and cached_reqs(out) == [("A", False, [3, 4], 32)]
    assert outputs.outputs == [] and waiting_ids(sched) == ["B"]
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 32} and cached_reqs(out) == [("A", False, [5, 6], 64)]
    assert outputs.outputs == []
    # A's last 4 prompt tokens, then B's prefill gets the 28 left over.
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 4, "B": 20} and out.total_num_scheduled_tokens == 24
    assert cached_reqs(out) == [("A", False, [7], 96)] and new_reqs(out) == [("B", [8, 9], 0)]
    assert summary(outputs) == [("A", [TOKEN], None), ("B", [TOKEN], None)]

    # Mixed batch: running decodes are scheduled before a waiting prefill, which gets the rest.
    sched.add_request(make_request("C", 50, max_tokens=2))
    out, outputs = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 30)]
    assert cached_reqs(out) == [("A", False, [], 100), ("B", False, [], 20)]
    assert new_reqs(out) == [("C", [10, 11], 0)]
    assert [o.request_id for o in outputs.outputs] == ["A", "B"]
    out, outputs = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("A", 1), ("B", 1), ("C", 20)]
    assert cached_reqs(out)[2] == ("C", False, [12, 13], 30)
    assert summary(outputs) == [
        ("A", [TOKEN], FinishReason.LENGTH),
        ("B", [TOKEN], FinishReason.LENGTH),
        ("C", [TOKEN], None),
    ]
    done = run_to_completion(sched, model)
    assert tokens_of(done["C"]) == [TOKEN]  # its second and last token


# ---- 3. max_num_seqs -----------------------------------------------------------------------


def test_max_num_seqs_caps_the_batch(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=20, max_num_seqs=2)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 10, max_tokens=2))
    sched.add_request(make_request("B", 10, max_tokens=5))
    sched.add_request(make_request("C", 10, max_tokens=2))

    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 10, "B": 10} and waiting_ids(sched) == ["C"]
    out, outputs = step(sched, model)  # budget is plenty, but the batch is full
    assert out.num_scheduled_tokens == {"A": 1, "B": 1} and waiting_ids(sched) == ["C"]
    assert outputs.outputs[0].finish_reason == FinishReason.LENGTH
    out, _ = step(sched, model)  # A's slot goes to C; A's block 1 went to the free tail
    assert out.num_scheduled_tokens == {"B": 1, "C": 10} and out.finished_req_ids == {"A"}
    assert new_reqs(out) == [("C", [3], 0)]
    assert len(sched.running) == 2
    done = run_to_completion(sched, model)
    assert len(tokens_of(done["B"])) == 2 and len(tokens_of(done["C"])) == 1


# ---- 4. prefix caching ---------------------------------------------------------------------


def test_prefix_cache_hits_skip_shared_blocks(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=20)
    model = FakeModel(sched)
    shared = list(range(500, 548))  # three full blocks
    sched.add_request(make_request("A", shared + list(range(600, 610)), max_tokens=3))
    out, outputs = step(sched, model)
    assert new_reqs(out) == [("A", [1, 2, 3, 4], 0)]
    assert outputs.outputs[0].num_cached_tokens == 0
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (58, 0)

    sched.add_request(make_request("B", shared + list(range(700, 705)), max_tokens=2))
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1, "B": 5}
    assert new_reqs(out) == [("B", [1, 2, 3, 5], 48)]
    assert outputs.outputs[1].request_id == "B" and outputs.outputs[1].num_cached_tokens == 48
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (53, 48)
    assert [b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks[1:6]] == [2, 2, 2, 1, 1]

    # A fully cached prompt still recomputes its last block: the model needs the last token.
    sched.add_request(make_request("C", shared, max_tokens=1))
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1, "C": 16}
    assert new_reqs(out) == [("C", [1, 2, 6], 32)]
    assert outputs.outputs[2].num_cached_tokens == 32
    assert all(o.finished for o in outputs.outputs)  # A, B and C all reached max_tokens

    # All freed: 4 (A), 5 and 3 (B), 6, 2, 1 (C) joined the free tail in that order; the hits
    # come out of the middle of the free queue and the one new block is the head, 7.
    assert free_ids(sched)[-6:] == [4, 5, 3, 6, 2, 1]
    sched.add_request(make_request("D", shared + [800], max_tokens=1))
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"D": 1} and out.finished_req_ids == {"A", "B", "C"}
    assert new_reqs(out) == [("D", [1, 2, 3, 7], 48)]
    assert outputs.outputs[0].num_cached_tokens == 48


def test_num_cached_tokens_is_taken_at_admission(make_scheduler: MakeScheduler) -> None:
    # X's prompt continues A's prompt with A's first two outputs. X waits for a block while the
    # second shared block fills during A's decode, then is admitted with both blocks hit.
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    a = make_request("A", 30, max_tokens=3)
    x = make_request("X", a.prompt_token_ids + [TOKEN, TOKEN] + list(range(900, 908)), max_tokens=1)
    sched.add_request(a)
    sched.add_request(x)
    out, _ = step(sched, model)  # X hits block 1 but needs two more; one is free
    assert new_reqs(out) == [("A", [1, 2], 0)] and waiting_ids(sched) == ["X"]
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1} and waiting_ids(sched) == ["X"]
    out, outputs = step(sched, model)  # A's position 31 fills block 2 in this very step
    assert out.num_scheduled_tokens == {"A": 1, "X": 8}
    assert new_reqs(out) == [("X", [1, 2, 3], 32)]
    assert {o.request_id: o.num_cached_tokens for o in outputs.outputs} == {"A": 0, "X": 32}


# ---- 5. preemption (FCFS) ------------------------------------------------------------------


def test_fcfs_preempts_latest_running_and_resumes(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=7)  # six usable blocks
    model = FakeModel(sched)
    for req_id, max_tokens in (("A", 5), ("B", 10), ("C", 5)):
        sched.add_request(make_request(req_id, 31, max_tokens=max_tokens))
    sched.add_request(make_request("D", 10, max_tokens=3))

    out, _ = step(sched, model)
    assert new_reqs(out) == [("A", [1, 2], 0), ("B", [3, 4], 0), ("C", [5, 6], 0)]
    assert waiting_ids(sched) == ["D"]  # no block left
    out, _ = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}

    # Token 33 of every request needs a third block: C, the latest, is preempted for A and B.
    c = sched.requests["C"]
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1} and out.preempted_req_ids == {"C"}
    assert cached_reqs(out) == [("A", False, [6], 32), ("B", False, [5], 32)]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.num_output_tokens == 2
    assert sched.kv_cache_manager.get_block_ids("C") == []
    assert waiting_ids(sched) == ["C", "D"]  # back at the front
    assert outputs.scheduler_stats.num_preemptions == 1

    for _ in range(2):  # A finishes at its fifth token; nothing fits for C meanwhile
        out, outputs = step(sched, model)
        assert out.num_scheduled_tokens == {"A": 1, "B": 1}
        assert outputs.scheduler_stats.num_preemptions == 0
    # C resumes with a whole new table (its old blocks were reused, so no prefix hits).
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"A"}
    assert out.num_scheduled_tokens == {"B": 1, "C": 33}
    assert cached_reqs(out) == [("B", False, [], 35), ("C", True, [6, 2, 1], 0)]
    assert waiting_ids(sched) == ["D"]

    done = run_to_completion(sched, model)
    assert {r: len(tokens_of(o)) for r, o in done.items()} == {"B": 4, "C": 2, "D": 3}
    assert all(o[-1].finish_reason == FinishReason.LENGTH for o in done.values())


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_request_resumes_from_its_own_cached_blocks(make_scheduler: MakeScheduler, caching: bool) -> None:
    sched = make_scheduler(num_blocks=6, caching=caching)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 30, max_tokens=10))
    sched.add_request(make_request("B", 30, max_tokens=10))
    out, _ = step(sched, model)
    assert new_reqs(out) == [("A", [1, 2], 0), ("B", [3, 4], 0)]
    step(sched, model)
    step(sched, model)
    # Both need a third block; A takes the last one and B, the latest, preempts itself.
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"A": 1} and out.preempted_req_ids == {"B"}
    assert cached_reqs(out) == [("A", False, [5], 32)]
    assert free_ids(sched) == [4, 3] and outputs.scheduler_stats.num_preemptions == 1
    for _ in range(6):  # A runs alone until its tenth token; B does not fit
        out, _ = step(sched, model)
        assert out.num_scheduled_tokens == {"A": 1} and waiting_ids(sched) == ["B"]

    out, _ = step(sched, model)
    assert out.finished_req_ids == {"A"}
    if caching:  # B's two full blocks are still cached: only its last token is recomputed
        assert cached_reqs(out) == [("B", True, [3, 4, 5], 32)]
        assert out.num_scheduled_tokens == {"B": 1}
    else:
        assert cached_reqs(out) == [("B", True, [4, 3, 5], 0)]
        assert out.num_scheduled_tokens == {"B": 33}
    done = run_to_completion(sched, model)
    assert len(tokens_of(done["B"])) == 6 and done["B"][-1].finish_reason == FinishReason.LENGTH
    assert done["B"][-1].num_cached_tokens == 0  # the first admission's hits, not the resume's


# ---- 6. priority policy --------------------------------------------------------------------


def test_priority_waiting_order(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    model = FakeModel(sched)
    for req_id, priority, arrival in (("R1", 1, 1.0), ("R2", 0, 2.0), ("R3", 2, 0.0), ("R4", 0, 3.0), ("R5", 1, 0.5)):
        sched.add_request(make_request(req_id, 5, priority=priority, arrival_time=arrival, max_tokens=1))
    assert waiting_ids(sched) == ["R2", "R4", "R5", "R1", "R3"]
    sched.finish_requests(["R1"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"R1"}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["R2", "R4"]
    assert list(out.num_scheduled_tokens) == ["R2", "R4"] and waiting_ids(sched) == ["R5", "R3"]
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens) == ["R5", "R3"]
    assert out.finished_req_ids == {"R2", "R4"}


def test_priority_preempts_lowest_priority_even_if_already_scheduled(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=5, policy="priority")
    model = FakeModel(sched)
    sched.add_request(make_request("L", 20, priority=5, arrival_time=0.0, max_tokens=10))
    out, _ = step(sched, model)
    assert new_reqs(out) == [("L", [1, 2], 0)]
    sched.add_request(make_request("H", 30, priority=0, arrival_time=1.0, max_tokens=6))
    out, _ = step(sched, model)
    assert list(out.num_scheduled_tokens.items()) == [("L", 1), ("H", 30)]
    assert new_reqs(out) == [("H", [3, 4], 0)]
    step(sched, model)
    step(sched, model)

    # H needs a third block; L, scheduled first in this step, is dropped and preempted.
    low = sched.requests["L"]
    out, outputs = step(sched, model)
    assert out.num_scheduled_tokens == {"H": 1} and out.total_num_scheduled_tokens == 1
    assert cached_reqs(out) == [("H", False, [2], 32)] and out.preempted_req_ids == {"L"}
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.num_output_tokens == 4 and waiting_ids(sched) == ["L"]
    assert [o.request_id for o in outputs.outputs] == ["H"]
    assert outputs.scheduler_stats.num_preemptions == 1

    for _ in range(2):  # L's first block is a free cached hit, but the second does not fit
        out, _ = step(sched, model)
        assert out.num_scheduled_tokens == {"H": 1}
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"H"}
    assert cached_reqs(out) == [("L", True, [1, 2], 16)] and out.num_scheduled_tokens == {"L": 8}
    done = run_to_completion(sched, model)
    assert len(tokens_of(done["L"])) == 5


def test_priority_self_preemption_does_not_stall_higher_priority(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=5, policy="priority")
    model = FakeModel(sched)
    sched.add_request(make_request("L", 31, priority=5, arrival_time=0.0, max_tokens=4))
    step(sched, model)
    sched.add_request(make_request("H", 17, priority=0, arrival_time=1.0, max_tokens=4))
    out, _ = step(sched, model)
    assert new_reqs(out) == [("H", [3, 4], 0)]
    # L needs a third block and is the lowest priority: it preempts itself, and H, after it in
    # the running list, still runs this step.
    out, _ = step(sched, model)
    assert out.preempted_req_ids == {"L"} and out.num_scheduled_tokens == {"H": 1}
    done = run_to_completion(sched, model)
    assert len(tokens_of(done["H"])) == 2 and len(tokens_of(done["L"])) == 2


# ---- 7. stop conditions --------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling, script, expected_tokens, reason, stop_reason",
    [
        (dict(max_tokens=10), [5, 6, EOS, 8], [5, 6, EOS], FinishReason.STOP, None),
        (dict(max_tokens=5, ignore_eos=True), [EOS, EOS, 5], [EOS, EOS, 5, TOKEN, TOKEN], FinishReason.LENGTH, None),
        (dict(max_tokens=10, stop_token_ids=[6]), [5, 6, 8], [5, 6], FinishReason.STOP, 6),
        (dict(max_tokens=10, min_tokens=3, stop_token_ids=[6]), [EOS, 6, 6, 8], [EOS, 6, 6], FinishReason.STOP, 6),
        (dict(max_tokens=10, min_tokens=3), [6, EOS, EOS, 8], [6, EOS, EOS], FinishReason.STOP, None),
        (dict(max_tokens=4), [], [TOKEN] * 4, FinishReason.LENGTH, None),
    ],
    ids=["eos", "ignore_eos", "stop_token_id", "min_tokens_stop_id", "min_tokens_eos", "max_tokens"],
)
def test_stop_conditions(
    make_scheduler: MakeScheduler,
    sampling: dict,
    script: list[int],
    expected_tokens: list[int],
    reason: FinishReason,
    stop_reason: int | None,
) -> None:
    sched = make_scheduler(num_blocks=10)
    model = FakeModel(sched, scripts={"A": script})
    request = make_request("A", 20, **sampling)
    sched.add_request(request)
    done = run_to_completion(sched, model)
    assert tokens_of(done["A"]) == expected_tokens
    assert [o.finish_reason for o in done["A"]] == [None] * (len(expected_tokens) - 1) + [reason]
    assert done["A"][-1].stop_reason == stop_reason and request.stop_reason == stop_reason
    assert request.output_token_ids == expected_tokens


def test_max_model_len_caps_output(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10, max_model_len=40)
    model = FakeModel(sched)
    request = make_request("A", 36, max_tokens=None)
    sched.add_request(request)
    done = run_to_completion(sched, model)
    assert len(tokens_of(done["A"])) == 4 and request.num_tokens == 40
    assert done["A"][-1].finish_reason == FinishReason.LENGTH
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_finished_request_frees_blocks_and_is_reported_next_step(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10)
    model = FakeModel(sched, scripts={"A": [EOS]})
    sched.add_request(make_request("A", 20, max_tokens=10))
    sched.add_request(make_request("B", 20, max_tokens=10))
    out, outputs = step(sched, model)
    assert summary(outputs) == [("A", [EOS], FinishReason.STOP), ("B", [TOKEN], None)]
    assert out.finished_req_ids == set()
    assert "A" not in sched.requests and sched.kv_cache_manager.get_block_ids("A") == []
    assert sched.kv_cache_manager.num_free_blocks == 9 - 2 and [r.request_id for r in sched.running] == ["B"]
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"A"} and out.num_scheduled_tokens == {"B": 1}
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)


# ---- 8. abort ------------------------------------------------------------------------------


def test_abort_waiting_running_unknown_and_finished(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    model = FakeModel(sched)
    a, b = make_request("A", 20, max_tokens=10), make_request("B", 20, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, model)
    assert waiting_ids(sched) == ["B"] and sched.kv_cache_manager.num_free_blocks == 7

    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)  # waiting
    assert b.status == RequestStatus.FINISHED_ABORTED and waiting_ids(sched) == []
    sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)  # running
    assert a.status == RequestStatus.FINISHED_ABORTED and sched.running == []
    assert sched.kv_cache_manager.num_free_blocks == 9 and not sched.has_unfinished_requests()
    sched.check_integrity()

    sched.finish_requests(["A", "nope"], RequestStatus.FINISHED_ABORTED)  # no-ops
    out, _ = step(sched, model)
    assert out.is_empty and out.finished_req_ids == {"A", "B"}

    c = make_request("C", 5, max_tokens=1)
    sched.add_request(c)
    step(sched, model)
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sched.finish_requests(["C"], RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_abort_between_schedule_and_update(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=10)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 20, max_tokens=10))
    sched.add_request(make_request("B", 20, max_tokens=10))
    step(sched, model)
    out = sched.schedule()
    runner_output = model.execute(out)
    sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    outputs = sched.update_from_output(out, runner_output)
    assert [o.request_id for o in outputs.outputs] == ["B"]
    sched.check_integrity()
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"A"} and out.num_scheduled_tokens == {"B": 1}
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)


def test_abort_preempted_request(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(num_blocks=6)
    model = FakeModel(sched)
    sched.add_request(make_request("A", 30, max_tokens=10))
    sched.add_request(make_request("B", 30, max_tokens=10))
    for _ in range(4):
        out, _ = step(sched, model)
    assert out.preempted_req_ids == {"B"}
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    assert waiting_ids(sched) == [] and sched.requests["A"].status == RequestStatus.RUNNING
    out, _ = step(sched, model)
    assert out.finished_req_ids == {"B"}
    run_to_completion(sched, model)


# ---- soak: many requests through a small pool ----------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_many_requests_through_a_small_pool(make_scheduler: MakeScheduler, policy: str) -> None:
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=40, policy=policy)
    model = FakeModel(sched)
    shared = list(range(300, 340))
    expected = {}
    for i in range(12):
        prompt = shared[: 8 * (i % 6)] + list(range(1000 * (i + 1), 1000 * (i + 1) + 5 + 3 * i))
        expected[f"R{i}"] = 3 + i % 5
        sched.add_request(
            make_request(f"R{i}", prompt, priority=i % 3, arrival_time=float(i), max_tokens=expected[f"R{i}"])
        )
    done = run_to_completion(sched, model)
    assert {r: len(tokens_of(o)) for r, o in done.items()} == expected
