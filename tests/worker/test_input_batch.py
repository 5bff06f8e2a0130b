"""The persistent input batch against the list-built reference, over random scheduler diffs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.flat_batch import flat_batch_arrays
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.request_state import update_states
from pagedllm.worker.staging import HostStager

BLOCK = 4
VOCAB = 1000


def _input_batch() -> InputBatch:
    return InputBatch(BLOCK, VOCAB, HostStager("cpu"))


class FakeScheduler:
    """Random steps over live requests: admissions, growth, requests left out of a step,
    preemption (resumed with a whole new table), finishing, and proposals."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.live: dict[str, dict] = {}  # req_id -> tokens, blocks, computed, known (worker has it)
        self.next_id = 0
        self.next_block = 1

    def _blocks_for(self, req: dict, upto: int) -> list[int]:
        new = []
        while len(req["blocks"]) * BLOCK < upto:
            req["blocks"].append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def step(self) -> SchedulerOutput:
        rng, finished = self.rng, set()
        for req_id in [r for r in self.live if rng.random() < 0.1]:
            finished.add(req_id)
            del self.live[req_id]
        new_reqs, cached, scheduled, drafts = [], CachedRequestData(), {}, {}
        for _ in range(rng.randrange(0, 4)):
            req_id = f"r{self.next_id}"
            self.next_id += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            req = {"tokens": prompt, "blocks": [], "computed": 0, "known": True}
            self.live[req_id] = req
            count = min(len(prompt), rng.randrange(1, 24))
            new_reqs.append(
                NewRequestData(req_id, list(prompt), SamplingParams(temperature=0.0), self._blocks_for(req, count), 0)
            )
            scheduled[req_id] = count
        for req_id, req in self.live.items():
            if req_id in scheduled or rng.random() < 0.2:  # new this step, or left out of it
                continue
            resumed = rng.random() < 0.1
            if resumed:  # preempted earlier: recompute from scratch on fresh blocks
                req["blocks"], req["computed"] = [], 0
            remaining = len(req["tokens"]) - req["computed"]
            count = min(remaining, rng.randrange(1, 24)) if remaining > 1 else 1
            if remaining == 1 and rng.random() < 0.3:
                drafts[req_id] = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
                count += len(drafts[req_id])
            new = self._blocks_for(req, req["computed"] + count)
            cached.add(req_id, resumed, list(req["blocks"]) if resumed else new, req["computed"])
            scheduled[req_id] = count
        return SchedulerOutput(
            new_reqs, cached, scheduled, sum(scheduled.values()), finished, scheduled_spec_decode_tokens=drafts
        )

    def after_step(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        for req_id, count in sched.num_scheduled_tokens.items():
            req = self.live[req_id]
            req["computed"] += count - len(sched.scheduled_spec_decode_tokens.get(req_id, []))
            req["tokens"] += sampled.get(req_id, [])


def _reference(batch_rows: list[str], live: dict[str, dict], sched: SchedulerOutput) -> dict[str, np.ndarray]:
    tokens, starts, tables, sample_ranges = [], [], [], []
    offset = 0
    for req_id in batch_rows:
        req, n = live[req_id], sched.num_scheduled_tokens[req_id]
        drafts = sched.scheduled_spec_decode_tokens.get(req_id, [])
        start = req["computed"]
        tokens.append(req["tokens"][start : start + n - len(drafts)] + drafts)
        starts.append(start)
        tables.append(req["blocks"])
        if start + n - len(drafts) == len(req["tokens"]):
            sample_ranges.extend(range(offset + n - 1 - len(drafts), offset + n))
        offset += n
    arrays = flat_batch_arrays(tokens, starts, tables, BLOCK)
    arrays["logits_indices"] = np.asarray(sample_ranges, dtype=np.int64)
    return arrays


def _check_sampling_inputs(inputs, sched: SchedulerOutput, states) -> None:
    """The typed step carries the metadata of its logits rows and the proposals they verify."""
    drafts = [sched.scheduled_spec_decode_tokens.get(r, []) for r in inputs.sample_req_ids]
    if any(drafts):
        assert inputs.drafts.num_draft_tokens == [len(d) for d in drafts]
        assert inputs.drafts.draft_token_ids.tolist() == [t for d in drafts for t in d]
        assert inputs.drafts.draft_probs is None  # nobody stored distributions
    else:
        assert inputs.drafts is None
    assert inputs.rows_per_request == [len(d) + 1 for d in drafts]
    assert (inputs.sampling is None) == (not inputs.sample_req_ids)
    if inputs.sampling is not None:
        rows = [inputs.req_ids[r] for r in inputs.sample_rows.tolist()]
        assert rows == inputs.logits_req_ids and inputs.sampling.num_rows == len(rows)
        assert all(got is states[r].output_token_ids for got, r in zip(inputs.sampling.output_token_ids, rows))


@pytest.mark.parametrize("seed", range(4))
def test_prepare_matches_list_reference_over_random_diffs(seed):
    fake, states, batch = FakeScheduler(seed), {}, _input_batch()
    for _ in range(60):
        sched = fake.step()
        if sched.is_empty:
            continue
        update_states(states, sched, lambda seed: None)
        batch.sync(states, sched)
        assert set(batch.req_ids) == set(sched.num_scheduled_tokens)  # rows = this step's requests
        assert all(batch.row_of[r] == i for i, r in enumerate(batch.req_ids))
        inputs = batch.prepare(sched)
        ref = _reference(batch.req_ids, fake.live, sched)
        width = ref["block_table"].shape[1]
        assert inputs.input_ids.tolist() == ref["input_ids"].tolist()
        assert inputs.positions.tolist() == ref["positions"].tolist()
        assert inputs.attn.slot_mapping.tolist() == ref["slot_mapping"].tolist()
        assert inputs.attn.seq_lens_cpu == ref["seq_lens"].tolist()
        assert inputs.attn.query_start_loc_cpu == ref["query_start_loc"].tolist()
        assert inputs.attn.block_table[:, :width].tolist() == ref["block_table"].tolist()
        assert not inputs.attn.block_table[:, width:].any()  # padding is the null block
        assert inputs.logits_indices.tolist() == ref["logits_indices"].tolist()
        _check_sampling_inputs(inputs, sched, states)
        sampled = {r: [random.randrange(1000)] for r in inputs.sample_req_ids}
        for req_id, tokens in sampled.items():
            states[req_id].output_token_ids.extend(tokens)
            batch.append_tokens(req_id, tokens)
            assert batch.tokens(req_id).tolist() == fake.live[req_id]["tokens"] + tokens
        fake.after_step(sched, sampled)
    assert batch.token_ids.shape[1] >= 40 and batch.version > 0


def test_rows_leave_and_come_back_with_their_state():
    states, batch = {}, _input_batch()
    params = SamplingParams(temperature=0.0)
    new = [
        NewRequestData(f"r{i}", [i] * (300 if i == 2 else 3), params, list(range(10 * i + 1, 10 * i + 3)), 0)
        for i in range(3)
    ]
    sched = SchedulerOutput(new, CachedRequestData(), {"r0": 3, "r1": 3, "r2": 300}, 306, set())
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    assert batch.req_ids == ["r0", "r1", "r2"] and batch.tokens("r2").tolist() == [2] * 300  # width grew
    version = batch.version
    cached = CachedRequestData()
    cached.add("r2", False, [], 300)
    sched = SchedulerOutput([], cached, {"r2": 1}, 1, {"r0"})  # r0 finished, r1 not scheduled
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    assert batch.req_ids == ["r2"] and batch.row_of == {"r2": 0} and batch.version > version
    assert batch.tokens("r2").tolist() == [2] * 300 and batch.block_table[0, :2].tolist() == [21, 22]
    cached = CachedRequestData()
    cached.add("r1", True, [7], 0)  # back from preemption on one new block
    sched = SchedulerOutput([], cached, {"r1": 3}, 3, set())
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    assert batch.req_ids == ["r1"] and batch.tokens("r1").tolist() == [1, 1, 1]
    assert batch.block_table[0].tolist()[:3] == [7, 0, 0]


def test_an_id_reused_by_a_new_request_gets_a_fresh_row():
    """A request finished (or aborted) and a new one under the same id in the next step: the
    row must come from the new state, not keep the old tokens and freed blocks."""
    states, batch = {}, _input_batch()
    params = SamplingParams(temperature=0.0)
    sched = SchedulerOutput([NewRequestData("x", [1, 2, 3], params, [5], 0)], CachedRequestData(), {"x": 3}, 3, set())
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    states["x"].output_token_ids.append(9)
    batch.append_tokens("x", [9])
    version = batch.version
    sched = SchedulerOutput([NewRequestData("x", [7, 7], params, [8], 0)], CachedRequestData(), {"x": 2}, 2, {"x"})
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    assert batch.tokens("x").tolist() == [7, 7] and batch.states[0] is states["x"]
    assert batch.block_table[0, :1].tolist() == [8] and batch.version > version
    inputs = batch.prepare(sched)
    assert inputs.input_ids.tolist() == [7, 7] and inputs.attn.slot_mapping.tolist() == [32, 33]


def test_sampling_metadata_select_matches_building_the_rows_directly():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            min_tokens=4,
            presence_penalty=0.5,
            stop_token_ids=[9],
            logit_bias={3: 1.0},
            allowed_token_ids=[1, 2, 3],
        ),
    ]
    prompts, outputs = [[1, 2], [3], [4, 5, 6]], [[7], [], [8, 8]]
    gens = {1: torch.Generator().manual_seed(3)}
    md = SamplingMetadata.from_params(params, prompts, outputs, 16, "cpu", gens)
    for rows in ([2, 2, 0], [0, 0], [1, 2], [2]):
        want = SamplingMetadata.from_params(
            [params[r] for r in rows],
            [prompts[r] for r in rows],
            [outputs[r] for r in rows],
            16,
            "cpu",
            {i: gens[r] for i, r in enumerate(rows) if r in gens},
        )
        got = md.select(rows)
        assert (got.all_greedy, got.all_random, got.greedy) == (want.all_greedy, want.all_random, want.greedy)
        assert got.output_token_ids == want.output_token_ids and got.logit_bias == want.logit_bias
        assert got.min_tokens == want.min_tokens and got.generators == want.generators
        for name in ("temperature", "presence_penalties", "frequency_penalties", "repetition_penalties"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        # Optional columns: a selection may keep one whose chosen rows are all neutral (off).
        for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("allowed_token_ids_mask", False)):
            a, b = getattr(got, name), getattr(want, name)
            assert torch.equal(a, b) if b is not None else (a is None or bool((a == neutral).all())), name
    outputs[2].append(5)  # the metadata holds the caller's lists: new tokens show without a rebuild
    assert md.output_token_ids[2] == [8, 8, 5] and md.select([2]).output_token_ids == [[8, 8, 5]]


