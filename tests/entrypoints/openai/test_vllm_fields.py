"""vLLM's request fields and endpoints beyond OpenAI's, against a real server with the official
client (``extra_body``) and httpx: prompt logprobs, echo, token ids, tokens as ids, truncation,
continuous usage, stop reasons, lax booleans, refused fields, /tokenize for chats, /tokenizer_info,
/invocations and /load."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import RemoteServer

PROMPT = "The quick brown fox jumps over the lazy dog and then"
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
SAYING = "An apple a day keeps"


@pytest.fixture(scope="module")
def flagged(server_model_dir):
    """A server with the optional endpoints and defaults switched on."""
    args = [
        "--served-model-name",
        "tiny",
        "--enable-tokenizer-info-endpoint",
        "--enable-server-load-tracking",
        "--return-tokens-as-token-ids",
        "--trust-request-chat-template",
        "--max-logprobs",
        "-1",
    ]
    with RemoteServer(server_model_dir, args) as srv:
        yield srv


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url_for(path.lstrip("/")), json=body, timeout=120, **kw)


def complete(server, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(server, **body) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **body}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    import json

    with httpx.stream("POST", server.url_for(path.lstrip("/")), json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def error_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


# ---------------------------------------------------------------------------------- completions
def test_prompt_logprobs_on_completions(client, tokenizer):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    rows = out.choices[0].prompt_logprobs
    ids = tokenizer.encode(PROMPT)
    assert len(rows) == len(ids) and rows[0] is None
    for token_id, row in zip(ids[1:], rows[1:]):
        assert str(token_id) in row and 1 <= len(row) <= 3  # the prompt's token and the top 2
        assert all(entry["logprob"] <= 0 and entry["rank"] >= 1 for entry in row.values())
        ranked = sorted(row.values(), key=lambda e: e["rank"])
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logprobs": -3}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),  # the whole vocabulary: above the default cap of 20
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 2**63}, "seed"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"use_beam_search": True, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
        ({"echo": "maybe"}, "echo"),
    ],
)
def test_completion_field_errors(server, body, param):
    error = error_of(post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, **body}))
    assert error["param"] == param and error["message"], error


def test_seed_takes_the_signed_64_bit_range(server):
    low = complete(server, seed=-(2**63), temperature=1.0)
    high = complete(server, seed=2**63 - 1, temperature=1.0)
    assert low["choices"][0]["text"] and high["choices"][0]["text"]


def test_echo_with_max_tokens_0_returns_the_prompt_only(server, tokenizer):
    out = complete(server, echo=True, max_tokens=0, logprobs=1)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(choice["logprobs"]["tokens"]) == len(tokenizer.encode(PROMPT))
    assert choice["logprobs"]["token_logprobs"][0] is None


def test_return_token_ids_and_tokens_as_ids(server, tokenizer):
    out = complete(server, max_tokens=8, logprobs=1, return_token_ids=True, return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    assert tokenizer.decode(choice["token_ids"]).startswith(choice["text"])
    plain = complete(server, max_tokens=8)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None and plain["prompt_logprobs"] is None
    assert plain["text"] == choice["text"]


def test_streamed_token_ids_and_continuous_usage(server, tokenizer):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = complete(server, **{**body, "return_token_ids": True})["choices"][0]
    chunks = sse_chunks(
        server,
        "/v1/completions",
        {**body, "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert all("prompt_token_ids" not in c["choices"][0] for c in with_choices[1:])
    streamed = [t for c in with_choices for t in c["choices"][0]["token_ids"]]
    assert streamed == full["token_ids"]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 10
    assert all(
        c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"] for c in chunks
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens(server, tokenizer, side):
    ids = tokenizer.encode(PROMPT)
    out = complete(server, truncate_prompt_tokens=4, truncation_side=side, return_token_ids=True, echo=True)
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == 4
    assert choice["prompt_token_ids"] == (ids[:4] if side == "right" else ids[-4:])
    assert choice["text"].startswith(tokenizer.decode(choice["prompt_token_ids"], skip_special_tokens=True))


def test_add_special_tokens_false(server, tokenizer):
    out = complete(server, add_special_tokens=False, return_token_ids=True, max_tokens=1)
    assert out["choices"][0]["prompt_token_ids"] == tokenizer.encode(PROMPT, add_special_tokens=False)


def test_stop_reason_names_the_stop_string(server):
    text = complete(server, max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    choice = complete(server, max_tokens=24, ignore_eos=True, stop=[stop])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert complete(server, max_tokens=2, ignore_eos=True)["choices"][0]["stop_reason"] is None


def test_request_id_names_the_response(server):
    assert complete(server, request_id="my-req-1")["id"] == "cmpl-my-req-1"
    assert complete(server, request_id="my-req-1")["id"] == "cmpl-my-req-1"  # reusable: engine ids stay unique


def test_allowed_token_ids_and_bad_words(server, tokenizer):
    token = tokenizer.encode(" fox", add_special_tokens=False)[-1]
    choice = complete(server, allowed_token_ids=[token], return_token_ids=True)["choices"][0]
    assert set(choice["token_ids"]) == {token}
    free = complete(server, max_tokens=12, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
    # the first generated token that is a word of its own (its text encodes back to it, bare or after a space)
    i, word = next(
        (i, tokenizer.decode([t]).strip())
        for i, t in enumerate(free)
        if i
        and tokenizer.decode([t]).strip()
        and [t]
        in (
            tokenizer.encode(w, add_special_tokens=False)
            for w in (tokenizer.decode([t]).strip(), " " + tokenizer.decode([t]).strip())
        )
    )
    out = complete(server, max_tokens=12, ignore_eos=True, return_token_ids=True, bad_words=[word])["choices"][0]
    assert out["token_ids"][:i] == free[:i] and out["token_ids"][i] != free[i]


def test_vllm_xargs_ride_along_and_change_nothing(server):
    plain = complete(server, max_tokens=6)["choices"][0]["text"]
    assert complete(server, max_tokens=6, vllm_xargs={"tag": "x", "n": [1, 2]})["choices"][0]["text"] == plain
    assert error_of(post(server, "/v1/completions", {"prompt": PROMPT, "vllm_xargs": [1]}))["param"] == "vllm_xargs"


def test_refused_fields_sent_with_their_default_are_fine(server):
    assert complete(server, use_beam_search="false", prompt_embeds=None, max_tokens=1)["choices"][0]["text"] is not None


def test_streamed_echo_for_several_prompts_and_choices(server, tokenizer):
    prompts = [PROMPT, "Once upon a time"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "return_token_ids": True}
    chunks = sse_chunks(server, "/v1/completions", {**body, "temperature": 1.0, "seed": 7})
    firsts: dict[int, dict] = {}
    texts = {i: "" for i in range(4)}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice)
            texts[choice["index"]] += choice["text"]
            assert ("prompt_token_ids" in choice) == (firsts[choice["index"]] is choice)
    for index in range(4):
        prompt = prompts[index // 2]
        assert firsts[index]["prompt_token_ids"] == tokenizer.encode(prompt)
        assert texts[index].startswith(prompt) and len(texts[index]) > len(prompt)


def test_streamed_echo_with_max_tokens_0(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True, "stream_options": {"include_usage": True}}
    chunks = sse_chunks(server, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_cached_tokens_under_both_names(server):
    body = {"prompt": PROMPT * 4, "max_tokens": 2}
    complete(server, **body)
    usage = complete(server, **body)["usage"]
    assert usage["cache_read_input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_non_json_content_type_is_refused(server):
    resp = httpx.post(
        server.url_for("v1/completions"), content=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"}
    )
    error = error_of(resp)
    assert "application/json" in error["message"]
    form = httpx.post(server.url_for("v1/completions"), data={"prompt": "hi"})
    assert "application/json" in error_of(form)["message"]


# ---------------------------------------------------------------------------------- chat
def test_chat_echo_continues_the_final_message(client):
    messages = [{"role": "user", "content": "tell me a saying"}, {"role": "assistant", "content": SAYING}]
    for echo in (True, False):
        out = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=6,
            temperature=0,
            extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False},
        )
        message = out.choices[0].message
        assert message.role == "assistant"
        assert message.content.startswith(SAYING) == echo


def test_chat_echo_streams_the_final_message_first(server):
    messages = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": SAYING}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chunks = sse_chunks(server, "/v1/chat/completions", {**body, "echo": True, "continue_final_message": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": SAYING}
    full = chat(server, **body, continue_final_message=True, echo=True)["choices"][0]["message"]["content"]
    assert SAYING + "".join(d.get("content", "") for d in deltas[2:]) == full


def test_continue_final_message_with_generation_prompt_is_400(server):
    body = {"model": "tiny", "messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}
    assert error_of(post(server, "/v1/chat/completions", body))["param"] == "continue_final_message"


def test_chat_prompt_logprobs_and_token_ids(client, server, tokenizer):
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs="true",  # a string, as vLLM's own tests send it
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    )
    tokenized = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES}).json()["tokens"]
    assert out.prompt_token_ids == tokenized
    assert len(out.prompt_logprobs) == len(tokenized) and out.prompt_logprobs[0] is None
    assert all(str(t) in row for t, row in zip(tokenized[1:], out.prompt_logprobs[1:]))
    assert len(out.choices[0].token_ids) == out.usage.completion_tokens == len(out.choices[0].logprobs.content)


def test_chat_stream_shape(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = chat(server, **body, return_token_ids=True)
    chunks = sse_chunks(
        server,
        "/v1/chat/completions",
        {**body, "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    with_choices = [c for c in chunks if c["choices"]]
    finishing = [c for c in with_choices if c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0] is with_choices[-1]
    assert finishing[0]["choices"][0]["delta"]["content"]  # the last token's text rides with finish_reason
    assert finishing[0]["choices"][0]["finish_reason"] == "length"
    streamed = [t for c in with_choices for t in c["choices"][0].get("token_ids", [])]
    assert streamed == full["choices"][0]["token_ids"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices)
    assert text == full["choices"][0]["message"]["content"]
    assert [c["usage"]["completion_tokens"] for c in with_choices][-1] == 6
    final = chunks[-1]["usage"]
    assert final["cache_read_input_tokens"] == final["prompt_tokens_details"]["cached_tokens"]


def test_custom_roles_render_with_the_template(flagged):
    messages = [{"role": "narrator", "content": "Once upon a time"}, *MESSAGES]
    tokens = post(flagged, "/tokenize", {"model": "tiny", "messages": messages}).json()["tokens"]
    out = chat(flagged, messages=messages, return_prompt_text=True)
    assert out["usage"]["prompt_tokens"] == len(tokens)
    assert "<|im_start|>narrator\nOnce upon a time" in out["prompt_text"]


def test_chat_echo_with_logprobs_returns_the_prompt_logprobs(server):
    out = chat(server, logprobs=True, top_logprobs=1, echo=True)
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
    assert chat(server, logprobs=True)["prompt_logprobs"] is None


def test_tool_call_stream_ends_with_the_finish_on_the_last_delta(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 40, "tools": tools, "tool_choice": "required"}
    chunks = [c for c in sse_chunks(server, "/v1/chat/completions", body) if c["choices"]]
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0] is chunks[-1]
    assert finishing[0]["choices"][0]["finish_reason"] in ("tool_calls", "length")
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "get_weather"


def test_request_chat_template_needs_the_trust_flag(server, flagged):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "chat_template": template}
    assert error_of(post(server, "/v1/chat/completions", body))["param"] == "chat_template"
    out = post(flagged, "/v1/chat/completions", {**body, "return_prompt_text": True}).json()
    assert out["prompt_text"] == MESSAGES[0]["content"]


# ---------------------------------------------------------------------------------- tokenizer routes
def test_tokenize_chat_with_continue_final_message_tools_and_strs(server, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": SAYING}]
    body = {"model": "tiny", "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    out = post(server, "/tokenize", {**body, "return_token_strs": True}).json()
    assert tokenizer.decode(out["tokens"]).endswith(SAYING)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    chat_ids = chat(server, **body, max_tokens=1, return_token_ids=True)["prompt_token_ids"]
    assert chat_ids == out["tokens"]


def test_tokenize_renders_tools_as_chat_does(flagged, tokenizer):
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": MESSAGES, "chat_template": template, "tools": tools, "tool_choice": "required"}
    out = post(flagged, "/tokenize", body).json()
    assert tokenizer.decode(out["tokens"]) == "[lookup]" + MESSAGES[0]["content"]
    sent = chat(flagged, **{k: v for k, v in body.items() if k != "model"}, max_tokens=1, return_token_ids=True)
    assert sent["prompt_token_ids"] == out["tokens"]
    none = post(flagged, "/tokenize", {**body, "tool_choice": "none"}).json()
    assert tokenizer.decode(none["tokens"]) == MESSAGES[0]["content"]


def test_tokenizer_info_behind_its_flag(server, flagged):
    assert httpx.get(server.url_for("tokenizer_info")).status_code == 404
    info = httpx.get(flagged.url_for("tokenizer_info")).json()
    assert info["tokenizer_class"] and "chat_template" in info and "vocab_file" not in info


# ---------------------------------------------------------------------------------- flagged server
def test_server_default_tokens_as_ids_and_uncapped_logprobs(flagged):
    out = complete(flagged, logprobs=-1, max_tokens=2, return_token_ids=True)["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    assert len(out["logprobs"]["top_logprobs"][0]) > 20  # -1: the whole vocabulary
    plain = complete(flagged, logprobs=0, max_tokens=2, return_tokens_as_token_ids=False)["choices"][0]
    assert not plain["logprobs"]["tokens"][0].startswith("token_id:")
    rows = complete(flagged, prompt_logprobs=-1, max_tokens=1)["choices"][0]["prompt_logprobs"]
    assert len(rows[1]) > 20


def test_invocations_dispatch_on_the_body(flagged):
    chat_out = post(flagged, "/invocations", {"messages": MESSAGES, "max_tokens": 2}).json()
    assert chat_out["object"] == "chat.completion"
    completion = post(flagged, "/invocations", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    assert error_of(post(flagged, "/invocations", {"input": "x"}))["param"] == "messages"
    assert httpx.get(flagged.url_for("ping")).status_code == 200


def test_load_counts_requests_in_flight(server, flagged):
    """A long streamed request is counted while it runs (polled, so a fast machine that finishes
    it quickly cannot slip between a client's read and its /load call) and uncounted after."""
    assert httpx.get(server.url_for("load")).json() == {"server_load": 0}
    done = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 480, "n": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", flagged.url_for("v1/completions"), json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    seen = set()
    while not done.is_set():
        seen.add(httpx.get(flagged.url_for("load")).json()["server_load"])
    thread.join(120)
    assert 1 in seen and seen <= {0, 1}
    assert httpx.get(flagged.url_for("load")).json() == {"server_load": 0}


def test_openai_client_sees_a_refused_field_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body={"watermarking": True})
    assert "watermarking" in str(info.value)


def test_no_blocks_left_in_use(server, flagged):
    """Every request above finished or was refused: both servers' KV caches are empty again."""
    for srv in (server, flagged):
        text = httpx.get(srv.url_for("metrics")).text
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc"))
        assert float(line.split()[-1]) == 0.0
