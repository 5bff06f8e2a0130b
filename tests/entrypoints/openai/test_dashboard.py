"""GET /dashboard and /dashboard/stats on a real server: the JSON agrees with /metrics read at the
same moment, the recent-error log, and the page rendered by headless Chromium (skipped when
Debian's ``chromium`` is not installed) shows the numbers /metrics exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from pagedllm.entrypoints.openai.dashboard import DashboardStats, RateWindow
from pagedllm.entrypoints.openai.error_log import RecentErrors, error_message
from pagedllm.metrics.snapshot import histogram_quantile
from tests.server_checks import DEBUG_ENV, assert_idle_and_intact, metric_samples, metric_sum, wait_idle

from .conftest import RemoteServer, assert_openai_error


# ---------------------------------------------------------------------------------- pure parts
def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)  # rank 1 of 2 in [0, 0.1]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.4)  # rank 5: 3/4 into (0.1, 0.5]
    assert histogram_quantile(0.99, buckets) == 1.0  # the +Inf bucket: the highest finite edge
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_rate_window_uses_the_readings_of_the_window():
    window = RateWindow(window=10)
    assert window.rates(0.0, {"t": 0.0}) == {"t": 0.0}
    assert window.rates(2.0, {"t": 100.0}) == {"t": 50.0}
    assert window.rates(20.0, {"t": 100.0}) == {"t": pytest.approx(0.0)}  # the burst left the window


def test_error_log_is_bounded_and_keeps_messages_short():
    errors = RecentErrors(maxlen=3)
    for i in range(5):
        errors.add("POST", "/v1/completions", 400, f"bad {i} " + "x" * 1000)
    recent = errors.recent()
    assert [e["message"][:5] for e in recent] == ["bad 4", "bad 3", "bad 2"]
    assert all(len(e["message"]) == 300 for e in recent) and errors.counts == {400: 5}
    assert error_message(b'{"error": {"message": "m"}}') == "m" and error_message(b"plain") == "plain"


def test_per_key_series_are_grouped_by_key():
    """Whatever per-key accounting exports under a ``key_name`` label shows up per key."""
    registry = CollectorRegistry()
    used = Counter("pagedllm:key_tokens", "tokens per key", ["key_name"], registry=registry)
    used.labels("team-a").inc(7)
    used.labels("team-b").inc(2)
    Histogram("vllm:time_to_first_token_seconds", "ttft", registry=registry).observe(0.2)
    stats = DashboardStats(registry, RecentErrors(), "m").read(in_flight=0)
    assert stats["keys"] == {"team-a": {"pagedllm:key_tokens_total": 7.0}, "team-b": {"pagedllm:key_tokens_total": 2.0}}
    assert stats["latency"]["ttft"]["count"] == 1 and 0.1 < stats["latency"]["ttft"]["p50"] <= 0.25


# ---------------------------------------------------------------------------------- on a server
@pytest.fixture(scope="module")
def srv(server_model_dir):
    args = ["--served-model-name", "tiny", "--disable-uvicorn-access-log"]
    with RemoteServer(server_model_dir, args, env=DEBUG_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def loaded(srv):
    """A few finished requests (plain, streamed, a shared prefix) and one bad one."""
    client = srv.openai_client()
    for i in range(3):
        prompt = "The same long prefix of words " * 4 + str(i)
        client.completions.create(model="tiny", prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "hi"}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks
    bad = httpx.post(srv.url_for("v1", "completions"), json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    assert_openai_error(bad, 400)
    wait_idle(srv.url)
    return srv


def _bucket_bounds(samples: dict, name: str, q: float) -> tuple[float, float]:
    """The (lower, upper) edges of the bucket where quantile ``q`` of /metrics' histogram falls."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples[name + "_bucket"])
    rank, lower = q * buckets[-1][1], 0.0
    for edge, count in buckets:
        if count >= rank:
            return lower, edge
        lower = edge
    raise AssertionError("unreachable: the +Inf bucket holds every observation")


def test_stats_agree_with_metrics(loaded):
    stats = httpx.get(loaded.url_for("dashboard", "stats")).json()
    samples = metric_samples(loaded.url)
    assert stats["requests"]["running"] == metric_sum(samples, "vllm:num_requests_running") == 0
    assert stats["requests"]["waiting"] == metric_sum(samples, "vllm:num_requests_waiting") == 0
    assert stats["kv_cache_usage"] == metric_sum(samples, "vllm:kv_cache_usage_perc")
    assert stats["tokens"]["prompt_total"] == metric_sum(samples, "vllm:prompt_tokens_total") > 0
    assert stats["tokens"]["generation_total"] == metric_sum(samples, "vllm:generation_tokens_total") == 3 * 6 + 5
    assert stats["prefix_cache"]["queries"] == metric_sum(samples, "vllm:prefix_cache_queries_total")
    assert stats["prefix_cache"]["hits"] == metric_sum(samples, "vllm:prefix_cache_hits_total") > 0
    for reason, count in stats["requests"]["finished"].items():
        assert count == metric_sum(samples, "vllm:request_success_total", finished_reason=reason)
    assert stats["requests"]["finished"]["length"] == 4
    for key, name in (("ttft", "vllm:time_to_first_token_seconds"), ("itl", "vllm:inter_token_latency_seconds")):
        summary = stats["latency"][key]
        assert summary["count"] == metric_sum(samples, name + "_count") > 0
        for q in (0.5, 0.9, 0.99):
            lower, upper = _bucket_bounds(samples, name, q)
            assert lower <= summary[f"p{round(q * 100)}"] <= upper


