"""Generation service for rlfleet: engines (HF transformers, vLLM) behind one protocol."""

import importlib.metadata

__version__ = importlib.metadata.version("rlfleet-rollout")  # written once: pyproject.toml
