"""``BatchInputs``: the typed contract of one step, everything the forward, the sampler and the
step's output read, prepared by ``InputBatch.prepare``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.layers.attention.metadata import CommonAttentionMetadata
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling.metadata import SamplingMetadata
from pagedllm.sampling.sampler import DraftBatch


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class LoRABatch:
    """The step's adapters: each token's ``lora_int_id`` (0: the base model) and the requests
    that name them (the worker puts them in slots and turns the ids into slot masks)."""

    token_lora_ids: np.ndarray  # [T]
    requests: dict[int, LoRARequest]


@dataclass
class BatchInputs:
    """One step's inputs. Batch rows are the step's requests; logits rows are the tokens whose
    logits are sampled (a request's last real token, then one per proposal it verifies)."""

    req_ids: list[str]  # per batch row
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: CommonAttentionMetadata  # what AttentionBackend.build_metadata takes
    starts: np.ndarray  # [rows] tokens computed before this step
    num_scheduled: np.ndarray  # [rows] tokens run this step
    logits_indices: torch.Tensor  # [R] token rows whose logits are sampled
    sample_req_ids: list[str] = field(default_factory=list)  # the requests that sample, in order
    sample_batch_rows: np.ndarray = field(default_factory=_empty)  # [S] their batch rows
    sample_rows: np.ndarray = field(default_factory=_empty)  # [R] each logits row's batch row
    # One row per logits row (a request's parameters repeated over its proposals' rows); None
    # when nothing samples.
    sampling: SamplingMetadata | None = None
    drafts: DraftBatch | None = None  # the proposals under verification (speculative decoding)
    lora: LoRABatch | None = None  # None: every row runs the base model

    @property
    def has_drafts(self) -> bool:
        return self.drafts is not None

    @property
    def rows_per_request(self) -> list[int]:
        """Logits rows of each sampling request: 1 + its proposals."""
        if self.drafts is None:
            return [1] * len(self.sample_req_ids)
        return [k + 1 for k in self.drafts.num_draft_tokens]

    @property
    def logits_req_ids(self) -> list[str]:
        """The request of each logits row (what the grammar bitmask is matched against)."""
        if self.drafts is None:
            return self.sample_req_ids
        return [r for r, k in zip(self.sample_req_ids, self.rows_per_request) for _ in range(k)]
