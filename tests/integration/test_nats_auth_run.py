"""An embedded run's nats-server, brought up by a real ``GRPOTrainer`` with nothing set by the user.

The run's workers (real processes) connect with their generated role credentials (whatever
``RLFLEET_NATS_*`` the user's shell holds for other clusters); a client without
credentials cannot connect to the run's server, a rollout-role client (from the run's join file)
cannot command the trainer, and no password lands in ``config.yaml``, the worker configs, the
worker logs or ``processes.json``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from rlfleet.common.control.messages import Shutdown
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject, worker_subject
from rlfleet.common.errors import NatsServerError
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"


@pytest.mark.timeout(240)
def test_an_embedded_run_is_locked_by_default(
    tmp_path: Path, tiny_model_dir: Path, procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # settings of the user's shell for some cluster: an embedded run uses none of them
    monkeypatch.setenv("RLFLEET_NATS_TOKEN", "a-token-for-another-cluster")
    monkeypatch.setenv("RLFLEET_NATS_TLS", "true")
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=2, max_prompt_length=32, max_response_length=8,
        output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0, device="cpu",
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32, seed=1), config)  # fmt: skip
    try:
        trainer.start()  # every worker announced over its own role's credential
        url, run = trainer.nats_url, trainer.fleet_run
        launcher = run.launcher
        assert launcher is not None and launcher.processes.credentials is not None  # type: ignore[attr-defined]
        passwords = list(launcher.processes.credentials.passwords.values())  # type: ignore[attr-defined]

        async def attacks() -> None:
            with pytest.raises(NatsServerError, match="refused"):
                await NatsTransport.connect(url, name="anon", connect_timeout=3.0, max_reconnect_attempts=0,
                                            env={})  # fmt: skip
            joined = yaml.safe_load(run.join_config.read_text())
            assert joined["nats_auth"]["user"] == "rollout" and run.join_config.stat().st_mode & 0o077 == 0
            auth = NatsConnection.model_validate(joined["nats_auth"])
            rollout = await NatsTransport.connect(url, name="intruder", auth=auth, env={})
            try:
                await rollout.publish(
                    worker_subject(trainer.cluster, "trainer", "trainer-0"), Shutdown(reason="x")
                )
                await rollout.publish(subject(trainer.cluster, "trainer", "save"), Shutdown(reason="x"))
                await rollout.flush()
            finally:
                await rollout.close()
            await asyncio.sleep(2.0)  # time for a worker that obeyed to exit

        asyncio.run(attacks())
        trainer.fleet_run.launcher.check()  # every worker still runs: nothing obeyed the intruder
        assert trainer.fleet.registry.get("trainer", "trainer-0") is not None
        output_dir = run.state.output_dir
        written = [output_dir / "config.yaml", output_dir / "fleet" / "processes.json",
                   *(output_dir / "fleet" / "workers").iterdir()]  # fmt: skip
        for path in written:
            text = path.read_text(errors="replace")
            assert not any(password in text for password in passwords), path
        started = procs.launched(output_dir)
    finally:
        trainer.close()
    assert procs.survivors(started) == []
