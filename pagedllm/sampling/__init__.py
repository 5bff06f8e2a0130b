"""Sampling: pure tensor ops, per-step metadata and the Sampler module."""

from pagedllm.sampling.metadata import SamplingMetadata, pad_token_ids
from pagedllm.sampling.sampler import DraftBatch, LogprobsTensors, Sampler, SamplerOutput, compute_logprobs_topk

__all__ = [
    "DraftBatch",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs_topk",
    "pad_token_ids",
]
