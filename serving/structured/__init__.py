"""Structured outputs: turning a `StructuredOutput` into a grammar and checking it (no torch here).

The front end checks a spec with `check` before the request reaches the engine (a 400 naming the
problem); the engine compiles the same spec into per-request matchers (serving.engine.grammar).
llguidance is the backend; `backend.py` is the one place that knows it.
"""

from serving.structured.backend import GrammarError, backend_tokenizer, check, to_backend_grammar

__all__ = ["GrammarError", "backend_tokenizer", "check", "to_backend_grammar"]
