"""Incremental detokenizer: equality with a full decode, stop strings, hold-back, specials.

The tokenizer is a small byte-level BPE trained here on text with accents, CJK and emoji, so
many characters are split over several tokens. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedllm.sampling_params import SamplingParams

WORDS = [
    "hello",
    "world",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "naïve",
    "café",
    "Größe",
    "日本語",
    "テキスト",
    "中文字符",
    "😀",
    "🚀🔥",
    "émoji",
    "straße",
    "привет",
    "мир",
    "κόσμος",
    "नमस्ते",
    "👩‍👩‍👧",
    "∑∫√",
    "1234",
    "STOP",
    "end.",
    "\n",
    "\t",
    "  ",
]
SPECIALS = ["<s>", "</s>", "<pad>"]
EXTRA_SPECIALS = ["<|im_end|>", "<|终|>"]


def random_text(rng: random.Random, low: int = 3, high: int = 15) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with few merges, so multi-byte characters span several tokens."""
    rng = random.Random(0)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([random_text(rng) for _ in range(400)], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": EXTRA_SPECIALS})
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def feed(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> str | None:
    """Feed ids in random chunks of 1..3 (as with speculative decoding); return a stop hit."""
    i = 0
    while i < len(ids):
        step = rng.randint(1, 3)
        stop = detok.update(ids[i : i + step], stop_terminated=False)
        if stop is not None:
            return stop
        i += step
    return None


def one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str | None]:
    """Feed ids one at a time until a stop string hits; return what each update returned."""
    hits: list[str | None] = []
    for token_id in ids:
        hits.append(detok.update([token_id], stop_terminated=False))
        if hits[-1] is not None:
            break
    return hits


# ---------------------------------------------------------------------------- decoding
def test_tokenizer_splits_multibyte_characters(tokenizer) -> None:
    ids = tokenizer.encode("😀 日本語 नमस्ते", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tokenizer.decode([i])]
    assert partial, "the test tokenizer must split some characters over tokens"


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_on_text(tokenizer, skip: bool) -> None:
    rng = random.Random(1)
    params = SamplingParams(skip_special_tokens=skip)
    for _ in range(200):
        prompt = tokenizer.encode(random_text(rng))
        ids = tokenizer.encode(random_text(rng), add_special_tokens=False)
        if rng.random() < 0.3:  # a special token between words
            ids.append(rng.choice(tokenizer.all_special_ids))
            ids += tokenizer.encode(random_text(rng), add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        streamed = []
        for token_id in ids:
            detok.update([token_id], stop_terminated=False)
            streamed.append(detok.get_next_output_text(finished=False, delta=True))
        assert "\ufffd" not in "".join(streamed)  # never a half character on the way
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_on_random_ids(tokenizer, skip: bool) -> None:
    """Arbitrary ids (often invalid UTF-8): the final text still equals a full decode."""
    rng = random.Random(2)
    params = SamplingParams(skip_special_tokens=skip)
    for _ in range(300):
        prompt = tokenizer.encode(random_text(rng, 1, 4))
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        feed(detok, ids, rng)
        detok.flush()
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_held_until_flush(tokenizer) -> None:
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    assert len(ids) > 2
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    one_by_one(detok, ids[:-1])
    assert detok.output_text == "a"  # the emoji's first bytes are not emitted as U+FFFD
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids[:-1])


def test_skip_special_tokens(tokenizer) -> None:
    im_end, zhong = (tokenizer.convert_tokens_to_ids(t) for t in EXTRA_SPECIALS)
    ids = [tokenizer.bos_token_id] + tokenizer.encode("hi", add_special_tokens=False)
    ids += [im_end, zhong]
    shown = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    hidden = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=True))
    one_by_one(shown, ids)
    one_by_one(hidden, ids)
    assert shown.output_text == "<s>hi<|im_end|><|终|>"
    assert hidden.output_text == "hi"


