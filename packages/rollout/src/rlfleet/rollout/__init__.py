"""Generation service for rlfleet: engines (HF transformers, vLLM) behind one protocol."""

__version__ = "0.1.0"
