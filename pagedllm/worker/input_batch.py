"""The worker's copy of request state, and turning a SchedulerOutput into flat batch tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers about a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs_done: int = 0  # prompt positions already reported (a resumed request recomputes)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]


@dataclass
class BatchInputs:
    """Flat tensors for one forward, plus which rows need logits."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: CommonAttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are sampled
    sample_req_ids: list[str]  # the requests those rows belong to, in order
    starts: list[int]  # per request: tokens already computed before this step
    num_scheduled: list[int]


def update_states(states: dict[str, CachedRequestState], sched: SchedulerOutput,
                  make_generator) -> None:
    """Apply the scheduler's diffs to the worker's request states."""
    for req_id in sched.finished_req_ids:
        states.pop(req_id, None)
    for new in sched.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(
            new.req_id, list(new.prompt_token_ids), len(new.prompt_token_ids), new.sampling_params,
            make_generator(new.sampling_params.seed), list(new.block_ids), new.num_computed_tokens)
    cached = sched.scheduled_cached_reqs
    for req_id, resumed, block_ids, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                    cached.new_block_ids, cached.num_computed_tokens):
        state = states[req_id]
        state.block_ids = list(block_ids) if resumed else state.block_ids + block_ids
        state.num_computed_tokens = computed


def prepare_inputs(states: dict[str, CachedRequestState], sched: SchedulerOutput, block_size: int,
                   device: torch.device) -> BatchInputs:
    """Build token ids, positions, slot mapping and block tables with vectorised index math."""
    req_ids = list(sched.num_scheduled_tokens)
    reqs = [states[r] for r in req_ids]
    num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
    starts = [s.num_computed_tokens for s in reqs]
    counts = np.asarray(num_scheduled, dtype=np.int64)
    cu = np.concatenate(([0], np.cumsum(counts)))
    req_of_token = np.repeat(np.arange(len(reqs)), counts)
    positions = np.asarray(starts, dtype=np.int64)[req_of_token] + np.arange(cu[-1]) - cu[:-1][req_of_token]
    input_ids = [t for s, a, n in zip(reqs, starts, num_scheduled) for t in s.token_ids[a:a + n]]
    table = _block_table(reqs)
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = [a + n for a, n in zip(starts, num_scheduled)]
    sample_rows = [i for i, s in enumerate(reqs) if seq_lens[i] == len(s.token_ids)]
    attn = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(cu).to(device), query_start_loc_cpu=cu.tolist(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(table).to(device), slot_mapping=torch.from_numpy(slots).to(device),
        block_size=block_size, max_query_len=max(num_scheduled), max_seq_len=max(seq_lens))
    return BatchInputs(
        req_ids=req_ids, input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device), attn=attn,
        logits_indices=torch.tensor([cu[i + 1] - 1 for i in sample_rows], dtype=torch.int64, device=device),
        sample_req_ids=[req_ids[i] for i in sample_rows], starts=starts, num_scheduled=num_scheduled)


def _block_table(reqs: list[CachedRequestState]) -> np.ndarray:
    width = max(len(s.block_ids) for s in reqs)
    table = np.zeros((len(reqs), width), dtype=np.int64)  # 0 = the null block
    for i, s in enumerate(reqs):
        table[i, :len(s.block_ids)] = s.block_ids
    return table
