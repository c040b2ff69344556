"""Environments (issue 33): episodes/s against the number of environment workers, and the cost of
multi-turn against single-turn generation for the same token budget, in one run.

    uv run --extra cpu python benchmarks/environments.py            # CPU, the tiny model, ~1 minute
    uv run --extra cpu python benchmarks/environments.py --workers 1,2 --rounds 2 --turn-tokens 16
    uv run --extra cpu python benchmarks/environments.py --smoke    # 1 environment worker, 1 job a side

Real parts on one machine: a nats-server and, for each count of ``--workers`` (1, 2, 4), a cluster
of its own: that many reward workers, each its own ``rlfleet-reward serve`` process serving
``calc`` (``calculator:max_turns=3``) and ``guess`` (``guess_number``, a secret from 1 to 10^6) in
the ``env.reset`` queue group, open (no tenants), ``max_concurrency`` 4; and a real rollout worker
in this process: the HF engine on CPU with ``tiny:digits``, the random-init 2-layer character
model of the examples (``rlfleet.controller.models``). ``--rounds`` rounds go over the counts in
turn, so a slow spell of the host falls on every count alike.

1. ``service``, the environment side alone: ``--clients`` concurrent loops, each running calculator
   episodes through the rollout side's own :class:`~rlfleet.rollout.episodes.EnvClient` (one NATS
   connection): reset, a tool call (``calculator: 17 * 23``, answered ``391``), the right answer
   (reward 1) and the close, 4 requests an episode as a rollout worker sends them, for
   ``--seconds`` a round after a warm-up. Episodes/s, requests/s, the median episode's time, how
   many workers took resets, and the cores each side kept busy meanwhile (from ``/proc``: this
   process's clients, the reward workers, the nats-server), hence the worker CPU an episode costs.
2. ``rollout``, end to end: generate jobs of ``--prompts`` x ``--n`` calculator episodes through
   the cluster's rollout worker (the first ``--turn-tokens`` a turn, at most 3 turns), ``--repeats``
   jobs a round after a warm-up job; episodes/s of the job of median wall time (request out, reply
   back). The random model never writes a tool call, so its episodes end at the first turn (its
   final answer): a job is a reset, one engine call, a step and a close per episode; ``env s/ep``
   is the mean time an episode waited on the environment.
3. ``turns``, on the largest cluster: for each of ``--turn-tokens`` (8 and 32), episodes of
   ``--turns`` (3) turns of that many tokens against ``guess`` (its answers, ``higher`` /
   ``lower`` / how to guess, cut to ``--observation-tokens`` tokens, go back into the context),
   against one turn of turns x turn-tokens tokens without an environment: the same budget of
   sampling steps, prompts, samples and seed, the two sides alternated, ``--repeats`` x
   ``--rounds`` jobs each. Wall time and sampled tokens/s of each (the job of median wall time)
   and their ratios. An EOS ends a single-turn sample but only a multi-turn turn, so the
   multi-turn side samples more of its budget (both sides' batches run their steps all the same):
   the wall ratio is the cost of multi-turn for the same budget.

The JSON (``benchmarks/results/environments.json``) names the machine and the command; its
figures are CPU figures for a tiny model, where the engine is cheap: they bound the environment
path's overhead, not a GPU run's throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper modules)

RESULTS = Path(__file__).parent / "results" / "environments.json"
MODEL = "tiny:digits"
ENVIRONMENTS = {"calc": "calculator:max_turns=3", "guess": "guess_number:high=1000000,max_turns=64"}
MAX_CONCURRENCY = 4
NOTE = f"CPU, {MODEL} (the random-init 2-layer character model, HF engine)"
TOOL_CALL, ANSWER = "calculator: 17 * 23", "The answer is 391."
_ids = itertools.count()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4", help="environment worker counts (one cluster each)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the worker counts, interleaved")
    p.add_argument("--clients", type=int, default=32, help="concurrent episode loops of the service side")
    p.add_argument("--seconds", type=float, default=3.0, help="measured service seconds a point a round")
    p.add_argument("--prompts", type=int, default=16, help="prompts of a generate job")
    p.add_argument("--n", type=int, default=8, help="samples (episodes) per prompt")
    p.add_argument("--repeats", type=int, default=2, help="timed generate jobs a point a round")
    p.add_argument("--turns", type=int, default=3, help="model turns of a multi-turn episode")
    p.add_argument(
        "--turn-tokens", default="8,32", help="tokens a turn at most: the first for part 2, each for part 3"
    )
    p.add_argument("--observation-tokens", type=int, default=8, help="an observation's tokens at most")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    settings = {"workers": "1", "rounds": 1, "clients": 4, "seconds": 0.5, "prompts": 2, "n": 2,
                "repeats": 1, "turn_tokens": "8"}  # fmt: skip
    args = smoke.parse(p, argv, settings)
    args.worker_counts = [int(x) for x in str(args.workers).split(",")]
    args.turn_sizes = [int(x) for x in str(args.turn_tokens).split(",")]
    if len(set(args.worker_counts)) != len(args.worker_counts) or min(args.worker_counts) < 1:
        p.error(f"--workers must be distinct counts from 1 (got {args.workers})")
    return args


# --- the fleets: one cluster per worker count ---------------------------------------------------------


@dataclass
class Fleet:
    """``count`` reward workers (processes) and a rollout worker (in this process) on their own cluster."""

    count: int
    cluster: str
    procs: list[subprocess.Popen[bytes]]
    worker: Any = None


def start_rewards(nats_url: str, cluster: str, count: int, folder: Path) -> list[subprocess.Popen[bytes]]:
    """``count`` reward workers serving :data:`ENVIRONMENTS`, each an ``rlfleet-reward serve`` process."""
    procs = []
    for k in range(count):
        worker_id = f"reward-env-{k}"
        config = folder / f"{cluster}-{worker_id}.yaml"
        config.write_text(yaml.safe_dump({
            "fleet": {"cluster": cluster, "nats_url": nats_url}, "worker_id": worker_id,
            "environments": ENVIRONMENTS, "max_concurrency": MAX_CONCURRENCY, "log_level": "WARNING",
        }))  # fmt: skip
        with config.with_suffix(".log").open("wb") as log:
            command = [sys.executable, "-m", "rlfleet.reward.main", "serve", "--config", str(config)]
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
    return procs


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def start_fleets(
    args: argparse.Namespace, nats_url: str, model_path: Path, folder: Path, stack: AsyncExitStack
) -> list[Fleet]:
    """Every fleet started and its reward workers announced; all stopped when ``stack`` closes."""
    from rlfleet.common.control.membership import WorkerRegistry
    from rlfleet.common.control.nats_transport import NatsTransport
    from rlfleet.common.schema.rollout import HFEngineSettings, RolloutSettings, RolloutWorkerConfig
    from rlfleet.common.schema.worker import FleetAddress, Placement
    from rlfleet.rollout.service import RolloutWorker

    fleets = []
    for count in args.worker_counts:  # the reward processes boot while the rollout workers load
        cluster = f"bench-env-{count}"
        fleets.append(Fleet(count, cluster, start_rewards(nats_url, cluster, count, folder)))
        stack.callback(stop_processes, fleets[-1].procs)
    for fleet in fleets:
        config = RolloutWorkerConfig(fleet=FleetAddress(cluster=fleet.cluster), worker_id="rollout-bench",
                                     model_path=str(model_path), placement=Placement(device="cpu", seed=0),
                                     rollout=RolloutSettings(engine=HFEngineSettings(type="hf")),
                                     catch_up_timeout_s=0.5)  # fmt: skip
        transport = await NatsTransport.connect(nats_url, name=f"rollout-{fleet.cluster}", tier="rollout")
        stack.push_async_callback(transport.close)
        fleet.worker = RolloutWorker(config, transport)
        await fleet.worker.start()
        stack.push_async_callback(fleet.worker.stop, "benchmark over")
        registry = WorkerRegistry(transport, fleet.cluster)
        await registry.start()
        try:
            await registry.wait_for("reward", fleet.count, timeout=120)
        except TimeoutError:
            logs = "\n".join(log.read_text()[-2000:] for log in sorted(folder.glob(f"{fleet.cluster}-*.log")))
            raise RuntimeError(
                f"the reward workers of {fleet.cluster} did not all start; their logs:\n{logs}"
            ) from None
        finally:
            await registry.stop()
    return fleets


# --- 1. the environment service alone -----------------------------------------------------------------


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user and system) process ``pid`` has used; None: this process."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_used(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by this process (``clients``) and by each named group of ``pids``."""
    return {"clients": cpu_seconds(), **{name: sum(map(cpu_seconds, group)) for name, group in pids.items()}}


