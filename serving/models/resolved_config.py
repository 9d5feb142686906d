"""A model's transformers configs, resolved once and kept as JSON, so that a Scheduler start need not import
transformers.

`AutoConfig.from_pretrained` imports transformers (~0.8 s of CPU) and the config class's module, which in
transformers 5 also imports `torch.distributed.tensor` (~0.9 s): together about a third of the CPU a small
model's Scheduler spends starting, at every start and every engine restart.  What it returns depends only on
config.json (and generation_config.json for the generation config) and the transformers version, and its
`to_dict()` has every default filled in.  So the first load writes both dicts to the cache directory under a
hash of those inputs, and later loads read them back as `ResolvedConfig`s: plain attribute views that the
engine reads exactly as it reads a transformers config (attributes only).  What needs transformers' own object
(a scaled rope type's init function) asks `to_transformers()`; the transformers model the tests compare with
loads its own from the directory.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from importlib.metadata import version
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
FORMAT = 1  # bump when what is stored changes


class ResolvedConfig:
    """Attribute access over a transformers config's `to_dict()`, as the engine reads a config."""

    def __init__(self, values: dict[str, Any], source: Path) -> None:
        self.__dict__.update(values)
        self._values, self._source = values, source

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._values)

    def to_transformers(self) -> Any:
        """The transformers config itself (imports transformers): for what reads more than attributes."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self._source)

    def __repr__(self) -> str:
        return f"ResolvedConfig({self._values.get('model_type')!r}, {self._source})"


def _key(path: Path) -> str:
    """What the resolved configs depend on: the two files' bytes and the transformers version."""
    h = hashlib.sha256(f"{FORMAT}|{version('transformers')}".encode())
    for name in ("config.json", "generation_config.json"):
        f = path / name
        h.update(b"|" + (f.read_bytes() if f.is_file() else b"-"))
    return h.hexdigest()[:24]


def _resolve(path: Path) -> tuple[Any, Any]:
    """transformers' own (config, generation config) of the directory."""
    from transformers import AutoConfig, GenerationConfig

    from serving.model_files import quiet_transformers

    quiet_transformers()
    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # none saved: what transformers derives from the config when it loads the model
        generation = GenerationConfig.from_model_config(config)
    return config, generation


def load_configs(path: Path, cache_dir: Path) -> tuple[Any, Any]:
    """(config, generation config) of the model directory `path`: from the cache when resolved before (two
    `ResolvedConfig`s), else transformers' own, stored for the next start.  transformers' errors propagate."""
    from serving.models.registry import architectures_of

    stored = cache_dir / "configs" / f"{_key(path)}.json"
    try:
        values = json.loads(stored.read_text())
        return ResolvedConfig(values["config"], path), ResolvedConfig(values["generation"], path)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    config, generation = _resolve(path)
    values = {"config": config.to_dict(), "generation": generation.to_dict()}
    values["config"]["architectures"] = architectures_of(config)  # named, so a later start need not look it up
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        tmp = stored.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(values))
        os.replace(tmp, stored)
    except (OSError, TypeError, ValueError) as exc:  # a read-only cache, a value JSON cannot hold: resolve each time
        log.debug("resolved config of %s not stored: %s", path, exc)
    return config, generation
