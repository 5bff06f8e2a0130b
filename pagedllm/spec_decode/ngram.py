"""Prompt-lookup (n-gram) proposer: guess the next tokens by finding the sequence's own tail earlier in it.

Numpy only (no torch), so it can run wherever the token ids live on the host.
"""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.proposer import Proposals, ProposerInputs


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` draft tokens per call by n-gram lookup.

    Matching rule. The suffix length ``n`` is tried longest first, from ``prompt_lookup_max``
    down to ``prompt_lookup_min``; the first ``n`` whose last ``n`` tokens occur earlier in the
    sequence wins. Among that suffix's earlier occurrences we take the MOST RECENT one that is
    followed by a full proposal's worth of tokens, and when none is (every occurrence sits
    too close to the end) the EARLIEST, which is followed by the most tokens. Why not vLLM's
    plain earliest match: when a phrase recurs with different continuations, the recent
    occurrence is the text being quoted or repeated now, so it predicts better. Why not the
    plain most recent: in a short repetition loop (period below ``k``) the most recent
    occurrence ends right at the sequence's end and could offer only a token or two, while
    an older lap of the same loop offers all ``k``.

    Cost: one vectorised comparison of the last token against the whole sequence, O(L), then
    at most ``prompt_lookup_max - 1`` comparisons over the surviving candidate positions only
    (usually a handful): about 15 us per call for 4k tokens on a slow CPU, mostly NumPy call
    overhead. Pass a NumPy array (e.g. a view of the persistent host token buffer) rather than
    a list: converting a 4k-token list costs ~100 us more, an O(L) Python pass every call.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: np.ndarray | list[int], max_tokens: int | None = None) -> list[int]:
        """Draft tokens continuing ``token_ids`` (the request's prompt + output so far).

        At most ``min(num_speculative_tokens, max_tokens)`` tokens (``max_tokens`` None: no
        extra cap; 0: none), fewer when the match is followed by fewer tokens. Returns []
        when no suffix of an allowed length occurs earlier, or when the sequence is shorter
        than ``prompt_lookup_min + 1``.
        """
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 or None, got {max_tokens}")
        want = self.num_speculative_tokens if max_tokens is None else min(self.num_speculative_tokens, max_tokens)
        tokens = np.asarray(token_ids)
        assert tokens.ndim == 1, f"token_ids must be 1-D, got shape {tokens.shape}"
        if want == 0 or len(tokens) < self.prompt_lookup_min + 1:
            return []
        ends = self._longest_match_ends(tokens)
        if ends is None:
            return []
        start = _pick_continuation_start(ends, len(tokens), want)
        return tokens[start : start + want].tolist()

    def _longest_match_ends(self, tokens: np.ndarray) -> np.ndarray | None:
        """End positions (ascending) of the earlier occurrences of the longest allowed suffix.

        Grows the match one token leftwards at a time, keeping only candidate ends that still
        match, so each step costs the number of survivors, not the sequence length.
        """
        length = len(tokens)
        # Ends lie in [0, length - 2]: an occurrence must end before the suffix's own last token.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best = ends if self.prompt_lookup_min <= 1 and ends.size else None
        for n in range(2, self.prompt_lookup_max + 1):
            ends = ends[ends >= n - 1]  # an n-token occurrence needs n - 1 tokens before its end
            if ends.size:  # survivors imply length >= n + 1, so tokens[length - n] is in range
                ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if ends.size == 0:
                break
            if n >= self.prompt_lookup_min:
                best = ends
        return best


def _pick_continuation_start(ends: np.ndarray, length: int, want: int) -> int:
    """Where the proposal starts: after the most recent occurrence with ``want`` tokens following, else the earliest."""
    starts = ends + 1
    full = starts[starts + want <= length]
    return int(full[-1]) if full.size else int(starts[0])


class NgramSpecProposer:
    """The ``Proposer`` of method "ngram": no model, each request's own text (the persistent
    batch's token rows) predicts its continuation."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.ngram = NgramProposer(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)

    @property
    def models(self) -> list:
        return []  # nothing to hold KV for

    def propose(self, inputs: ProposerInputs) -> Proposals:
        proposals = Proposals()
        rows, rooms = inputs.sample_batch_rows.tolist(), inputs.max_proposals.tolist()
        for row, room in zip(rows, rooms):
            tokens = self.ngram.propose(inputs.token_ids[row, : inputs.num_tokens[row]], room) if room else []
            if tokens:
                proposals.token_ids[inputs.req_ids[row]] = tokens
        return proposals
