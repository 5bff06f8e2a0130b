"""Multi-LoRA through the server and the official ``openai`` client: adapters named in ``model``,
mixed in one batch, against transformers + PEFT; /v1/models; runtime load/unload; bad input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import RemoteServer
from tests.lora.conftest import hf_greedy

NEW_TOKENS = 10
PROMPTS = [[5, 17, 42, 99, 7], [300, 2, 2, 8, 64, 11, 90, 13, 250, 3], [1, 400]]


@pytest.fixture(scope="module")
def adapters(llama_model_dir, make_adapter):
    return [
        make_adapter(llama_model_dir, seed=11),
        make_adapter(llama_model_dir, seed=12, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        make_adapter(llama_model_dir, seed=13, r=16, alpha=16, use_rslora=True),
    ]


@pytest.fixture(scope="module")
def server(llama_model_dir, adapters):
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "256", "--enable-lora"]
    args += ["--max-loras", "3", "--enable-lora-runtime-updates"]
    args += ["--lora-modules", f"a1={adapters[0]}", f'{{"name": "a2", "path": "{adapters[1]}"}}']
    with RemoteServer(llama_model_dir, args) as srv:
        yield srv


def _complete(server, model: str, prompt: list[int]) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    response = httpx.post(server.url_for("v1", "completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_models_lists_adapters_with_their_parent(server):
    cards = {m.id: m for m in server.openai_client().models.list().data}
    assert set(cards) == {"tiny", "a1", "a2"}
    assert cards["a1"].parent == "tiny" and cards["a2"].parent == "tiny"
    assert cards["tiny"].parent is None


def test_mixed_adapters_in_one_batch_match_peft(server, llama_model_dir, adapters):
    load = httpx.post(
        server.url_for("v1", "load_lora_adapter"), json={"lora_name": "a3", "lora_path": str(adapters[2])}
    )
    assert load.status_code == 200, load.text
    paths = {"tiny": None, "a1": adapters[0], "a2": adapters[1], "a3": adapters[2]}
    cases = [(model, p) for p in PROMPTS for model in paths]
    with ThreadPoolExecutor(len(cases)) as pool:  # all at once: the engine batches them together
        got = list(pool.map(lambda case: _complete(server, *case), cases))
    want = [hf_greedy(llama_model_dir, paths[model], p, NEW_TOKENS) for model, p in cases]
    assert got == want


def test_chat_with_an_adapter_through_the_openai_client(server):
    client = server.openai_client()
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0.0
    )
    assert chat.model == "a1" and chat.choices[0].message.content is not None


def test_unknown_model_is_a_404_naming_the_served_names(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.openai_client().completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in str(info.value) and "`a1`" in str(info.value) and "`tiny`" in str(info.value)


def test_bad_adapter_load_is_a_400_naming_it(server, tmp_path, llama_model_dir, make_adapter):
    big = make_adapter(llama_model_dir, seed=14, r=32, alpha=32)
    for name, path, fragment in [("ghost", tmp_path / "none", "not a directory"), ("big", big, "rank 32")]:
        response = httpx.post(
            server.url_for("v1", "load_lora_adapter"), json={"lora_name": name, "lora_path": str(path)}
        )
        assert response.status_code == 400, response.text
        assert repr(name) in response.json()["error"]["message"] and fragment in response.json()["error"]["message"]
    assert "ghost" not in {m.id for m in server.openai_client().models.list().data}


def test_unload_refuses_in_flight_then_unloads(server, adapters):
    load = httpx.post(
        server.url_for("v1", "load_lora_adapter"), json={"lora_name": "tmp", "lora_path": str(adapters[0])}
    )
    assert load.status_code == 200
    body = {"model": "tmp", "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # one iterator: dropping it would close the stream
        first = next(lines)  # the request is running
        assert first.startswith("data: "), first
        busy = httpx.post(server.url_for("v1", "unload_lora_adapter"), json={"lora_name": "tmp"})
        assert busy.status_code == 409 and "tmp" in busy.json()["error"]["message"], busy.text
        assert list(lines)[-2] == "data: [DONE]"  # the request runs to its end with its adapter
    done = httpx.post(server.url_for("v1", "unload_lora_adapter"), json={"lora_name": "tmp"})
    assert done.status_code == 200, done.text
    assert "tmp" not in {m.id for m in server.openai_client().models.list().data}
    gone = httpx.post(server.url_for("v1", "unload_lora_adapter"), json={"lora_name": "tmp"})
    assert gone.status_code == 404


def test_lora_metrics(server):
    text = httpx.get(server.url_for("metrics")).text
    assert "vllm:lora_requests_info{" in text and 'max_lora="3"' in text


def test_lora_server_flags():
    import argparse

    from pagedllm.entrypoints.openai.server_options import ServerOptions

    def options(**kw) -> ServerOptions:
        return ServerOptions.from_args(argparse.Namespace(model="m", **kw))

    parsed = options(enable_lora=True, lora_modules=["a=/x", '{"name": "b", "path": "/y"}'])
    assert parsed.lora_modules == [("a", "/x"), ("b", "/y")]
    with pytest.raises(ValueError, match="NAME=PATH"):
        options(enable_lora=True, lora_modules=["nopath"])
    with pytest.raises(ValueError, match="--enable-lora"):
        options(lora_modules=["a=/x"])
