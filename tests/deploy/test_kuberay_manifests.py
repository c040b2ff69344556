"""deploy/kuberay: the RayCluster and RayJob are valid for KubeRay, and the job they run loads.

Each object is validated against the v1 openAPIV3Schema of KubeRay's own CRDs (tests/deploy/crds/,
from ray-project/kuberay v1.7.0) with ``jsonschema``, strictly: an object schema that names its
properties refuses any other field, as ``kubectl apply --validate=strict`` does (the API server
would otherwise drop a misspelt field silently). The pod templates inside them are validated too,
against the Kubernetes schemas (kubernetes-validate, strict). The job file is loaded from the
ConfigMap with the RayJob entrypoint's own overrides through the real CLI parser and JobConfig,
and every custom resource its ``launcher.resources`` asks for is one a worker group declares.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.controller.cli import _load_job, build_parser
from rlfleet.controller.launcher_settings import RayLauncher

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CRDS = Path(__file__).parent / "crds"
KUBERNETES_VERSION = "1.31"
SCHEMAS = {"RayCluster": "ray.io_rayclusters.v1.json", "RayJob": "ray.io_rayjobs.v1.json"}


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())


def _objects() -> dict[str, dict[str, Any]]:
    """Kind -> the one object of that kind the kustomization applies."""
    docs = [yaml.safe_load((KUBERAY / r).read_text()) for r in _kustomization()["resources"]]
    return {doc["kind"]: doc for doc in docs}


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and
    does not keep unknown fields (x-kubernetes-preserve-unknown-fields): strict field validation."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def _validate(obj: dict[str, Any]) -> None:
    schema = json.loads((CRDS / SCHEMAS[obj["kind"]]).read_text())
    assert obj["apiVersion"] == "ray.io/v1", obj["apiVersion"]
    jsonschema.validate(obj, _strict(schema), cls=jsonschema.Draft7Validator)


def _groups() -> list[dict[str, Any]]:
    spec = _objects()["RayCluster"]["spec"]
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def _ray_resources(group: dict[str, Any]) -> dict[str, float]:
    """The custom resources a group's pods declare (rayStartParams.resources: quoted JSON)."""
    raw = group["rayStartParams"].get("resources")
    return json.loads(json.loads(raw)) if raw else {}


def _entrypoint_job() -> Any:
    """The job the RayJob runs: its ConfigMap's file, loaded with the entrypoint's arguments."""
    argv = shlex.split(_objects()["RayJob"]["spec"]["entrypoint"])
    assert argv[:2] == ["rlfleet", "train"], argv
    args = build_parser().parse_args(argv[1:])
    head = _groups()[0]["template"]["spec"]
    mounts = head["containers"][0]["volumeMounts"]
    mount = next(m for m in mounts if str(args.config).startswith(m["mountPath"]))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    generators = _kustomization()["configMapGenerator"]
    generator = next(g for g in generators if g["name"] == volume["configMap"]["name"])
    key = args.config.relative_to(mount["mountPath"]).as_posix()
    assert key in generator["files"], (key, generator["files"])
    return _load_job(KUBERAY / key, args.overrides)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_each_object_is_valid_for_kuberay(kind: str) -> None:
    _validate(_objects()[kind])


