"""Every endpoint fuzzed from the server's own OpenAPI schema (schemathesis): valid and invalid
bodies, paths and queries. No answer may be a 5xx, every 4xx carries an OpenAI-style error body,
and afterwards the server is idle, its block pool whole and its memory grown by a bounded amount.

Valid bodies keep the generation sizes small (max_tokens, n, ...: ``CAPS``) so the short run fits
the CPU budget; everything else is as generated. ``PAGEDLLM_SOAK=1`` draws more examples."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.entrypoints.openai.conftest import RemoteServer
from tests.server_checks import (
    DEBUG_ENV,
    assert_idle_and_intact,
    assert_no_server_errors,
    engine_core_pid,
    rss_bytes,
)

from .conftest import SERVER_ARGS, SOAK

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

EXAMPLES = 100 if SOAK else 10  # per endpoint and mode (valid / invalid data)
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 2, "best_of": 2}
CAPS |= {"logprobs": 5, "top_logprobs": 5, "prompt_logprobs": 5, "beam_width": 2}
MiB = 1024 * 1024
MAX_RSS_GROWTH = 128 * MiB


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A short context (96 tokens): a valid body without max_tokens generates up to it."""
    with RemoteServer(tiny_model_dir("llama"), [*SERVER_ARGS, "--max-model-len", "96"], env=DEBUG_ENV) as srv:
        yield srv


def _bounded(body: Any, positive: bool) -> Any:
    """A valid body names the served model and asks for little generation (the server's short
    context bounds the requests that name no size)."""
    if not isinstance(body, dict):
        return body
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    if positive and "model" in body:
        body["model"] = "tiny"
    return body


def _problem(response: Any) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{response.status_code} without an OpenAI error body: {response.text[:300]}"
    return None


def _fuzz(operation: Any, mode: Any, url: str, session: Any, found: list[str], statuses: Counter) -> None:
    positive = mode.value == "positive"

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same examples every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if isinstance(getattr(case, "body", None), dict):
            case.body = _bounded(case.body, positive)
        response = case.call(base_url=url, session=session, timeout=120)
        statuses[response.status_code] += 1
        problem = _problem(response)
        if problem is not None:
            found.append(
                f"{operation.label} ({mode.value}) body={json.dumps(getattr(case, 'body', None))[:300]}: {problem}"
            )

    # Unsatisfiable: no parameter to make invalid (a GET without a query): nothing to fuzz in this mode.
    with contextlib.suppress(Unsatisfiable):
        run()


def test_openapi_schema_is_served(server):
    schema = httpx.get(server.url_for("openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/dashboard/stats", "/tokenize"} <= set(schema["paths"])
    assert "requestBody" in schema["paths"]["/v1/chat/completions"]["post"]


def test_fuzz_every_endpoint(server):
    schema = schemathesis.openapi.from_url(server.url_for("openapi.json"))
    rss_before = rss_bytes(server.proc.pid), rss_bytes(engine_core_pid(server.proc.pid))
    found: list[str] = []
    statuses: Counter = Counter()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            for mode in schemathesis.GenerationMode:
                _fuzz(result.ok(), mode, server.url, session, found, statuses)
    assert not found, "\n".join(found[:20])
    assert_idle_and_intact(server.url)
    assert_no_server_errors(server.url)
    rss_after = rss_bytes(server.proc.pid), rss_bytes(engine_core_pid(server.proc.pid))
    growth = [round((a - b) / MiB, 1) for a, b in zip(rss_after, rss_before)]
    print("fuzz:", json.dumps({"requests": sum(statuses.values()), "statuses": statuses, "rss_growth_mib": growth}))
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
    assert max(growth) * MiB < MAX_RSS_GROWTH, growth
