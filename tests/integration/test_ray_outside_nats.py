"""``launcher.type=ray`` on an outside, permissioned nats-server (issue 13 point 1: "NATS comes from
``fleet.nats_url`` or is started by the launcher").

The test starts the nats-server itself, on every interface, with one user per role allowed only
its role's subjects (``nats_roles.server_config``), and names it by this node's IP (never
loopback). ``rlfleet train`` (a real CLI process; the controller's login in ``RLFLEET_NATS_*``, the
workers' in a ``launcher.worker_auth`` file) places every tier through a local Ray and trains on that
server without starting one of its own. Each worker announced itself, which only its own role's
user may do on that server, so each logged in with its role's login; no password reaches a file
the run wrote. A trainer given a wrong password is refused by the server, and the run says so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_roles import RunCredentials, server_config
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.errors import TierDied
from rlfleet.controller.ray_launcher import import_ray

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
CLUSTER = "outside"
TIERS = ("trainer", "rollout", "reward")


@pytest.fixture(scope="module")
def outside() -> Iterator[tuple[str, RunCredentials]]:
    """A permissioned nats-server on every interface, and its URL by this node's IP."""
    ip = str(import_ray(local=True).util.get_node_ip_address())
    assert not ip.startswith("127."), ip
    credentials = RunCredentials.generate(CLUSTER)
    with EmbeddedNats(jetstream=False, config=server_config(credentials), host="0.0.0.0") as server:
        yield f"nats://{ip}:{server.port}", credentials


def _logins(credentials: RunCredentials, path: Path, **wrong: str) -> Path:
    logins = {}
    for tier in TIERS:
        login = credentials.connection(tier)
        logins[tier] = {"user": login.user, "password": wrong.get(tier, login.password.get_secret_value())}
    path.write_text(yaml.safe_dump(logins))
    path.chmod(0o600)
    return path


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rlfleet_train_places_the_tiers_with_ray_on_an_outside_nats(
    outside: tuple[str, RunCredentials], venv_script, cli_env, tmp_path: Path, procs
) -> None:
    url, credentials = outside
    out = tmp_path / "run"
    controller = credentials.connection("controller")
    env = {**cli_env, "RLFLEET_NATS_USER": controller.user,
           "RLFLEET_NATS_PASSWORD": controller.password.get_secret_value()}  # fmt: skip
    logins = _logins(credentials, tmp_path / "logins.yaml")
    args = ["train", str(EXAMPLE), "launcher.type=ray", "launcher.num_cpus=4", f"fleet.nats_url={url}",
            f"fleet.cluster={CLUSTER}", f"launcher.worker_auth={logins}", "max_steps=3",
            f"output_dir={out}", "loggers=[jsonl]", "sample_table_size=0", "log_every=1"]  # fmt: skip
    run = subprocess.run([venv_script("rlfleet"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=400)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3], steps
    assert all(0.0 <= s["reward/mean"] <= 1.0 for s in steps)
    processes = json.loads((out / "fleet" / "processes.json").read_text())
    assert processes["nats"] is None  # the run started no nats-server: it used the outside one
    assert sorted(w["tier"] for w in processes["workers"]) == sorted(TIERS)
    assert all(w["node_ip"] == url.split("//")[1].split(":")[0] for w in processes["workers"])
    for worker in processes["workers"]:
        written = yaml.safe_load((out / "fleet" / "workers" / f"{worker['worker_id']}.yaml").read_text())
        assert written["nats_url"] == url and "nats_auth" not in written  # the previous release's flat form
    files = [out / "config.yaml", out / "fleet" / "processes.json", *(out / "fleet" / "workers").iterdir()]
    shown = [path.read_text(errors="replace") for path in files] + [run.stdout, run.stderr]
    assert not any(password in text for password in credentials.passwords.values() for text in shown)
    assert procs.survivors([w["pid"] for w in processes["workers"]]) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_with_a_wrong_login_is_refused_by_the_outside_nats(
    outside: tuple[str, RunCredentials], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, credentials = outside
    logins = _logins(credentials, tmp_path / "logins.yaml", trainer="not-its-password")
    config = TrainerConfig(
        launcher={"type": "ray", "num_cpus": 4, "worker_auth": str(logins)},
        fleet={"nats_url": url, "cluster": CLUSTER, "nats_auth": credentials.connection("controller")},
        output_dir=str(tmp_path / "run"),
        rollout_batch_size=4, train_batch_size=4, group_size=2, max_prompt_length=32, max_response_length=8,
        loggers=["jsonl"], sample_table_size=0,
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32), config)  # fmt: skip
    try:
        with pytest.raises(TierDied, match="trainer-0") as caught:
            trainer.start()
    finally:
        trainer.close()
    assert "the server refused these credentials" in str(caught.value), caught.value
    assert "not-its-password" not in str(caught.value)
