"""Wire protocol, transports and config base shared by every rlfleet tier."""

__version__ = "0.1.0"
