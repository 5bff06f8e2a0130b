"""Pooling: each prompt's final hidden states -> one embedding, built up chunk by chunk.

A decoder's prompt may be computed over several steps (chunked prefill), so the pooler keeps a
running value per request: the sum of the rows (MEAN), the first row (CLS); LAST needs only the
prompt's final row. A chunk that starts at position 0 starts the value afresh, which is also what
a preempted request that recomputes does. When the chunk reaches the end of the prompt the
embedding is finished: truncated to the request's ``dimensions`` and normalized if asked, and
sent back as float32 bytes (little-endian, what OpenAI's base64 encoding carries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.config.pooler import PoolerConfig
from pagedllm.pooling_params import PoolingParams
from pagedllm.worker.batch_inputs import BatchInputs
from pagedllm.worker.request_state import CachedRequestState


class Pooler:
    """Turns a step's hidden states into the embeddings of the prompts that end in it."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: dict[str, torch.Tensor] = {}  # req_id -> running sum (MEAN) or first row (CLS)

    def __call__(
        self, batch: BatchInputs, hidden: torch.Tensor, states: dict[str, CachedRequestState]
    ) -> dict[str, bytes]:
        finished: dict[str, bytes] = {}
        offset = 0
        for req_id, start, count in zip(batch.req_ids, batch.starts.tolist(), batch.num_scheduled.tolist()):
            state = states[req_id]
            params = state.pooling_params
            assert params is not None, "a pooling runner runs pooling requests only"
            rows = hidden[offset : offset + count]
            offset += count
            self._accumulate(req_id, params.pooling_type, start, rows)
            if start + count == state.num_prompt_tokens:
                vector = self._pooled(req_id, params.pooling_type, rows, state.num_prompt_tokens)
                finished[req_id] = self._finish(vector, params).numpy().tobytes()
        return finished

    def forget(self, req_ids: set[str]) -> None:
        """Drop the running values of requests that finished or were aborted."""
        for req_id in req_ids:
            self._partial.pop(req_id, None)

    def _accumulate(self, req_id: str, pooling_type: str, start: int, rows: torch.Tensor) -> None:
        if pooling_type == "MEAN":
            chunk_sum = rows.sum(dim=0, dtype=torch.float32)
            self._partial[req_id] = chunk_sum if start == 0 else self._partial[req_id] + chunk_sum
        elif pooling_type == "CLS" and start == 0:
            self._partial[req_id] = rows[0].float()

    def _pooled(self, req_id: str, pooling_type: str, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        if pooling_type == "LAST":
            return rows[-1].float()
        value = self._partial.pop(req_id)
        return value / num_tokens if pooling_type == "MEAN" else value

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        if normalize:
            vector = F.normalize(vector, p=2.0, dim=-1)
        return vector.to(device="cpu", dtype=torch.float32).contiguous()