async def episode_loop(client: Any, until: float, seconds: list[float], takers: set[str]) -> None:
    """Calculator episodes one after another until ``until``: reset, tool call, answer, close."""
    from rlfleet.rollout.episodes import Episode

    while time.perf_counter() < until:
        t0 = time.perf_counter()
        ep = Episode(prompt=0, sample=0, episode_id=f"svc-{next(_ids)}", prompt_ids=[])
        first = await client.reset(ep, {"answer": 391}, seed=0)
        tool = await client.step(ep, TOOL_CALL)
        final = await client.step(ep, ANSWER)
        await client.close(ep)
        assert tool.observation == "391" and final.done and final.reward == 1.0, (tool, final)
        seconds.append(time.perf_counter() - t0)
        takers.add(first.worker_id)


async def service_round(
    transport: Any, fleet: Fleet, args: argparse.Namespace, nats_pid: int
) -> dict[str, Any]:
    """``args.clients`` episode loops against ``fleet``'s reward workers for ``args.seconds`` after a
    warm-up: the episodes' seconds, the workers that took resets, the CPU seconds each side used."""
    from rlfleet.common.control.messages.rollout import EpisodeSpec
    from rlfleet.rollout.episodes import EnvClient

    spec = EpisodeSpec(env="calc", items=[], max_episode_tokens=1, env_timeout_s=30)
    client = EnvClient(transport, fleet.cluster, spec, lambda: None)
    warm = time.perf_counter() + min(0.5, args.seconds / 3)
    await asyncio.gather(*(episode_loop(client, warm, [], set()) for _ in range(args.clients)))
    pids = {"reward_workers": [p.pid for p in fleet.procs], "nats_server": [nats_pid]}
    seconds: list[float] = []
    takers: set[str] = set()
    before, start = cpu_used(pids), time.perf_counter()
    until = start + args.seconds
    await asyncio.gather(*(episode_loop(client, until, seconds, takers) for _ in range(args.clients)))
    elapsed, after = time.perf_counter() - start, cpu_used(pids)
    return {"elapsed_s": elapsed, "episode_s": seconds, "takers": takers,
            "cpu_s": {name: after[name] - before[name] for name in after}}  # fmt: skip


