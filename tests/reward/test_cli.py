"""``rlfleet-reward`` as a platform team runs it (issue 35, point 6): the console script as a subprocess.

Every command lists its subcommands and options in ``--help``; a config that cannot work exits 2
with one line and no traceback; ``admin`` exits 1 when a server refuses, with the server's reason on
one line of stderr, and 2 when it cannot reach one; ``admin score`` smoke-tests an endpoint with
plain texts. The servers are real ``rlfleet-reward serve`` processes on a real nats-server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlfleet.common.control.embedded_nats import EmbeddedNats, free_port

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(sys.executable).parent / "rlfleet-reward"
ADMIN_TOKEN = "admin-token-0123"
TEAM_TOKEN = "team-a-token-0123"
WITHOUT_MODELS = (
    # as where rlfleet-reward[models] is not installed: neither transformers nor torch (rlfleet-common's
    # tensor plane reads the texts as numpy arrays without it)
    "import sys\nsys.modules['transformers'] = None\nsys.modules['torch'] = None\n"
    "from rlfleet.reward.main import main\nsys.exit(main(sys.argv[1:]))\n"
)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """``rlfleet-reward ARGS`` (the console script next to this Python)."""
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else dict(os.environ))  # fmt: skip


def one_line_error(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The error line of a command that had to exit ``code`` without a traceback."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines, "nothing said on stderr"
    return lines[-1]


def start_server(spawn: Any, tmp_path: Path, name: str, config: dict[str, Any],
                 command: Sequence[str] | None = None) -> None:  # fmt: skip
    """Start ``rlfleet-reward serve`` with ``config`` (or ``command`` + its serve arguments) and wait until
    it says it is up."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"quota_store": "process", "heartbeat_s": 0.5, **config}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if command is None:
        proc = spawn.serve(name, path, env=env)
    else:
        proc = spawn.start(name, [*command, "serve", "--config", str(path)], env=env)
    deadline = time.monotonic() + 90
    while "is up on cluster" not in spawn.log(name):
        assert proc.poll() is None, spawn.log(name)[-3000:]
        assert time.monotonic() < deadline, spawn.log(name)[-3000:]
        time.sleep(0.2)


def admin(url: str, cluster: str, *args: str, token: str = "") -> subprocess.CompletedProcess[str]:
    extra = ["--token", token] if token else []
    return cli("admin", "--nats", url, "--cluster", cluster, "--timeout", "30", *extra, *args)


# --- help ------------------------------------------------------------------------------------


def test_help_lists_every_command_and_its_options() -> None:
    top = cli("--help")
    assert top.returncode == 0, top.stderr
    assert "serve" in top.stdout and "admin" in top.stdout and "--version" in top.stdout
    serve = cli("serve", "--help")
    assert serve.returncode == 0, serve.stderr
    assert all(
        flag in serve.stdout for flag in ("--config", "--nats", "--cluster", "--worker-id", "overrides")
    )
    adm = cli("admin", "--help")
    assert adm.returncode == 0, adm.stderr
    for word in ("stats", "set-spec", "set-model", "score", "--token", "--cluster", "--nats", "--timeout"):
        assert word in adm.stdout, word
    options = {
        "stats": ["endpoint"],
        "set-spec": ["endpoint", "spec", "--scaler"],
        "set-model": ["endpoint", "path", "--component"],
        "score": ["endpoint", "--prompt", "--response", "--metadata", "--store-host", "--queue", "--json"],
    }
    for action, words in options.items():
        done = cli("admin", action, "--help")
        assert done.returncode == 0, done.stderr
        assert all(word in done.stdout for word in words), (action, done.stdout)


def test_version_and_usage_errors() -> None:
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("rlfleet-reward "), version
    assert "serve,admin" in one_line_error(cli(), 2)
    assert "invalid choice" in one_line_error(cli("srve"), 2)


# --- config errors: exit 2, one line ----------------------------------------------------------


