"""Whether a ``launcher=ray`` job fits its Ray cluster (issue 36): the sums, the per-node check of
the trainer's placement group, the one-line refusals, and the local Ray's size."""

from __future__ import annotations

import pytest

from rlfleet.controller import TrainerConfig
from rlfleet.controller.errors import RayJobDoesNotFit, WorkerStartTimeout
from rlfleet.controller.launcher import WorkerSpec, trainer_rank_specs
from rlfleet.controller.ray_fit import ClusterCapacity, JobReservation, TierNeed, fit_problem, local_ray_cpus
from rlfleet.controller.ray_launcher import job_reservation

pytestmark = pytest.mark.timeout(30)

CPU_ONLY = JobReservation(
    [
        TierNeed("trainer", 1, {"CPU": 1.0}),
        TierNeed("rollout", 2, {"CPU": 1.0}),
        TierNeed("reward", 1, {"CPU": 1.0}),
    ]
)


def _cluster(
    total: dict[str, float], nodes: list[dict[str, float]] | None = None, local: bool = False
) -> ClusterCapacity:
    where = "the local Ray cluster at 10.0.0.1:6379" if local else "the Ray cluster at 10.0.0.1:6379"
    return ClusterCapacity(total, [total] if nodes is None else nodes, where, local)


def test_a_job_that_fits_passes() -> None:
    assert fit_problem(CPU_ONLY, _cluster({"CPU": 4.0, "memory": 1e9})) is None
    assert fit_problem(CPU_ONLY, _cluster({"CPU": 8.0, "GPU": 2.0}, [{"CPU": 4.0}, {"CPU": 4.0}])) is None


def test_too_few_cpus_names_both_sides_and_the_fix_on_one_line() -> None:
    problem = fit_problem(CPU_ONLY, _cluster({"CPU": 2.0}, local=True))
    assert problem == (
        "the job reserves 4 CPUs (trainer 1, rollout 2 x 1, reward 1) and 0 GPUs; the local Ray cluster at "
        "10.0.0.1:6379 has 2 CPUs, 0 GPUs; set launcher.num_cpus=4 for a local Ray (or leave it unset), or "
        "lower the reservations (launcher.resources, rollout.workers, num_train_workers)"
    )
    remote = fit_problem(CPU_ONLY, _cluster({"CPU": 3.0}))
    assert remote is not None and "the Ray cluster at 10.0.0.1:6379 has 3 CPUs, 0 GPUs" in remote
    assert remote.endswith("add nodes that have them to the cluster, or lower the reservations "
                           "(launcher.resources, rollout.workers, num_train_workers)")  # fmt: skip


def test_gpus_and_custom_resources_are_summed_per_tier() -> None:
    job = JobReservation([
        TierNeed("trainer", 2, {"CPU": 1.0, "GPU": 1.0, "gpu_node": 1.0}, packed=True),
        TierNeed("rollout", 3, {"CPU": 1.0, "GPU": 0.5, "gpu_node": 1.0}),
        TierNeed("reward", 1, {"CPU": 2.0, "cpu_node": 1.0}),
    ])  # fmt: skip
    assert job.total() == {"CPU": 7.0, "GPU": 3.5, "gpu_node": 5.0, "cpu_node": 1.0}
    ample = {"CPU": 16.0, "GPU": 4.0, "gpu_node": 8.0, "cpu_node": 1.0}
    assert fit_problem(job, _cluster(ample)) is None
    few_gpus = fit_problem(job, _cluster({**ample, "GPU": 3.0}))
    assert few_gpus is not None and few_gpus.startswith(
        "the job reserves 7 CPUs (trainer 2 x 1, rollout 3 x 1, reward 2), 3.5 GPUs (trainer 2 x 1, rollout "
        "3 x 0.5), 1 cpu_node (reward 1) and 5 gpu_node (trainer 2 x 1, rollout 3 x 1); the Ray cluster at "
    ), few_gpus
    assert "has 16 CPUs, 3 GPUs, 1 cpu_node, 8 gpu_node;" in few_gpus
    no_label = fit_problem(job, _cluster({"CPU": 16.0, "GPU": 4.0, "gpu_node": 8.0}, local=True))
    assert no_label is not None and "has 16 CPUs, 4 GPUs, 0 cpu_node, 8 gpu_node;" in no_label
    assert "a local Ray has this machine's GPUs and no custom resources" in no_label


def test_the_trainers_strict_pack_group_must_fit_one_node() -> None:
    job = JobReservation([TierNeed("trainer", 2, {"CPU": 1.0, "GPU": 1.0}, packed=True)])
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    problem = fit_problem(job, _cluster({"CPU": 16.0, "GPU": 2.0}, nodes))
    assert problem == (
        "the trainer's 2 ranks reserve {CPU: 2, GPU: 2} together on one node (one STRICT_PACK placement "
        "group), and no node of the Ray cluster at 10.0.0.1:6379 has that much (its nodes: {CPU: 8, GPU: 1});"
        " lower num_train_workers or the trainer's launcher.resources, or add a larger node"
    )
    unpacked = JobReservation([TierNeed("rollout", 2, {"CPU": 1.0, "GPU": 1.0})])  # one per node: fine
    assert fit_problem(unpacked, _cluster({"CPU": 16.0, "GPU": 2.0}, nodes)) is None
    wide = JobReservation([TierNeed("rollout", 1, {"GPU": 2.0})])
    single = fit_problem(wide, _cluster({"CPU": 16.0, "GPU": 2.0}, nodes))
    assert single is not None and single.startswith(
        "each rollout worker reserves {GPU: 2} on one node, and no"
    )


def test_a_local_ray_gets_what_the_job_reserves_when_the_machine_has_less() -> None:
    assert local_ray_cpus(3.0, 2) == 3
    assert local_ray_cpus(2.5, 2) == 3
    assert local_ray_cpus(2.0, 2) is None  # Ray's own count suffices
    assert local_ray_cpus(1.0, 16) is None


def test_job_reservation_counts_every_worker_and_the_peak_of_the_rollout_schedule() -> None:
    scale = {3: {"default": 4}, 10: {"default": 1}}
    config = TrainerConfig(launcher="ray", device="cpu", rollout={"workers": 2, "scale": scale})
    specs = [*trainer_rank_specs({}, 2), WorkerSpec("reward", "reward-0", {}),
             WorkerSpec("rollout", "rollout-0", {}), WorkerSpec("rollout", "rollout-1", {})]  # fmt: skip
    job = job_reservation(config, specs)
    assert job.total() == {"CPU": 7.0}
    trainer = next(n for n in job.needs if n.tier == "trainer")
    assert (trainer.workers, trainer.packed, trainer.on_one_node()) == (2, True, {"CPU": 2.0})
    assert next(n for n in job.needs if n.tier == "rollout").workers == 4


def test_the_errors_are_one_line_each() -> None:
    refused = RayJobDoesNotFit("the job reserves 4 CPUs", {"CPU": 4.0}, {"CPU": 2.0})
    assert str(refused) == "launcher=ray: the job reserves 4 CPUs" and refused.needed == {"CPU": 4.0}
    late = WorkerStartTimeout("rollout-0's Ray actor", 120.0, {"CPU": 1.0}, {"CPU": 0.0, "memory": 1e9})
    assert str(late) == (
        "rollout-0's Ray actor did not start within 120 s; it reserves {CPU: 1}; the cluster has "
        "{CPU: 0, GPU: 0} available (raise startup_timeout_s if other work frees it later)"
    )