def test_recent_errors_show_route_status_message_but_no_key(loaded):
    stats = httpx.get(loaded.url_for("dashboard", "stats")).json()
    first = stats["errors"]["recent"][0]
    assert first["path"] == "/v1/completions" and first["status"] == 400 and first["method"] == "POST"
    assert "max_tokens" in first["message"] and stats["errors"]["counts"]["400"] >= 1
    assert set(first) == {"time", "method", "path", "status", "message"}


def test_page_is_self_contained(srv):
    resp = httpx.get(srv.url_for("dashboard"))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    page = resp.text
    assert "<style>" in page and "<script>" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page must load no external asset"
    assert "@import" not in page and "url(http" not in page


def test_stats_need_the_api_key_when_keys_are_set(server_model_dir):
    args = ["--served-model-name", "tiny", "--api-key", "sk-dash-secret", "--max-num-seqs", "2"]
    with RemoteServer(server_model_dir, args, env=DEBUG_ENV) as keyed:
        assert httpx.get(keyed.url_for("dashboard")).status_code == 200  # the page holds no data
        assert_openai_error(httpx.get(keyed.url_for("dashboard", "stats")), 401)
        assert_openai_error(httpx.get(keyed.url_for("debug", "integrity")), 401)
        wrong = {"Authorization": "Bearer sk-wrong-secret"}
        assert_openai_error(httpx.get(keyed.url_for("v1", "models"), headers=wrong), 401)
        auth = {"Authorization": "Bearer sk-dash-secret"}
        stats = httpx.get(keyed.url_for("dashboard", "stats"), headers=auth)
        assert stats.status_code == 200 and stats.json()["errors"]["counts"]["401"] == 3
        assert "secret" not in stats.text  # neither the right key nor the wrong one is logged
        assert_idle_and_intact(keyed.url, headers=auth)


# ---------------------------------------------------------------------------------- in a browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _ById(HTMLParser):
    """The text of every element with an id, and the body's data-updates count."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.updates = 0
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        found = dict(attrs)
        if tag == "body":
            self.updates = int(found.get("data-updates") or 0)
        self._open.append(found.get("id"))
        if found.get("id"):
            self.text[found["id"]] = ""

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element_id in filter(None, self._open):
            self.text[element_id] += data


def _chromium(url: str, *flags: str) -> subprocess.CompletedProcess:
    # --virtual-time-budget lets the page's 1 s polling run a few times before the DOM is read.
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3500", *flags, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
def test_page_in_headless_chromium_shows_the_metrics(loaded, tmp_path):
    shot = tmp_path / "dashboard.png"
    assert _chromium(loaded.url_for("dashboard"), f"--screenshot={shot}", "--window-size=1280,900").returncode == 0
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    dom = _chromium(loaded.url_for("dashboard"), "--dump-dom")
    assert dom.returncode == 0, dom.stderr
    page = _ById()
    page.feed(dom.stdout)
    samples = metric_samples(loaded.url)
    assert page.updates >= 2, "the page did not poll its stats more than once"
    shown = {k: page.text[k].strip() for k in ("running", "waiting", "gen-total", "prompt-total", "kv-usage")}
    assert _number(shown["running"]) == metric_sum(samples, "vllm:num_requests_running")
    assert _number(shown["waiting"]) == metric_sum(samples, "vllm:num_requests_waiting")
    assert _number(shown["gen-total"]) == metric_sum(samples, "vllm:generation_tokens_total")
    assert _number(shown["prompt-total"]) == metric_sum(samples, "vllm:prompt_tokens_total")
    assert _number(shown["kv-usage"]) == 100 * metric_sum(samples, "vllm:kv_cache_usage_perc")
    hit_rate = metric_sum(samples, "vllm:prefix_cache_hits_total") / metric_sum(
        samples, "vllm:prefix_cache_queries_total"
    )
    assert _number(page.text["hit-rate"]) == pytest.approx(100 * hit_rate, abs=0.05)
    assert "max_tokens" in page.text["errors"] and "/v1/completions" in page.text["errors"]


def test_server_ends_idle_and_intact(loaded):
    assert_idle_and_intact(loaded.url)
