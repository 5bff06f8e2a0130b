"""The typed face of a loaded model as the runner and the proposers use it.

``load_model`` returns an ``nn.Module``, whose ``__getattr__`` types every attribute as a tensor or
module; the runner only calls the forward and ``compute_logits``, so it holds the model as this
protocol (a cast, free at run time). Stand-ins such as the benchmark's timed wrapper fit it too.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class CausalLM(Protocol):
    """A decoder model: hidden states from tokens, then logits from hidden states."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...
