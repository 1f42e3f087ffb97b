"""deploy/: the Grafana dashboard asks only for metrics the picker really exposes; the Kubernetes manifests render
with kustomize and validate offline; the container recipe, the compose file and the standalone Envoy's bootstrap
say what the picker needs (its config, its ports, its health services, its user)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from inferlb.envoyconf import EnvoyOptions, render_bootstrap
from inferlb.filter.server import HEALTH_SERVICES
from inferlb.metrics import prometheus_text
from inferlb.picker import SHUTDOWN_GRACE_S, create_picker
from inferlb.procs import ProcessError, find_tool, free_port
from inferlb.scorer.address import parse_address
from inferlb.scorer.config import Config, load_config, parse_config

from .conftest import envoy_accepts

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
VARIANTS = ("base", "inferencepool", "standalone", "shared")


def _kubectl() -> str | None:
    try:
        return find_tool("kubectl")
    except ProcessError:
        return None


KUBECTL = _kubectl()
# Kustomize is kubectl's (`kubectl kustomize`). Tests that render skip without it here, never on CI.
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None and not os.environ.get("CI"), reason="needs kubectl, for kustomize (.ci/run installs it)"
)
# The Kubernetes release whose API schemas (shipped in kubernetes-validate) the objects are checked against: the
# oldest minor still supported upstream when this was written (gRPC probes are GA since 1.27, PodDisruptionBudget
# policy/v1 since 1.21: older clusters take these files too).
KUBERNETES_VERSION = "1.35.0"
# How deploy/kubernetes/standalone/envoy.yaml is rendered from the picker's ConfigMap: Envoy in pods of its own,
# reaching the pickers through the headless Service's name, the servers through the Override Host cluster (only
# pool members). INFERLB_RENDER_DEPLOY=1 writes the file from them instead of comparing.
STANDALONE_ENVOY = EnvoyOptions(
    listen="0.0.0.0:8080",
    admin="127.0.0.1:9901",
    cluster_mode="override-host",
    picker_address="inferlb-picker-headless.llm.svc.cluster.local:9002",
)

# Objects of CRDs are not in kubernetes-validate's schemas: each is held to a small JSON Schema of the fields these
# manifests use, written from the CRD's documented v1 fields (Prometheus Operator; Gateway API Inference
# Extension v1). additionalProperties false, so that a misspelt field fails here instead of being dropped by the
# API server.
_DURATION = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h))+$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}}
_PORT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["number"],
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}


def _crd_object(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": spec,
        },
    }


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _crd_object(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": _LABELS},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                        },
                    },
                },
            },
        },
    ),
    "InferencePool": _crd_object(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {**_LABELS, "minProperties": 1}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string", "minLength": 1},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    # The CRD's own rule: a Service (the default kind) needs its port.
                    "if": {"not": {"properties": {"kind": {"not": {"const": "Service"}}}, "required": ["kind"]}},
                    "then": {"required": ["port"]},
                },
            },
        },
    ),
}


def kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [KUBECTL or "kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every variant, rendered once for the module."""
    return {variant: kustomize(KUBERNETES / variant) for variant in VARIANTS}


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def picker_config(objects: list[dict[str, Any]], tmp_path: Path) -> tuple[Path, Config]:
    """The picker's file, from the ConfigMap its Deployment mounts, written to ``tmp_path``, and parsed."""
    pod = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    data = one(objects, "ConfigMap", volume["configMap"]["name"])["data"]
    path = tmp_path / "picker.yaml"
    path.write_text(data["picker.yaml"], encoding="utf-8")
    return path, load_config(path)


def picker_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["spec"]["containers"]
    return container


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


