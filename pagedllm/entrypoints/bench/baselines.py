"""Hugging Face ``transformers`` baselines on the same requests as pagedllm (llama.cpp: ``llama_cpp.py``).

Two ways people run HF ``generate`` without an inference engine:
  * one request at a time (batch size 1, no padding), and
  * static padded batches (left padding + attention mask): every batch runs until its longest
    output is done, so only each request's own output length counts as useful work.
EOS is disabled (``generation_config.eos_token_id = None``) so every request generates exactly
its output length, like pagedllm with ``ignore_eos=True``; the produced lengths are checked.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedllm.entrypoints.bench.common import is_gguf
from pagedllm.entrypoints.bench.datasets import BenchRequest


@dataclass(frozen=True)
class HFRun:
    """What one baseline did: wall time, and output tokens generated in total vs. requested."""

    elapsed_s: float
    useful_output_tokens: int  # sum of each request's own output length
    generated_tokens: int  # including the tokens padded batches generate past a request's length


def load_hf_model(model_dir: str | Path, dummy: bool, seed: int) -> Any:
    """fp32 eval model: random weights (HF init; throughput does not depend on values) when
    ``dummy``, else the checkpoint's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if dummy:
        config = AutoConfig.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif is_gguf(model_dir):  # transformers dequantizes the file's blocks to float32
        path = Path(model_dir)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(torch.float32).eval()
    pad_id = _pad_token_id(model)
    model.generation_config.eos_token_id = None  # nothing may stop a request early
    model.generation_config.pad_token_id = pad_id
    return model


def _pad_token_id(model: Any) -> int:
    for source in (model.generation_config, model.config):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0  # any id works: padded positions are masked out


def warm_up(model: Any) -> None:
    """One short generate, so one-time costs (allocator, kernel selection) are not timed."""
    run_one_at_a_time(model, [BenchRequest(list(range(10, 26)), 4)])


def run_one_at_a_time(model: Any, requests: Sequence[BenchRequest]) -> HFRun:
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for request in requests:
            ids = torch.tensor([request.prompt_token_ids], dtype=torch.long)
            out = _generate(model, ids, torch.ones_like(ids), request.output_len)
            generated += _check_lengths(out, ids.shape[1], [request.output_len])
    elapsed = time.perf_counter() - start
    return HFRun(elapsed, sum(r.output_len for r in requests), generated)


def run_padded_batches(model: Any, requests: Sequence[BenchRequest], batch_size: int) -> HFRun:
    """Batches in dataset order (no length sorting: that is what a plain loop over a dataset does)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    pad_id = model.generation_config.pad_token_id
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_id)
            max_len = max(r.output_len for r in batch)
            out = _generate(model, ids, mask, max_len)
            generated += _check_lengths(out, ids.shape[1], [max_len] * len(batch))
    elapsed = time.perf_counter() - start
    return HFRun(elapsed, sum(r.output_len for r in requests), generated)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [batch, longest prompt], padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids, mask = ids.to(model.device), mask.to(model.device)
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )


def _check_lengths(out: torch.Tensor, prompt_width: int, expected: list[int]) -> int:
    """Every row must hold exactly its expected new tokens; returns the number generated."""
    produced = out.shape[1] - prompt_width
    if out.shape[0] != len(expected) or any(produced != e for e in expected):
        raise RuntimeError(
            f"HF generate produced {produced} new tokens per row for {out.shape[0]} rows, "
            f"expected {expected}: EOS was not disabled"
        )
    return produced * out.shape[0]


def decode_step_seconds(
    model: Any, batch: int, prompt_len: int, warmup: int, steps: int, vocab_size: int, seed: int
) -> list[float]:
    """Seconds per greedy decode step of a plain HF forward loop with a ``DynamicCache`` (what
    ``generate`` runs, minus its bookkeeping) at ``batch`` sequences of ``prompt_len`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab_size, (batch, prompt_len), generator=gen).to(model.device)
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(warmup + steps):
            start = time.perf_counter()
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return times


def prefill_seconds(model: Any, prompt_len: int, iters: int, vocab_size: int, seed: int) -> float:
    """Median seconds of one forward over a ``prompt_len``-token prompt (after one warm-up)."""
    gen = torch.Generator().manual_seed(seed)
    times = []
    with torch.inference_mode():
        for i in range(iters + 1):
            ids = torch.randint(10, vocab_size, (1, prompt_len), generator=gen).to(model.device)
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            if i:
                times.append(time.perf_counter() - start)
    return statistics.median(times)
