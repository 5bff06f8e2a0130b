"""The persistent input batch every step's typed inputs (``BatchInputs``) come from.

``InputBatch`` holds the requests scheduled in the current step as dense rows of numpy buffers
(token ids, computed counts, block tables) that persist across steps and change only by the
scheduler's diffs, so building a step is a few numpy gathers over those buffers, not
per-request Python list work; per-row caches (the rows' sampling metadata) are reused while
the rows stay the same (``InputBatch.version``). After sampling it records the emitted tokens
and hands a proposer its view of the step (``ProposerInputs``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.sampler import DraftBatch
from pagedllm.spec_decode.proposer import Proposals, ProposerInputs, speculation_room
from pagedllm.worker.batch_inputs import BatchInputs, LoRABatch
from pagedllm.worker.flat_batch import batch_tensors, index_arrays
from pagedllm.worker.request_state import CachedRequestState
from pagedllm.worker.staging import HostStager


class InputBatch:
    """The requests of the current step as dense rows of persistent numpy buffers.

    A row holds its request's tokens (prompt + output; during a step, proposals under
    verification sit past the end), computed count and block table. A request that is not
    scheduled in a step (finished, preempted, or its turn went to others) leaves the rows and
    comes back from its ``CachedRequestState`` when it is scheduled again. Removing a row moves
    the last row into the hole, so rows stay dense and the others keep their place; ``version``
    changes with every change of membership or order. Buffers grow (doubling) as needed.
    """

    def __init__(self, block_size: int, vocab_size: int, stager: HostStager) -> None:
        self.block_size, self.vocab_size, self.stager = block_size, vocab_size, stager
        self._sampling: tuple[int, SamplingMetadata] | None = None  # (version, the rows' metadata)
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
        return self.token_ids[row, : self.num_tokens[row]]

    # ------------------------------------------------------------------ diffs
    def sync(self, states: dict[str, CachedRequestState], sched: SchedulerOutput) -> None:
        """Make the rows the requests ``sched`` schedules, with ``states`` already updated."""
        scheduled = sched.num_scheduled_tokens
        # Rows leave when not scheduled, and when their id now names another request (one that
        # finished or was aborted, then came back under the same id with a fresh state).
        for req_id in [s.req_id for s in self.states if s.req_id not in scheduled or states.get(s.req_id) is not s]:
            self._remove(req_id)
        cached = sched.scheduled_cached_reqs
        for req_id, resumed, new_blocks in zip(cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids):
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
        self._append(self.row_of[req_id], tokens)

    def _append(self, row: int, tokens: list[int]) -> None:
        end = self.num_tokens[row] + len(tokens)
        self._fit(row + 1, end)
        self.token_ids[row, self.num_tokens[row] : end] = tokens
        self.num_tokens[row] = end

    def _add(self, state: CachedRequestState) -> None:
        row = len(self.states)
        self._fit(row + 1, state.num_tokens)
        self.states.append(state)
        self.row_of[state.req_id] = row
        prompt = state.num_prompt_tokens
        self.token_ids[row, :prompt] = state.prompt_token_ids
        self.token_ids[row, prompt : state.num_tokens] = state.output_token_ids
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
        self.block_table[row, : len(block_ids)] = block_ids
        self.block_table[row, len(block_ids) :] = 0  # the null block pads, as in a fresh table
        self.num_blocks[row] = len(block_ids)

    def _fit(self, rows: int, width: int) -> None:
        """Grow the buffers to at least ``rows`` rows and ``width`` tokens per row."""
        if rows > self.token_ids.shape[0] or width > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, rows, width)
        if rows > self.num_tokens.shape[0]:
            self.block_table = _grown(self.block_table, rows, self.block_table.shape[1])
            self.num_tokens, self.num_computed, self.num_blocks = (
                _grown(a[None], 1, rows)[0] for a in (self.num_tokens, self.num_computed, self.num_blocks)
            )

    # ------------------------------------------------------------------ one step
    def prepare(self, sched: SchedulerOutput, sampling: bool = True) -> BatchInputs:
        """The step's typed inputs: token ids, positions, slot mapping and block tables gathered
        from the buffers and moved (with the sampled rows) to the device in one go, plus the
        sampling metadata of the rows that sample and the proposals they verify.

        A request with proposals (speculative decoding) runs its real tokens then its proposals;
        it samples at its last real token and at every proposal, and the verifier keeps a prefix.
        ``sampling=False`` (a pooling runner): no row samples.
        """
        n = len(self.states)
        counts = np.fromiter((sched.num_scheduled_tokens[s.req_id] for s in self.states), dtype=np.int64, count=n)
        num_drafts = self._write_drafts(sched.scheduled_spec_decode_tokens)
        starts = self.num_computed[:n].copy()
        arrays, req_of_token = index_arrays(counts, starts, self._table(), self.block_size)
        arrays["input_ids"] = self.token_ids[req_of_token, arrays["positions"]]
        # Rows that reach the end of their tokens sample: the last real token's row + each proposal's.
        sample = np.flatnonzero(starts + counts - num_drafts == self.num_tokens[:n])
        if not sampling:
            sample = sample[:0]
        sample_rows, arrays["logits_indices"], is_draft = _logits_rows(
            arrays["query_start_loc"], sample, num_drafts[sample]
        )
        has_drafts = bool(is_draft.any())
        if has_drafts:  # a proposal is the input token at every logits row but its request's first
            arrays["draft_token_ids"] = arrays["input_ids"][arrays["logits_indices"][is_draft]]
        staged = self.stager.stage(arrays)
        input_ids, positions, attn = batch_tensors(arrays, staged, self.block_size)
        req_ids = self.req_ids
        batch = BatchInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            attn=attn,
            starts=starts,
            num_scheduled=counts,
            logits_indices=staged["logits_indices"],
            sample_req_ids=[req_ids[i] for i in sample.tolist()],
            sample_batch_rows=sample,
            sample_rows=sample_rows,
            lora=self._lora_batch(req_of_token),
        )
        if len(sample):
            batch.sampling = self._step_metadata(sample_rows, has_drafts)
        if has_drafts:
            batch.drafts = self._drafts(sample, num_drafts[sample].tolist(), staged["draft_token_ids"])
        return batch

    def _lora_batch(self, req_of_token: np.ndarray) -> LoRABatch | None:
        """Each token's adapter id, when any row runs an adapter."""
        loras = {s.lora_request.lora_int_id: s.lora_request for s in self.states if s.lora_request is not None}
        if not loras:
            return None
        row_ids = np.fromiter(
            (0 if s.lora_request is None else s.lora_request.lora_int_id for s in self.states),
            dtype=np.int64,
            count=len(self.states),
        )
        return LoRABatch(row_ids[req_of_token], loras)

    def _table(self) -> np.ndarray:
        """The rows' block tables, as wide as the widest (0 = the null block pads)."""
        n = len(self.states)
        return self.block_table[:n, : max(1, int(self.num_blocks[:n].max()))]

    def _write_drafts(self, spec_tokens: dict[str, list[int]]) -> np.ndarray:
        """Write each request's proposals past its tokens (where this step's KV goes); [rows] counts."""
        n = len(self.states)
        num_drafts = np.zeros(n, dtype=np.int64)
        for req_id, drafts in spec_tokens.items():
            if drafts:
                row = self.row_of[req_id]
                end = self.num_tokens[row] + len(drafts)
                self._fit(n, end)
                self.token_ids[row, self.num_tokens[row] : end] = drafts
                num_drafts[row] = len(drafts)
        return num_drafts

    def row_metadata(self) -> SamplingMetadata:
        """The sampling metadata of the rows (row i = batch row i): built when the rows change,
        reused while they stay the same (its output lists are the states' live lists)."""
        if self._sampling is None or self._sampling[0] != self.version:
            states = self.states
            self._sampling = (
                self.version,
                SamplingMetadata.from_params(
                    [s.sampling_params for s in states],
                    [s.prompt_token_ids for s in states],
                    [s.output_token_ids for s in states],
                    self.vocab_size,
                    self.stager.device,
                    {i: s.generator for i, s in enumerate(states) if s.generator is not None},
                ),
            )
        return self._sampling[1]

    def _step_metadata(self, sample_rows: np.ndarray, has_drafts: bool) -> SamplingMetadata:
        """One metadata row per logits row: the rows' own when every row samples once, in row
        order; else ``select`` of it (some rows don't sample, or a request has several rows)."""
        metadata = self.row_metadata()
        if len(sample_rows) == len(self.states) and not has_drafts:
            return metadata
        return metadata.select(sample_rows.tolist())

    def _drafts(self, sample: np.ndarray, num_drafts: list[int], draft_ids: torch.Tensor) -> DraftBatch:
        """The proposals under verification, with the distributions a draft model drew them from."""
        probs = [self.states[row].draft_probs for row in sample.tolist()]
        draft_probs = None
        if any(p is not None for p in probs):
            # A request without stored distributions (greedy, which never reads them) gets one-hot
            # rows at its proposals: exact for any proposer, should one ever be verified randomly.
            rows = [
                p[: len(d)] if p is not None else F.one_hot(d, self.vocab_size).float()
                for p, d in zip(probs, draft_ids.split(num_drafts))
            ]
            draft_probs = torch.cat(rows)
        return DraftBatch(num_drafts, draft_ids, draft_probs)

    # ------------------------------------------------------------------ after sampling
    def record_sampled(self, batch: BatchInputs, token_ids: list[list[int]]) -> None:
        """Append each sampling request's emitted tokens to its state and its row."""
        for row, tokens in zip(batch.sample_batch_rows.tolist(), token_ids):
            self.states[row].output_token_ids.extend(tokens)
            self._append(row, tokens)

    def proposer_inputs(
        self,
        batch: BatchInputs,
        hidden: torch.Tensor,
        emitted: list[list[int]],
        k: int,
        max_model_len: int,
        limits: dict[str, int],
    ) -> ProposerInputs:
        """What a proposer sees of the step (after ``record_sampled``): views of the rows. Each
        request may get ``k`` proposals, or ``limits[req_id]`` where given."""
        n, rows = len(self.states), batch.sample_batch_rows
        states = [self.states[row] for row in rows.tolist()]
        rooms = [
            speculation_room(
                s.sampling_params, s.num_tokens, len(s.output_token_ids), limits.get(s.req_id, k), max_model_len
            )
            for s in states
        ]
        return ProposerInputs(
            req_ids=batch.req_ids,
            token_ids=self.token_ids[:n],
            num_tokens=self.num_tokens[:n],
            starts=batch.starts,
            num_scheduled=batch.num_scheduled,
            block_table=self._table(),
            block_size=self.block_size,
            hidden_states=hidden,
            sample_batch_rows=rows,
            emitted=emitted,
            max_proposals=np.asarray(rooms, dtype=np.int64),
            sampling=self.row_metadata() if states else None,
        )

    def set_proposals(self, batch: BatchInputs, proposals: Proposals) -> None:
        """Keep the distributions of the sampling requests' new proposals (None: deterministic)."""
        for row in batch.sample_batch_rows.tolist():
            state = self.states[row]
            state.draft_probs = proposals.probs.get(state.req_id)


def _logits_rows(
    query_start_loc: np.ndarray,
    sample: np.ndarray,
    num_drafts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the sampling requests ``sample`` (batch rows) with ``num_drafts`` proposals each: per
    logits row its batch row, its token row (a request's last 1 + k tokens) and whether it is a
    proposal's (every row of a request but its first)."""
    rows_per_sample = num_drafts + 1
    sample_rows = np.repeat(sample, rows_per_sample)
    first_of_request = np.repeat(np.cumsum(rows_per_sample) - rows_per_sample, rows_per_sample)
    position = np.arange(len(sample_rows)) - first_of_request  # within its request's rows
    token_rows = np.repeat(query_start_loc[sample + 1] - rows_per_sample, rows_per_sample) + position
    return sample_rows, token_rows, position > 0


def _grown(a: np.ndarray, rows: int, width: int) -> np.ndarray:
    """``a`` copied into a zeroed array at least [rows, width], each side doubled when it grows."""
    new_rows = a.shape[0] if rows <= a.shape[0] else max(rows, 2 * a.shape[0])
    new_width = a.shape[1] if width <= a.shape[1] else max(width, 2 * a.shape[1])
    out = np.zeros((new_rows, new_width), dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out
