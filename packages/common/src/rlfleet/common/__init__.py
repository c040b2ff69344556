"""Wire protocol, transports and config base shared by every rlfleet tier."""

import importlib.metadata

__version__ = importlib.metadata.version("rlfleet-common")  # written once: pyproject.toml
