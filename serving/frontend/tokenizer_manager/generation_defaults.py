"""Sampling defaults from the model directory's `generation_config.json` (`--generation-config auto`).

Model authors ship the sampling they tuned (Qwen3: temperature 0.6, top_p 0.95, top_k 20);
vLLM applies them to requests that leave those fields unset, so a client moving from vLLM
sees the same outputs here.  The same fields as vLLM: temperature, top_p, top_k, min_p,
repetition_penalty, and `max_new_tokens` as the default `max_tokens`.  Each request records
where each effective value came from (`GenerateReqInput.param_sources`: `request`,
`generation_config` or `default`), on its span and in /debug/requests.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FIELDS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}
SOURCED = tuple(FIELDS)  # the sampling fields whose source a request records


def load(model_dir: str | Path | None, mode: str) -> dict[str, Any]:
    """The defaults `generation_config.json` sets (empty with mode `none`, or no such file); logged once."""
    if mode == "none" or not model_dir:
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        log.info("generation defaults: %s has no generation_config.json; OpenAI's defaults apply", model_dir)
        return {}
    except (OSError, ValueError) as exc:
        log.warning("generation defaults: cannot read %s (%s); OpenAI's defaults apply", path, exc)
        return {}
    found = {}
    for name, typ in FIELDS.items():
        value = raw.get(name) if isinstance(raw, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if typ is int and value != int(value) or not math.isfinite(value):
            continue
        found[name] = typ(value)
    log.info("generation defaults from %s: %s", path, found or "none of the sampling fields")
    return found


def resolve(name: str, requested: Any, defaults: dict[str, Any], fallback: Any, sources: dict[str, str]) -> Any:
    """The effective value of a sampling field, recording its source in `sources`."""
    if requested is not None:
        sources[name] = "request"
        return requested
    if name in defaults:
        sources[name] = "generation_config"
        return defaults[name]
    sources[name] = "default"
    return fallback
