"""sightline: an observability-first LLM serving stack."""

__version__ = "0.1.0"
