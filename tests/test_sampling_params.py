"""SamplingParams validation: every out-of-range field raises ValueError naming the field."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": {3: 200.0}}, "logit_bias"),
        ({"logit_bias": {3: -100.5}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_out_of_range_field_raises_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**kwargs)


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop_token_ids": [3, 100]}, "stop_token_ids"),
        ({"allowed_token_ids": [-1, 3]}, "allowed_token_ids"),
        ({"allowed_token_ids": [50]}, "allowed_token_ids"),
        ({"logit_bias": {99: 1.0}}, "logit_bias"),
    ],
)
def test_verify_vocab_rejects_out_of_vocab_ids(kwargs: dict, field: str) -> None:
    params = SamplingParams(**kwargs)  # fine without a vocabulary
    with pytest.raises(ValueError, match=rf"^{field} must be token ids in \[0, 50\)"):
        params.verify_vocab(50)


def test_verify_vocab_accepts_in_range_ids() -> None:
    SamplingParams(stop_token_ids=[0, 49], allowed_token_ids=[1], logit_bias={49: 1.0}).verify_vocab(50)


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        logit_bias={0: 100.0},
    )
    assert params.top_k == 0


def test_greedy_normalises_random_knobs() -> None:
    params = SamplingParams(temperature=1e-7, top_p=0.5, top_k=5, min_p=0.3)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.0)
    assert params.sampling_type_greedy


def test_normalisation_of_stop_and_logit_bias_keys() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[7], logit_bias={"5": 1})  # JSON gives str keys
    assert params.stop == ["END"] and params.all_stop_token_ids == {7}
    assert params.logit_bias == {5: 1.0}


def test_infinite_temperature_rejected() -> None:
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=float("inf"))


def test_non_numeric_logit_bias_names_field() -> None:
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias={"a": 1.0})


def test_clone_revalidates_and_bools_rejected() -> None:
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams().clone(temperature=-1.0)
    with pytest.raises(ValueError, match="^max_tokens"):
        SamplingParams(max_tokens=True)
    with pytest.raises(ValueError, match="^stop_token_ids"):
        SamplingParams(stop_token_ids=5)
