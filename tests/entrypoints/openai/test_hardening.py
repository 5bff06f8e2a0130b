"""What a hostile or broken client must not do to a real ``pagedllm serve``: fan one request out
into thousands of engine requests, send a body without bound, crash the handlers with odd JSON
(deep nesting, lone surrogates, huge integers), hold connections with half-sent headers, or read
the API docs without the key.

One server: an API key, small limits (64 KiB bodies, 1 s header and keep-alive timeouts) and an
admission limit of 2 running + 6 waiting, so --max-prompts-per-request 16 is held to 4.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from .conftest import RemoteServer, assert_openai_error

KEY = "sk-harden"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def srv(server_model_dir):
    args = [
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "6",
        "--max-prompts-per-request",
        "16",
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--header-read-timeout",
        "1",
        "--body-read-timeout",
        "1",
        "--timeout-keep-alive",
        "1",
        "--disable-uvicorn-access-log",
    ]
    with RemoteServer(server_model_dir, args) as server:
        yield server


@pytest.fixture()
def client(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        yield c


def raw_request(srv: RemoteServer, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``) on a raw socket; everything the server answers."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------- prompts per request
def test_too_many_prompts_is_400_naming_the_limit(srv):
    client = srv.openai_client(api_key=KEY)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[[1, 2]] * 5, max_tokens=1)
    error = info.value.body
    assert error["param"] == "prompt" and "at most 4" in error["message"]
    assert "--max-prompts-per-request 16" in error["message"] and "--max-waiting-requests" in error["message"]
    with pytest.raises(openai.BadRequestError):  # the fuzzer's size: refused before any engine work
        client.completions.create(model="tiny", prompt=["x"] * 5000, max_tokens=1)
    assert len(client.completions.create(model="tiny", prompt=["a", "b", "c", "d"], max_tokens=1).choices) == 4


def test_an_allowed_batch_leaves_room_for_others(client):
    batch = {"model": "tiny", "prompt": ["a", "b", "c", "d"], "max_tokens": 300, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=batch) as resp:
        assert resp.status_code == 200
        assert next(line for line in resp.iter_lines() if line.startswith("data: "))  # the batch is running
        other = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert other.status_code == 200, other.text


# ---------------------------------------------------------------------------------- body size
def test_declared_oversize_body_is_413_before_it_is_read(srv):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 200000000\r\nConnection: close\r\n\r\n"
    )
    started = time.monotonic()
    answer = raw_request(srv, head, b'{"prompt": "' + b"x" * 1000)
    assert time.monotonic() - started < 10
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    error = json.loads(body)["error"]
    assert (
        error["code"] == 413 and "--max-request-body-bytes" in error["message"] and str(BODY_LIMIT) in error["message"]
    )


def test_streamed_oversize_body_is_413(client):
    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    resp = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "--max-request-body-bytes" in assert_openai_error(resp, 413)["message"]
    under = client.post("/tokenize", json={"prompt": "x" * (BODY_LIMIT // 2)})  # under the limit: fine
    assert under.status_code == 200, under.text


# ---------------------------------------------------------------------------------- odd JSON
def post_raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def test_deeply_nested_json_is_400(client):
    deep = '{"model": "tiny", "prompt": ' + "[" * 10_000 + "]" * 10_000 + "}"
    assert "nested too deeply" in assert_openai_error(post_raw(client, "/v1/completions", deep), 400)["message"]
    # deep enough to pass the JSON parser but not the server's limit: the 400 names the field
    schema = {"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}
    nested: dict = {"type": "object"}
    for _ in range(100):
        nested = {"type": "object", "properties": {"a": nested}}
    schema["response_format"]["json_schema"] = {"name": "deep", "schema": nested}
    error = assert_openai_error(client.post("/v1/chat/completions", json={**schema, "messages": []}), 400)
    assert error["param"] == "response_format" and "nested too deeply" in error["message"]


@pytest.mark.parametrize(
    ("path", "text", "param"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        ("/tokenize", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(client, path, text, param):
    error = assert_openai_error(post_raw(client, path, text), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_paired_surrogates_are_text(client):
    resp = post_raw(client, "/tokenize", '{"model": "tiny", "prompt": "\\ud83d\\ude00"}')
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("field", ["priority", "seed", "max_tokens", "logprobs", "top_k", "truncate_prompt_tokens"])
@pytest.mark.parametrize("value", [2**70, -(2**70), 2**64])
def test_huge_integers_are_400(client, field, value):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1, field: value}
    error = assert_openai_error(client.post("/v1/completions", json=body), 400)
    assert error["param"] == field


def test_huge_integers_are_400_on_every_generation_route(client):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "priority": 2**70}
    assert assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "priority"
    responses = {"model": "tiny", "input": "x", "priority": 2**70}
    assert assert_openai_error(client.post("/v1/responses", json=responses), 400)["param"] == "priority"
    ids = {"model": "tiny", "prompt": [1, 2**70]}
    assert assert_openai_error(client.post("/v1/completions", json=ids), 400)["param"] == "prompt.1"


# ---------------------------------------------------------------------------------- slow clients
def closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock``; sends ``trickle`` a byte every 0.2 s meanwhile."""
    started = time.monotonic()
    sock.setblocking(False)
    deadline = started + 15
    while time.monotonic() < deadline:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        if trickle:
            try:
                sock.send(trickle[:1])
            except OSError:
                return time.monotonic() - started
            trickle = trickle[1:]
        time.sleep(0.2)
    return float("inf")


def test_half_sent_headers_are_closed_within_the_timeout(srv):
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert httpx.get(srv.url_for("health"), timeout=5).status_code == 200  # others are served meanwhile
        assert closed_after(sock, b"X-Slow: " + b"y" * 100) < 4  # trickling does not extend the deadline


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body), however the reads split it."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def test_a_half_sent_body_is_a_408_within_the_timeout(srv):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n".encode()
    )
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(head + b'{"model": "tiny", "prompt": ')  # and nothing more
        answer = _read_response(sock)
        assert time.monotonic() - started < 4, "the 1 s body deadline"
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "--body-read-timeout" in error["message"] and error["code"] == 408
    assert httpx.get(srv.url_for("health"), timeout=5).status_code == 200  # the server is fine


def test_idle_and_slow_keep_alive_connections_are_closed(srv):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_after(sock) < 4  # --timeout-keep-alive 1
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_after(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X" * 100) < 4  # the next head, slowly


# ---------------------------------------------------------------------------------- API docs
@pytest.mark.parametrize("path", ["docs", "redoc", "openapi.json", "docs/oauth2-redirect"])
def test_api_docs_need_the_key(srv, path):
    assert_openai_error(httpx.get(srv.url_for(path)), 401)
    assert httpx.get(srv.url_for(path), headers=AUTH).status_code == 200
