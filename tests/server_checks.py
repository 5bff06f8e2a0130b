"""Checks that tests of a server process end with: nothing running or waiting, the KV cache idle,
the block pool whole (GET /debug/integrity, served with PAGEDLLM_DEBUG_ENDPOINTS=1), and
readings of /metrics and of a process's resident memory."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

DEBUG_ENV = {"PAGEDLLM_DEBUG_ENDPOINTS": "1"}


def metric_samples(url: str, headers: dict[str, str] | None = None) -> dict[str, list]:
    """Every /metrics sample, by sample name."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def metric_sum(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def wait_idle(url: str, timeout: float = 60, headers: dict[str, str] | None = None) -> dict[str, list]:
    """Poll /metrics until no request runs or waits and the KV cache is empty; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metric_samples(url, headers)
        busy = [
            n
            for n in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            if metric_sum(samples, n) != 0
        ]
        if not busy:
            return samples
        assert time.monotonic() < deadline, f"the server is not idle after {timeout} s: {busy} are not 0"
        time.sleep(0.2)


def assert_idle_and_intact(url: str, headers: dict[str, str] | None = None) -> None:
    """Idle (as ``wait_idle``), no request left in the front end, and the block pool's check passes."""
    wait_idle(url, headers=headers)
    resp = httpx.get(f"{url}/debug/integrity", headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"integrity": "ok", "unfinished_requests": 0}


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def engine_core_pid(server_pid: int) -> int:
    """The server's engine core process: its child started by multiprocessing's spawn."""
    for children in Path(f"/proc/{server_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError(f"server {server_pid} has no engine core process")


def server_error_counts(url: str, headers: dict[str, str] | None = None) -> dict[int, int]:
    """The error responses the server has sent since it started, by status (GET /dashboard/stats):
    these include answers no client read (it had hung up), which a client-side count misses."""
    counts = httpx.get(f"{url}/dashboard/stats", headers=headers, timeout=10).json()["errors"]["counts"]
    return {int(status): n for status, n in counts.items()}


def assert_no_server_errors(url: str, headers: dict[str, str] | None = None) -> dict[int, int]:
    """No 5xx was ever sent (read on the server's side); returns the error counts."""
    counts = server_error_counts(url, headers)
    assert not {s: n for s, n in counts.items() if s >= 500}, f"the server sent 5xx answers: {counts}"
    return counts
