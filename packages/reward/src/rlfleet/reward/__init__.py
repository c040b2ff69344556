"""Reward service for rlfleet: rule rewards, reward models, RewardScaler, tenants.

The library API: :func:`build_reward` turns a spec (``"0.7*rm:path=/models/rm + 0.3*concise"``)
into a :class:`CompositeReward`; :class:`RewardScaler` scales its scores. The service
(``rlfleet-reward serve``) serves specs on named endpoints to tenants, with hot swaps. See the
package README.
"""

import importlib.metadata

from rlfleet.reward.composite import CompositeReward, ScoreBatch
from rlfleet.reward.registry import BUILTINS, MODELS, RULES, build_reward, parse_reward_spec
from rlfleet.reward.reward_model import RewardModel
from rlfleet.reward.scaler import RewardScaler, ScalerConfig
from rlfleet.reward.similarity import Similarity
from rlfleet.reward.spec import ComponentSpec, RewardSpec, format_reward_spec

__version__ = importlib.metadata.version("rlfleet-reward")  # written once: pyproject.toml

__all__ = [
    "BUILTINS",
    "MODELS",
    "RULES",
    "ComponentSpec",
    "CompositeReward",
    "RewardModel",
    "RewardScaler",
    "RewardSpec",
    "ScalerConfig",
    "ScoreBatch",
    "Similarity",
    "build_reward",
    "format_reward_spec",
    "parse_reward_spec",
]
