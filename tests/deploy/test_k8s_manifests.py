"""deploy/k8s: every manifest is valid Kubernetes, and every config a pod mounts loads as it starts.

The kustomization is expanded here the way ``kubectl apply -k`` does for what it uses (resources,
namespace, ConfigMaps generated from the files under deploy/), then each object is validated
offline against the Kubernetes schemas (kubernetes-validate, strict: an unknown field fails).
Each container's command is run through its tier's real argument parser and config loader, with
the pod's ``$(VAR)`` references filled in, so a renamed flag or config field fails here and not on
a cluster. Every Secret a pod reads is one deploy/k8s/README.md tells the operator to create.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from rlfleet.common.control.worker import cli_overrides, parse_service_args
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import RolloutWorkerConfig

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.31"
TIERS = {"rlfleet-reward": RewardWorkerConfig, "rlfleet-rollout": RolloutWorkerConfig}
POD_FIELDS = {"metadata.name": "rlfleet-x-5d9c7-abcde", "status.podIP": "10.1.2.3"}


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _config_maps() -> dict[str, dict[str, Path]]:
    """Generated ConfigMap name -> {key: the file under deploy/ it holds}."""
    maps: dict[str, dict[str, Path]] = {}
    for generator in _kustomization()["configMapGenerator"]:
        files = {}
        for entry in generator["files"]:
            key, _, source = entry.partition("=")
            files[key] = (K8S / (source or key)).resolve()
        maps[generator["name"]] = files
    return maps


def _objects() -> list[dict[str, Any]]:
    """Every object the kustomization applies, generated ConfigMaps included, in its namespace."""
    kustomization = _kustomization()
    objects = [
        doc
        for resource in kustomization["resources"]
        for doc in yaml.safe_load_all((K8S / resource).read_text())
        if doc is not None
    ]
    for name, files in _config_maps().items():
        data = {key: path.read_text() for key, path in files.items()}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
    for obj in objects:
        obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    deployments = [o for o in _objects() if o["kind"] == "Deployment"]
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in deployments]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in a command, from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = POD_FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_the_kustomization_names_files_that_exist() -> None:
    for resource in _kustomization()["resources"]:
        assert (K8S / resource).is_file(), resource
    for files in _config_maps().values():
        for path in files.values():
            assert path.is_file() and path.is_relative_to(DEPLOY), path


@pytest.mark.parametrize("obj", _objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_every_object_is_valid_kubernetes(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_wrong_field_is_caught() -> None:
    """The check above can fail: a misspelt field and a wrong type are both refused."""
    deployment = next(o for o in _objects() if o["kind"] == "Deployment")
    misspelt = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    wrong_type = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES_VERSION, strict=True)


def test_mounted_config_maps_and_keys_exist() -> None:
    maps = _config_maps()
    for name, pod in _pod_specs():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            for mount in container["volumeMounts"]:
                volume = volumes[mount["name"]]  # KeyError: a mount of no volume
                if "configMap" in volume:
                    keys = maps[volume["configMap"]["name"]]
                    assert mount.get("subPath", next(iter(keys))) in keys, (name, mount)


@pytest.mark.parametrize("deployment", [n for n, _ in _pod_specs()])
def test_each_container_starts_with_a_config_that_loads(deployment: str) -> None:
    """The command's program is installed, its flags parse, and the mounted config loads with them."""
    pod = dict(_pod_specs())[deployment]
    maps = _config_maps()
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod["containers"]:
        env = _env(container)
        command = [_expand(arg, env) for arg in container["command"]]
        assert "$(" not in " ".join(command), command  # every reference names a defined variable
        program = command[0]
        assert shutil.which(program) or (Path(".venv/bin") / program).exists(), program
        if program not in TIERS:
            continue  # nats-server: its config is run for real by tests/integration/test_nats_auth_deploy.py
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        args = parse_service_args(program, command[1:])
        mount = mounts[str(args.config)]
        source = maps[volumes[mount["name"]]["configMap"]["name"]][mount["subPath"]]
        config = load_config(TIERS[program], source, cli_overrides(args))
        assert config.worker_id == POD_FIELDS["metadata.name"]
        assert config.fleet.nats_url == "nats://nats:4222"
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert config.metrics_port == ports["metrics"], (config.metrics_port, ports)
        plane = config.tensor_plane
        assert (config.metrics_host or plane.bind_host) == "0.0.0.0"  # reachable from Prometheus
        if program == "rlfleet-rollout":
            assert (plane.bind_host, plane.advertise_host) == ("0.0.0.0", POD_FIELDS["status.podIP"])
        else:
            state = next(m for m in container["volumeMounts"] if volumes[m["name"]].get("emptyDir") == {})
            assert str(config.state_dir) == state["mountPath"]


def test_every_secret_a_pod_reads_is_one_the_readme_creates() -> None:
    readme = (K8S / "README.md").read_text()
    created = set(re.findall(r"create secret generic (\S+)", readme))
    used = set()
    for _, pod in _pod_specs():
        used |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for container in pod["containers"]:
            used |= {s["secretRef"]["name"] for s in container.get("envFrom", [])}
            refs = [v["valueFrom"] for v in container.get("env", []) if "valueFrom" in v]
            used |= {ref["secretKeyRef"]["name"] for ref in refs if "secretKeyRef" in ref}
    assert used and used <= created, used - created


def test_the_nats_password_secret_has_a_key_for_every_user_of_the_config() -> None:
    """deploy/nats-server.conf reads one $RLFLEET_NATS_PASS_<USER> per user: the README creates each."""
    needed = set(re.findall(r"\$(RLFLEET_NATS_PASS_[A-Z_]+)", (DEPLOY / "nats-server.conf").read_text()))
    readme = (K8S / "README.md").read_text()
    assert needed and all(f"--from-literal={name}=" in readme for name in needed), needed


def test_every_service_selects_a_deployment_and_a_port_its_pods_name() -> None:
    """Each Service reaches pods (its selector matches a Deployment's pod labels) on named container
    ports that exist; a metrics Service carries the Prometheus scrape annotations for that port."""
    objects = _objects()
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"rlfleet-reward-metrics", "rlfleet-rollout-metrics"}
    for service in services:
        selector = service["spec"]["selector"].items()
        pods = [
            d["spec"]["template"]
            for d in deployments
            if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, service["metadata"]["name"]
        named = {
            p["name"]: p["containerPort"]
            for t in pods
            for c in t["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, (service["metadata"]["name"], port)
        if service["metadata"]["name"].endswith("-metrics"):
            notes = service["metadata"]["annotations"]
            assert notes["prometheus.io/scrape"] == "true"
            assert int(notes["prometheus.io/port"]) == named["metrics"]
