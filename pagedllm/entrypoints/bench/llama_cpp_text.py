"""llama.cpp on real text: teacher-forced log-probabilities (perplexity) and greedy decoding of
one sequence, for comparing pagedllm's answers and scores with llama.cpp's on the same GGUF file.
Token ids come from the caller (pagedllm's tokenizer), so both engines see the same sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedllm.entrypoints.bench.llama_cpp import Entry, LlamaCpp, decode_in_chunks, prompt_entries


def teacher_forced(llm: LlamaCpp, tokens: Sequence[int], vocab: int) -> tuple[Any, Any]:
    """(log-probability of each of ``tokens[1:]`` given the tokens before it, the argmax token at
    each of those positions): numpy arrays, sequence 0 scored from position 0."""
    import numpy as np

    llm.clear()
    entries: list[Entry] = [(t, pos, 0, True) for pos, t in enumerate(tokens)]
    logprobs, argmax = [], []
    for start in range(0, len(entries), llm.n_batch):
        chunk = entries[start : start + llm.n_batch]
        llm.decode(chunk)
        for j in range(len(chunk)):
            if start + j + 1 < len(tokens):  # the last position predicts past the text
                row = llm.last_logits(vocab, j).astype(np.float64)
                logz = row.max() + np.log(np.exp(row - row.max()).sum())
                logprobs.append(row[tokens[start + j + 1]] - logz)
                argmax.append(int(row.argmax()))
    return np.array(logprobs), np.array(argmax)


def greedy(llm: LlamaCpp, prompt: Sequence[int], max_tokens: int, vocab: int, stop: set[int]) -> list[int]:
    """Argmax decoding of sequence 0 after ``prompt``, up to ``max_tokens`` or a ``stop`` token
    (included, as pagedllm reports an EOS)."""
    llm.clear()
    decode_in_chunks(llm, prompt_entries(prompt, 0))
    out: list[int] = []
    for pos in range(len(prompt), len(prompt) + max_tokens):
        token = int(llm.last_logits(vocab).argmax())
        out.append(token)
        if token in stop or len(out) == max_tokens:
            break
        llm.decode([(token, pos, 0, True)])
    return out
