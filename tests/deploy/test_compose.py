"""deploy/compose.yaml and the files it mounts: they exist, they agree with each other, and every
metric the dashboard, the Prometheus rules and the autoscaler name is one a live server exports."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import DASHBOARD, DEPLOY, METRIC_NAME, REPO, load_yaml, metric_samples, serve_args, yaml_docs

COMPOSE = DEPLOY / "compose.yaml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "pagedllm.yml"


def services() -> dict:
    return load_yaml(COMPOSE)["services"]


def bind_mounts(service: str) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts (``./...`` sources)."""
    mounts = {}
    for volume in services()[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE.parent / source).resolve()
    return mounts


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dash["panels"] for target in panel["targets"]]
    return exprs + [var["definition"] for var in dash["templating"]["list"]]


def rule_exprs() -> list[str]:
    return [
        rule["expr"] for group in load_yaml(DEPLOY / "prometheus" / "rules.yml")["groups"] for rule in group["rules"]
    ]


def hpa_metric_names() -> list[str]:
    [hpa] = yaml_docs(DEPLOY / "k8s" / "hpa.yaml")
    return [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]


def test_every_mounted_file_and_build_input_exists():
    for name in services():
        for target, source in bind_mounts(name).items():
            assert source.exists(), f"{name} mounts {source} at {target}: it does not exist"
    declared = set(load_yaml(COMPOSE)["volumes"])
    for name, service in services().items():
        named = {v.split(":")[0] for v in service.get("volumes", []) if not v.startswith(".")}
        assert named <= declared, f"{name} uses undeclared volumes {named - declared}"
    build = services()["pagedllm"]["build"]
    assert (COMPOSE.parent / build["context"]).resolve() == REPO
    assert (REPO / build["dockerfile"]).is_file()


def test_the_services_point_at_each_other():
    nginx_conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    assert "server pagedllm:8000 " in nginx_conf and "8000" in services()["pagedllm"]["expose"]
    assert bind_mounts("nginx") == {"/etc/nginx/nginx.conf": DEPLOY / "nginx" / "nginx.conf"}
    prom = services()["prometheus"]
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    mounted = bind_mounts("prometheus")
    assert mounted[config_path] == DEPLOY / "prometheus" / "prometheus.yml"
    config = load_yaml(mounted[config_path])
    for rule_file in config["rule_files"]:  # relative to the config file, inside the container
        assert mounted[str(Path(config_path).parent / rule_file)].is_file()
    [job] = config["scrape_configs"]
    assert job["dns_sd_configs"] == [{"names": ["pagedllm"], "type": "A", "port": 8000, "refresh_interval": "15s"}]


def test_grafana_provisioning_matches_the_dashboard():
    mounted = bind_mounts("grafana")
    assert mounted["/etc/grafana/provisioning"] == DEPLOY / "grafana" / "provisioning"
    [provider] = load_yaml(PROVIDERS)["providers"]
    assert mounted[provider["options"]["path"]] == DASHBOARD.parent
    [source] = load_yaml(DATASOURCES)["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090:9090" in services()["prometheus"]["ports"]
    dash = json.loads(DASHBOARD.read_text())
    refs = [p["datasource"] for p in dash["panels"]] + [t["datasource"] for p in dash["panels"] for t in p["targets"]]
    assert all(ref == {"type": "prometheus", "uid": source["uid"]} for ref in refs)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_the_dashboard_shows_load_kv_throughput_and_latency_quantiles():
    exprs = dashboard_exprs()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert any(name in e for e in exprs), name
    for counter in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert any(f"rate({counter}" in e for e in exprs), counter
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        quantiles = [e for e in exprs if e.startswith("histogram_quantile(") and f"{histogram}_bucket" in e]
        assert len(quantiles) == 3, histogram  # p50, p90, p99


def test_the_server_command_parses():
    args = serve_args(["--host", "0.0.0.0", "--port", "8000", *services()["pagedllm"]["command"]])
    assert args.max_model_len == 4096 and args.shutdown_timeout < int(services()["pagedllm"]["stop_grace_period"][:-1])


def test_every_referenced_metric_is_exported(live_server):
    referenced = {
        name for expr in dashboard_exprs() + rule_exprs() + hpa_metric_names() for name in METRIC_NAME.findall(expr)
    }
    assert len(referenced) >= 10 and "vllm:num_requests_waiting" in referenced
    exported = {name for name, _ in metric_samples(live_server.server)}
    assert referenced - exported == set(), f"not on a live server's /metrics: {sorted(referenced - exported)}"
