"""deploy/k8s/model-affinity: each model's requests to one pod through ingress-nginx. The Ingress
passes the API schemas and reaches the sluice Service's HTTP port; the controller's http-snippet
defines the hash key with the very maps of deploy/nginx.conf (whose behaviour a real nginx tests in
test_nginx_affinity.py), affinity on."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy.k8s_render import K8S, Rendered, kustomize
from tests.unit.deploy.test_kubernetes import SCHEMA_VERSIONS
from tests.unit.deploy.tools import DEPLOY


@pytest.fixture(scope="module")
def affinity() -> Rendered:
    return Rendered("model-affinity", kustomize("model-affinity"))


def nginx_maps(text: str) -> list[str]:
    """The lines from the `$affinity_by_model` map to the end of the `$model_hash_key` map,
    stripped of indentation."""
    lines = [line.strip() for line in text.splitlines()]
    start = lines.index('map "" $affinity_by_model {')
    end = lines.index('map "$affinity_by_model $uri" $model_hash_key {')
    end += lines[end:].index("}")
    return lines[start : end + 1]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_the_ingress_passes_the_api_schema(affinity: Rendered, version: str) -> None:
    assert [o["kind"] for o in affinity.objects] == ["Ingress"]
    kubernetes_validate.validate(affinity.objects[0], version, strict=True)


def test_the_ingress_hashes_on_the_model_to_the_sluice_http_port(affinity: Rendered) -> None:
    sluice = Rendered("production", kustomize("overlays/production"))
    ingress = affinity.get("Ingress", "sluice-model-affinity")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == (
        "$model_hash_key"
    )
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    service = sluice.get("Service", backend["name"])
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert backend["port"]["name"] == "http"


def test_the_controller_defines_the_key_as_deploy_nginx_conf_does_with_affinity_on() -> None:
    values = yaml.safe_load((K8S / "model-affinity" / "ingress-nginx-values.yaml").read_text())
    snippet = nginx_maps(values["controller"]["config"]["http-snippet"])
    conf = nginx_maps((DEPLOY / "nginx.conf").read_text())
    assert conf[1] == "default off;"
    assert snippet == [conf[0], "default on;", *conf[2:]]
