"""POST /v1/embeddings on a real server process (a tiny Llama run with --runner pooling), with the
official OpenAI client, against transformers; bad input is a 400 with an OpenAI error body; the
generation endpoints on an embedding server (and the reverse) say which endpoints are served."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.entrypoints.openai.conftest import RemoteServer

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a third input"]


@pytest.fixture(scope="module")
def embed_server(server_model_dir):
    with RemoteServer(server_model_dir, ["--runner", "pooling", "--served-model-name", "emb"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def expected(server_model_dir):
    """transformers' last hidden state at each text's last token, normalized (LAST pooling)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    model = AutoModel.from_pretrained(server_model_dir, dtype=torch.float32)
    result = {}
    for text in TEXTS:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            result[text] = (ids[0].tolist(), F.normalize(model(ids).last_hidden_state[0, -1], dim=-1).numpy())
    return result


def test_openai_client_embeddings_match_transformers(embed_server, expected):
    client = embed_server.openai_client()
    response = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, text in zip(response.data, TEXTS):
        np.testing.assert_allclose(np.array(data.embedding), expected[text][1], atol=2e-5)
    assert response.usage.prompt_tokens == sum(len(expected[t][0]) for t in TEXTS) == response.usage.total_tokens
    assert response.model == "emb"


def test_float_base64_token_ids_and_dimensions(embed_server, expected):
    url = embed_server.url_for("v1", "embeddings")
    ids, vector = expected[TEXTS[1]]
    floats = httpx.post(url, json={"input": TEXTS[1], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(floats["data"][0]["embedding"], vector, atol=2e-5)
    b64 = httpx.post(url, json={"input": [ids, ids[:3]], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vector, atol=2e-5)
    assert b64["usage"]["prompt_tokens"] == len(ids) + 3
    short = httpx.post(url, json={"input": ids, "encoding_format": "float", "dimensions": 8}).json()
    part = vector[:8] / np.linalg.norm(vector[:8])
    np.testing.assert_allclose(short["data"][0]["embedding"], part, atol=2e-5)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["a", ""]}, "input", "empty string"),
        ({"input": "x", "dimensions": 65}, "dimensions", "embedding size of 64"),
        ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "word " * 600}, "input", "max_model_len) is 512"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": ["x"] * 300}, "input", "at most 256 in one request"),
        ({"input": [[1, 2, 10**9]]}, "input", "outside the vocabulary"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "pass the text as input"),
        ({"input": "x", "model": "nope"}, "model", "does not exist"),
    ],
)
def test_bad_input_is_a_400_with_an_openai_error(embed_server, body, param, words):
    response = httpx.post(embed_server.url_for("v1", "embeddings"), json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_generation_endpoints_on_an_embedding_server_name_the_served_ones(embed_server):
    for path, body in (
        (("v1", "completions"), {"prompt": "hi"}),
        (("v1", "chat", "completions"), {"messages": [{"role": "user", "content": "hi"}]}),
        (("v1", "responses"), {"input": "hi"}),
    ):
        response = httpx.post(embed_server.url_for(*path), json=body)
        assert response.status_code == 400, response.text
        assert "embeddings (/v1/embeddings, /score, /rerank) only" in response.json()["error"]["message"]


def test_embeddings_on_a_generation_server_say_how_to_serve_them(server):
    for path, body in ((("v1", "embeddings"), {"input": "hi"}), (("score",), {"text_1": "a", "text_2": "b"})):
        response = httpx.post(server.url_for(*path), json=body)
        assert response.status_code == 400
        assert "--runner pooling" in response.json()["error"]["message"]


def test_score_and_rerank_are_cosine_similarities(embed_server, expected):
    vectors = {t: v for t, (_, v) in expected.items()}
    score = httpx.post(embed_server.url_for("v1", "score"), json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1] and score["data"][0]["object"] == "score"
    for d, text in zip(score["data"], TEXTS[1:]):
        assert d["score"] == pytest.approx(float(vectors[TEXTS[0]] @ vectors[text]), abs=1e-5)
    pairwise = httpx.post(embed_server.url_for("score"), json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert pairwise["data"][1]["score"] == pytest.approx(float(vectors[TEXTS[1]] @ vectors[TEXTS[2]]), abs=1e-5)
    rerank = httpx.post(
        embed_server.url_for("v1", "rerank"), json={"query": TEXTS[0], "documents": TEXTS, "top_n": 2}
    ).json()
    assert len(rerank["results"]) == 2 and rerank["results"][0]["index"] == 0  # the query itself ranks first
    assert rerank["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert rerank["results"][0]["document"] == {"text": TEXTS[0]}
    bad = httpx.post(embed_server.url_for("score"), json={"text_1": TEXTS[:2], "text_2": TEXTS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    empty = httpx.post(embed_server.url_for("rerank"), json={"query": "q", "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_nothing_is_left_running(embed_server):
    """Last in the module: after every request above, no request runs and the KV pool is idle."""
    metrics = httpx.get(embed_server.url_for("metrics")).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{"))
    }
    assert values == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0}
    assert "vllm:prompt_tokens_total" in metrics


def test_a_bert_model_serves_embeddings_as_sentence_transformers_computes_them(bert_model_dir):
    """`pagedllm serve` on an all-MiniLM-style encoder: the pooling runner by default, mean pooling
    and normalization from its sentence-transformers files."""
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(bert_model_dir), device="cpu").encode(TEXTS, convert_to_numpy=True)
    with RemoteServer(bert_model_dir, ["--served-model-name", "minilm", "--api-key", "sk-t"]) as srv:
        for path in (("v1", "embeddings"), ("score",), ("rerank",), ("v2", "rerank")):  # all behind the key
            assert httpx.post(srv.url_for(*path), json={"input": "x"}).status_code == 401
        response = srv.openai_client(api_key="sk-t").embeddings.create(model="minilm", input=TEXTS)
        got = np.array([d.embedding for d in response.data])
        np.testing.assert_allclose(got, expected, atol=2e-5)
        chat = httpx.post(
            srv.url_for("v1", "chat", "completions"),
            json={"messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": "Bearer sk-t"},
        )
        assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