def test_a_short_token_in_the_config_exits_2_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text(yaml.safe_dump({"tenants": [{"name": "a", "token": "short", "endpoints": ["e"]}],
                                      "endpoints": {"e": "concise"}}))  # fmt: skip
    line = one_line_error(cli("serve", "--config", str(config)), 2)
    assert "tenants[0].token" in line and "at least 8 characters" in line and "short" not in line


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"tenants": [{"name": "a", "token_env": "TEAM_A_TOKEN", "endpoints": ["e"]}]}, "TEAM_A_TOKEN"),
        ({"admin": {"token_env": "UNSET_ADMIN_TOKEN_VAR"}}, "UNSET_ADMIN_TOKEN_VAR"),
        ({"tenants": [{"name": "a", "token": TEAM_TOKEN, "endpoints": ["e"]},
                      {"name": "b", "token": TEAM_TOKEN, "endpoints": ["e"]}]}, "share a token"),
    ],
)  # fmt: skip
def test_an_unusable_token_exits_2_in_one_line(
    nats_server: EmbeddedNats, tmp_path: Path, settings: dict[str, Any], said: str
) -> None:
    config = tmp_path / "reward.yaml"
    fleet = {"nats_url": nats_server.url, "cluster": "cli-token"}
    config.write_text(yaml.safe_dump({"fleet": fleet, "quota_store": "process", "endpoints": {"e": "concise"},
                                      **settings}))  # fmt: skip
    env = {**os.environ, "TEAM_A_TOKEN": "abc"}  # shorter than 8 characters
    env.pop("UNSET_ADMIN_TOKEN_VAR", None)
    line = one_line_error(cli("serve", "--config", str(config), env=env), 2)
    assert line.startswith("TenantConfigError") and said in line
    assert "abc" not in line


def test_a_model_spec_without_the_models_extra_exits_2_naming_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    config = tmp_path / "reward.yaml"
    fleet = {"nats_url": nats_server.url, "cluster": "cli-no-extra"}
    config.write_text(yaml.safe_dump({"quota_store": "process", "endpoints": {"e": f"rm:path={tmp_path}"},
                                      "fleet": fleet}))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", WITHOUT_MODELS, "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "pip install 'rlfleet-reward[models]'" in one_line_error(done, 2)


def test_serve_without_nats_exits_1_in_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    line = one_line_error(cli("serve", f"fleet.nats_url={url}", "endpoints={e: concise}"), 1)
    assert line.startswith("rlfleet-reward: NatsServerError") and url in line


# --- admin: refusals exit 1 with the server's reason ------------------------------------------


def test_admin_exits_1_with_the_servers_reason_when_refused(
    nats_server: EmbeddedNats, tmp_path: Path, spawn: Any
) -> None:
    cluster = "cli-refusals"
    start_server(spawn, tmp_path, "reward", {
        "fleet": {"nats_url": nats_server.url, "cluster": cluster}, "worker_id": "reward-cli",
        "admin": {"token": ADMIN_TOKEN},
        "tenants": [{"name": "team-a", "token": TEAM_TOKEN, "endpoints": ["team-a/e"]}],
        "endpoints": {"team-a/e": "concise"},
    })  # fmt: skip
    url = nats_server.url
    bad = admin(url, cluster, "set-spec", "team-a/e", "no_such_rule", token=ADMIN_TOKEN)
    line = one_line_error(bad, 1)
    assert line.startswith("rlfleet-reward admin: reward-cli refused reward.set_spec:")
    assert "UnknownReward" in line and "no_such_rule" in line and bad.stdout == ""
    # a tenant without can_update, a wrong token, an unknown endpoint: each refused in one line, exit 1
    assert "forbidden" in one_line_error(
        admin(url, cluster, "set-spec", "team-a/e", "concise", token=TEAM_TOKEN), 1
    )
    assert "invalid_token" in one_line_error(admin(url, cluster, "stats", token="wrong-token-123"), 1)
    assert "unknown_endpoint" in one_line_error(admin(url, cluster, "stats", "nope", token=ADMIN_TOKEN), 1)
    assert "rm" in one_line_error(
        admin(url, cluster, "set-model", "team-a/e", str(tmp_path), token=ADMIN_TOKEN), 1
    )
    good = admin(url, cluster, "set-spec", "team-a/e", "concise:max_words=5", token=ADMIN_TOKEN)
    assert good.returncode == 0, good.stderr
    reply = json.loads(good.stdout.splitlines()[0])
    assert reply["worker"] == "reward-cli" and reply["spec"] == "concise:decay=linear,max_words=5"