async def test_every_dashboard_query_names_a_metric_the_picker_exposes() -> None:
    # create_picker builds gRPC servers, which belong to a running event loop.
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {m for e in exprs for m in re.findall(r"\b(inferlb_[a-z0-9_]+)", e)}
    config = parse_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "admin": f"127.0.0.1:{free_port()}",
            "otel": {"receiver": f"127.0.0.1:{free_port()}"},
            "pool": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000"}]},
            "experiments": [
                {
                    "name": "ab",
                    "arms": [
                        {"name": "a", "profile": "default", "weight": 0.5},
                        {"name": "b", "profile": "round-robin", "weight": 0.5},
                    ],
                }
            ],
        }
    )
    picker = create_picker(config)
    assert picker.spans is not None
    picker.spans.histograms.observe(0, 0.05, 1.2)
    log = picker.service.decisions  # one of each, so that every counter family has a sample
    log.by_endpoint["10.0.0.1:8000", "max-score"] += 1
    log.refused[404] += 1
    log.shed["batch"] += 1
    families = list(text_string_to_metric_families(prometheus_text(picker)))
    # A sample's name, or a family's: recording rules (deploy/prometheus/) name a histogram by its family.
    exposed = {s.name for f in families for s in f.samples} | {f.name for f in families if f.type == "histogram"}
    missing = sorted(n for n in names if n not in exposed)
    assert not missing, f"the dashboard queries metrics the picker does not expose: {missing}"
    heatmaps = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    assert len(heatmaps) >= 2


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_offline(manifests: dict[str, list[dict[str, Any]]], variant: str) -> None:
    objects = manifests[variant]
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), f"{variant}: an object is defined twice"
    for obj in objects:
        where = f"{variant}: {obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"].get("namespace") == "llm", f"{where} is not in the namespace discovery watches"
        schema = CRD_SCHEMAS.get(obj["kind"])
        try:
            if schema is not None:
                jsonschema.Draft202012Validator(schema).validate(obj)
            else:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{where}: {path}: {exc.message}")


