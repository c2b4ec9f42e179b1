"""deploy/k8s: every overlay renders, passes the Kubernetes API schemas, and its parts agree
with each other and with sluice (ports, probe paths, secret keys, config paths, grace periods)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from engine.model_config import ModelConfig
from server.settings import Settings, load_settings
from tests.unit.deploy.dockerfile import parse
from tests.unit.deploy.k8s_render import K8S, OVERLAYS, Rendered, kustomize
from tests.unit.deploy.tools import ROOT

SCHEMA_VERSIONS = ["1.29", "1.33"]
PRE_STOP_MARGIN_S = 5


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param, kustomize(f"overlays/{request.param}"))


def settings_of(rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The Settings the sluice container builds: its env (secrets resolved) and mounted config."""
    config_path = Path(rendered.env("SLUICE_CONFIG_FILE")["value"])
    (mount,) = [
        m for m in rendered.container["volumeMounts"] if m["mountPath"] == str(config_path.parent)
    ]
    config_map = rendered.get(
        "ConfigMap", rendered.volume_source(mount["name"])["configMap"]["name"]
    )
    local = tmp_path / config_path.name
    local.write_text(config_map["data"][config_path.name])
    repository = tmp_path / "models"
    repository.mkdir()
    for entry in rendered.container["env"]:
        if "value" in entry:
            value = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            value = rendered.secret_value(ref["name"], ref["key"])
        monkeypatch.setenv(entry["name"], value)
    # Paths inside the container that do not exist here.
    monkeypatch.setenv("SLUICE_MODEL_REPOSITORY", str(repository))
    monkeypatch.delenv("SLUICE_CONFIG_FILE")
    image = parse(ROOT / "Dockerfile").final.env()
    monkeypatch.setenv("SLUICE_HOST", image["SLUICE_HOST"])
    return load_settings(local)


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_object_passes_the_api_schema(rendered: Rendered, version: str) -> None:
    for obj in rendered.objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_base_renders_on_its_own() -> None:
    kinds = sorted(o["kind"] for o in kustomize("base"))
    assert kinds == sorted(
        ["ConfigMap"] * 3 + ["Secret"] * 2 + ["Service"] * 2
        + ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "PersistentVolumeClaim"]
    )  # fmt: skip


