"""deploy/k8s/: every manifest validates against a pinned Kubernetes version's schemas (strict:
an unknown or misspelt field fails), and the manifests agree with each other and the server."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest

from .conftest import DEPLOY, serve_args, yaml_docs

K8S_VERSION = "1.33.0"  # the schemas ship in the kubernetes-validate wheel: no network
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def resources() -> dict[str, dict]:
    """kind -> the one manifest of that kind."""
    found = {doc["kind"]: doc for path in MANIFESTS for doc in yaml_docs(path)}
    assert set(found) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"}
    return found


def container() -> dict:
    [main] = resources()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return main


def test_the_pinned_schemas_ship_with_the_package():
    """Validation reads these files; nothing is fetched."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{K8S_VERSION}-local-strict"
    assert (schemas / "horizontalpodautoscaler-autoscaling-v2.json").is_file()


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path):
    for doc in yaml_docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_catches_a_misspelt_field():
    deployment = copy.deepcopy(resources()["Deployment"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_service_and_autoscaler_target_the_deployment():
    res = resources()
    deployment, service, hpa = res["Deployment"], res["Service"], res["HorizontalPodAutoscaler"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container()["ports"]}
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    [signal] = hpa["spec"]["metrics"]
    assert signal["type"] == "Pods" and signal["pods"]["metric"]["name"] == "vllm:num_requests_waiting"


def test_probes_resources_and_model_volume():
    res = resources()
    main = container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert {"cpu", "memory"} <= main["resources"]["requests"].keys() <= main["resources"]["limits"].keys()
    volumes = {v["name"]: v for v in res["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    [models] = [m for m in main["volumeMounts"] if m["mountPath"] == "/models"]
    claim = volumes[models["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == res["PersistentVolumeClaim"]["metadata"]["name"]


def test_the_container_args_parse():
    """The image's entrypoint flags and the manifest's args, $(VAR) expanded as the kubelet does."""
    env = {e["name"]: e["value"] for e in container()["env"]}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container()["args"]]
    parsed = serve_args(["--host", "0.0.0.0", "--port", "8000", *args])
    assert parsed.model == "/models/model" and parsed.served_model_name == [env["SERVED_MODEL_NAME"]]
    assert parsed.max_model_len == 4096
    grace = resources()["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert parsed.shutdown_timeout < grace  # the drain finishes before the kubelet's SIGKILL
