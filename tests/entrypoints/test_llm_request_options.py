"""vLLM's offline request options end to end on a tiny llama: bad words, extra_args, best_of,
max_logprobs, reset_prefix_cache, cache_salt in prompt dicts and prompt truncation.

One LLM serves the module (max_logprobs=5); after every test no request is left and the block
pool is intact.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine_checks import assert_idle_and_intact

MAX_MODEL_LEN = 128
BLOCK = 16
PROMPT = "The capital of France is"
LONG_TEXT = "Once upon a time, in a village by the river, there lived an old clockmaker."


@pytest.fixture(scope="module")
def llm(llama_model_dir) -> LLM:
    return LLM(str(llama_model_dir), max_model_len=MAX_MODEL_LEN, max_logprobs=5)


@pytest.fixture(autouse=True)
def _pool_intact(llm: LLM):
    yield
    assert_idle_and_intact(llm)


def _greedy(max_tokens: int | None = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _run(llm: LLM, prompt, params: SamplingParams):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def _ids(llm: LLM, prompt, params: SamplingParams) -> list[int]:
    return _run(llm, prompt, params).outputs[0].token_ids


# ------------------------------------------------------------------ bad words
def _bad_word_sequences(llm: LLM, words: list[str]) -> list[list[int]]:
    """What intake makes of ``words`` (they are tokenized when the request is processed)."""
    request, _ = llm.llm_engine.input_processor.process("probe", PROMPT, _greedy(bad_words=words))
    return request.sampling_params.bad_words_token_ids


def _first_ban(tokens: list[int], sequences: list[list[int]]) -> int | None:
    """The first position whose token completes a bad sequence right after the rest of it."""
    for i, token in enumerate(tokens):
        for seq in sequences:
            k = len(seq) - 1
            if k <= i and tokens[i - k : i] == seq[:-1] and token == seq[-1]:
                return i
    return None


def _word_of(llm: LLM, tokens: list[int], width: int) -> str:
    """A word the greedy output spells with ``width`` tokens that tokenize back to exactly them."""
    tok = llm.get_tokenizer()
    for start in range(2, len(tokens) - width):
        word = tok.decode(tokens[start : start + width])
        if (
            word.strip() == word
            and word.isalpha()
            and tok.encode(word, add_special_tokens=False) == tokens[start : start + width]
        ):
            return word
    raise AssertionError(f"no {width}-token word in {tokens}")


@pytest.mark.parametrize("width", [1, 2])
def test_bad_words_are_banned_exactly_where_they_would_complete(llm, width):
    """Greedy output up to the first place the word would be completed is unchanged; there a
    different token comes; nowhere does the output complete any of the word's sequences."""
    reference = _ids(llm, PROMPT, _greedy())
    word = _word_of(llm, reference, width)
    sequences = _bad_word_sequences(llm, [word])
    first = _first_ban(reference, sequences)
    assert first is not None
    masked = _ids(llm, PROMPT, _greedy(bad_words=[word]))
    assert masked[:first] == reference[:first]
    assert masked[first] != reference[first]
    assert _first_ban(masked, sequences) is None
    assert len(masked) == len(reference)
    # Here no other spelling of the word comes up either (vLLM bans token sequences, not text).
    assert word not in llm.get_tokenizer().decode(masked)


def test_bad_words_are_tokenized_bare_and_after_a_space(llm):
    """Both forms a word takes are banned. Here " Paris" has one token more than "Paris" (the
    space is its own token); vLLM would drop that form, this engine keeps every distinct one."""
    encode = llm.get_tokenizer().encode
    bare, spaced = (encode(t, add_special_tokens=False) for t in ("Paris", " Paris"))
    assert bare != spaced and len(bare) != len(spaced)
    assert _bad_word_sequences(llm, ["Paris", "  Paris"]) == [bare, spaced]  # leading spaces stripped, deduplicated
    assert _bad_word_sequences(llm, []) == []


def test_bad_words_hold_under_random_sampling(llm):
    sequences = _bad_word_sequences(llm, ["the", "a"])
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=48, ignore_eos=True, bad_words=["the", "a"])
    for output in llm.generate([PROMPT, LONG_TEXT], params, use_tqdm=False):
        assert _first_ban(output.outputs[0].token_ids, sequences) is None


