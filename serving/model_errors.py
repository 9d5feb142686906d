"""How a model that cannot be loaded is reported: one exception type and one exit code (and the exit code
of the other start failure a child reports in one line: a KV-events endpoint it cannot open).

Kept apart from `serving.model_files` so that what it calls (`serving.gguf_rope`'s
conversion) can raise the same error without importing it back.
"""

from __future__ import annotations

EXIT_MODEL_LOAD = 3  # exit code of a child process that could not load the model (it printed why, in one line)
EXIT_KV_EVENTS = 4  # exit code of a Scheduler whose --kv-events-endpoint could not be opened (the same)


class ModelLoadError(Exception):
    """A model that cannot be found or read; its message is one line meant for users."""
