"""The worker's copy of request state, and turning a SchedulerOutput into flat batch tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    logits_indices: torch.Tensor  # rows whose logits are sampled (1 + its proposals per request)
    sample_req_ids: list[str]  # the requests those rows belong to, in order
    starts: list[int]  # per request: tokens already computed before this step
    num_scheduled: list[int]
    num_draft_tokens: list[int] = field(default_factory=list)  # per sampled request: proposals verified
    draft_token_ids: list[int] = field(default_factory=list)  # all sampled requests' proposals, flat

    @property
    def has_drafts(self) -> bool:
        return bool(self.draft_token_ids)


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
    """Build token ids, positions, slot mapping and block tables with vectorised index math.

    A request with proposals (speculative decoding) runs its real tokens then its proposals;
    it samples at its last real token and at every proposal, and the verifier keeps a prefix.
    """
    req_ids = list(sched.num_scheduled_tokens)
    reqs = [states[r] for r in req_ids]
    num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
    drafts = [sched.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
    starts = [s.num_computed_tokens for s in reqs]
    tokens = [s.token_ids[a:a + n - len(d)] + d for s, a, n, d in zip(reqs, starts, num_scheduled, drafts)]
    input_ids, positions, attn = build_flat_batch(tokens, starts, [s.block_ids for s in reqs], block_size, device)
    cu = attn.query_start_loc_cpu
    sample_rows = [i for i, (s, a, n, d) in enumerate(zip(reqs, starts, num_scheduled, drafts))
                   if a + n - len(d) == len(s.token_ids)]
    logits_indices = [row for i in sample_rows for row in range(cu[i + 1] - 1 - len(drafts[i]), cu[i + 1])]
    return BatchInputs(
        req_ids=req_ids, input_ids=input_ids, positions=positions, attn=attn,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sample_req_ids=[req_ids[i] for i in sample_rows], starts=starts, num_scheduled=num_scheduled,
        num_draft_tokens=[len(drafts[i]) for i in sample_rows],
        draft_token_ids=[t for i in sample_rows for t in drafts[i]])


def build_flat_batch(tokens: list[list[int]], starts: list[int], block_ids: list[list[int]], block_size: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(input_ids, positions, attention metadata) for requests that each run ``tokens[i]`` from
    position ``starts[i]`` on, writing KV through their block tables. Shared by the target's
    step and a draft model's proposal forwards."""
    counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    cu = np.concatenate(([0], np.cumsum(counts)))
    req_of_token = np.repeat(np.arange(len(tokens)), counts)
    positions = np.asarray(starts, dtype=np.int64)[req_of_token] + np.arange(cu[-1]) - cu[:-1][req_of_token]
    table = _block_table(block_ids)
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = [a + len(t) for a, t in zip(starts, tokens)]
    attn = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(cu).to(device), query_start_loc_cpu=cu.tolist(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(table).to(device), slot_mapping=torch.from_numpy(slots).to(device),
        block_size=block_size, max_query_len=int(counts.max()), max_seq_len=max(seq_lens))
    input_ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=device)
    return input_ids, torch.from_numpy(positions).to(device), attn


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    width = max(len(ids) for ids in block_ids)
    table = np.zeros((len(block_ids), width), dtype=np.int64)  # 0 = the null block
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = ids
    return table
