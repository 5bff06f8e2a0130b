"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.protocol import LogprobsLists
from pagedllm.layers.attention import Attention
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.models.loader import load_model
from pagedllm.sampling.metadata import SAMPLING_EPS, SamplingMetadata
from pagedllm.sampling.sampler import LogprobsTensors, Sampler, compute_logprobs_topk
from pagedllm.sampling.spec_sampler import DraftBatch, sample_with_drafts
from pagedllm.spec_decode.proposer import ProposeContext, make_proposer
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.worker.cuda_graph import CudaGraphRunner, capture_sizes, graphs_enabled
from pagedllm.worker.input_batch import BatchInputs, CachedRequestState, InputBatch, update_states
from pagedllm.worker.staging import HostStager

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = _TORCH_DTYPES[config.model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.arch.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch()  # the step's requests as persistent rows
        self._sampling: tuple[int, SamplingMetadata] | None = None  # (input_batch.version, its metadata)
        self.sampler = Sampler()
        self.attn_backend = get_attn_backend(device.type, config.attention_backend)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.proposer = None  # speculative decoding: set up in load_model
        self.draft_probs: dict[str, torch.Tensor] = {}  # req_id -> [k, V] of its pending proposals
        self.stager = HostStager(device)  # one pinned buffer, one host-to-device copy per step (CUDA)
        self.cuda_graphs: CudaGraphRunner | None = None  # decode-only steps replay these (CUDA)

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        mc = self.config.model_config
        self.model = load_model(mc.model, mc.arch, load_format=mc.load_format, dtype=self.dtype,
                                device=self.device, seed=mc.seed, quantization=mc.quantization)
        self.proposer = make_proposer(self.config, self)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[2, num_blocks, block_size, KVH, D]`` per layer and bind it to the layers."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # A draft model's layers get their own tensors over the same block ids (shared tables).
        layers += getattr(self.proposer, "attention_layers", list)()
        self.kv_caches = []
        for layer in layers:
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            # Zeroed, not empty: padded reads of unused slots are masked, but NaN garbage would
            # still poison the attention matmul (0 * NaN = NaN).
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.bind_kv_cache(cache, self.attn_backend)
            self.kv_caches.append(cache)

    def capture_cuda_graphs(self) -> None:
        """Capture decode-only forwards (after the KV cache is bound: the graphs bake in its address)."""
        if not graphs_enabled(self.config, self.device, self.attn_backend):
            return
        sizes = capture_sizes(self.config.scheduler_config.max_num_seqs)
        self.cuda_graphs = CudaGraphRunner(self.model, self.attn_backend, sizes,
                                           self.config.blocks_per_max_len_request(), self.block_size,
                                           self.config.model_config.max_model_len, self.device)
        seconds = self.cuda_graphs.capture()
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s (--enforce-eager turns them off)",
                    sizes, seconds)

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        update_states(self.requests, sched, self._make_generator)
        for req_id in sched.finished_req_ids:
            self.draft_probs.pop(req_id, None)
        self.input_batch.sync(self.requests, sched)  # an empty step empties the rows too
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch.prepare(sched, self.block_size, self.stager)
        hidden = self._forward(batch)
        output = ModelRunnerOutput(sampled_token_ids={r: [] for r in batch.req_ids})
        self._compute_prompt_logprobs(batch, hidden, output)
        if batch.sample_req_ids:
            self._sample(batch, hidden, output, sched.grammar_bitmask)
        # Every step, sampled or not: a draft model must see each prefill chunk to keep its KV whole.
        self._propose(batch, hidden, output)
        return output

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        """Hidden states [T, hidden]: a CUDA graph replay for decode-only steps, else eager."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, self.attn_backend.build_metadata(batch.attn))

    def _sample(self, batch: BatchInputs, hidden: torch.Tensor, output: ModelRunnerOutput,
                grammar_bitmask=None) -> None:
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        row_req_ids = [r for r, k in zip(batch.sample_req_ids, self._rows_per_request(batch)) for _ in range(k)]
        apply_grammar_bitmask(logits, grammar_bitmask, row_req_ids)  # constrained rows only (never speculated)
        states = [self.requests[r] for r in batch.sample_req_ids]
        metadata = self._sampling_metadata(batch)
        if batch.has_drafts:
            emitted, logprobs = sample_with_drafts(self.sampler, logits, metadata, self._draft_batch(batch, states))
        else:
            result = self.sampler(logits, metadata)
            emitted, logprobs = [[t] for t in result.sampled_token_ids.tolist()], result.logprobs_tensors
        for state, tokens in zip(states, emitted):
            state.output_token_ids.extend(tokens)
            self.input_batch.append_tokens(state.req_id, tokens)
            output.sampled_token_ids[state.req_id] = tokens
        if logprobs is not None:
            _split_logprobs(logprobs, states, emitted, self._rows_per_request(batch), output.logprobs)

    def _sampling_metadata(self, batch: BatchInputs) -> SamplingMetadata:
        """The metadata of the step's logits rows: the batch's own, built when its rows change
        and reused while they stay the same; ``select`` of it when only some rows sample or a
        request has several rows (proposals)."""
        rows = self.input_batch
        if self._sampling is None or self._sampling[0] != rows.version:
            states = rows.states
            self._sampling = (rows.version, SamplingMetadata.from_params(
                [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
                [s.output_token_ids for s in states], self.vocab_size, self.device,
                {i: s.generator for i, s in enumerate(states) if s.generator is not None}))
        metadata = self._sampling[1]
        sample_rows = batch.sample_rows
        if len(sample_rows) == len(rows) and not batch.has_drafts:
            return metadata  # every row samples once, in row order
        return metadata.select(sample_rows.tolist())

    @staticmethod
    def _rows_per_request(batch: BatchInputs) -> list[int]:
        return [k + 1 for k in batch.num_draft_tokens]

    def _draft_batch(self, batch: BatchInputs, states: list[CachedRequestState]) -> DraftBatch:
        """The proposals under verification, with the distributions a draft model drew them from."""
        probs = [self.draft_probs.get(s.req_id) for s in states]
        draft_probs = None
        if any(p is not None for p in probs):
            # A request without stored distributions (greedy, which never reads them) gets one-hot
            # rows at its proposals: exact for any proposer, should one ever be verified randomly.
            drafts = torch.tensor(batch.draft_token_ids, device=self.device).split(batch.num_draft_tokens)
            rows = [p[:len(d)] if p is not None else F.one_hot(d, self.vocab_size).float()
                    for p, d in zip(probs, drafts)]
            draft_probs = torch.cat(rows)
        return DraftBatch(batch.num_draft_tokens, batch.draft_token_ids, draft_probs,
                          [s.sampling_params.temperature < SAMPLING_EPS for s in states],
                          {i: s.generator for i, s in enumerate(states) if s.generator is not None})

    def _propose(self, batch: BatchInputs, hidden: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Guess the next tokens of the requests that just sampled (speculative decoding)."""
        if self.proposer is None:
            return
        emitted = {r: output.sampled_token_ids[r] for r in batch.sample_req_ids}
        proposals = self.proposer.propose(ProposeContext(self, batch, hidden, emitted))
        for req_id in emitted:
            self.draft_probs.pop(req_id, None)
        self.draft_probs.update(proposals.probs)
        output.spec_token_ids = proposals.token_ids

    def _compute_prompt_logprobs(self, batch: BatchInputs, hidden: torch.Tensor,
                                 output: ModelRunnerOutput) -> None:
        """Logprobs of each next prompt token for the prompt positions computed this step."""
        offset = 0
        for req_id, start, count in zip(batch.req_ids, batch.starts, batch.num_scheduled):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            first = max(start, state.prompt_logprobs_done)
            end = min(start + count, state.num_prompt_tokens - 1)  # last prompt token predicts nothing
            if k is not None and end > first:
                rows = hidden[offset + first - start:offset + end - start]
                targets = torch.tensor(state.prompt_token_ids[first + 1:end + 1], device=self.device)
                lp = compute_logprobs_topk(self.model.compute_logits(rows), k, targets)
                output.prompt_logprobs[req_id] = LogprobsLists(*lp.tolists())
                state.prompt_logprobs_done = end
            offset += count


def _split_logprobs(tensors: LogprobsTensors, states: list[CachedRequestState], emitted: list[list[int]],
                    rows_per_request: list[int], out: dict[str, LogprobsLists]) -> None:
    """One row per emitted token, trimmed to the request's own number of logprobs."""
    ids, lps, ranks = tensors.tolists()
    row = 0
    for state, tokens, num_rows in zip(states, emitted, rows_per_request):
        k = state.sampling_params.logprobs
        if k is not None:
            rows = range(row, row + len(tokens))
            out[state.req_id] = LogprobsLists([ids[r][:k + 1] for r in rows], [lps[r][:k + 1] for r in rows],
                                              [ranks[r] for r in rows])
        row += num_rows
