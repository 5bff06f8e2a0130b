"""The draft-model proposer: a smaller model with the target's tokenizer guesses k tokens.

The draft model's KV lives in its own cache tensors but in the same blocks as the target's:
every block table, slot mapping and block id is shared, so the scheduler's block machinery
(allocation, prefix caching, preemption) covers both models at once, and a prefix-cache hit
brings the draft's KV along with the target's. Each step the draft first catches up on the
tokens the target just ran plus the ones it emitted, then feeds its own guesses back k - 1
times; those writes land in lookahead slots the scheduler reserves
(``SpeculativeConfig.num_lookahead_tokens``) and are overwritten once the target verifies.
"""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.attention import Attention
from pagedllm.models.loader import load_model
from pagedllm.sampling import ops
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.spec_decode.proposer import ProposeContext, Proposals, speculation_room
from pagedllm.worker.flat_batch import build_flat_batch


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = config.speculative_config
        mc = config.model_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = mc.max_model_len
        self.vocab_size = spec.draft_arch.vocab_size
        self.model = load_model(spec.draft_model, spec.draft_arch, load_format=mc.load_format, dtype=dtype,
                                device=device, seed=mc.seed)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext) -> Proposals:
        hidden, last_row = self._catch_up(ctx)
        runner = ctx.runner
        rooms = {r: speculation_room(runner.requests[r], self.k, self.max_model_len) for r in ctx.emitted}
        active = [r for r, room in rooms.items() if room > 0]
        proposals = Proposals()
        if not active:
            return proposals
        logits = self.model.compute_logits(hidden[[last_row[r] for r in active]])
        for j in range(max(rooms[r] for r in active)):
            tokens, probs = self._draw(runner, active, logits)
            for i, req_id in enumerate(active):
                proposals.token_ids.setdefault(req_id, []).append(tokens[i])
                if probs is not None and probs[i] is not None:
                    proposals.probs.setdefault(req_id, []).append(probs[i])
            active = [r for r in active if len(proposals.token_ids[r]) < rooms[r]]
            if not active:
                break
            logits = self._feed_back(runner, active, proposals, j)
        proposals.probs = {r: torch.stack(rows) for r, rows in proposals.probs.items()}
        return proposals

    def _catch_up(self, ctx: ProposeContext) -> tuple[torch.Tensor, dict[str, int]]:
        """Run the draft over what the target ran this step, plus the tokens it emitted (the
        accepted proposals and the new token), so the draft's KV covers every computed token."""
        runner, batch = ctx.runner, ctx.batch
        tokens, starts, tables = [], [], []
        for req_id, start, num_scheduled in zip(batch.req_ids, batch.starts, batch.num_scheduled):
            row = runner.input_batch.tokens(req_id)
            end = len(row) if req_id in ctx.emitted else start + num_scheduled
            tokens.append(row[start:end].tolist())
            starts.append(start)
            tables.append(runner.requests[req_id].block_ids)
        hidden = self._forward(runner, tokens, starts, tables)
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0).tolist()
        return hidden, {r: ends[i] - 1 for i, r in enumerate(batch.req_ids)}

    def _feed_back(self, runner, active: list[str], proposals: Proposals, j: int) -> torch.Tensor:
        """One decode step of the draft on its own latest guess for each request still going."""
        states = [runner.requests[r] for r in active]
        # The emitted token sits at num_tokens - 1; guess j + 1 goes right after guess j.
        starts = [s.num_tokens + j for s in states]
        tokens = [[proposals.token_ids[r][j]] for r in active]
        hidden = self._forward(runner, tokens, starts, [s.block_ids for s in states])
        return self.model.compute_logits(hidden)

    def _forward(self, runner, tokens: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        input_ids, positions, attn = build_flat_batch(tokens, starts, tables, runner.block_size, runner.device,
                                                      stager=runner.stager)
        return self.model(input_ids, positions, runner.attn_backend.build_metadata(attn))

    def _draw(self, runner, active: list[str], logits: torch.Tensor) -> tuple[list[int], list | None]:
        """Sample one guess per request from the draft's processed distribution (argmax for greedy
        requests); return the distributions of the random ones for the verifier."""
        states = [runner.requests[r] for r in active]
        md = SamplingMetadata.from_params(
            [s.sampling_params for s in states], [[] for _ in states], [s.output_token_ids for s in states],
            self.vocab_size, logits.device, {i: s.generator for i, s in enumerate(states) if s.generator is not None})
        processed = runner.sampler.apply_constraints(logits.to(torch.float32, copy=True), md)
        greedy = processed.argmax(dim=-1)
        if md.all_greedy:
            return greedy.tolist(), None
        probs = runner.sampler.processed_probs(processed, md)
        drawn = ops.random_sample(probs.clone(), md.generators)
        is_greedy = md.temperature < 1e-5
        tokens = torch.where(is_greedy, greedy, drawn).tolist()
        return tokens, [None if g else probs[i] for i, g in enumerate(is_greedy.tolist())]
