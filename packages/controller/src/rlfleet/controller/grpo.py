"""``GRPOTrainer``: the single controller's GRPO loop, usable as a library.

One step, as the controller runs it (the controller moves refs, never tensors)::

    prompts ──► fleet.generate ──► rollout refs ──► fleet.score ──► scores
                                        │                              │
                                        └──────► fleet.train_step ◄────┘ ──► metrics
    rollout workers ◄── fleet.load_weights ◄── fleet.publish_weights (version + 1)
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rlfleet.common.messages import SamplingParams
from rlfleet.controller.algo_config import advance_kl_controller
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.loop import StepLoop, StepResult
from rlfleet.controller.routing import RolloutFn, RolloutRouter, RouteSummary

__all__ = ["GRPOTrainer", "StepResult"]

logger = logging.getLogger(__name__)


class GRPOTrainer(StepLoop):
    """Group Relative Policy Optimization over the rlfleet tiers.

    ``reward`` is a reward spec string of rlfleet-reward (``"concise:max_words=50 + 0.5*relevance"``)
    or its dict form. ``dataset`` is a :class:`PromptDataset` or a path to one. With
    ``config.algorithm`` set to ``rloo`` or ``reinforce_pp`` the same loop trains those: only the
    trainer's advantages differ.
    """

    def __init__(
        self,
        actor_model_name: str,
        reward: str | dict[str, Any],
        dataset: PromptDataset | str,
        config: TrainerConfig | None = None,
    ) -> None:
        super().__init__(actor_model_name, reward, dataset, config or TrainerConfig())
        pools = list(self.config.rollout_pools)
        self.router = RolloutRouter(self.tokenizer, self.config.max_response_length, self.own_store, pools)
        self.last_routes: dict[str, RouteSummary] = {}
        """Where the last step's prompts went: route (pool, ``any`` or ``text``) -> rows and workers."""

    def set_rollout_fn(self, fn: RolloutFn | None) -> None:
        """Route each prompt of the next steps: ``fn(item)`` sees a :class:`PromptItem` and returns the
        name of the rollout pool that serves it (``TrainerConfig.rollout_pools``, or a joined worker's
        ``--pool``), ``None`` for any pool, or the response text itself (one ``str`` for every sample,
        or a list of ``group_size``). ``None`` instead of a fn restores the default: every pool serves
        every prompt. See :mod:`rlfleet.controller.routing`.
        """
        if fn is not None and not callable(fn):
            raise TypeError(
                f"set_rollout_fn takes a function of a PromptItem (or None), got {type(fn).__name__}"
            )
        self.router.fn = fn

    # --- the step -------------------------------------------------------------------------

    def _sampling(self, greedy: bool = False) -> SamplingParams:
        cfg = self.config
        return SamplingParams(
            n=1 if greedy else cfg.group_size,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_tokens=cfg.max_response_length,
            seed=cfg.seed + self.global_step,
        )

    async def _step(self, batch: list[PromptItem]) -> dict[str, float]:
        cfg = self.config
        fleet = self.fleet
        t0 = time.perf_counter()
        routed = await self.router.generate(fleet, batch, self._sampling(), self.weight_version)
        results = routed.results
        self.last_routes = routed.routes
        t1 = time.perf_counter()
        metadata = self._chunk_metadata(routed.items, results)
        scored = await fleet.score(results, metadata, cfg.reward_endpoint)
        scores = [s for result in scored for s in result.scores]
        t2 = time.perf_counter()
        hyper = {
            "kl_coef": self.kl_coef,
            "group_size": cfg.group_size,
            "num_updates": cfg.rollout_batch_size // cfg.train_batch_size,
        }
        refs = [r.ref for r in results]
        stepped = await fleet.train_step(self.global_step + 1, refs, scores, hyper, algorithm=cfg.algorithm)
        t3 = time.perf_counter()
        published = await fleet.publish_weights(cfg.weight_bucket_mb, carrier=cfg.weight_carrier,
                                                dtype=cfg.publish_dtype())  # fmt: skip
        loaded = await fleet.load_weights(published)
        self.weight_version = published.weight_version
        t4 = time.perf_counter()
        await self._release(results)
        metrics = dict(stepped.metrics)
        metrics.update(_reward_metrics(scores, scored))
        metrics.update(routed.metrics())
        generated = sum(r.num_tokens for r in results if r.worker_id != "controller")  # not fn-written
        metrics.update({
            "weight_version": float(self.weight_version),
            "rollout/weight_version_min": float(min(r.weight_version for r in loaded)),
            "rollout/load_s_max": max(r.seconds for r in loaded),
            "publish/ipc_workers": float(sum(r.carrier == "cuda_ipc" for r in loaded)),
            "kl_coef": float(self.kl_coef),  # the one this step used; the controller moves on below
            "time/generate_s": t1 - t0,
            "time/score_s": t2 - t1,
            "time/train_s": t3 - t2,
            "time/publish_s": t4 - t3,
            "time/step_s": t4 - t0,
            "throughput/gen_tok_s": generated / max(t1 - t0, 1e-9),
            "publish/mb": published.nbytes / 2**20,
            "publish/trainer_s": published.seconds,
            "publish/mb_s": published.nbytes / 2**20 / max(published.seconds, 1e-9),
        })  # fmt: skip
        advance_kl_controller(self.kl_controller, metrics, len(scores))
        return metrics

    @staticmethod
    def _chunk_metadata(batch: list[PromptItem], results: list[Any]) -> list[list[dict[str, Any]]]:
        """Per-prompt metadata, split the way the fleet split the prompts (contiguous chunks)."""
        out: list[list[dict[str, Any]]] = []
        start = 0
        for result in results:
            out.append([dict(item.metadata) for item in batch[start : start + result.num_prompts]])
            start += result.num_prompts
        return out


def _reward_metrics(scores: list[float], scored: list[Any]) -> dict[str, float]:
    import statistics

    metrics = {
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        "reward/max": max(scores),
        "reward/min": min(scores),
    }
    names = {name for result in scored for name in result.components}
    for name in sorted(names):
        values = [v for result in scored for v in result.components.get(name, [])]
        if values:
            metrics[f"reward/{name}"] = statistics.fmean(values)
    return metrics
