"""The worker's copy of request state, and turning a SchedulerOutput into flat batch tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.staging import HostStager


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
                   device: torch.device, stager: HostStager | None = None) -> BatchInputs:
    """Build token ids, positions, slot mapping and block tables with vectorised index math, and
    move them (with the sampled rows) to the device in one go (``stager``; default: a fresh one).

    A request with proposals (speculative decoding) runs its real tokens then its proposals;
    it samples at its last real token and at every proposal, and the verifier keeps a prefix.
    """
    req_ids = list(sched.num_scheduled_tokens)
    reqs = [states[r] for r in req_ids]
    num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
    drafts = [sched.scheduled_spec_decode_tokens.get(r, []) for r in req_ids]
    starts = [s.num_computed_tokens for s in reqs]
    tokens = [s.token_ids[a:a + n - len(d)] + d for s, a, n, d in zip(reqs, starts, num_scheduled, drafts)]
    arrays = flat_batch_arrays(tokens, starts, [s.block_ids for s in reqs], block_size)
    cu = arrays["query_start_loc"].tolist()
    sample_rows = [i for i, (s, a, n, d) in enumerate(zip(reqs, starts, num_scheduled, drafts))
                   if a + n - len(d) == len(s.token_ids)]
    logits_indices = [row for i in sample_rows for row in range(cu[i + 1] - 1 - len(drafts[i]), cu[i + 1])]
    arrays["logits_indices"] = np.asarray(logits_indices, dtype=np.int64)
    staged = (stager or HostStager(device)).stage(arrays)
    input_ids, positions, attn = _batch_tensors(arrays, staged, block_size)
    return BatchInputs(
        req_ids=req_ids, input_ids=input_ids, positions=positions, attn=attn,
        logits_indices=staged["logits_indices"],
        sample_req_ids=[req_ids[i] for i in sample_rows], starts=starts, num_scheduled=num_scheduled,
        num_draft_tokens=[len(drafts[i]) for i in sample_rows],
        draft_token_ids=[t for i in sample_rows for t in drafts[i]])


def build_flat_batch(tokens: list[list[int]], starts: list[int], block_ids: list[list[int]], block_size: int,
                     device: torch.device, stager: HostStager | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(input_ids, positions, attention metadata) for requests that each run ``tokens[i]`` from
    position ``starts[i]`` on, writing KV through their block tables. Shared by the target's
    step and a draft model's proposal forwards."""
    arrays = flat_batch_arrays(tokens, starts, block_ids, block_size)
    return _batch_tensors(arrays, (stager or HostStager(device)).stage(arrays), block_size)


def flat_batch_arrays(tokens: list[list[int]], starts: list[int], block_ids: list[list[int]],
                      block_size: int) -> dict[str, np.ndarray]:
    """The host (numpy) side of :func:`build_flat_batch`: every per-step index array, int64."""
    counts = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    cu = np.concatenate(([0], np.cumsum(counts)))
    req_of_token = np.repeat(np.arange(len(tokens)), counts)
    positions = np.asarray(starts, dtype=np.int64)[req_of_token] + np.arange(cu[-1]) - cu[:-1][req_of_token]
    table = _block_table(block_ids)
    return {
        "input_ids": np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(cu[-1])),
        "positions": positions,
        "query_start_loc": cu,
        "seq_lens": np.asarray(starts, dtype=np.int64) + counts,
        "block_table": table,
        "slot_mapping": table[req_of_token, positions // block_size] * block_size + positions % block_size,
    }


def _batch_tensors(arrays: dict[str, np.ndarray], staged: dict[str, torch.Tensor], block_size: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(input_ids, positions, metadata) from the staged tensors; the Python-int fields from the host arrays."""
    cu, seq_lens = arrays["query_start_loc"], arrays["seq_lens"]
    attn = CommonAttentionMetadata(
        query_start_loc=staged["query_start_loc"], query_start_loc_cpu=cu.tolist(),
        seq_lens=staged["seq_lens"], seq_lens_cpu=seq_lens.tolist(),
        block_table=staged["block_table"], slot_mapping=staged["slot_mapping"],
        block_size=block_size, max_query_len=int(np.diff(cu).max()), max_seq_len=int(seq_lens.max()))
    return staged["input_ids"], staged["positions"], attn


def _block_table(block_ids: list[list[int]]) -> np.ndarray:
    width = max(len(ids) for ids in block_ids)
    table = np.zeros((len(block_ids), width), dtype=np.int64)  # 0 = the null block
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = ids
    return table
