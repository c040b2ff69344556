"""Reward service for rlfleet: rule rewards, reward models, RewardScaler, tenants."""

__version__ = "0.1.0"
