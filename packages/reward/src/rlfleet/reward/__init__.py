"""Reward service for rlfleet: rule rewards, reward models, RewardScaler, tenants.

The library API: :func:`build_reward` turns a spec (``"0.7*concise:max_words=50 + 0.3*relevance"``)
into a :class:`CompositeReward`; :class:`RewardScaler` scales its scores. See the package README.
"""

from rlfleet.reward.composite import CompositeReward, ScoreBatch
from rlfleet.reward.registry import RULES, build_reward, parse_reward_spec
from rlfleet.reward.scaler import RewardScaler, ScalerConfig
from rlfleet.reward.spec import ComponentSpec, RewardSpec, format_reward_spec

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "ComponentSpec",
    "CompositeReward",
    "RewardScaler",
    "RewardSpec",
    "ScalerConfig",
    "ScoreBatch",
    "build_reward",
    "format_reward_spec",
    "parse_reward_spec",
]
