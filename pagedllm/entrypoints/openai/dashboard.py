"""What ``GET /dashboard/stats`` answers: one JSON reading of the server, computed from the same
Prometheus registry ``/metrics`` exports (so the two agree), plus the recent error responses.

Token rates are taken over a sliding window of the readings themselves (whoever polls), so
they need no per-step bookkeeping in the engine; a single reading has no rate yet (0).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

import pagedllm
from pagedllm.entrypoints.openai.error_log import RecentErrors
from pagedllm.metrics.snapshot import MetricSnapshot

RATE_WINDOW_S = 10.0  # tokens/s are averaged over about this long
RECENT_ERRORS_SHOWN = 20
# Labels that name an API key on per-key series; their series are grouped per key on the page.
KEY_LABELS = ("key_name",)
LATENCY_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
PAGE = Path(__file__).with_name("dashboard.html")


class RateWindow:
    """Counter readings of the last ``window`` seconds; rates are the change across them."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._readings: deque[tuple[float, dict[str, float]]] = deque()

    def rates(self, now: float, totals: dict[str, float]) -> dict[str, float]:
        self._readings.append((now, totals))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window:
            self._readings.popleft()
        then, old = self._readings[0]
        elapsed = now - then
        return {k: (v - old.get(k, 0.0)) / elapsed if elapsed > 0 else 0.0 for k, v in totals.items()}


class DashboardStats:
    """Builds the dashboard's JSON from the metrics registry and the error log."""

    def __init__(self, registry: Any, errors: RecentErrors, model_name: str) -> None:
        self.registry = registry
        self.errors = errors
        self.model_name = model_name
        self.started = time.time()
        self._rates = RateWindow()

    def read(self, in_flight: int) -> dict[str, Any]:
        snap = MetricSnapshot(self.registry)
        now = time.time()
        return {
            "time": now,
            "model": self.model_name,
            "version": pagedllm.__version__,
            "uptime_s": now - self.started,
            "requests": _requests(snap, in_flight),
            "kv_cache_usage": snap.value("vllm:kv_cache_usage_perc"),
            "prefix_cache": _prefix_cache(snap),
            "tokens": self._tokens(snap, time.monotonic()),
            "latency": {key: snap.histogram(name) for key, name in LATENCY_HISTOGRAMS.items()},
            "keys": _per_key(snap),
            "errors": {
                "counts": {str(k): v for k, v in sorted(self.errors.counts.items())},
                "recent": self.errors.recent(RECENT_ERRORS_SHOWN),
            },
        }

    def _tokens(self, snap: MetricSnapshot, now: float) -> dict[str, float]:
        totals = {
            "prompt": snap.value("vllm:prompt_tokens_total"),
            "generation": snap.value("vllm:generation_tokens_total"),
        }
        rates = self._rates.rates(now, totals)
        return {
            "prompt_total": totals["prompt"],
            "generation_total": totals["generation"],
            "prompt_per_s": rates["prompt"],
            "generation_per_s": rates["generation"],
        }


def _requests(snap: MetricSnapshot, in_flight: int) -> dict[str, Any]:
    return {
        "running": snap.value("vllm:num_requests_running"),
        "waiting": snap.value("vllm:num_requests_waiting"),
        "in_flight_http": in_flight,
        "finished": snap.by_label("vllm:request_success_total", "finished_reason"),
    }


def _prefix_cache(snap: MetricSnapshot) -> dict[str, float | None]:
    queries, hits = snap.value("vllm:prefix_cache_queries_total"), snap.value("vllm:prefix_cache_hits_total")
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def _per_key(snap: MetricSnapshot) -> dict[str, dict[str, float]]:
    """Per-key series (whatever per-key accounting exports under a key label), grouped by key."""
    keys: dict[str, dict[str, float]] = {}
    for label in KEY_LABELS:
        for key, values in snap.per_label_value(label).items():
            keys.setdefault(key, {}).update(values)
    return keys


def page_html() -> str:
    return PAGE.read_text()


def for_tenant(stats: dict[str, Any], key_name: str) -> dict[str, Any]:
    """What a non-admin key may see: the server-wide figures, its own row of per-key usage, the
    error counts by status, and none of the recent errors (their messages may quote other
    tenants' requests)."""
    errors = {**stats["errors"], "recent": []}
    own = {name: usage for name, usage in stats["keys"].items() if name == key_name}
    return {**stats, "keys": own, "errors": errors}
