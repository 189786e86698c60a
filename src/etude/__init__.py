"""etude: an open training stack for agentic coding models."""

__version__ = "0.1.0"
