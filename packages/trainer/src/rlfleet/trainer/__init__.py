"""Training service for rlfleet: actor/ref/critic, RL losses, weight publishing."""

__version__ = "0.1.0"
