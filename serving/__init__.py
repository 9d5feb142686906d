"""sightline, an observability-first LLM serving stack: one package per process below, and here what they all
share (flags, sockets and codec, process setup, model files, the CLI)."""

__version__ = "0.1.0"
