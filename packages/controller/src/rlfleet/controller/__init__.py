"""The rlfleet single controller: datasets, GRPO/PPO/DPO trainers, embedded launcher, CLI."""

__version__ = "0.1.0"
