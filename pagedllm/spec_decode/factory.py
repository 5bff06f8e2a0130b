"""Picks the ``Proposer`` a speculative config asks for (the one module that knows them all)."""

from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.layers.attention.backends.base import AttentionBackend
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.ngram import NgramSpecProposer
from pagedllm.spec_decode.proposer import Proposer
from pagedllm.worker.staging import HostStager


def make_proposer(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, attn_backend: AttentionBackend, stager: HostStager
) -> Proposer | None:
    """None without speculative decoding. A draft model is loaded here onto ``device``; it runs its
    forwards with the target's attention backend and host stager."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramSpecProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return DraftModelProposer(config, device, dtype, attn_backend, stager)
