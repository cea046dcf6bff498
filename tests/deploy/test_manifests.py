"""The deployment files: deploy/k8s/ against the Kubernetes JSON schemas (kubernetes-validate, strict: an unknown
field fails), deploy/compose.yaml against the Compose specification's schema (check-jsonschema's bundled copy), both
offline; and the facts the files must agree on with each other, the server and the image."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = ("deployment.yaml", "service.yaml", "hpa.yaml", "pdb.yaml")
# The oldest Kubernetes the files are for (the preStop `sleep` action is on by default from 1.30) and the newest
# schema kubernetes-validate bundles.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
MEASURED_PEAK_MIB = 324  # docs/how-to/deploy.md, Sizing: models/default, 4,096-token runs and a full token cache


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def resource(kind: str, name: str = "elmo") -> dict:
    for file in MANIFESTS:
        for document in documents(file):
            if document["kind"] == kind and document["metadata"]["name"] == name:
                return document
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def flags(args: list[str]) -> dict[str, str]:
    """``["--port=50051", "--model", "DIR"]`` -> {"--port": "50051", "--model": "DIR"}."""
    out, pending = {}, None
    for arg in args:
        if pending:
            out[pending], pending = arg, None
        elif "=" in arg:
            key, _, value = arg.partition("=")
            out[key] = value
        elif arg.startswith("--"):
            pending = arg
    return out


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("file", MANIFESTS)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(file, version):
    for document in documents(file):
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_refuses_a_misspelt_field():
    pdb = resource("PodDisruptionBudget")
    pdb["spec"]["maxUnavailabel"] = pdb["spec"].pop("maxUnavailable")
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        kubernetes_validate.validate(pdb, VERSIONS[-1], strict=True)
    assert "maxUnavailabel" in info.value.message


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(MANIFESTS)
    assert sorted(p.name for p in K8S.glob("*.yaml")) == sorted([*MANIFESTS, "kustomization.yaml"])


def test_the_deployment_probes_grpc_health_drains_and_is_sized_from_the_measurements():
    deployment = resource("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = flags(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(args["--port"]),
        "http": int(args["--http-port"]),
        "metrics": int(args["--metrics-port"]),
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": ports["grpc"]}, probe  # grpc.health.v1, Kubernetes' own probe
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    delay = float(args["--shutdown-delay-s"])
    assert delay >= 3  # deploy/haproxy.cfg takes a replica out about 2 s after its health says NOT_SERVING
    assert pod["terminationGracePeriodSeconds"] > pre_stop + delay + float(args["--drain-timeout-s"])
    memory = container["resources"]["requests"]["memory"]
    assert memory.endswith("Mi") and int(memory[:-2]) >= 1.25 * MEASURED_PEAK_MIB
    assert args["--threads"] == container["resources"]["requests"]["cpu"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    assert (REPO / args["--model"].removeprefix("/app/")).is_dir()  # the image copies models/default to /app/


def test_services_hpa_and_pdb_select_the_deployment():
    labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    for name in ("elmo", "elmo-headless"):
        service = resource("Service", name)
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= {"grpc", "http", "metrics"}
    assert resource("Service", "elmo-headless")["spec"]["clusterIP"] == "None"
    assert resource("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = resource("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "elmo"}
    assert hpa["spec"]["minReplicas"] > resource("PodDisruptionBudget")["spec"]["maxUnavailable"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f'"{name}"' in (REPO / "service" / "telemetry" / "metrics.py").read_text()  # a metric the server exports


# -- compose ---------------------------------------------------------------------------------------------------------
def test_compose_is_valid_against_the_compose_schema(tmp_path):
    def check(path: Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    done = check(DEPLOY / "compose.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text((DEPLOY / "compose.yaml").read_text().replace("stop_grace_period:", "stop_grace_periode:"))
    assert check(broken).returncode != 0  # the schema refuses an unknown key


def test_compose_agrees_with_haproxy_cfg_and_the_dockerfile():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    cfg = (DEPLOY / "haproxy.cfg").read_text()
    hosts = dict(re.findall(r"\$\{ELMO(\d)_HOST-([\w.-]+)\}", cfg))
    grpc_port = set(re.findall(r"\$\{ELMO\d_GRPC_PORT-(\d+)\}", cfg))
    http_port = set(re.findall(r"\$\{ELMO\d_HTTP_PORT-(\d+)\}", cfg))
    replicas = sorted(hosts.values())
    assert replicas == ["elmo1", "elmo2", "elmo3"] and len(grpc_port) == len(http_port) == 1
    dockerfile = (REPO / "Dockerfile").read_text()
    exposed = set(re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split())
    for name in replicas:
        service = compose["services"][name]
        assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == REPO / "Dockerfile"
        args = flags(service["command"])
        assert {args["--port"], args["--http-port"]} == grpc_port | http_port and args["--host"] == "0.0.0.0"
        assert {args["--port"], args["--http-port"], args["--metrics-port"]} <= exposed
        delay, drain = float(args["--shutdown-delay-s"]), float(args["--drain-timeout-s"])
        assert delay >= 3 and int(service["stop_grace_period"].removesuffix("s")) > delay + drain
    haproxy = compose["services"]["haproxy"]
    (volume,) = haproxy["volumes"]
    source, target, _ = volume.split(":")
    assert (DEPLOY / source).resolve() == DEPLOY / "haproxy.cfg" and target == "/usr/local/etc/haproxy/haproxy.cfg"
    binds = re.findall(r'bind "\$\{ELMO_LB_\w+-:(\d+)\}"', cfg)
    assert sorted(p.split(":")[1] for p in haproxy["ports"]) == sorted(binds)
    assert set(haproxy["depends_on"]) == set(replicas)
    assert all(v == {"condition": "service_healthy"} for v in haproxy["depends_on"].values())
