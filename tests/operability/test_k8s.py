"""deploy/k8s: every overlay renders, validates against the Kubernetes schemas, and hangs
together (volumes, config, probes, socket and arena paths, identity annotations)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.core.config import load_config
from kvtier.server.daemon import admin_credentials, is_loopback, split_address
from kvtier.server.http_port import HEALTH_PATH
from tests.operability.kustomize import Doc, build, normalise

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ["sidecar", "daemonset", "s3", "gcs"]
KUBERNETES = "1.30.0"  # native sidecars (initContainers with restartPolicy) are on by default
WORKLOADS = {"Deployment", "DaemonSet"}


def _render(overlay: str) -> list[Doc]:
    return build(K8S / "overlays" / overlay)


def _one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def _config(docs: list[Doc], tmp_path: Path) -> Any:
    text = _one(docs, "ConfigMap", "kvtier-config")["data"]["kvtier.yaml"]
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return load_config(path)


def _mount_dir(container: dict[str, Any], path: Path) -> str | None:
    """The volume a container sees ``path`` through."""
    best = None
    for mount in container.get("volumeMounts", []):
        if path.is_relative_to(mount["mountPath"]) and (
            best is None or len(mount["mountPath"]) > len(best["mountPath"])
        ):
            best = mount
    return None if best is None else str(best["name"])


@pytest.mark.parametrize("overlay", [*OVERLAYS, "monitoring"])
def test_manifests_validate_against_the_kubernetes_schemas(overlay: str) -> None:
    directory = K8S / overlay if overlay == "monitoring" else K8S / "overlays" / overlay
    docs = build(directory)
    assert docs
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":  # a CRD: no schema in the package
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_validation_refuses_a_broken_manifest() -> None:
    deployment = _one(_render("sidecar"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_hang_together(overlay: str, tmp_path: Path) -> None:
    docs = _render(overlay)
    config = _config(docs, tmp_path)
    assert _one(docs, "ServiceAccount", "kvtier")
    service = _one(docs, "Service", "kvtier-metrics")
    metrics_port = int(config.server.metrics_address.rpartition(":")[2])
    # operators call the admin API from inside the pod: its token never crosses the network
    assert is_loopback(split_address(config.server.admin_address, "server.admin_address")[0])
    assert not config.server.allow_insecure_token
    assert service["spec"]["ports"][0]["port"] == metrics_port
    kvtier_pods = []
    for workload in [d for d in docs if d["kind"] in WORKLOADS]:
        template = workload["spec"]["template"]
        pod = template["spec"]
        labels = template["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        containers = _containers(pod)
        for container in containers.values():
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, (container["name"], mount["name"])
            assert container["resources"]["limits"]["memory"], container["name"]
        for volume in volumes.values():
            if "configMap" in volume:
                assert _one(docs, "ConfigMap", volume["configMap"]["name"])
        if "kvtier" not in containers:
            # an engine of the node daemon: the daemon's socket and arena at its paths
            vllm = containers["vllm"]
            for path in (config.server.socket_path, config.arena.path):
                name = _mount_dir(vllm, path)
                assert name is not None, path
                assert volumes[name]["hostPath"]["path"]
            continue
        kvtier_pods.append(workload)
        assert service["spec"]["selector"].items() <= labels.items()
        assert pod["serviceAccountName"] == "kvtier"
        daemon = containers["kvtier"]
        ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
        assert ports["kvtier-metrics"] == metrics_port
        assert "kvtier-admin" not in ports  # on loopback: nothing outside the pod reaches it
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert daemon[probe]["httpGet"] == {"path": HEALTH_PATH, "port": metrics_port}, probe
        mounts = {m["mountPath"]: m for m in daemon["volumeMounts"]}
        assert mounts["/etc/kvtier/kvtier.yaml"]["subPath"] == "kvtier.yaml"
        assert daemon["args"] == ["serve", "--config", "/etc/kvtier/kvtier.yaml"]
        # the token is a copy only kvtierd's user may read, made from the Secret before it starts
        token = config.server.admin_token_file
        copy = _mount_dir(daemon, token)
        assert copy is not None
        assert volumes[copy]["emptyDir"]["medium"] == "Memory"
        inits = pod.get("initContainers", [])
        fillers = [c for c in inits if c is not daemon and _mount_dir(c, token) == copy]
        assert len(fillers) == 1, fillers
        assert "restartPolicy" not in fillers[0]
        assert fillers[0]["command"][:3] == ["install", "-m", "0600"]
        if daemon in inits:
            assert inits.index(fillers[0]) < inits.index(daemon)
        secrets = [volumes[m["name"]].get("secret", {}) for m in fillers[0]["volumeMounts"]]
        assert {"secretName": "kvtier-admin-token", "defaultMode": 0o440} in secrets
        arena = volumes[_mount_dir(daemon, config.arena.path)]
        memory_backed = arena.get("emptyDir", {}).get("medium") == "Memory" or arena.get(
            "hostPath", {}
        ).get("path", "").startswith("/dev/shm/")
        assert memory_backed, arena
        if "vllm" in containers:  # the sidecar shares the socket and the arena with vLLM
            vllm = containers["vllm"]
            for path in (config.server.socket_path, config.arena.path):
                assert _mount_dir(vllm, path) == _mount_dir(daemon, path), path
        for name in ("vllm",):
            engines = [
                c
                for d in docs
                if d["kind"] in WORKLOADS
                for c in _containers(d["spec"]["template"]["spec"]).values()
                if c["name"] == name
            ]
            for engine in engines:
                transfer = json.loads(
                    engine["args"][engine["args"].index("--kv-transfer-config") + 1]
                )
                extra = transfer["kv_connector_extra_config"]
                assert extra["socket_path"] == str(config.server.socket_path)
    assert len(kvtier_pods) == 1


def _ids(pod: dict[str, Any], container: dict[str, Any]) -> tuple[int, set[int]]:
    """The uid and the groups a container runs with."""
    ctx = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    return ctx["runAsUser"], {ctx["runAsGroup"], *ctx.get("supplementalGroups", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_may_call_kvtierd_and_map_its_arena(overlay: str, tmp_path: Path) -> None:
    docs = _render(overlay)
    config = _config(docs, tmp_path)
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in WORKLOADS]
    daemons = [(p, c) for p in pods for c in _containers(p).values() if c["name"] == "kvtier"]
    engines = [(p, c) for p in pods for c in _containers(p).values() if c["name"] == "vllm"]
    assert len(daemons) == 1
    assert engines
    daemon_uid, daemon_groups = _ids(*daemons[0])
    group = config.server.group if config.server.group is not None else min(daemon_groups)
    assert group in daemon_groups  # kvtierd may give the socket and the arena its group
    for engine in engines:
        uid, groups = _ids(*engine)
        if uid == daemon_uid:
            continue  # the owner: the 0600 bits suffice
        # the socket is 0660; the arena as configured
        assert group in groups, (overlay, uid, groups, group)
        assert config.arena.file_mode & 0o060 == 0o060, oct(config.arena.file_mode)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_shipped_admin_setup_passes_the_start_checks(overlay: str, tmp_path: Path) -> None:
    server = _config(_render(overlay), tmp_path).server
    token = tmp_path / "token"  # as the admin-token init container leaves it
    token.write_text("secret\n")
    token.chmod(0o600)
    admin, _read = admin_credentials(server.model_copy(update={"admin_token_file": token}))
    assert admin == "secret"


@pytest.mark.parametrize(
    ("overlay", "scheme", "annotation"),
    [
        ("s3", "s3://", "eks.amazonaws.com/role-arn"),
        ("gcs", "gs://", "iam.gke.io/gcp-service-account"),
    ],
)
def test_object_store_overlays_use_workload_identity(
    overlay: str, scheme: str, annotation: str, tmp_path: Path
) -> None:
    docs = _render(overlay)
    config = _config(docs, tmp_path)
    assert str(config.object.url).startswith(scheme)
    account = _one(docs, "ServiceAccount", "kvtier")
    assert account["metadata"]["annotations"][annotation]
    text = yaml.safe_dump_all(docs)
    for secret in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"):
        assert secret not in text
    if overlay == "s3":  # IRSA's token is a projected ServiceAccount token
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is True


def test_service_monitor_selects_the_metrics_service() -> None:
    monitor = _one(build(K8S / "monitoring"), "ServiceMonitor")
    service = _one(_render("sidecar"), "Service", "kvtier-metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendering_matches_kubectl_kustomize(overlay: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    theirs = normalise([d for d in yaml.safe_load_all(out) if d])
    assert normalise(_render(overlay)) == theirs