@pytest.mark.parametrize(
    "breakage",
    [
        lambda o: o["spec"]["headGroupSpec"].update(rayStartParam={}),  # misspelt field
        lambda o: o["spec"]["workerGroupSpecs"][0].update(replicas="one"),  # wrong type
        lambda o: o["spec"]["workerGroupSpecs"][1].pop("groupName"),  # required field gone
        lambda o: o["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(imag="x"),
    ],
    ids=["misspelt", "wrong-type", "missing-required", "misspelt-in-pod"],
)
def test_a_broken_raycluster_is_refused(breakage: Any) -> None:
    """The check above can fail: each of these edits of the real RayCluster is refused."""
    broken = copy.deepcopy(_objects()["RayCluster"])
    breakage(broken)
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


def test_a_broken_rayjob_is_refused() -> None:
    broken = copy.deepcopy(_objects()["RayJob"])
    broken["spec"]["entryPoint"] = broken["spec"].pop("entrypoint")
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


@pytest.mark.parametrize("group", range(3), ids=["head", "worker-0", "worker-1"])
def test_each_pod_template_is_valid_kubernetes(group: int) -> None:
    template = _groups()[group]["template"]
    pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(pod)
    broken["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_generated_config_map_keeps_the_name_the_raycluster_mounts() -> None:
    """kustomize does not rewrite ConfigMap names inside a CRD's pod templates: no hash suffix."""
    assert _kustomization()["generatorOptions"]["disableNameSuffixHash"] is True


def test_the_rayjob_runs_on_the_raycluster() -> None:
    objects = _objects()
    cluster = objects["RayCluster"]["metadata"]["name"]
    assert objects["RayJob"]["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}


def test_the_entrypoint_job_loads_as_a_ray_run() -> None:
    job = _entrypoint_job()
    assert isinstance(job.launcher, RayLauncher)
    assert (job.launcher.type, job.launcher.address, job.fleet.nats_url) == ("ray", "auto", None)
    assert job.model.name.startswith("/models/") and job.data.path.startswith("/models/")


def test_every_custom_resource_the_job_asks_for_is_offered_by_a_worker_group() -> None:
    """launcher.resources names rlfleet_gpu_node / rlfleet_cpu_node: a group declares each, enough of it
    (and GPUs) for a trainer's ranks on one node (STRICT_PACK), and the head takes no tier."""
    job = _entrypoint_job()
    groups = _groups()
    assert groups[0]["rayStartParams"]["num-cpus"] == "0" and not _ray_resources(groups[0])
    assert isinstance(job.launcher, RayLauncher)
    for tier, wanted in job.launcher.resources.items():
        world = job.num_train_workers if tier == "trainer" else 1
        fits = []
        for group in groups[1:]:
            offered = _ray_resources(group)
            gpus = float(group["rayStartParams"].get("num-gpus", "0"))
            cpus = float(group["rayStartParams"]["num-cpus"])
            custom = all(offered.get(k, 0) >= v * world for k, v in wanted.get("resources", {}).items())
            gpus_fit = gpus >= wanted.get("num_gpus", 0) * world
            fits.append(custom and gpus_fit and cpus >= wanted.get("num_cpus", 1) * world)
        assert any(fits), (tier, wanted)
    for group in groups[1:]:  # the GPUs Ray offers are the ones the pod gets
        resources = group["template"]["spec"]["containers"][0]["resources"]
        gpus = float(resources["limits"].get("nvidia.com/gpu", 0))
        assert float(group["rayStartParams"].get("num-gpus", "0")) == gpus
        assert group["rayStartParams"]["num-cpus"] == resources["requests"]["cpu"]  # what Ray offers


def test_the_shared_reward_variant_of_the_readme_loads() -> None:
    """deploy/kuberay/README.md's entrypoint that scores on deploy/k8s's shared reward server."""
    readme = (KUBERAY / "README.md").read_text()
    found = re.search(r"^\s*(rlfleet train /config/job\.yaml .*reward\.url=.*)$", readme, re.M)
    assert found, "no entrypoint with reward.url in deploy/kuberay/README.md"
    line = found.group(1)
    args = build_parser().parse_args(shlex.split(line)[1:])
    job = _load_job(KUBERAY / "job.yaml", args.overrides)
    assert (job.reward.cluster, job.reward.endpoint) == ("shared", "team-a/helpful")
    assert job.reward.url == "nats://nats.rlfleet.svc:4222"
    assert isinstance(job.launcher, RayLauncher) and job.launcher.address == "auto"
    reward = load_config(RewardWorkerConfig, ROOT / "deploy" / "reward.yaml")
    assert job.reward.cluster == reward.fleet.cluster and job.reward.endpoint in reward.endpoints


def test_every_secret_and_claim_the_pods_use_is_one_the_readme_creates() -> None:
    readme = (KUBERAY / "README.md").read_text() + (ROOT / "deploy" / "k8s" / "README.md").read_text()
    created = set(re.findall(r"create secret generic (\S+)", readme))
    claims = set(re.findall(r"PersistentVolumeClaim `([^`]+)`", readme))
    for group in _groups():
        pod = group["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in created, volume
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume
        for container in pod["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in created and f"{ref['key']}=" in readme, ref
