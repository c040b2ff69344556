"""The kustomizations build with the real kustomize (``kubectl kustomize``), with the commands the
READMEs give, into the objects the manifest tests validate (same kinds and names).

The manifest tests expand the kustomizations themselves (offline, no kubectl needed); this test
checks that expansion against kustomize's own where kubectl is installed, so a file kustomize
refuses to load, or a reference it renames, fails here and not at ``kubectl apply``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BUILDS = {
    "k8s": ["--load-restrictor", "LoadRestrictionsNone"],  # its ConfigMaps hold ../*.yaml
    "kuberay": [],
}


def _build(folder: str) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", *BUILDS[folder], str(DEPLOY / folder)],
                          capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.mark.parametrize("folder", sorted(BUILDS))
def test_the_readme_command_builds(folder: str) -> None:
    readme = (DEPLOY / folder / "README.md").read_text()
    flags = BUILDS[folder]
    command = (
        " ".join(["kubectl kustomize", *flags, f"deploy/{folder}"])
        if flags
        else f"kubectl apply -k deploy/{folder}"
    )
    assert command in readme, command
    objects = _build(folder)
    assert all(o["metadata"]["namespace"] == "rlfleet" for o in objects)
    assert all(o["spec"]["template"]["spec"]["containers"][0]["image"].startswith("ghcr.io/")
               for o in objects if o["kind"] == "Deployment")  # fmt: skip


@pytest.mark.parametrize("folder", sorted(BUILDS))
def test_it_builds_what_the_manifest_tests_validate(folder: str) -> None:
    """The objects of the kustomization's resources and its generated ConfigMaps, nothing else."""
    kustomization = yaml.safe_load((DEPLOY / folder / "kustomization.yaml").read_text())
    expanded = {(d["kind"], d["metadata"]["name"]) for r in kustomization["resources"]
                for d in yaml.safe_load_all((DEPLOY / folder / r).read_text()) if d}  # fmt: skip
    expanded |= {("ConfigMap", g["name"]) for g in kustomization.get("configMapGenerator", [])}
    hashed = not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash")
    built = {(o["kind"], o["metadata"]["name"]) for o in _build(folder)}
    unhashed = {(k, n.rsplit("-", 1)[0] if k == "ConfigMap" and hashed else n) for k, n in built}
    assert unhashed == expanded


def test_kuberay_keeps_the_config_map_name_the_raycluster_mounts() -> None:
    objects = {o["kind"]: o for o in _build("kuberay")}
    head = objects["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    names = {v["configMap"]["name"] for v in head["volumes"] if "configMap" in v}
    assert names == {objects["ConfigMap"]["metadata"]["name"]}
    assert "job.yaml" in objects["ConfigMap"]["data"]