def service_summary(count: int, rounds: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    """A worker count's service figures over its rounds."""
    elapsed = sum(r["elapsed_s"] for r in rounds)
    episodes = [s for r in rounds for s in r["episode_s"]]
    cpu = {name: sum(r["cpu_s"][name] for r in rounds) for name in rounds[0]["cpu_s"]}
    return {
        "workers": count, "clients": clients, "episodes": len(episodes),
        "episodes_per_s": len(episodes) / elapsed, "requests_per_s": 4 * len(episodes) / elapsed,
        "episodes_per_s_by_round": [round(len(r["episode_s"]) / r["elapsed_s"], 1) for r in rounds],
        "episode_p50_ms": 1000 * statistics.median(episodes),
        "workers_taking_resets": len(set().union(*(r["takers"] for r in rounds))),
        "cores_busy": {name: round(used / elapsed, 2) for name, used in cpu.items()},
        "worker_cpu_ms_per_episode": 1000 * cpu["reward_workers"] / len(episodes),
    }  # fmt: skip


# --- 2. and 3. generate jobs through the rollout worker -----------------------------------------------


async def run_job(
    control: Any, worker: Any, prompts: list[list[int]], sampling: Any, episode: Any = None
) -> dict[str, Any]:
    """One generate job (an episode job when ``episode``); its wall time and what its batch holds."""
    from rlfleet.common.control.messages import GenerateRequest, GenerateResult
    from rlfleet.common.schema.batch import LOSS_MASK

    request = GenerateRequest(job_id=f"bench-{next(_ids)}", prompt_token_ids=prompts, sampling=sampling,
                              episode=episode)  # fmt: skip
    t0 = time.perf_counter()
    reply = await control.request(worker.own_subject, request, timeout=300, tier="rollout")
    wall = time.perf_counter() - t0
    assert isinstance(reply, GenerateResult), reply
    batch = worker.store.get_local(reply.ref.key)
    worker.store.delete(reply.ref.key)  # as a trainer does once it has the batch
    row = {"wall_s": wall, "worker_s": reply.seconds, "samples": reply.num_samples,
           "sampled_tokens": int(batch[LOSS_MASK].sum()) if LOSS_MASK in batch else reply.num_tokens,
           "response_tokens": int(batch["response_mask"].sum())}  # fmt: skip
    if episode is not None:
        row["turns_mean"] = float(batch["episode_turns"].float().mean())
        row["env_s_mean"] = float(batch["episode_env_s"].mean())
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The job with the median wall time, with every job's wall time beside it."""
    ordered = sorted(rows, key=lambda r: r["wall_s"])
    return {**ordered[(len(ordered) - 1) // 2], "walls_s": [round(r["wall_s"], 4) for r in rows]}


def calc_episode(args: argparse.Namespace) -> Any:
    from rlfleet.common.control.messages.rollout import EpisodeSpec

    items = [{"answer": (3 * i + 4) % 10} for i in range(args.prompts)]
    return EpisodeSpec(env="calc", items=items, max_turns=3, max_episode_tokens=128,
                       max_observation_tokens=args.observation_tokens)  # fmt: skip


async def rollout_round(
    control: Any, worker: Any, prompts: list[list[int]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``args.repeats`` calculator episode jobs through ``worker``, one after another."""
    from rlfleet.common.control.messages import SamplingParams

    rows = []
    for _ in range(args.repeats):
        sampling = SamplingParams(n=args.n, max_tokens=args.turn_sizes[0], temperature=1.0, seed=next(_ids))
        rows.append(await run_job(control, worker, prompts, sampling, calc_episode(args)))
    return rows


async def turns_point(
    control: Any, worker: Any, prompts: list[list[int]], args: argparse.Namespace, turn_tokens: int
) -> dict[str, Any]:
    """Multi-turn (``guess``, ``args.turns`` turns of ``turn_tokens``; the episode's ``max_turns`` ends
    it) and single-turn jobs of the same token budget, alternated."""
    from rlfleet.common.control.messages import SamplingParams
    from rlfleet.common.control.messages.rollout import EpisodeSpec

    budget = args.turns * turn_tokens
    episode = EpisodeSpec(env="guess", items=[{} for _ in prompts], max_turns=args.turns,
                          max_episode_tokens=budget + args.turns * (args.observation_tokens + 16),
                          max_observation_tokens=args.observation_tokens)  # fmt: skip
    sides: dict[str, list[dict[str, Any]]] = {"multi_turn": [], "single_turn": []}
    for _ in range(args.repeats * args.rounds):
        seed = next(_ids)
        multi = SamplingParams(n=args.n, max_tokens=turn_tokens, temperature=1.0, seed=seed)
        sides["multi_turn"].append(await run_job(control, worker, prompts, multi, episode))
        single = SamplingParams(n=args.n, max_tokens=budget, temperature=1.0, seed=seed)
        sides["single_turn"].append(await run_job(control, worker, prompts, single))
    out: dict[str, Any] = {"turns": args.turns, "turn_tokens": turn_tokens, "token_budget": budget}
    for name, rows in sides.items():
        row = median_row(rows)
        out[name] = {**row, "sampled_tokens_per_s": row["sampled_tokens"] / row["wall_s"]}
    multi_row, single_row = out["multi_turn"], out["single_turn"]
    out["wall_ratio"] = multi_row["wall_s"] / single_row["wall_s"]
    out["tokens_per_s_ratio"] = multi_row["sampled_tokens_per_s"] / single_row["sampled_tokens_per_s"]
    return out


# --- the run ------------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, nats: Any, model_path: Path, folder: Path) -> dict[str, Any]:
    """Start the fleets, then measure (see the module docstring); the results by part."""
    from rlfleet.common.control.messages import SamplingParams
    from rlfleet.common.control.nats_transport import NatsTransport

    async with AsyncExitStack() as stack:
        fleets = await start_fleets(args, nats.url, model_path, folder, stack)
        control = await NatsTransport.connect(nats.url, name="controller-bench", tier="controller")
        stack.push_async_callback(control.close)
        env_side = await NatsTransport.connect(nats.url, name="env-client-bench", tier="rollout")
        stack.push_async_callback(env_side.close)
        tokenizer = fleets[0].worker.engine.tokenizer
        questions = [f"What is {i % 10} + {(3 * i) % 10}? " for i in range(args.prompts)]
        prompts = [tokenizer(q)["input_ids"] for q in questions]
        warm = SamplingParams(n=args.n, max_tokens=args.turn_sizes[0], seed=1)
        for fleet in fleets:  # each engine's first call
            await run_job(control, fleet.worker, prompts, warm, calc_episode(args))
        service: dict[int, list[dict[str, Any]]] = {f.count: [] for f in fleets}
        rollout: dict[int, list[dict[str, Any]]] = {f.count: [] for f in fleets}
        for k in range(args.rounds):  # interleaved: a slow spell of the host falls on every count
            for fleet in fleets:
                service[fleet.count].append(await service_round(env_side, fleet, args, nats.pid))
                rollout[fleet.count] += await rollout_round(control, fleet.worker, prompts, args)
                last = service[fleet.count][-1]
                print(f"  round {k + 1}, {fleet.count} worker(s): service "
                      f"{len(last['episode_s']) / last['elapsed_s']:.0f} episodes/s, rollout "
                      f"{rollout[fleet.count][-1]['samples'] / rollout[fleet.count][-1]['wall_s']:.0f} "
                      "episodes/s", flush=True)  # fmt: skip
        largest = max(fleets, key=lambda f: f.count)
        turns = [{"workers": largest.count, **await turns_point(control, largest.worker, prompts, args, size)}
                 for size in args.turn_sizes]  # fmt: skip
    rollout_rows = []
    for count, rows in rollout.items():
        row = median_row(rows)
        rollout_rows.append({"workers": count, **row, "episodes_per_s": row["samples"] / row["wall_s"]})
    return {"service": [service_summary(count, rounds, args.clients) for count, rounds in service.items()],
            "rollout": rollout_rows, "turns": turns}  # fmt: skip


def report(result: dict[str, Any]) -> None:
    print(f"\n{NOTE}; {len(os.sched_getaffinity(0))} cores")
    print("\nenvironment service alone (calculator: reset, tool call, answer, close)")
    print(f"{'workers':>8}{'clients':>9}{'episodes/s':>12}{'requests/s':>12}{'p50 ms':>9}{'took resets':>13}"
          f"{'cores: clients':>16}{'workers':>9}{'nats':>6}{'worker CPU ms/ep':>18}")  # fmt: skip
    for r in result["service"]:
        cores = r["cores_busy"]
        print(f"{r['workers']:>8}{r['clients']:>9}{r['episodes_per_s']:>12.1f}{r['requests_per_s']:>12.1f}"
              f"{r['episode_p50_ms']:>9.1f}{r['workers_taking_resets']:>13}{cores['clients']:>16.2f}"
              f"{cores['reward_workers']:>9.2f}{cores['nats_server']:>6.2f}"
              f"{r['worker_cpu_ms_per_episode']:>18.2f}")  # fmt: skip
    print("\nend to end through one rollout worker (calculator episodes; the random model answers at once)")
    print(f"{'workers':>8}{'episodes':>10}{'wall s':>9}{'episodes/s':>12}{'turns':>7}{'env s/ep':>10}")
    for r in result["rollout"]:
        print(f"{r['workers']:>8}{r['samples']:>10}{r['wall_s']:>9.3f}{r['episodes_per_s']:>12.1f}"
              f"{r['turns_mean']:>7.2f}{r['env_s_mean']:>10.4f}")  # fmt: skip
    print("\nmulti-turn (guess_number) against single-turn, the same token budget; one rollout worker")
    print(f"{'side':>24}{'samples':>9}{'sampled':>9}{'response':>10}{'wall s':>9}{'tokens/s':>10}"
          f"{'env s/ep':>10}{'wall x':>8}{'tokens/s x':>12}")  # fmt: skip
    for t in result["turns"]:
        for name, label in (("multi_turn", f"{t['turns']} turns x {t['turn_tokens']}"),
                            ("single_turn", f"1 turn x {t['token_budget']}")):  # fmt: skip
            r = t[name]
            ratios = (
                f"{t['wall_ratio']:>8.2f}{t['tokens_per_s_ratio']:>12.2f}" if name == "multi_turn" else ""
            )
            print(f"{label:>24}{r['samples']:>9}{r['sampled_tokens']:>9}{r['response_tokens']:>10}"
                  f"{r['wall_s']:>9.3f}{r['sampled_tokens_per_s']:>10.1f}{r.get('env_s_mean', 0.0):>10.4f}"
                  f"{ratios}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from async_pipeline import machine

    from rlfleet.common.control.embedded_nats import EmbeddedNats
    from rlfleet.controller.models import resolve_model

    model_path = resolve_model(MODEL)
    start = time.perf_counter()
    with EmbeddedNats() as nats, tempfile.TemporaryDirectory(prefix="rlfleet-bench-env-") as tmp:
        result = asyncio.run(bench(args, nats, model_path, Path(tmp)))
    seconds = time.perf_counter() - start
    report(result)
    data = {
        "benchmark": "environments: episodes/s against environment workers; multi-turn against single-turn",
        "note": f"{NOTE}: the environment path's overhead, not a GPU run's throughput",
        "environments": ENVIRONMENTS, "reward_max_concurrency": MAX_CONCURRENCY, "model": MODEL,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "worker_counts", "turn_sizes")},
        **result, "run_s": round(seconds, 1), "machine": machine("cpu"),
        "command": " ".join(["python", *sys.argv]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{seconds:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
