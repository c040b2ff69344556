"""The vLLM engine: ``vllm.LLM`` behind the rollout engine protocol (imports vLLM only when built).

- :mod:`.engine`: :class:`VLLMEngine` (generate, in-place weight loads, sleep/wake, CUDA IPC loads)
- :mod:`.outputs`: sampling parameters in, completions out
- :mod:`.runtime`: settings checks, the supported vLLM range, the environment, the in-process slot
- :mod:`.weights`: weight buckets on their way in (tied names, per-block staging, the wire payload)
- :mod:`.worker`: rlfleet's extension of vLLM's worker process (the in-place reloads themselves)
"""

from rlfleet.rollout.engines.vllm.engine import LOGPROBS_MODE, VLLMEngine

__all__ = ["LOGPROBS_MODE", "VLLMEngine"]
