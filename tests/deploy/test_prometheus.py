"""deploy/prometheus/: promtool accepts the config and rules, and the real Prometheus, scraping a
live server with the deploy config (its service discovery swapped for the server's address),
stores vllm: series and evaluates the recording rules over them."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.entrypoints.openai.conftest import _die_with_parent, free_port

from .conftest import AUTH, DASHBOARD, DEPLOY, load_yaml, metric

PROM_DIR = DEPLOY / "prometheus"
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus is not installed (.ci/run installs it)"
)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool comes with prometheus (.ci/run installs it)")
def test_promtool_accepts_config_and_rules():
    for check in (["config", "prometheus.yml"], ["rules", "rules.yml"]):
        done = subprocess.run(["promtool", "check", *check], cwd=PROM_DIR, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


def scrape_config(server_port: int, tmp: Path) -> Path:
    """The deploy config with a 1 s scrape and rule interval, scraping 127.0.0.1:server_port."""
    config = load_yaml(PROM_DIR / "prometheus.yml")
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    [job] = config["scrape_configs"]
    del job["dns_sd_configs"]
    job.update(static_configs=[{"targets": [f"127.0.0.1:{server_port}"]}], scrape_timeout="1s")
    for rule_file in config["rule_files"]:
        shutil.copy(PROM_DIR / rule_file, tmp / rule_file)
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def prometheus(live_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cmd = [
        "prometheus",
        f"--config.file={scrape_config(live_server.server.port, tmp)}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)  # gone with pytest
    try:
        yield _Prometheus(f"http://127.0.0.1:{port}", proc, tmp / "prometheus.log")
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


class _Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 30) -> list[dict]:
        """The query's first non-empty result within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()}"
            try:
                if result := self.query(promql):
                    return result
            except httpx.HTTPError:
                pass  # still starting
            time.sleep(0.25)
        raise AssertionError(f"no result for {promql} within {timeout} s:\n{self.log.read_text()[-3000:]}")


@needs_prometheus
def test_prometheus_scrapes_vllm_series(prometheus, live_server):
    server = live_server.server
    [up] = prometheus.wait_for('up{job="pagedllm"} == 1')
    [running] = prometheus.wait_for('vllm:num_requests_running{job="pagedllm"}')
    assert running["metric"]["model_name"] == "tiny" and running["metric"]["instance"] == up["metric"]["instance"]
    body = {"model": "tiny", "prompt": "Counting tokens", "max_tokens": 7, "ignore_eos": True}
    assert httpx.post(server.url_for("v1", "completions"), json=body, headers=AUTH, timeout=30).status_code == 200
    generated = metric(server, "vllm:generation_tokens_total")
    prometheus.wait_for(f'vllm:generation_tokens_total{{job="pagedllm"}} == {generated}')
    # The recording rules run over the scraped series too (a rate needs two scrapes).
    [rate] = prometheus.wait_for("model_name:vllm_generation_tokens:rate1m")
    assert rate["metric"]["model_name"] == "tiny"
    live_server.assert_idle()


@needs_prometheus
def test_every_dashboard_query_runs_on_prometheus(prometheus, live_server):
    """Each panel's PromQL, with Grafana's variables filled in as Grafana does ($model_name: All),
    is a valid query; the gauges' panels show the live server's series."""
    prometheus.wait_for('vllm:num_requests_running{job="pagedllm"}')
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        for target in panel["targets"]:
            promql = target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m")
            result = prometheus.query(promql)  # raises on a 400: Prometheus rejected the query
            if "rate(" not in promql and "histogram_quantile" not in promql:
                assert result, f"{panel['title']}: {promql} has no data"