def test_selectors_match_the_pod_labels(rendered: Rendered) -> None:
    deployment = rendered.deployment
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    for service in rendered.all("Service"):
        if service["metadata"]["name"].startswith("sluice-redis"):
            continue
        assert service["spec"]["selector"] == selector
    assert (
        rendered.get("PodDisruptionBudget", "sluice")["spec"]["selector"]["matchLabels"] == selector
    )
    for policy in rendered.all("NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            assert rule["from"][0]["podSelector"]["matchLabels"].items() <= labels.items()


def test_ports_and_probes_match_sluice(
    rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_of(rendered, tmp_path, monkeypatch)
    container = rendered.container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "http": settings.http_port,
        "grpc": settings.grpc_port,
        "metrics": settings.metrics.port,
    }
    probes = {
        kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {
        "startupProbe": ("/v2/health/live", "http"),
        "livenessProbe": ("/v2/health/live", "http"),
        "readinessProbe": ("/v2/health/ready", "http"),
    }
    for service in rendered.all("Service"):
        for port in service["spec"]["ports"]:
            if port["name"] in ports:
                assert (port["port"], port["targetPort"]) == (ports[port["name"]], port["name"])
    annotations = rendered.deployment["spec"]["template"]["metadata"]["annotations"]
    # Scraped on metrics.port, which asks for no key: on the HTTP port, bound beyond loopback
    # with keys, /metrics needs an admin key. No Service routes that port.
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
        str(settings.metrics.port),
        "/metrics",
    )
    assert settings.metrics.require_key is None
    routed = {p["targetPort"] for s in rendered.all("Service") for p in s["spec"]["ports"]}
    assert "metrics" not in routed
    assert settings.metrics.port not in routed


def test_grace_period_covers_pre_stop_and_drain(
    rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_of(rendered, tmp_path, monkeypatch)
    command = rendered.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = int(command[1])
    assert pre_stop_s > 0
    grace = rendered.pod["terminationGracePeriodSeconds"]
    assert pre_stop_s + settings.drain_timeout_s + PRE_STOP_MARGIN_S <= grace
    assert grace <= pre_stop_s + settings.drain_timeout_s + 30


def test_settings_share_redis_and_need_keys(
    rendered: Rendered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_of(rendered, tmp_path, monkeypatch)
    assert settings.host == "0.0.0.0"
    assert settings.allow_unauthenticated is False
    assert settings.auth.keys == []  # shipped empty: sluice refuses to start until keys are set
    assert (settings.cache.backend, settings.rate_limit.backend) == ("tiered", "redis")
    url = rendered.secret_value(
        rendered.generated("Secret", "sluice-redis")["metadata"]["name"], "url"
    )
    assert settings.cache.redis_url == settings.rate_limit.redis_url == url
    if rendered.name == "in-cluster-redis":
        service = rendered.get("Service", "sluice-redis")
        parts = urlsplit(url)
        assert parts.hostname == service["metadata"]["name"]
        assert parts.port in [p["port"] for p in service["spec"]["ports"]]


def test_references_resolve(rendered: Rendered) -> None:
    for entry in rendered.container["env"]:
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in rendered.get("Secret", ref["name"])["data"]
    for volume in rendered.pod["volumes"]:
        if "configMap" in volume:
            rendered.get("ConfigMap", volume["configMap"]["name"])
        if "persistentVolumeClaim" in volume:
            rendered.get("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    names = {v["name"] for v in rendered.pod["volumes"]}
    for container in rendered.pod["containers"] + rendered.pod["initContainers"]:
        assert {m["name"] for m in container["volumeMounts"]} <= names


def test_model_configs_are_valid(rendered: Rendered) -> None:
    configs = rendered.generated("ConfigMap", "sluice-model-configs")["data"]
    assert configs
    for key, text in configs.items():
        assert key.endswith(".yaml")
        config = ModelConfig(**yaml.safe_load(text))
        if rendered.name == "gpu":
            assert config.onnxruntime.execution_providers[0] == "TensorrtExecutionProvider"


def test_the_init_container_lays_out_what_sluice_mounts(rendered: Rendered) -> None:
    (init,) = rendered.pod["initContainers"]
    script = init["command"][1]
    store, configs, repository = init["command"][2:]
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert str(Path(script).parent) in mounts
    assert {store, configs, repository} <= set(mounts)
    assert mounts[store]["readOnly"] is True
    main = {m["mountPath"]: m["name"] for m in rendered.container["volumeMounts"]}
    # The repository's symlinks point into the store: the server must see it at the same path.
    assert main[store] == mounts[store]["name"]
    assert main[repository] == mounts[repository]["name"]
    assert rendered.env("SLUICE_MODEL_REPOSITORY")["value"] == repository
    assert init["image"] == rendered.container["image"]


def test_pods_run_as_the_image_user_locked_down(rendered: Rendered) -> None:
    user = parse(ROOT / "Dockerfile").final.one("USER").text
    context = rendered.pod["securityContext"]
    assert f"{context['runAsUser']}:{context['runAsGroup']}" == user
    assert context["runAsNonRoot"] is True
    for container in rendered.pod["containers"] + rendered.pod["initContainers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_autoscaling_and_disruption_budget(rendered: Rendered) -> None:
    hpa = rendered.get("HorizontalPodAutoscaler", "sluice")
    target = hpa["spec"]["scaleTargetRef"]
    deployment = rendered.deployment
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], deployment["kind"], deployment["metadata"]["name"],
    )  # fmt: skip
    pdb = rendered.get("PodDisruptionBudget", "sluice")
    # A node drain must be able to evict one pod while the budget still holds.
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["minAvailable"]
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert "cpu" in rendered.container["resources"]["requests"]  # utilisation needs a request
    if rendered.name in {"production", "gpu"}:
        assert metrics["Pods"]["pods"]["metric"]["name"] == "sluice_queue_depth"


def test_queue_depth_metric_is_one_sluice_exports_and_the_adapter_serves() -> None:
    values = yaml.safe_load(
        (K8S / "components/queue-depth-autoscaling/prometheus-adapter-values.yaml").read_text()
    )
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == "sluice_queue_depth"
    assert rule["seriesQuery"].startswith("sluice_queue_depth{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    metrics_source = (ROOT / "engine" / "metrics.py").read_text()
    assert re.search(r'"sluice_queue_depth",\s*"Requests waiting', metrics_source)


def test_gpu_overlay_asks_for_a_gpu_and_the_gpu_image() -> None:
    gpu = Rendered("gpu", kustomize("overlays/gpu"))
    assert gpu.container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu.container["image"].endswith("-gpu")
    assert gpu.pod["initContainers"][0]["image"] == gpu.container["image"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu.pod[
        "tolerations"
    ]