def test_no_spaces_between_special_tokens(tokenizer) -> None:
    im_end, zhong = (tokenizer.convert_tokens_to_ids(t) for t in EXTRA_SPECIALS)
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    one_by_one(detok, [im_end, zhong, im_end])
    assert detok.output_text == "<|im_end|><|终|><|im_end|>"


def test_detokenize_false_produces_no_text(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams(detokenize=False))
    assert detok.update(tokenizer.encode("hello", add_special_tokens=False), False) is None
    assert detok.get_next_output_text(finished=True, delta=False) == ""
    assert detok.decode_token(5) is None


def test_stop_terminated_token_text_is_left_out(tokenizer) -> None:
    ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    for include, expected in [(False, "hello"), (True, "hello</s>")]:
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, [], params)
        detok.update(ids, stop_terminated=True)
        assert detok.output_text == expected


# ---------------------------------------------------------------------------- stop strings
def _boundary_stop(tokenizer, text: str) -> tuple[list[int], str, int]:
    """Token ids of ``text`` and a 3-char stop string that straddles a token boundary."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    cut = next(e for e in ends[1:-1] if e >= 2 and e + 2 <= len(text))
    return ids, text[cut - 1 : cut + 2], cut - 1


def test_stop_string_spanning_tokens_is_found_and_truncated(tokenizer) -> None:
    text = "the quick brown fox jumps"
    ids, stop, start = _boundary_stop(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    hits = one_by_one(detok, ids)
    assert [h for h in hits if h] == [stop]
    assert detok.output_text == text[:start]
    kept = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert feed(kept, ids, random.Random(0)) == stop
    assert kept.output_text == text[: start + len(stop)]


def test_stop_string_earliest_match_wins(tokenizer) -> None:
    ids = tokenizer.encode("hello world fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["fox", "wor"]))
    assert detok.update(ids, stop_terminated=False) == "wor"
    assert detok.output_text == "hello "
    assert find_stop_string("abcabc", 4, ["bc"]) == ("bc", 4)  # old text is not searched again


def test_stop_string_ignored_within_min_tokens(tokenizer) -> None:
    ids = tokenizer.encode("fox fox fox fox", add_special_tokens=False)
    first_fox_end = next(i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]) == "fox")
    params = SamplingParams(stop=["fox"], min_tokens=first_fox_end + 1)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    hits = one_by_one(detok, ids)
    assert hits[: first_fox_end + 1] == [None] * (first_fox_end + 1)
    assert hits[-1] == "fox" and detok.output_text == "fox "


def test_possible_stop_prefix_is_held_back_until_finished(tokenizer) -> None:
    text = "hello world fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP!"]))
    deltas = []
    for token_id in ids:
        assert detok.update([token_id], stop_terminated=False) is None
        running = detok.get_next_output_text(finished=False, delta=False)
        assert running == detok.output_text[:-4]  # max stop length - 1 held back
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    assert "".join(deltas) == text[:-4]
    assert detok.get_next_output_text(finished=True, delta=True) == text[-4:]
    assert detok.get_next_output_text(finished=True, delta=False) == text


def test_no_hold_back_when_stop_string_is_kept(tokenizer) -> None:
    params = SamplingParams(stop=["STOP!"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    detok.update(tokenizer.encode("hello", add_special_tokens=False), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "hello"


def test_streamed_deltas_never_contain_the_stop_string(tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(100):
        text = random_text(rng)
        stop = rng.choice(["STOP", "fox", "日本", "😀"])
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
        ids, pieces, hit = tokenizer.encode(text, add_special_tokens=False), [], None
        for token_id in ids:
            hit = detok.update([token_id], stop_terminated=False)
            pieces.append(detok.get_next_output_text(finished=hit is not None, delta=True))
            if hit:
                break
        expected = text[: text.find(stop)] if stop in text else text
        if hit is None:
            pieces.append(detok.get_next_output_text(finished=True, delta=True))
        assert "".join(pieces) == expected
