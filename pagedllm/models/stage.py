"""What a model needs to build one pipeline stage (``distributed/pipeline.py``) and nothing more.

A stage builds only its ``[start, end)`` decoder layers; the others, and the embedding, final norm
or LM head it does not run, are :class:`PPMissingLayer` placeholders that hold no parameters, so
the module names stay the checkpoint's and the loader skips the tensors of missing modules
(:func:`missing_prefixes`) without reading them. A stage that is not the first takes
:class:`IntermediateTensors` instead of token ids; one that is not the last returns them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.distributed.pipeline import get_pp_group


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage owns: no parameters here, never run here."""


@dataclass
class IntermediateTensors:
    """What one stage hands the next: hidden states and the residual stream, both [T, hidden]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): this stage's ``build(i)`` for i in [start, end), placeholders elsewhere."""
    start, end = get_pp_group().layer_range(num_layers)
    layers = nn.ModuleList(build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The dotted names (with a trailing dot) of the model's placeholders."""
    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))
