"""API-key file parsing, the constant-time key lookup and the per-key quota arithmetic (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pagedllm.entrypoints.openai.api_keys import ApiKey, KeyRing, default_name, describe_keys, load_api_keys
from pagedllm.entrypoints.openai.quotas import QuotaBook, QuotaExceeded, SlidingWindow, reserve_prompts
from pagedllm.metrics.key_usage import KeyUsageMetrics


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------- key file
def test_key_file_with_limits_and_plain_lines(tmp_path) -> None:
    path = write(tmp_path, "# comment\nsk-plain\n\nsk-abc name=team-a rpm=60 tpm=20000 max_concurrent=4 priority=-1\n")
    plain, team = load_api_keys(None, path)
    assert plain == ApiKey(b"sk-plain", default_name("sk-plain")) and not plain.has_limits
    assert plain.name.startswith("key-") and "sk-plain" not in plain.name
    assert team == ApiKey(b"sk-abc", "team-a", rpm=60, tpm=20000, max_concurrent=4, priority=-1)
    assert "sk-abc" not in repr(team) and "sk-abc" not in describe_keys([plain, team], "priority")
    line = describe_keys([team], "fcfs")
    assert "team-a (rpm 60, tpm 20000, max_concurrent 4, priority -1 (ignored" in line


@pytest.mark.parametrize(
    "line, message",
    [
        ("sk-a rmp=5", "line 2: 'rmp=5' is not FIELD=VALUE with FIELD one of name, rpm"),
        ("sk-a rpm", "line 2: 'rpm' is not FIELD=VALUE"),
        ("sk-a rpm=0", "line 2: rpm='0' must be a whole number >= 1"),
        ("sk-a tpm=lots", "line 2: tpm='lots' must be a whole number >= 1"),
        ("sk-a priority=high", "line 2: priority='high' must be a whole number"),
        ("sk-a name=team a", "line 2: 'a' is not FIELD=VALUE"),
        ("sk-a name=tëam", "line 2: name='tëam': use 1-64 letters"),
        ("sk-a rpm=1 rpm=2", "line 2: rpm is set twice"),
        ("rpm=5 sk-a", "line 2: the line starts with rpm=; put the key first"),
        ("sk-a admin=maybe", "line 2: admin='maybe' must be 1 or 0"),
    ],
)
def test_key_file_errors_name_the_line_and_the_fix(tmp_path, line: str, message: str) -> None:
    with pytest.raises(ValueError, match="^--api-key-file '.*keys.txt' " + message.replace("(", r"\(")) as info:
        load_api_keys(None, write(tmp_path, f"sk-ok\n{line}\n"))
    assert "sk-a" not in str(info.value)


def test_duplicate_keys_and_names(tmp_path) -> None:
    assert len(load_api_keys(["sk-a"], write(tmp_path, "sk-a\n"))) == 1  # the same key twice: harmless
    with pytest.raises(ValueError, match="two API keys are named 'x'.*own name=NAME"):
        load_api_keys(None, write(tmp_path, "sk-a name=x\nsk-b name=x\n"))
    with pytest.raises(ValueError, match="listed again") as info:
        load_api_keys(None, write(tmp_path, "sk-a name=x\nsk-a name=y rpm=3\n"))
    assert "sk-a" not in str(info.value)


def test_key_ring_matches_every_position() -> None:
    keys = [ApiKey(f"sk-{i}".encode(), f"k{i}") for i in range(5)]
    ring = KeyRing(keys)
    assert [ring.match(f"sk-{i}") for i in range(5)] == keys
    assert ring.match("sk-") is None and ring.match("sk-00") is None and ring.match("") is None


# ---------------------------------------------------------------------------------- windows
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sliding_window_expiry_correction_and_retry_after() -> None:
    window = SlidingWindow()
    first = window.charge(0.0, 10)
    window.charge(20.0, 5)
    assert window.used(30.0) == 15
    assert window.retry_after(30.0, 10, 20) == 30  # the first charge leaves at 60
    assert window.retry_after(30.0, 20, 20) == 50  # both must leave: the second at 80
    window.correct(first, 2)
    assert window.used(30.0) == 7 and window.used(60.0) == 5 and window.used(80.0) == 0


def test_rpm_then_retry_after_then_admitted_again() -> None:
    clock = Clock()
    book = QuotaBook(clock=clock)
    key = ApiKey(b"k", "k", rpm=2)
    book.admit(key).release()
    clock.now += 10
    book.admit(key).release()
    with pytest.raises(QuotaExceeded) as info:
        book.admit(key)
    assert info.value.limit == "rpm" and info.value.retry_after == 50 and "2 requests per minute" in info.value.message
    clock.now += 50
    book.admit(key).release()


def test_max_concurrent_frees_on_release() -> None:
    book = QuotaBook()
    key = ApiKey(b"k", "k", max_concurrent=2)
    first, _ = book.admit(key), book.admit(key)
    with pytest.raises(QuotaExceeded) as info:
        book.admit(key)
    assert info.value.limit == "max_concurrent" and info.value.retry_after == 1
    first.release()
    book.admit(key)


def output(prompt: int, generated: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        prompt_token_ids=[0] * prompt, outputs=[SimpleNamespace(token_ids=[0] * n) for n in generated]
    )


async def stream(outputs: list[SimpleNamespace]):
    for item in outputs:
        yield item


def drain(gen) -> list:
    async def run() -> list:
        return [item async for item in gen]

    return asyncio.run(run())


def test_tpm_reserves_then_settles_with_real_usage() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    book = QuotaBook(KeyUsageMetrics(registry, "m", ["k"]), clock=clock)
    key = ApiKey(b"k", "k", tpm=100, rpm=10)
    tokenizer = SimpleNamespace(encode=lambda text: [1] * len(text.split()))
    params = SimpleNamespace(max_tokens=30, n=2)
    ticket = book.admit(key)
    prompts, (charge,) = reserve_prompts(ticket, ["a b c d"], params, tokenizer, 512)
    assert prompts == [{"prompt": "a b c d", "prompt_token_ids": [1] * 4}]
    assert book.state(key).tokens.used(clock.now) == 4 + 30 * 2
    with pytest.raises(QuotaExceeded) as info:  # 64 reserved + 64 more > 100
        reserve_prompts(book.admit(key), ["a b c d"], params, tokenizer, 512)
    assert info.value.limit == "tpm" and info.value.retry_after == 60
    assert book.state(key).requests.used(clock.now) == 1  # the refused request is not counted in rpm
    # Streamed (delta) outputs: 4 prompt tokens, 3 + 2 generated over two choices.
    drain(ticket.metered(charge, stream([output(4, [1, 1]), output(4, [2, 1])]), delta=True))
    assert book.state(key).tokens.used(clock.now) == 9
    ticket.release()
    sample = registry.get_sample_value
    assert sample("pagedllm:api_key_prompt_tokens_total", {"model_name": "m", "key_name": "k"}) == 4
    assert sample("pagedllm:api_key_generation_tokens_total", {"model_name": "m", "key_name": "k"}) == 5
    assert sample("pagedllm:api_key_requests_total", {"model_name": "m", "key_name": "k"}) == 2
    assert sample("pagedllm:api_key_rate_limited_total", {"model_name": "m", "key_name": "k", "limit": "tpm"}) == 1


def test_tpm_final_outputs_unstarted_streams_and_too_large_requests() -> None:
    book = QuotaBook()
    key = ApiKey(b"k", "k", tpm=100)
    tokenizer = SimpleNamespace(encode=lambda text: [])
    ticket = book.admit(key)
    _, (used, unused) = reserve_prompts(ticket, [[1, 2], [3]], SimpleNamespace(max_tokens=10, n=1), tokenizer, 64)
    assert book.state(key).tokens.used(book.clock()) == 12 + 11
    drain(ticket.metered(used, stream([output(2, [3]), output(2, [7])]), delta=False))  # cumulative: 7
    ticket.release()  # the second prompt's stream never ran: it used nothing
    assert book.state(key).tokens.used(book.clock()) == 9 and book.state(key).in_flight == 0
    # A stream that ends before its first output (the client hung up) pays for its prompt.
    ticket = book.admit(key)
    _, (hung_up,) = reserve_prompts(ticket, [[1, 2, 3]], SimpleNamespace(max_tokens=10, n=1), tokenizer, 64)
    drain(ticket.metered(hung_up, stream([]), delta=True))
    ticket.release()
    assert book.state(key).tokens.used(book.clock()) == 9 + 3
    with pytest.raises(ValueError, match="reserves 501 tokens .* more than the 100 tokens per minute .* max_tokens"):
        reserve_prompts(book.admit(key), [[1]], SimpleNamespace(max_tokens=None, n=1), tokenizer, 501)


def test_windows_stay_bounded_for_keys_without_rate_limits() -> None:
    """A key with no rpm / tpm is charged too (its usage counts); what left the window is dropped
    at each charge, so a long-running server does not keep every request ever made."""
    clock = Clock()
    book = QuotaBook(clock=clock)
    key = ApiKey(b"k", "k", max_concurrent=4)
    for _ in range(1000):
        ticket = book.admit(key)
        reserve_prompts(ticket, [[1, 2]], SimpleNamespace(max_tokens=4, n=1), None, 64)
        ticket.release()
        clock.now += 1
    state = book.state(key)
    assert len(state.requests._charges) <= 61 and len(state.tokens._charges) <= 61


def test_reservations_never_go_negative_and_count_truncated_prompts() -> None:
    """A prompt longer than max_model_len with max_tokens unset reserves its kept tokens and no
    generation (never a negative amount that would free room under tpm); truncate_prompt_tokens
    is applied first. A request refused as too large for tpm is not counted in rpm."""
    book = QuotaBook()
    key = ApiKey(b"k", "k", tpm=1000, rpm=5)
    params = SimpleNamespace(max_tokens=None, n=8, truncate_prompt_tokens=None)
    _, (charge,) = reserve_prompts(book.admit(key), [[1] * 300], params, None, 256)
    assert charge.amount == 300  # no room left to generate: 0 tokens x 8, not -44 x 8
    truncated = SimpleNamespace(max_tokens=None, n=2, truncate_prompt_tokens=100)
    _, (charge,) = reserve_prompts(book.admit(key), [[1] * 5000], truncated, None, 256)
    assert charge.amount == 100 + 156 * 2
    assert book.state(key).requests.used(book.clock()) == 2
    with pytest.raises(ValueError, match="more than the 1000 tokens per minute"):
        reserve_prompts(book.admit(key), [[1] * 10], SimpleNamespace(max_tokens=600, n=2), None, 2048)
    assert book.state(key).requests.used(book.clock()) == 2


# ---------------------------------------------------------------------------------- the gate
def run_gate(gate, token: str) -> dict:
    """One POST /v1/completions through ``gate``; the response start message (or the app's)."""
    sent: list[dict] = []
    scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": [(b"authorization", token)]}

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request"}

    async def run() -> None:
        try:
            await gate(scope, receive, send)
        except RuntimeError:
            sent.append({"status": "app failed"})

    asyncio.run(run())
    return sent[0] if sent else {"status": "ran", "state": scope.get("state")}


def test_gate_order_and_release_on_failure() -> None:
    from pagedllm.entrypoints.openai.auth import ServerGate

    key = ApiKey(b"sk-g", "g", rpm=2, max_concurrent=1)
    book = QuotaBook()
    load = [0]

    async def failing_app(scope, receive, send) -> None:
        assert scope["state"]["api_key"] is key and book.state(key).in_flight == 1
        raise RuntimeError("the handler failed")

    gate = ServerGate(failing_app, [key], 4, lambda: load[0], SimpleNamespace(in_flight=0), book)
    assert run_gate(gate, b"Bearer sk-wrong")["status"] == 401
    assert run_gate(gate, b"Bearer sk-g") == {"status": "app failed"}
    assert book.state(key).in_flight == 0  # a failed request frees its slot
    load[0] = 4
    assert run_gate(gate, b"Bearer sk-g")["status"] == 503  # overloaded: not counted in rpm
    load[0] = 0
    assert run_gate(gate, b"Bearer sk-g") == {"status": "app failed"}
    refused = run_gate(gate, b"Bearer sk-g")
    assert refused["status"] == 429 and (b"retry-after", b"60") in refused["headers"]


@pytest.mark.parametrize("policy, requested, expected", [("priority", 0, 3), ("priority", 5, 5), ("fcfs", 0, 0)])
def test_key_priority_is_the_most_urgent_a_request_may_be(policy: str, requested: int, expected: int) -> None:
    from pagedllm.entrypoints.openai.serving_common import OpenAIServing

    engine = SimpleNamespace(config=SimpleNamespace(scheduler_config=SimpleNamespace(policy=policy)))
    serving = OpenAIServing(engine, None)  # type: ignore[arg-type]
    ticket = QuotaBook().admit(ApiKey(b"k", "k", priority=3))
    assert serving._priority(requested, ticket) == expected
    assert serving._priority(requested, None) == requested  # no keys: the request's own


def test_embeddings_run_as_the_keys_tenant_at_most_as_urgent_as_the_key() -> None:
    """Embedding and score requests take the key's name as their tenant (fair share) and its
    priority floor, as generation does."""
    from pagedllm.entrypoints.openai.serving_embeddings import OpenAIServingEmbedding
    from pagedllm.pooling_params import PoolingParams

    calls = []

    async def encode(prompt, params, request_id, priority=0, tenant=None):
        calls.append((priority, tenant))
        yield SimpleNamespace(request_id=request_id)

    engine = SimpleNamespace(config=SimpleNamespace(scheduler_config=SimpleNamespace(policy="priority")), encode=encode)
    serving = OpenAIServingEmbedding(engine, None)  # type: ignore[arg-type]
    ticket = QuotaBook().admit(ApiKey(b"k", "team-a", priority=10))
    raw_request = SimpleNamespace(state=SimpleNamespace(quota_ticket=ticket))
    asyncio.run(serving._embed_all(["a", "b"], PoolingParams(), -1_000_000, raw_request))  # type: ignore[arg-type]
    assert calls == [(10, "team-a"), (10, "team-a")]


def test_admin_keys_and_what_a_tenant_sees_on_the_dashboard(tmp_path) -> None:
    """--api-key keys are admins; a key file's only with admin=1. A tenant's dashboard stats keep
    the server-wide figures and its own usage, and drop other keys' rows and the recent errors."""
    from pagedllm.entrypoints.openai.dashboard import for_tenant

    path = write(tmp_path, "sk-ops name=ops admin=1\nsk-a name=team-a\n")
    cli, ops, team = load_api_keys(["sk-cli"], path)
    assert cli.admin and ops.admin and not team.admin
    stats = {
        "requests": {"running": 3},
        "keys": {"ops": {"requests": 1.0}, "team-a": {"requests": 5.0}, "team-b": {"requests": 9.0}},
        "errors": {"counts": {"400": 2}, "recent": [{"message": "team-b's prompt was ..."}]},
    }
    seen = for_tenant(stats, "team-a")
    assert seen == {
        "requests": {"running": 3},
        "keys": {"team-a": {"requests": 5.0}},
        "errors": {"counts": {"400": 2}, "recent": []},
    }
