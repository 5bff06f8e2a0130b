"""Seeded synthetic request sets for benchmarks: random token ids, optionally sharing a prefix.

Requests are token ids, never text, so any model works whatever its tokenizer. Ids below
``MIN_TOKEN_ID`` are avoided: tokenizers put their special tokens (BOS, EOS, PAD, ...) there.
The same arguments always give the same requests (``random.Random(seed)``, no global state).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

MIN_TOKEN_ID = 10
LenRange = tuple[int, int]  # inclusive (low, high)


class BenchRequest(NamedTuple):
    """One request: the prompt's token ids and how many tokens to generate (exactly)."""

    prompt_token_ids: list[int]
    output_len: int


def random_requests(
    n: int, prompt_len_range: LenRange, output_len_range: LenRange, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """``n`` requests with prompt and output lengths uniform in the inclusive ranges."""
    _check_common(n, output_len_range, vocab_size)
    _check_range("prompt_len_range", prompt_len_range, minimum=1)
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len = rng.randint(*prompt_len_range)
        output_len = rng.randint(*output_len_range)
        requests.append(BenchRequest(_random_ids(rng, prompt_len, vocab_size), output_len))
    return requests


def prefix_sharing_requests(
    n: int,
    prefix_len: int,
    suffix_len_range: LenRange,
    output_len_range: LenRange,
    vocab_size: int,
    seed: int = 0,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """``n`` requests, each one of ``num_prefixes`` shared prefixes of ``prefix_len`` tokens (request
    ``i`` gets prefix ``i % num_prefixes``) followed by its own random suffix."""
    _check_common(n, output_len_range, vocab_size)
    _check_range("suffix_len_range", suffix_len_range, minimum=0)
    if prefix_len < 0 or num_prefixes < 1:
        raise ValueError(f"need prefix_len >= 0 and num_prefixes >= 1, got {prefix_len} and {num_prefixes}")
    if prefix_len == 0 and suffix_len_range[0] == 0:
        raise ValueError("prompts could be empty: raise prefix_len or the low end of suffix_len_range")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    requests = []
    for i in range(n):
        suffix = _random_ids(rng, rng.randint(*suffix_len_range), vocab_size)
        requests.append(BenchRequest(prefixes[i % num_prefixes] + suffix, rng.randint(*output_len_range)))
    return requests


def long_prompt_mix_requests(
    n: int,
    short_prompt_range: LenRange,
    long_prompt_range: LenRange,
    output_len_range: LenRange,
    long_output_range: LenRange,
    long_fraction: float,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Mostly short-prompt, long-output chats with a long-prompt request every ``1 / long_fraction``
    requests (evenly spread, so long prompts keep arriving while the others decode)."""
    _check_common(n, output_len_range, vocab_size)
    _check_range("long_output_range", long_output_range, minimum=1)
    _check_range("short_prompt_range", short_prompt_range, minimum=1)
    _check_range("long_prompt_range", long_prompt_range, minimum=1)
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        is_long = long_fraction > 0 and int((i + 1) * long_fraction) > int(i * long_fraction)
        prompt_range, out_range = (
            (long_prompt_range, long_output_range) if is_long else (short_prompt_range, output_len_range)
        )
        prompt = _random_ids(rng, rng.randint(*prompt_range), vocab_size)
        requests.append(BenchRequest(prompt, rng.randint(*out_range)))
    return requests


def total_prompt_tokens(requests: Sequence[BenchRequest]) -> int:
    return sum(len(r.prompt_token_ids) for r in requests)


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(length)]


def _check_common(n: int, output_len_range: LenRange, vocab_size: int) -> None:
    if n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID} (ids below it are reserved), got {vocab_size}")
    _check_range("output_len_range", output_len_range, minimum=1)


def _check_range(name: str, value: LenRange, minimum: int) -> None:
    low, high = value
    if not minimum <= low <= high:
        raise ValueError(f"{name} must be (low, high) with {minimum} <= low <= high, got {value}")
