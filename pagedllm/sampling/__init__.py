"""Sampling: pure tensor ops, per-step metadata and the Sampler module."""

from pagedllm.sampling.metadata import SamplingMetadata, pad_token_ids
from pagedllm.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_logprobs_topk

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs_topk",
    "pad_token_ids",
]
