"""Per-key quotas: requests per minute, tokens per minute, requests in flight.

How each limit is counted (all per key, over a sliding 60-second window):

* ``max_concurrent``: HTTP requests of the key inside the server (admitted by the gate, not yet
  fully answered); the slot frees when the response ends, fails or the client hangs up.
* ``rpm``: requests admitted in the last 60 s. A request refused for ``tpm`` is not counted.
* ``tpm``: at admission each prompt reserves ``prompt tokens + max_tokens x n`` (max_tokens left
  out: what max_model_len leaves), and a request is admitted only if its reservation fits in
  what the window has left. When a prompt's request ends (finished, failed or aborted) its
  reservation is corrected to what it really used: prompt tokens + tokens generated. A request
  that could never fit (its reservation alone is over ``tpm``) is a 400 that says so.

A refusal raises ``QuotaExceeded`` with ``retry_after``: whole seconds until the window has room
(1 for ``max_concurrent``, which frees when a request ends, not with time).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedllm.entrypoints.openai.api_keys import ApiKey
from pagedllm.metrics.key_usage import KeyUsageMetrics

WINDOW_S = 60.0


class QuotaExceeded(Exception):
    """A key is over one of its limits: a 429 with ``Retry-After: retry_after``."""

    def __init__(self, message: str, retry_after: int, limit: str) -> None:
        super().__init__(message)
        self.message, self.retry_after, self.limit = message, retry_after, limit


class _Charge:
    """One entry of a window: an amount charged at a time (a reservation can be corrected)."""

    __slots__ = ("time", "amount", "prompt")

    def __init__(self, time: float, amount: int, prompt: int = 0) -> None:
        # prompt: a reservation's prompt tokens, charged if its stream ends before any output
        self.time, self.amount, self.prompt = time, amount, prompt


class SlidingWindow:
    """What was charged in the last ``WINDOW_S`` seconds (a log of charges, oldest first)."""

    def __init__(self) -> None:
        self._charges: deque[_Charge] = deque()
        self._total = 0

    def used(self, now: float) -> int:
        while self._charges and self._charges[0].time <= now - WINDOW_S:
            self._total -= self._charges.popleft().amount
        return self._total

    def charge(self, now: float, amount: int, prompt: int = 0) -> _Charge:
        self.used(now)  # drop what left the window: a key without a limit is charged too
        charge = _Charge(now, amount, prompt)
        self._charges.append(charge)
        self._total += amount
        return charge

    def correct(self, charge: _Charge, amount: int) -> None:
        """Set a charge to ``amount`` (if it is still in the window)."""
        if self._charges and charge.time >= self._charges[0].time:
            self._total += amount - charge.amount
        charge.amount = amount

    def retry_after(self, now: float, amount: int, limit: int) -> int:
        """Whole seconds until ``amount`` more fits under ``limit`` (at least 1)."""
        excess = self.used(now) + amount - limit
        for charge in self._charges:
            excess -= charge.amount
            if excess <= 0:
                return max(1, math.ceil(charge.time + WINDOW_S - now))
        return math.ceil(WINDOW_S)


class _KeyState:
    def __init__(self) -> None:
        self.requests = SlidingWindow()
        self.tokens = SlidingWindow()
        self.in_flight = 0


class QuotaBook:
    """Every key's windows and in-flight count; ``admit`` hands out a ``Ticket`` per request."""

    def __init__(self, metrics: KeyUsageMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self._states: dict[str, _KeyState] = {}

    def state(self, key: ApiKey) -> _KeyState:
        return self._states.setdefault(key.name, _KeyState())

    def admit(self, key: ApiKey) -> Ticket:
        """A ticket for one request of ``key``, or QuotaExceeded (max_concurrent, then rpm)."""
        state, now = self.state(key), self.clock()
        try:
            if key.max_concurrent is not None and state.in_flight >= key.max_concurrent:
                raise QuotaExceeded(
                    f"API key {key.name!r} has {state.in_flight} requests in flight, its limit "
                    f"(max_concurrent) is {key.max_concurrent}; wait for one to finish",
                    1,
                    "max_concurrent",
                )
            if key.rpm is not None and state.requests.used(now) >= key.rpm:
                wait = state.requests.retry_after(now, 1, key.rpm)
                raise QuotaExceeded(
                    f"API key {key.name!r} reached its limit of {key.rpm} requests per minute (rpm); retry in {wait} s",
                    wait,
                    "rpm",
                )
        except QuotaExceeded as exc:
            self.refused(key, exc.limit)
            raise
        return Ticket(self, key, state, now)

    def refused(self, key: ApiKey, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.rate_limited(key.name, limit)


class Ticket:
    """One admitted request: holds its key's in-flight slot and rpm charge until ``release``,
    and its token reservations until each is settled with real usage."""

    def __init__(self, book: QuotaBook, key: ApiKey, state: _KeyState, now: float) -> None:
        self.book, self.key, self.state = book, key, state
        state.in_flight += 1
        self._request = state.requests.charge(now, 1)
        self._unstarted: list[_Charge] = []  # reservations whose stream never ran
        if book.metrics is not None:
            book.metrics.request(key.name)

    def reserve(self, amounts: list[int], prompts: list[int] | None = None) -> list[_Charge]:
        """Reserve tokens for each prompt (``prompts``: the prompt tokens within each amount);
        ValueError if they alone exceed tpm, QuotaExceeded if the window has no room for them
        now (the request is then not counted in rpm)."""
        tpm, total, now = self.key.tpm, sum(amounts), self.book.clock()
        if tpm is not None and total > tpm:
            self.state.requests.correct(self._request, 0)  # a refused request is not counted in rpm
            raise ValueError(
                f"this request reserves {total} tokens (prompt tokens + max_tokens x n per prompt), more "
                f"than the {tpm} tokens per minute (tpm) of API key {self.key.name!r}; lower max_tokens"
            )
        if tpm is not None and self.state.tokens.used(now) + total > tpm:
            wait = self.state.tokens.retry_after(now, total, tpm)
            self.state.requests.correct(self._request, 0)
            self.book.refused(self.key, "tpm")
            raise QuotaExceeded(
                f"API key {self.key.name!r} reached its limit of {tpm} tokens per minute (tpm): this request "
                f"reserves {total} and {self.state.tokens.used(now)} were used in the last minute; retry in {wait} s",
                wait,
                "tpm",
            )
        prompts = prompts or [0] * len(amounts)
        charges = [self.state.tokens.charge(now, amount, prompt) for amount, prompt in zip(amounts, prompts)]
        self._unstarted += charges
        return charges

    def metered(self, charge: _Charge, outputs: AsyncIterator[Any], delta: bool) -> AsyncIterator[Any]:
        """``outputs`` (one prompt's RequestOutputs) passed through; at their end the reservation
        is settled with the tokens used. ``delta``: outputs carry new tokens only (streaming)."""
        return self._meter(charge, outputs, delta)

    async def _meter(self, charge: _Charge, outputs: AsyncIterator[Any], delta: bool) -> AsyncIterator[Any]:
        if charge in self._unstarted:
            self._unstarted.remove(charge)
        # A client that hangs up before the first output still pays for its prompt: the engine
        # had taken it (and may have prefilled it) by then.
        prompt, generated = charge.prompt, 0
        try:
            async for output in outputs:
                prompt = len(output.prompt_token_ids or ())
                tokens = sum(len(c.token_ids) for c in output.outputs)
                generated = generated + tokens if delta else max(generated, tokens)
                yield output
        finally:
            self.settle(charge, prompt, generated)

    def settle(self, charge: _Charge, prompt: int, generated: int) -> None:
        self.state.tokens.correct(charge, prompt + generated)
        if self.book.metrics is not None:
            self.book.metrics.tokens(self.key.name, prompt, generated)

    def release(self) -> None:
        """The HTTP request is over: free the in-flight slot; reservations never used count 0."""
        self.state.in_flight -= 1
        for charge in self._unstarted:
            self.state.tokens.correct(charge, 0)
        self._unstarted = []


def reserve_prompts(
    ticket: Ticket, prompts: list[Any], params: Any, tokenizer: Any, max_model_len: int
) -> tuple[list[Any], list[_Charge]]:
    """Reserve each prompt's tokens under the key's tpm: prompt + max_tokens x n. Text prompts
    are tokenized here for the count and handed on with their ids (so the engine's intake does
    not tokenize them again); returns the prompts to run and one reservation per prompt."""
    if ticket.key.tpm is None:
        return prompts, ticket.reserve([0] * len(prompts))
    prompts = [_with_ids(p, tokenizer) for p in prompts]
    amounts, num_prompts = [], []
    for prompt in prompts:
        num_prompt = _kept_prompt_tokens(prompt, params, max_model_len)
        max_tokens = params.max_tokens if params.max_tokens is not None else max(0, max_model_len - num_prompt)
        amounts.append(num_prompt + max_tokens * max(params.n, 1))
        num_prompts.append(num_prompt)
    return prompts, ticket.reserve(amounts, num_prompts)


def _kept_prompt_tokens(prompt: Any, params: Any, max_model_len: int) -> int:
    """The prompt's tokens after ``truncate_prompt_tokens`` (k, or -1: as many as fit)."""
    num_prompt = len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
    keep = getattr(params, "truncate_prompt_tokens", None)
    if keep is not None:
        num_prompt = min(num_prompt, max_model_len if keep == -1 else keep)
    return num_prompt


def _with_ids(prompt: Any, tokenizer: Any) -> Any:
    """A text prompt as ``{"prompt", "prompt_token_ids"}``, tokenized as the engine's intake would."""
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        return {**prompt, "prompt_token_ids": tokenizer.encode(prompt["prompt"])}
    if isinstance(prompt, str):
        return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
    return prompt
