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
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logit_bias": {3: 200.0}}, "logit_bias"),
        ({"logit_bias": {3: -100.5}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"best_of": True}, "best_of"),
        ({"bad_words": "darn"}, "bad_words"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"extra_args": ["a"]}, "extra_args"),
        ({"extra_args": {1: "a"}}, "extra_args"),
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


# ------------------------------------------------------------------ vLLM's request options
def test_best_of_none_or_n_accepted_more_refused_with_the_reason() -> None:
    assert SamplingParams(n=3, best_of=3).best_of == 3
    assert SamplingParams(n=2).best_of is None
    with pytest.raises(ValueError, match=r"^best_of must be >= n \(3\), got 2"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match=r"^best_of must be None or equal to n \(1\): like vLLM V1 .* logprobs"):
        SamplingParams(best_of=4)


def test_logits_processors_are_refused_with_what_to_use_instead() -> None:
    with pytest.raises(ValueError, match="per-request Python callables") as info:
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    for alternative in ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs"):
        assert alternative in str(info.value)
    assert SamplingParams(logits_processors=[]).logits_processors == []  # nothing to run: accepted, as vLLM V1


def test_bad_words_normalised_and_token_ids_left_to_the_engine() -> None:
    params = SamplingParams(bad_words=["darn", "heck", "darn"])
    assert params.bad_words == ["darn", "heck"] and params.bad_words_token_ids == []
    assert SamplingParams().bad_words == []


def test_extra_args_kept_and_copied_by_clone() -> None:
    extra = {"my_processor": {"window": 3, "ids": [1, 2]}}
    params = SamplingParams(extra_args=extra)
    assert params.extra_args is extra
    copy = params.clone()
    assert copy.extra_args == extra and copy.extra_args is not extra


def test_truncation_options() -> None:
    assert SamplingParams().truncate_prompt_tokens is None and SamplingParams().truncation_side == "left"
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1
    params = SamplingParams(truncate_prompt_tokens=5, truncation_side="right")
    assert (params.truncate_prompt_tokens, params.truncation_side) == (5, "right")


def test_new_fields_cross_the_engine_socket() -> None:
    """The engine-process path encodes SamplingParams with msgspec: every new field survives."""
    import msgspec

    from pagedllm.engine.protocol import EngineCoreRequest

    params = SamplingParams(
        bad_words=["darn"], truncate_prompt_tokens=4, truncation_side="right", extra_args={"k": [1, 2]}, n=2, best_of=2
    )
    params.bad_words_token_ids = [[5, 6], [7]]
    request = EngineCoreRequest("r", [1, 2, 3], params, None, cache_salt="salt")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert back.sampling_params == params and back.cache_salt == "salt"


# ------------------------------------------------------------------ beam search (vLLM V0's spelling)


def test_use_beam_search_makes_best_of_the_beam_width() -> None:
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, length_penalty=0.5)
    assert (params.beam_width, params.n, params.length_penalty) == (4, 2, 0.5)
    assert SamplingParams(use_beam_search=True, n=3).beam_width == 3  # best_of None: width n
    assert SamplingParams(use_beam_search=False).use_beam_search is False  # the no-op default


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"use_beam_search": 1}, "use_beam_search"),
        ({"use_beam_search": True, "best_of": 1, "n": 2}, "best_of"),
        ({"use_beam_search": True, "best_of": True}, "best_of"),
        ({"use_beam_search": True, "length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": 2.0}, "length_penalty"),  # without beam search it would do nothing
        ({"best_of": 4, "n": 2}, "best_of"),  # still refused without beam search
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "stop_token_ids": [3]}, "stop_token_ids"),
        ({"use_beam_search": True, "min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "presence_penalty": 0.5}, "presence_penalty"),
        ({"use_beam_search": True, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"use_beam_search": True, "logit_bias": {3: 1.0}}, "logit_bias"),
        ({"use_beam_search": True, "bad_words": ["darn"]}, "bad_words"),
        ({"use_beam_search": True, "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"use_beam_search": True, "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ],
)
def test_beam_search_validation_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_beam_search_fields_cross_the_engine_socket() -> None:
    import msgspec

    from pagedllm.engine.protocol import EngineCoreRequest

    params = SamplingParams(use_beam_search=True, best_of=3, n=2, length_penalty=0.7)
    request = EngineCoreRequest("r", [1, 2, 3], params, None)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert back.sampling_params == params
