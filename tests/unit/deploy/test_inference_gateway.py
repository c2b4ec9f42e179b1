"""deploy/k8s/inference-gateway: sluice behind a Gateway API inference gateway. The Kubernetes
objects pass the API schemas; the InferencePool and HTTPRoute (CRDs, which those schemas do not
hold) agree with the sluice pods and the endpoint picker, whose metric flags name the
sluice_gateway_* gauges sluice exports, on the port that serves /metrics without a key."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest

from engine.generation.gateway_metrics import GatewayCollector
from tests.unit.deploy.k8s_render import Rendered, kustomize
from tests.unit.deploy.test_kubernetes import SCHEMA_VERSIONS

CRDS = {"InferencePool", "HTTPRoute"}
METRIC_FLAGS = {
    "total-queued-requests-metric": "sluice_gateway_queued_requests",
    "total-running-requests-metric": "sluice_gateway_running_requests",
    "kv-cache-usage-percentage-metric": "sluice_gateway_kv_cache_usage_ratio",
    "lora-info-metric": "sluice_gateway_lora_requests_info",
}


@pytest.fixture(scope="module")
def gateway() -> Rendered:
    return Rendered("inference-gateway", kustomize("inference-gateway"))


@pytest.fixture(scope="module")
def sluice() -> Rendered:
    return Rendered("production", kustomize("overlays/production"))


def epp_args(gateway: Rendered) -> dict[str, str]:
    (container,) = gateway.get("Deployment", "sluice-epp")["spec"]["template"]["spec"]["containers"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_the_kubernetes_objects_pass_the_api_schema(gateway: Rendered, version: str) -> None:
    assert {o["kind"] for o in gateway.objects} >= CRDS
    for obj in gateway.objects:
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_pool_is_the_sluice_pods_and_its_picker(gateway: Rendered, sluice: Rendered) -> None:
    pool = gateway.get("InferencePool", "sluice")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    pod_labels = sluice.deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in sluice.container["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}]
    picker = pool["spec"]["endpointPickerRef"]
    service = gateway.get("Service", picker["name"])
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    epp = gateway.get("Deployment", "sluice-epp")
    pod = epp["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    epp_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = epp_args(gateway)
    assert epp_ports[grpc["targetPort"]] == int(args["grpc-port"]) == picker["port"]["number"]
    assert args["pool-name"] == pool["metadata"]["name"]
    assert (
        pod["spec"]["serviceAccountName"]
        == gateway.get("RoleBinding", "sluice-epp")["subjects"][0]["name"]
    )
    (route,) = gateway.all("HTTPRoute")
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "sluice"}
    ]


def test_the_picker_reads_sluice_gateway_metrics(gateway: Rendered, sluice: Rendered) -> None:
    args = epp_args(gateway)
    exported = {family.name for family in GatewayCollector(lambda: {"models": []}).collect()}
    for flag, name in METRIC_FLAGS.items():
        match = re.fullmatch(r"(\w+)\{model=([\w.-]+)\}", args[flag])
        assert match is not None, args[flag]  # the picker's `name{label=value}` form
        assert match[1] == name
        assert name in exported
    # Scraped where /metrics asks for no key (sluice's metrics.port), not the pool's port.
    ports = {p["name"]: p["containerPort"] for p in sluice.container["ports"]}
    assert int(args["model-server-metrics-port"]) == ports["metrics"]