def test_step_metadata_is_reused_while_the_rows_stay_the_same():
    states, batch = {}, _input_batch()
    params = SamplingParams(temperature=0.7, seed=1)
    new = [NewRequestData(f"r{i}", [1, 2, 3], params, [i + 1], 0) for i in range(2)]
    sched = SchedulerOutput(new, CachedRequestData(), {"r0": 3, "r1": 3}, 6, set())
    update_states(states, sched, lambda seed: torch.Generator().manual_seed(seed))
    batch.sync(states, sched)
    first = batch.prepare(sched).sampling
    assert first is batch.row_metadata() and first.generators == {0: states["r0"].generator, 1: states["r1"].generator}
    batch.record_sampled(batch.prepare(sched), [[4], [5]])
    cached = CachedRequestData()
    for req_id in ("r0", "r1"):
        cached.add(req_id, False, [], 3)
    sched = SchedulerOutput([], cached, {"r0": 1, "r1": 1}, 2, set())
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    assert batch.prepare(sched).sampling is first  # same rows: no rebuild, and it sees the new tokens
    assert first.output_token_ids == [[4], [5]]
    cached = CachedRequestData()
    cached.add("r1", False, [], 3)
    sched = SchedulerOutput([], cached, {"r1": 1}, 1, {"r0"})  # r0 finished: the rows change
    update_states(states, sched, lambda seed: None)
    batch.sync(states, sched)
    again = batch.prepare(sched).sampling
    assert again is not first and again.output_token_ids == [[5]] and again.generators == {0: states["r1"].generator}