@needs_kubectl
def test_the_pickers_configmap_passes_config_check(manifests: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    path, config = picker_config(manifests["base"], tmp_path)
    result = subprocess.run(
        [find_tool("inferlb"), "config", "check", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for variant in VARIANTS:  # the overlays change nothing in it (the shared one adds its replicas)
        (tmp_path / variant).mkdir()
        overlay = picker_config(manifests[variant], tmp_path / variant)[1]
        assert (replace(overlay, replicas=None) if variant == "shared" else overlay) == config
    # What "In Kubernetes" (README.md) asks for: reachable from other pods, the pool from the API server.
    assert parse_address(config.listen)[0] == "0.0.0.0" and config.admin is not None
    assert parse_address(config.admin)[0] == "0.0.0.0"
    assert config.discovery is not None and config.discovery.kubernetes is not None and not config.endpoints
    for pod_ip in ("10.244.1.7", "10.42.0.9", "10.8.3.4"):  # kubeadm's, k3s' and a cloud's Pod networks
        assert config.allowed_networks.contains(pod_ip)
    assert config.inflight.end == "stream"  # a gateway sends no access log; each replica counts its own requests


@needs_kubectl
def test_the_picker_runs_unprivileged_as_the_images_user(manifests: dict[str, list[dict[str, Any]]]) -> None:
    for variant in VARIANTS:
        pod = one(manifests[variant], "Deployment", "inferlb-picker")["spec"]["template"]["spec"]
        container = picker_container(manifests[variant])
        assert container["command"] == ["inferlb", "serve", "--config", "/etc/inferlb/picker.yaml"]
        context = {**pod["securityContext"], **container["securityContext"]}
        assert context["runAsNonRoot"] is True and context["runAsUser"] == container_user()[0] != 0
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]} and not context.get("privileged")
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        resources = container["resources"]
        assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/etc/inferlb"]["readOnly"] is True and "subPath" not in mounts["/etc/inferlb"]


@needs_kubectl
def test_the_probes_ask_the_pickers_grpc_health_services_on_its_port(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, config = picker_config(manifests["base"], tmp_path)
    container = picker_container(manifests["base"])
    port = parse_address(config.listen)[1]
    probes = {name: container[f"{name}Probe"]["grpc"] for name in ("startup", "readiness", "liveness")}
    assert probes == {
        "startup": {"port": port, "service": "liveness"},
        "readiness": {"port": port, "service": "readiness"},
        "liveness": {"port": port, "service": "liveness"},
    }
    assert {"readiness", "liveness"} <= set(HEALTH_SERVICES)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": port, "admin": parse_address(config.admin or "")[1]}


@needs_kubectl
def test_the_kubelet_waits_out_the_drain(manifests: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    _, config = picker_config(manifests["base"], tmp_path)
    deployment = one(manifests["base"], "Deployment", "inferlb-picker")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > config.drain_s + SHUTDOWN_GRACE_S
    budget = one(manifests["base"], "PodDisruptionBudget", "inferlb-picker")["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(budget["selector"]["matchLabels"], labels)
    assert 0 < budget["minAvailable"] < deployment["spec"]["replicas"]


@needs_kubectl
def test_rbac_grants_exactly_list_and_watch_on_what_discovery_watches(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = manifests["base"]
    _, config = picker_config(objects, tmp_path)
    assert config.discovery is not None and config.discovery.kubernetes is not None
    source = config.discovery.kubernetes
    watched = ("", "pods") if source.service is None else ("discovery.k8s.io", "endpointslices")
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == source.namespace
    assert role["rules"] == [{"apiGroups": [watched[0]], "resources": [watched[1]], "verbs": ["list", "watch"]}]
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = one(objects, "RoleBinding")
    account = one(manifests["base"], "Deployment", "inferlb-picker")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "inferlb-picker"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": source.namespace}]
    one(objects, "ServiceAccount", account)


@needs_kubectl
def test_the_admin_token_is_a_file_from_a_secret(manifests: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    objects = manifests["base"]
    path, _ = picker_config(objects, tmp_path)
    token_file = Path(yaml.safe_load(path.read_text())["admin_auth"]["token_file"])
    container = picker_container(objects)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(token_file.parent))
    pod = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["spec"]
    secret = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert token_file.name in [item["path"] for item in secret["items"]]
    assert not [o for o in objects if o["kind"] == "Secret"]  # the token is never in these files


@needs_kubectl
def test_prometheus_scrapes_the_admin_port_of_the_pickers_service(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = manifests["base"]
    _, config = picker_config(objects, tmp_path)
    service = one(objects, "Service", "inferlb-picker")
    labels = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["metadata"]["labels"]
    assert matches(service["spec"]["selector"], labels)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {
        "grpc": (parse_address(config.listen)[1], "grpc"),
        "admin": (parse_address(config.admin or "")[1], "admin"),
    }
    monitor = one(objects, "ServiceMonitor")["spec"]
    assert matches(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [(e["port"], e["path"]) for e in monitor["endpoints"]] == [("admin", "/metrics")]


@needs_kubectl
def test_the_inferencepool_selects_what_the_picker_discovers_and_names_its_service(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = manifests["inferencepool"]
    _, config = picker_config(objects, tmp_path)
    assert config.discovery is not None and config.discovery.kubernetes is not None
    source = config.discovery.kubernetes
    pool = one(objects, "InferencePool")
    assert pool["metadata"]["namespace"] == source.namespace
    assert pool["spec"]["selector"]["matchLabels"] == source.selector
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == list(source.target_ports or ())
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", ref["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert (ref["kind"], ref["port"]["number"]) == ("Service", grpc["port"])
    assert ref["failureMode"] == "FailOpen"


@needs_kubectl
def test_a_name_prefix_renames_the_inferencepools_reference_too(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    base = os.path.relpath(KUBERNETES / "inferencepool", overlay)  # kustomize refuses absolute paths
    (overlay / "kustomization.yaml").write_text(f"resources: [{base}]\nnamePrefix: team-a-\n")
    objects = kustomize(overlay)
    ref = one(objects, "InferencePool")["spec"]["endpointPickerRef"]["name"]
    assert ref == "team-a-inferlb-picker"
    one(objects, "Service", ref)


def admitted(objects: list[dict[str, Any]], labels: dict[str, str], port: int) -> list[dict[str, Any]] | None:
    """The sources the NetworkPolicies among ``objects`` admit to ``port`` of the Pods labelled ``labels``: None when
    no policy isolates those Pods' ingress (then any Pod may connect), else the peers of every rule that covers the
    port, a rule without ``from`` counting as the peer {} (anyone)."""
    policies = [
        o["spec"]
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and all(labels.get(k) == v for k, v in o["spec"]["podSelector"].get("matchLabels", {}).items())
        and not o["spec"]["podSelector"].get("matchExpressions")
        and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return None
    return [
        peer
        for policy in policies
        for rule in policy.get("ingress", ())
        if not rule.get("ports") or port in [p.get("port") for p in rule["ports"]]
        for peer in rule.get("from") or [{}]
    ]


def admits_anyone(peer: dict[str, Any]) -> bool:
    """A NetworkPolicy peer that lets in more than chosen Pods: anyone ({}), every Pod of the namespace (an empty
    podSelector alone), every namespace (an empty namespaceSelector, with or without a podSelector: anyone may
    label a Pod of their own), or an ipBlock of the whole address space."""

    def empty(selector: dict[str, Any] | None) -> bool:
        return selector is not None and not selector.get("matchLabels") and not selector.get("matchExpressions")

    if not peer:
        return True
    if "ipBlock" in peer:
        return peer["ipBlock"]["cidr"].endswith("/0")
    if "namespaceSelector" in peer:
        return empty(peer["namespaceSelector"])
    return empty(peer.get("podSelector"))


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_gateway_reaches_the_pickers_grpc_port_and_only_prometheus_their_admin_port(
    manifests: dict[str, list[dict[str, Any]]], variant: str, tmp_path: Path
) -> None:
    objects = manifests[variant]
    _, config = picker_config(objects, tmp_path)
    grpc_port, admin_port = parse_address(config.listen)[1], parse_address(config.admin or "")[1]
    labels = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["metadata"]["labels"]
    for port in (grpc_port, admin_port):
        sources = admitted(objects, labels, port)
        assert sources is not None, f"{variant}: no NetworkPolicy selects the pickers: any Pod reaches port {port}"
        assert sources, f"{variant}: nothing reaches port {port}, Prometheus or the gateway included"
        assert not [s for s in sources if admits_anyone(s)], f"{variant}: port {port} is open to anyone: {sources}"
    # No other port: every rule names its ports, and they are these two.
    policy = one(objects, "NetworkPolicy", "inferlb-picker")["spec"]
    assert matches(policy["podSelector"]["matchLabels"], labels)
    for rule in policy["ingress"]:
        assert rule.get("ports") and {p["port"] for p in rule["ports"]} <= {grpc_port, admin_port}
    # The gateway: the operator's (Pods chosen by their labels), or the standalone variants' own Envoy.
    gateway = admitted(objects, labels, grpc_port) or []
    if variant in ("standalone", "shared"):
        envoy = one(objects, "Deployment", "inferlb-envoy")["spec"]["template"]["metadata"]["labels"]
        assert [set(s) for s in gateway] == [{"podSelector"}]
        assert matches(gateway[0]["podSelector"]["matchLabels"], envoy)
    else:
        assert all(s.get("podSelector", {}).get("matchLabels") for s in gateway)
        assert not [s for s in gateway if matches(s["podSelector"]["matchLabels"], labels)]
    # Prometheus: the same Pods, of a namespace chosen by its labels, in every variant.
    prometheus = admitted(objects, labels, admin_port) or []
    assert prometheus == admitted(manifests["base"], labels, admin_port)
    for source in prometheus:
        assert source["namespaceSelector"]["matchLabels"] and source["podSelector"]["matchLabels"]
        assert source not in gateway


def render_standalone_bootstrap(picker_file: Path) -> str:
    return render_bootstrap(load_config(picker_file), STANDALONE_ENVOY)


@needs_kubectl
@pytest.mark.envoy
def test_the_standalone_bootstrap_is_what_inferlb_renders_today(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = manifests["standalone"]
    path, _ = picker_config(objects, tmp_path)
    committed = KUBERNETES / "standalone" / "envoy.yaml"
    expected = render_standalone_bootstrap(path)
    if os.environ.get("INFERLB_RENDER_DEPLOY"):
        committed.write_text(expected, encoding="utf-8")
    assert committed.read_text(encoding="utf-8") == expected, (
        "deploy/kubernetes/standalone/envoy.yaml is stale: render it again (deploy/README.md)"
    )
    pod = one(objects, "Deployment", "inferlb-envoy")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "bootstrap")
    assert one(objects, "ConfigMap", volume["configMap"]["name"])["data"]["envoy.yaml"] == expected
    envoy_accepts(committed)


@needs_kubectl
def test_the_standalone_envoy_reaches_every_picker_and_only_it_reaches_their_grpc_port(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    objects = manifests["standalone"]
    host, port = (STANDALONE_ENVOY.picker_address or "").rsplit(":", 1)
    name, namespace, *_ = host.split(".")
    headless = one(objects, "Service", name)
    assert headless["metadata"]["namespace"] == namespace and headless["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [int(port)]
    picker_labels = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["metadata"]["labels"]
    assert matches(headless["spec"]["selector"], picker_labels)

    envoy = one(objects, "Deployment", "inferlb-envoy")["spec"]["template"]
    (container,) = envoy["spec"]["containers"]
    assert container["command"][:3] == ["envoy", "-c", "/etc/envoy/envoy.yaml"]
    assert container["image"] == picker_container(objects)["image"]  # the Envoy the bootstrap is tested with
    listen_port = parse_address(STANDALONE_ENVOY.listen)[1]
    assert [p["containerPort"] for p in container["ports"]] == [listen_port]
    context = {**envoy["spec"]["securityContext"], **container["securityContext"]}
    assert context["runAsNonRoot"] is True and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"] == {"drop": ["ALL"]} and context["allowPrivilegeEscalation"] is False
    entry = one(objects, "Service", "inferlb-envoy")
    assert matches(entry["spec"]["selector"], envoy["metadata"]["labels"])

    (source,) = admitted(objects, picker_labels, int(port)) or [{}]
    assert set(source) == {"podSelector"}  # Envoy's Pods, of this namespace
    assert matches(source["podSelector"]["matchLabels"], envoy["metadata"]["labels"])


def containerfile_stages() -> list[list[tuple[str, str]]]:
    """deploy/Containerfile as stages of (instruction, arguments), continuation lines joined."""
    text = (DEPLOY / "Containerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, arguments = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), arguments.strip()))
    return stages


def container_user() -> tuple[int, int]:
    (user,) = [a for i, a in containerfile_stages()[-1] if i == "USER"]
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def test_the_container_recipe_builds_the_wheel_and_runs_the_picker_unprivileged() -> None:
    args, *stages = containerfile_stages()
    build, final = stages[0], stages[-1]
    assert len(stages) == 2, "a build stage and the image"
    (python,) = [a.split("=", 1)[1] for i, a in args if i == "ARG" and a.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"python:3\.11-slim", python)
    assert [a for i, a in build if i == "FROM"] == ["${PYTHON_IMAGE} AS build"]
    assert [a for i, a in final if i == "FROM"] == ["${PYTHON_IMAGE}"]
    assert any(i == "RUN" and a.startswith("pip wheel") for i, a in build)
    (install,) = [a for i, a in final if i == "RUN"]
    assert "--no-index" in install and "from=build" in install  # only the built wheels go in
    for i, a in build:
        if i == "COPY":  # everything the wheel is built from exists (paths relative to the repository's root)
            for source in a.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
    uid, gid = container_user()
    assert uid != 0 and gid != 0
    command = [*json.loads(dict(final)["ENTRYPOINT"]), *json.loads(dict(final)["CMD"])]
    assert command == ["inferlb", "serve", "--config", "/etc/inferlb/picker.yaml"]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    return loaded


def bind_mounts(service: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    for volume in service.get("volumes", ()):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            yield (DEPLOY / source).resolve(), target


def test_the_compose_file_runs_envoy_the_picker_two_servers_and_prometheus() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"envoy", "picker", "vllm-0", "vllm-1", "prometheus"}
    built = doc["x-inferlb"]["build"]
    assert (DEPLOY / built["context"] / built["dockerfile"]).resolve() == DEPLOY / "Containerfile"
    for name, service in services.items():
        for source, _ in bind_mounts(service):
            assert source.is_file(), f"{name}: {source} does not exist"
    address = {name: s["networks"]["inferlb"]["ipv4_address"] for name, s in services.items()}

    picker_file = dict((t, s) for s, t in bind_mounts(services["picker"]))["/etc/inferlb/picker.yaml"]
    config = load_config(picker_file)
    servers = []
    for name in ("vllm-0", "vllm-1"):
        argv = services[name]["command"]
        listen = argv[argv.index("--listen") + 1]
        assert parse_address(listen)[0] == address[name]
        assert argv[argv.index("--otlp-endpoint") + 1] == f"http://{config.otel.receiver}"
        servers.append(listen)
    assert [e.address for e in config.endpoints] == servers
    assert parse_address(config.listen)[0] == address["picker"]  # Envoy, elsewhere, is pointed at this address

    prometheus_file = dict((t, s) for s, t in bind_mounts(services["prometheus"]))["/etc/prometheus/prometheus.yml"]
    jobs = {j["job_name"]: j for j in yaml.safe_load(prometheus_file.read_text())["scrape_configs"]}
    admin_port = parse_address(config.admin or "")[1]
    assert jobs["inferlb-picker"]["static_configs"][0]["targets"] == [f"{address['picker']}:{admin_port}"]
    assert jobs["vllm"]["static_configs"][0]["targets"] == servers


@pytest.mark.envoy
def test_the_compose_envoy_renders_a_bootstrap_envoy_accepts(tmp_path: Path) -> None:
    envoy = compose()["services"]["envoy"]
    assert envoy["entrypoint"] == ["sh", "-c"]
    render, run = envoy["command"][0].split("&&")
    mounts = {target: source for source, target in bind_mounts(envoy)}
    argv = [mounts.get(a, str(tmp_path / "envoy.yaml") if a == "/tmp/envoy.yaml" else a) for a in shlex.split(render)]
    assert argv[:2] == ["inferlb", "envoy-config"]
    result = subprocess.run([find_tool("inferlb"), *argv[1:]], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert shlex.split(run)[:4] == ["exec", "envoy", "-c", "/tmp/envoy.yaml"]
    envoy_accepts(tmp_path / "envoy.yaml")


@needs_kubectl
def test_the_shared_replicas_reach_a_redis_only_they_reach_with_secrets_from_secrets(
    manifests: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    objects = manifests["shared"]
    path, config = picker_config(objects, tmp_path)
    assert config.replicas is not None
    # The replicas' Redis is the Service of redis.yaml, at its port.
    url = urlsplit(config.replicas.url)
    name, namespace, *_ = (url.hostname or "").split(".")
    service = one(objects, "Service", name)
    assert service["metadata"]["namespace"] == namespace and [p["port"] for p in service["spec"]["ports"]] == [url.port]
    redis = one(objects, "Deployment", name)["spec"]["template"]
    assert matches(service["spec"]["selector"], redis["metadata"]["labels"])
    (server,) = redis["spec"]["containers"]
    assert server["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    secret_of = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in server["env"]}
    assert secret_of["REDIS_PASSWORD"] == {"name": "inferlb-redis", "key": "password"}
    context = {**redis["spec"]["securityContext"], **server["securityContext"]}
    assert context["runAsNonRoot"] is True and context["readOnlyRootFilesystem"] is True
    # The pickers read the same password from a file, and share one secret hash seed.
    assert config.replicas.password is not None
    password_file = Path(yaml.safe_load(path.read_text())["replicas"]["password"]["token_file"])
    container = picker_container(objects)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(password_file.parent))
    pod = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]
    assert volume["secretName"] == "inferlb-redis" and password_file.name in [i["path"] for i in volume["items"]]
    env = {e["name"]: e for e in container["env"]}
    assert env["PYTHONHASHSEED"]["valueFrom"]["secretKeyRef"] == {"name": "inferlb-hashseed", "key": "seed"}
    assert not [o for o in objects if o["kind"] == "Secret"]
    # Only the pickers reach Redis.
    policy = one(objects, "NetworkPolicy", "inferlb-redis")["spec"]
    assert matches(policy["podSelector"]["matchLabels"], redis["metadata"]["labels"])
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    picker_labels = one(objects, "Deployment", "inferlb-picker")["spec"]["template"]["metadata"]["labels"]
    assert matches(source["podSelector"]["matchLabels"], picker_labels)
    assert rule["ports"] == [{"port": url.port, "protocol": "TCP"}]
    # The overlay's picker.yaml is the base's with the replicas section added, nothing else.
    base = yaml.safe_load((KUBERNETES / "base" / "picker.yaml").read_text())
    shared = yaml.safe_load((KUBERNETES / "shared" / "picker.yaml").read_text())
    assert {k: v for k, v in shared.items() if k != "replicas"} == base
