"""The worker's request state and the persistent input batch the step's tensors come from.

``CachedRequestState`` is what the worker remembers about every live request. ``InputBatch``
holds the requests scheduled in the current step as dense rows of numpy buffers (token ids,
computed counts, block tables) that persist across steps and change only by the scheduler's
diffs, so building a step is a few numpy gathers over those buffers, not per-request Python
list work; per-row caches (the runner's sampling metadata) are reused while the rows stay
the same (``InputBatch.version``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.flat_batch import batch_tensors, index_arrays
from pagedllm.worker.staging import HostStager


@dataclass
class CachedRequestState:
    """What the worker remembers about a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    # Appended in place as tokens are sampled: the sampling metadata holds this very list.
    output_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_done: int = 0  # prompt positions already reported (a resumed request recomputes)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


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
    # Per logits row: its request's batch row (the request repeated over its proposals' rows).
    sample_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

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
            new.req_id, list(new.prompt_token_ids), new.sampling_params,
            make_generator(new.sampling_params.seed), list(new.block_ids), new.num_computed_tokens)
    cached = sched.scheduled_cached_reqs
    for req_id, resumed, block_ids, computed in zip(cached.req_ids, cached.resumed_from_preemption,
                                                    cached.new_block_ids, cached.num_computed_tokens):
        state = states[req_id]
        state.block_ids = list(block_ids) if resumed else state.block_ids + block_ids
        state.num_computed_tokens = computed