def test_bad_words_under_speculative_decoding_change_no_token(llm, llama_model_dir):
    """n-gram proposals are verified under the same bans. Bad words of one token ("f", " f")
    leave the request speculating; longer ones ("Paris") make it decode one token at a time."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    spec = LLM(str(llama_model_dir), max_model_len=MAX_MODEL_LEN, speculative_config=ngram)
    assert all(len(seq) == 1 for seq in _bad_word_sequences(llm, ["f", "B"]))
    looping = [5, 6, 7, 8] * 8  # its greedy output repeats itself: n-gram proposals get made
    cases = [(looping, ["B"], True), (looping, ["Paris"], False), (PROMPT, ["f"], None)]
    for prompt, words, speculates in cases:
        params = _greedy(max_tokens=40, bad_words=words)
        output = _run(spec, prompt, params)
        assert output.outputs[0].token_ids == _ids(llm, prompt, params)
        if speculates is not None:
            assert (output.metrics.spec_num_draft_tokens > 0) == speculates
    assert _ids(llm, PROMPT, _greedy(max_tokens=40, bad_words=["f"])) != _ids(llm, PROMPT, _greedy(max_tokens=40))
    spec.llm_engine.check_integrity()


# ------------------------------------------------------------------ extra_args, best_of
def test_extra_args_travel_with_the_request_and_change_nothing(llm):
    extra = {"my_logits_processor": {"window": 4, "ids": [1, 2]}}
    request, _ = llm.llm_engine.input_processor.process("probe", PROMPT, _greedy(extra_args=extra))
    assert request.sampling_params.extra_args == extra
    assert request.sampling_params.extra_args is not extra  # the engine works on its own copy
    assert _ids(llm, PROMPT, _greedy(extra_args=extra)) == _ids(llm, PROMPT, _greedy())


def test_best_of_equal_to_n_is_plain_n(llm):
    params = SamplingParams(n=2, best_of=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    same_without = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    outputs = _run(llm, PROMPT, params).outputs
    assert len(outputs) == 2
    assert [o.token_ids for o in outputs] == [o.token_ids for o in _run(llm, PROMPT, same_without).outputs]


# ------------------------------------------------------------------ max_logprobs
def test_logprobs_up_to_max_logprobs_and_no_further(llm):
    output = _run(llm, PROMPT, _greedy(max_tokens=3, logprobs=5, prompt_logprobs=5))
    assert all(len(position) >= 5 for position in output.outputs[0].logprobs)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name}=6 is more than this engine's max_logprobs=5; .*--max-logprobs"):
            llm.generate([PROMPT, PROMPT], [_greedy(), _greedy(**{name: 6})], use_tqdm=False)
    assert llm.llm_engine.config.model_config.max_logprobs == 5  # where the server reads the cap
    with pytest.raises(ValueError, match=r"^logprobs=-1 \(the whole vocabulary, \d+\) is more than"):
        _run(llm, PROMPT, _greedy(logprobs=-1))


def test_minus_one_logprobs_cover_the_whole_vocabulary(llama_model_dir):
    uncapped = LLM(str(llama_model_dir), max_model_len=MAX_MODEL_LEN, max_logprobs=-1)
    output = _run(uncapped, PROMPT, _greedy(max_tokens=2, logprobs=-1, prompt_logprobs=-1))
    vocab = uncapped.llm_engine.config.model_config.arch.vocab_size
    assert [len(row) for row in output.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(row) == vocab for row in output.prompt_logprobs[1:])
    assert_idle_and_intact(uncapped)


# ------------------------------------------------------------------ reset_prefix_cache
def _cached(llm: LLM, prompt, params=None) -> int:
    return _run(llm, prompt, params or _greedy(max_tokens=2)).num_cached_tokens


def test_reset_prefix_cache_drops_every_cached_block(llm):
    prompt = {"prompt_token_ids": list(range(100, 140))}  # 40 tokens: 2 full blocks can hit
    llm.reset_prefix_cache()
    assert _cached(llm, prompt) == 0
    assert _cached(llm, prompt) == 2 * BLOCK
    assert llm.reset_prefix_cache() is True
    pool = llm.llm_engine.engine_core.scheduler.kv_cache_manager.block_pool
    assert not pool.cached_block_hash_to_block and all(b.block_hash is None for b in pool.blocks)
    assert _cached(llm, prompt) == 0


def test_reset_prefix_cache_refused_while_requests_run_unless_they_are_preempted(llm):
    prompt = {"prompt_token_ids": list(range(200, 240))}
    reference = _ids(llm, prompt, _greedy())
    engine = llm.llm_engine
    engine.add_request("running", prompt, _greedy())
    outputs = engine.step()
    assert llm.reset_prefix_cache() is False  # vLLM's answer: nothing changed
    engine.check_integrity()
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert not engine.engine_core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    engine.check_integrity()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == reference  # recomputed, same tokens


# ------------------------------------------------------------------ cache_salt
def test_cache_salt_in_prompt_dicts_separates_prefix_caches(llm):
    ids = llm.get_tokenizer().encode(LONG_TEXT)
    hit = (len(ids) - 1) // BLOCK * BLOCK
    assert hit >= BLOCK
    llm.reset_prefix_cache()
    salted = [{"prompt": LONG_TEXT, "cache_salt": s} for s in ("alice", "bob", "alice")]
    # In one batch: the second alice reuses the first's blocks (hashed as they fill), bob does not.
    assert [o.num_cached_tokens for o in llm.generate(salted, _greedy(max_tokens=2), use_tqdm=False)] == [0, 0, hit]
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "bob"}) == hit  # token ids: same salt, same blocks
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "carol"}) == 0
    assert _cached(llm, LONG_TEXT) == 0  # no salt is its own namespace
    assert _cached(llm, {"prompt": LONG_TEXT}) == hit
    outputs = llm.generate(salted + [LONG_TEXT], _greedy(max_tokens=8), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1  # the salt changes no token


@pytest.mark.parametrize("salt", ["", 7])
def test_cache_salt_must_be_a_non_empty_string(llm, salt):
    with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
        llm.generate({"prompt": PROMPT, "cache_salt": salt}, _greedy(), use_tqdm=False)


# ------------------------------------------------------------------ truncate_prompt_tokens
def test_truncate_prompt_tokens_keeps_the_last_or_first_k(llm):
    ids = list(range(20, 70))
    left = _run(llm, ids, _greedy(max_tokens=6, truncate_prompt_tokens=10))
    assert left.prompt_token_ids == ids[-10:]
    assert left.outputs[0].token_ids == _ids(llm, ids[-10:], _greedy(max_tokens=6))
    right = _run(llm, ids, _greedy(max_tokens=6, truncate_prompt_tokens=10, truncation_side="right"))
    assert right.prompt_token_ids == ids[:10]
    assert right.outputs[0].token_ids == _ids(llm, ids[:10], _greedy(max_tokens=6))
    assert _run(llm, ids, _greedy(max_tokens=2, truncate_prompt_tokens=100)).prompt_token_ids == ids


def test_truncated_text_prompt_keeps_its_text(llm):
    output = _run(llm, {"prompt": LONG_TEXT}, _greedy(max_tokens=2, truncate_prompt_tokens=3))
    assert output.prompt_token_ids == llm.get_tokenizer().encode(LONG_TEXT)[-3:]
    assert output.prompt == LONG_TEXT


def test_truncate_minus_one_keeps_what_fits(llm):
    ids = [5 + i % 300 for i in range(200)]  # longer than max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(ids, _greedy(max_tokens=8), use_tqdm=False)
    output = _run(llm, ids, _greedy(max_tokens=8, truncate_prompt_tokens=-1))
    assert output.prompt_token_ids == ids[-(MAX_MODEL_LEN - 8) :] and len(output.outputs[0].token_ids) == 8
    assert _run(llm, ids, _greedy(max_tokens=None, truncate_prompt_tokens=-1)).prompt_token_ids == ids[-127:]


def test_truncate_prompt_tokens_that_cannot_fit_is_an_error(llm):
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens=128 leaves no room .* at most 127"):
        llm.generate(PROMPT, _greedy(truncate_prompt_tokens=MAX_MODEL_LEN), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens=-1 keeps .* lower max_tokens"):
        llm.generate(PROMPT, _greedy(max_tokens=MAX_MODEL_LEN, truncate_prompt_tokens=-1), use_tqdm=False)
