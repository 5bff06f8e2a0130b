"""Bad words in the sampler: a sequence's last token is banned exactly where the rest of it ends
the output so far (vLLM's rule); the prompt never counts, other rows are untouched."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling import Sampler, SamplingMetadata, ops
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.proposer import speculation_room

V = 8
NEG_INF = float("-inf")


def _banned(output_token_ids: list[list[int]], bad: dict[int, list[list[int]]]) -> list[list[int]]:
    logits = ops.apply_bad_words(torch.zeros(len(output_token_ids), V), output_token_ids, bad)
    return [torch.nonzero(row == NEG_INF).flatten().tolist() for row in logits]


def test_one_token_sequences_are_always_banned() -> None:
    assert _banned([[], [1, 2]], {0: [[5]], 1: [[3], [6]]}) == [[5], [3, 6]]


@pytest.mark.parametrize(
    "output, banned",
    [
        ([], []),  # nothing generated yet: no prefix to match
        ([2], [4]),  # [2] ends the output: 4 would complete [2, 4]
        ([1, 2], [4]),
        ([2, 1], []),  # 2 is in the output but not at its end
        ([2, 4, 2, 3], [5]),  # [2, 3] ends it: the three-token sequence's last token
        ([1, 3], []),
    ],
)
def test_multi_token_sequences_need_their_prefix_at_the_end_of_the_output(output, banned) -> None:
    assert _banned([output], {0: [[2, 4], [2, 3, 5]]}) == [banned]


def test_the_prompt_does_not_count_as_a_prefix() -> None:
    """Only output tokens are matched (vLLM's past_tokens_ids): a prompt ending in 2 bans nothing."""
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[2, 4]]
    md = SamplingMetadata.from_params([params], [[7, 2]], [[]], V)
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    assert Sampler().sample(logits, md).token_ids == [[4]]


def test_greedy_rows_with_bad_words_take_the_processing_path() -> None:
    """An all-greedy batch with bad words is not argmaxed raw: the banned best token loses."""
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[3]]
    plain = SamplingParams(temperature=0.0)
    md = SamplingMetadata.from_params([params, plain], [[], []], [[], []], V)
    assert md.has_logit_processing
    logits = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0, 0, 0, 0]] * 2)
    assert Sampler().sample(logits, md).token_ids == [[2], [3]]


def test_random_rows_never_draw_a_banned_token() -> None:
    params = SamplingParams(temperature=1.0)
    params.bad_words_token_ids = [[1], [0, 2]]
    outputs = [[0]]
    md = SamplingMetadata.from_params([params], [[]], outputs, V)
    logits = torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    draws = {Sampler().sample(logits, md).token_ids[0][0] for _ in range(200)}
    assert draws and not draws & {1, 2}


def test_select_keeps_each_rows_bad_words() -> None:
    first, second = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)
    first.bad_words_token_ids, second.bad_words_token_ids = [[1]], [[2]]
    md = SamplingMetadata.from_params([first, SamplingParams(), second], [[]] * 3, [[]] * 3, V)
    assert md.select([2, 1, 0, 2]).bad_words_token_ids == {0: [[2]], 2: [[1]], 3: [[2]]}
    assert md.select([1]).bad_words_token_ids == {}


def test_multi_token_bad_words_turn_speculation_off() -> None:
    """Draft rows would be matched against the output before the step, so a request whose bad
    words span several tokens decodes one token at a time; one-token bad words do not care."""
    params = SamplingParams(max_tokens=None)
    assert speculation_room(params, 10, 2, 4, 100) == 4
    params.bad_words_token_ids = [[3]]
    assert speculation_room(params, 10, 2, 4, 100) == 4
    params.bad_words_token_ids = [[3], [5, 6]]
    assert speculation_room(params, 10, 2, 4, 100) == 0