def test_admin_exits_2_in_one_line_when_nothing_answers(nats_server: EmbeddedNats) -> None:
    line = one_line_error(admin(nats_server.url, "cli-nobody-here", "stats"), 2)
    assert "reward" in line
    url = f"nats://127.0.0.1:{free_port()}"
    assert "cannot connect to NATS" in one_line_error(admin(url, "x", "stats"), 2)
    bad_json = admin(url, "x", "set-spec", "e", "concise", "--scaler", "{oops")  # refused before connecting
    assert "Expecting property name" in one_line_error(bad_json, 2)


# --- admin score: smoke-test an endpoint with plain texts --------------------------------------


def test_admin_score_prints_the_score_of_each_response(
    nats_server: EmbeddedNats, tmp_path: Path, spawn: Any
) -> None:
    cluster = "cli-score"
    start_server(spawn, tmp_path, "reward", {
        "fleet": {"nats_url": nats_server.url, "cluster": cluster}, "worker_id": "reward-score",
        "endpoints": {"math": "exact_match + 0.5*concise:max_words=2"},
    })  # fmt: skip
    url = nats_server.url
    group = admin(url, cluster, "score", "math", "--prompt", "2+2?", "--response", "4",
                  "--response", "it is five, surely", "--metadata", '{"answer": "4"}')  # fmt: skip
    assert group.returncode == 0, group.stderr
    head, first, second = group.stdout.strip().splitlines()
    assert head.startswith("endpoint math (version ") and "2 score(s)" in head
    assert first.split()[0] == "1.5000" and "exact_match=1.0000" in first and "'4'" in first
    assert float(second.split()[0]) < 0.5 and "exact_match=0.0000" in second
    # one prompt per response, through the queue group a tenant's run uses, as JSON
    answers = '[{"answer": "7"}, {"answer": "9"}]'
    pairs = admin(url, cluster, "score", "math", "--queue", "--json", "--prompt", "a?", "--prompt", "b?",
                  "--response", "7", "--response", "8", "--metadata", answers)  # fmt: skip
    assert pairs.returncode == 0, pairs.stderr
    result = json.loads(pairs.stdout)
    assert result["kind"] == "reward.result" and result["components"]["exact_match"] == [1.0, 0.0]
    # refusals and mistakes, one line each
    assert "unknown_endpoint" in one_line_error(admin(url, cluster, "score", "nope", "--prompt", "a",
                                                      "--response", "b"), 1)  # fmt: skip
    mismatch = admin(url, cluster, "score", "math", "--prompt", "a", "--prompt", "b", "--response", "c",
                     "--response", "d", "--response", "e")  # fmt: skip
    assert "2 --prompt for 3 --response" in one_line_error(mismatch, 2)


def test_a_server_without_the_models_extra_scores_rules_and_refuses_models_naming_it(
    nats_server: EmbeddedNats, tmp_path: Path, spawn: Any
) -> None:
    cluster = "cli-no-models"
    start_server(spawn, tmp_path, "rules-only", {
        "fleet": {"nats_url": nats_server.url, "cluster": cluster}, "worker_id": "reward-rules",
        "endpoints": {"e": "charset:allowed=0123456789"},
    }, command=[sys.executable, "-c", WITHOUT_MODELS])  # fmt: skip
    # admin score serves the texts from a TensorStore of its own, without torch too
    admin_args = ["admin", "--nats", nats_server.url, "--cluster", cluster, "--timeout", "30", "score", "e"]
    texts = ["--prompt", "n?", "--response", "42", "--response", "x"]
    command = [sys.executable, "-c", WITHOUT_MODELS, *admin_args, *texts]
    scored = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert scored.returncode == 0, scored.stderr
    assert [line.split()[0] for line in scored.stdout.splitlines()[1:]] == ["1.0000", "0.0000"]
    refused = admin(nats_server.url, cluster, "set-spec", "e", f"rm:path={tmp_path}")
    assert "pip install 'rlfleet-reward[models]'" in one_line_error(refused, 1)
