"""The draft-model proposer: a smaller model with the target's tokenizer guesses k tokens.

The draft model's KV lives in its own cache tensors but in the same blocks as the target's:
every block table, slot mapping and block id is shared, so the scheduler's block machinery
(allocation, prefix caching, preemption) covers both models at once, and a prefix-cache hit
brings the draft's KV along with the target's. The runner binds those caches like the target's
(``models``). Each step the draft first catches up on the tokens the target just ran plus the
ones it emitted, then feeds its own guesses back k - 1 times; those writes land in lookahead
slots the scheduler reserves (``SpeculativeConfig.num_lookahead_tokens``) and are overwritten
once the target verifies. Guesses are drawn through the target's ``Sampler`` chain with the
requests' own sampling metadata.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.attention.backends.base import AttentionBackend
from pagedllm.models.loader import load_model
from pagedllm.sampling.sampler import Sampler
from pagedllm.spec_decode.proposer import Proposals, ProposerInputs
from pagedllm.worker.causal_lm import CausalLM
from pagedllm.worker.flat_batch import batch_tensors, index_arrays
from pagedllm.worker.staging import HostStager


class DraftModelProposer:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        attn_backend: AttentionBackend,
        stager: HostStager,
    ) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.draft_arch is not None, "a draft_model speculative config has its arch"
        mc = config.model_config
        self.model = load_model(
            spec.draft_model, spec.draft_arch, load_format=mc.load_format, dtype=dtype, device=device, seed=mc.seed
        )
        self.lm = cast(CausalLM, self.model)  # the same module, typed for its calls
        self.attn_backend, self.stager = attn_backend, stager
        self.sampler = Sampler()

    @property
    def models(self) -> list[torch.nn.Module]:
        return [self.model]

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> Proposals:
        hidden, last_row = self._catch_up(inputs)
        rooms = inputs.max_proposals
        active = np.flatnonzero(rooms > 0)  # indices into the sampling requests
        proposals = Proposals()
        if not active.size:
            return proposals
        guesses = np.zeros((len(rooms), int(rooms.max())), dtype=np.int64)
        probs: dict[int, list[torch.Tensor]] = {}
        logits = self.lm.compute_logits(hidden[torch.as_tensor(last_row[active], device=hidden.device)])
        for j in range(guesses.shape[1]):
            guesses[active, j] = self._draw(inputs, active, logits, probs)
            active = active[rooms[active] > j + 1]
            if not active.size:
                break
            logits = self._feed_back(inputs, active, guesses[active, j], j)
        req_ids = [inputs.req_ids[row] for row in inputs.sample_batch_rows.tolist()]
        for i, room in enumerate(rooms.tolist()):
            if room:
                proposals.token_ids[req_ids[i]] = guesses[i, :room].tolist()
        proposals.probs = {req_ids[i]: torch.stack(rows) for i, rows in probs.items()}
        return proposals

    def _catch_up(self, inputs: ProposerInputs) -> tuple[torch.Tensor, np.ndarray]:
        """Run the draft over what the target ran this step, plus the tokens it emitted (the
        accepted proposals and the new token), so the draft's KV covers every computed token.
        Returns the hidden states and, per sampling request, the row of its last token."""
        ends = inputs.starts + inputs.num_scheduled
        ends[inputs.sample_batch_rows] = inputs.num_tokens[
            inputs.sample_batch_rows
        ]  # rejected proposals out, emitted in
        counts = ends - inputs.starts
        arrays, req_of_token = index_arrays(counts, inputs.starts, inputs.block_table, inputs.block_size)
        arrays["input_ids"] = inputs.token_ids[req_of_token, arrays["positions"]]
        hidden = self._forward(arrays, inputs.block_size)
        return hidden, arrays["query_start_loc"][inputs.sample_batch_rows + 1] - 1

    def _feed_back(self, inputs: ProposerInputs, active: np.ndarray, tokens: np.ndarray, j: int) -> torch.Tensor:
        """One decode step of the draft on its own latest guess for each request still going."""
        rows = inputs.sample_batch_rows[active]
        # The emitted token sits at num_tokens - 1; guess j + 1 goes right after guess j.
        arrays, _ = index_arrays(
            np.ones(len(rows), dtype=np.int64), inputs.num_tokens[rows] + j, inputs.block_table[rows], inputs.block_size
        )
        arrays["input_ids"] = tokens
        return self.lm.compute_logits(self._forward(arrays, inputs.block_size))

    def _forward(self, arrays: dict[str, np.ndarray], block_size: int) -> torch.Tensor:
        input_ids, positions, attn = batch_tensors(arrays, self.stager.stage(arrays), block_size)
        return self.lm(input_ids, positions, self.attn_backend.build_metadata(attn))

    def _draw(
        self, inputs: ProposerInputs, active: np.ndarray, logits: torch.Tensor, probs: dict[int, list[torch.Tensor]]
    ) -> list[int]:
        """One guess per active request through the Sampler (argmax for greedy requests); the
        distributions of the random ones are kept for the verifier."""
        assert inputs.sampling is not None, "requests with room sampled this step: their metadata exists"
        md = inputs.sampling.select(inputs.sample_batch_rows[active].tolist())
        tokens, drawn_from = self.sampler.draw(logits, md, keep_probs=True)
        if drawn_from is not None:
            for i, (request, greedy) in enumerate(zip(active.tolist(), md.greedy)):
                if not greedy:
                    probs.setdefault(request, []).append(drawn_from[i])
        return tokens.tolist()