class InputBatch:
    """The requests of the current step as dense rows of persistent numpy buffers.

    A row holds its request's tokens (prompt + output; during a step, proposals under
    verification sit past the end), computed count and block table. A request that is not
    scheduled in a step (finished, preempted, or its turn went to others) leaves the rows and
    comes back from its ``CachedRequestState`` when it is scheduled again. Removing a row moves
    the last row into the hole, so rows stay dense and the others keep their place; ``version``
    changes with every change of membership or order. Buffers grow (doubling) as needed.
    """

    def __init__(self) -> None:
        self.states: list[CachedRequestState] = []  # row i's request
        self.row_of: dict[str, int] = {}
        self.token_ids = np.zeros((8, 256), dtype=np.int64)
        self.num_tokens = np.zeros(8, dtype=np.int64)
        self.num_computed = np.zeros(8, dtype=np.int64)
        self.block_table = np.zeros((8, 16), dtype=np.int64)
        self.num_blocks = np.zeros(8, dtype=np.int64)
        self.version = 0

    def __len__(self) -> int:
        return len(self.states)

    @property
    def req_ids(self) -> list[str]:
        """The rows' request ids, in row order."""
        return [s.req_id for s in self.states]

    def tokens(self, req_id: str) -> np.ndarray:
        """The request's prompt + output so far (a view: valid until the batch next changes)."""
        row = self.row_of[req_id]
        return self.token_ids[row, :self.num_tokens[row]]

    # ------------------------------------------------------------------ diffs
    def sync(self, states: dict[str, CachedRequestState], sched: SchedulerOutput) -> None:
        """Make the rows the requests ``sched`` schedules, with ``states`` already updated."""
        scheduled = sched.num_scheduled_tokens
        # Rows leave when not scheduled, and when their id now names another request (one that
        # finished or was aborted, then came back under the same id with a fresh state).
        for req_id in [s.req_id for s in self.states if s.req_id not in scheduled or states.get(s.req_id) is not s]:
            self._remove(req_id)
        cached = sched.scheduled_cached_reqs
        for req_id, resumed, new_blocks in zip(cached.req_ids, cached.resumed_from_preemption,
                                               cached.new_block_ids):
            row = self.row_of.get(req_id)
            if row is not None and (resumed or new_blocks):
                self._set_blocks(row, states[req_id].block_ids)
        for req_id in scheduled:
            if req_id not in self.row_of:
                self._add(states[req_id])
        n = len(self.states)
        self.num_computed[:n] = np.fromiter((s.num_computed_tokens for s in self.states), dtype=np.int64, count=n)

    def append_tokens(self, req_id: str, tokens: list[int]) -> None:
        """Record sampled tokens (the caller extends the state's ``output_token_ids``)."""
        row = self.row_of[req_id]
        end = self.num_tokens[row] + len(tokens)
        self._fit(row + 1, end)
        self.token_ids[row, self.num_tokens[row]:end] = tokens
        self.num_tokens[row] = end

    def _add(self, state: CachedRequestState) -> None:
        row = len(self.states)
        self._fit(row + 1, state.num_tokens)
        self.states.append(state)
        self.row_of[state.req_id] = row
        prompt = state.num_prompt_tokens
        self.token_ids[row, :prompt] = state.prompt_token_ids
        self.token_ids[row, prompt:state.num_tokens] = state.output_token_ids
        self.num_tokens[row] = state.num_tokens
        self._set_blocks(row, state.block_ids)
        self.version += 1

    def _remove(self, req_id: str) -> None:
        row, last = self.row_of.pop(req_id), len(self.states) - 1
        if row != last:  # the last row fills the hole
            self.states[row] = self.states[last]
            self.row_of[self.states[row].req_id] = row
            width = self.num_tokens[last]
            self.token_ids[row, :width] = self.token_ids[last, :width]
            self.block_table[row] = self.block_table[last]
            for column in (self.num_tokens, self.num_computed, self.num_blocks):
                column[row] = column[last]
        self.states.pop()
        self.version += 1

    def _set_blocks(self, row: int, block_ids: list[int]) -> None:
        if len(block_ids) > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, self.block_table.shape[0], len(block_ids))
        self.block_table[row, :len(block_ids)] = block_ids
        self.block_table[row, len(block_ids):] = 0  # the null block pads, as in a fresh table
        self.num_blocks[row] = len(block_ids)

    def _fit(self, rows: int, width: int) -> None:
        """Grow the buffers to at least ``rows`` rows and ``width`` tokens per row."""
        if rows > self.token_ids.shape[0] or width > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, rows, width)
        if rows > self.num_tokens.shape[0]:
            self.block_table = _grown(self.block_table, rows, self.block_table.shape[1])
            self.num_tokens, self.num_computed, self.num_blocks = (
                _grown(a[None], 1, rows)[0] for a in (self.num_tokens, self.num_computed, self.num_blocks))

    # ------------------------------------------------------------------ one step
    def prepare(self, sched: SchedulerOutput, block_size: int, stager: HostStager) -> BatchInputs:
        """The step's flat tensors: token ids, positions, slot mapping and block tables gathered
        from the buffers, moved (with the sampled rows) to the device in one go.

        A request with proposals (speculative decoding) runs its real tokens then its proposals;
        it samples at its last real token and at every proposal, and the verifier keeps a prefix.
        """
        req_ids = self.req_ids
        n = len(req_ids)
        counts = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=n)
        num_drafts = np.zeros(n, dtype=np.int64)
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            if drafts:  # written past the request's tokens, where this step's KV goes
                row = self.row_of[req_id]
                end = self.num_tokens[row] + len(drafts)
                self._fit(n, end)
                self.token_ids[row, self.num_tokens[row]:end] = drafts
                num_drafts[row] = len(drafts)
        starts = self.num_computed[:n].copy()
        table = self.block_table[:n, :max(1, int(self.num_blocks[:n].max()))]
        arrays, req_of_token = index_arrays(counts, starts, table, block_size)
        arrays["input_ids"] = self.token_ids[req_of_token, arrays["positions"]]
        # Rows that reach the end of their tokens sample: the last real token's row + each proposal's.
        sample = np.flatnonzero(starts + counts - num_drafts == self.num_tokens[:n])
        rows_per_sample = num_drafts[sample] + 1
        sample_rows = np.repeat(sample, rows_per_sample)
        first_row = np.repeat(arrays["query_start_loc"][sample + 1] - rows_per_sample, rows_per_sample)
        arrays["logits_indices"] = first_row + np.arange(len(sample_rows)) - np.repeat(
            np.cumsum(rows_per_sample) - rows_per_sample, rows_per_sample)
        staged = stager.stage(arrays)
        input_ids, positions, attn = batch_tensors(arrays, staged, block_size)
        sample_list = sample.tolist()
        return BatchInputs(
            req_ids=req_ids, input_ids=input_ids, positions=positions, attn=attn,
            logits_indices=staged["logits_indices"], sample_req_ids=[req_ids[i] for i in sample_list],
            starts=starts.tolist(), num_scheduled=counts.tolist(),
            num_draft_tokens=num_drafts[sample].tolist(),
            draft_token_ids=[t for i in sample_list for t in sched.scheduled_spec_decode_tokens.get(req_ids[i], ())],
            sample_rows=sample_rows)


def _grown(a: np.ndarray, rows: int, width: int) -> np.ndarray:
    """``a`` copied into a zeroed array at least [rows, width], each side doubled when it grows."""
    new_rows = a.shape[0] if rows <= a.shape[0] else max(rows, 2 * a.shape[0])
    new_width = a.shape[1] if width <= a.shape[1] else max(width, 2 * a.shape[1])
    out = np.zeros((new_rows, new_width), dtype=a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out
