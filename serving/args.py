"""`ServerArgs`: the one configuration object, validated once, turned into CLI flags.

Every field's `help` metadata is its documentation; `add_cli_args` makes a flag of
each (`--max-running-requests` for `max_running_requests`), so no knob exists that
the CLI cannot set.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    # -- model --------------------------------------------------------------
    model: str = _opt("smollm2-135m", "Model to serve: 'smollm2-135m' (bundled), 'tiny-random', a .gguf file or a local HF directory.")
    served_model_name: str | None = _opt(None, "Name clients put in the `model` field (default: derived from --model).")
    cache_dir: str | None = _opt(None, "Where converted models are cached (default: $SIGHTLINE_CACHE_DIR or ~/.cache/sightline).")
    context_length: int | None = _opt(None, "Maximum prompt + output tokens per request (default: the model's, capped by --max-total-tokens).")
    # -- engine ---------------------------------------------------------------
    max_total_tokens: int = _opt(32768, "KV pool size in token slots (per layer); bounds the tokens of all running requests.")
    max_running_requests: int = _opt(64, "Most requests in the running batch at once.")
    max_prefill_tokens: int = _opt(512, "Prompt tokens prefilled per step; longer prompts are chunked across steps.")
    num_threads: int | None = _opt(None, "torch intra-op threads for the forward pass (default: all CPU cores).")
    random_seed: int = _opt(0, "Seeds the generators of requests that give no seed of their own.")
    # -- server -------------------------------------------------------------------
    host: str = _opt("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _opt(8000, "Port the HTTP server listens on.")
    log_level: str = _opt("info", "Log level of every process: debug, info, warning, error.")
    heartbeat_interval: float = _opt(0.5, "Seconds between the idle Scheduler's stats/heartbeat messages.")
    startup_timeout: float = _opt(600.0, "Seconds to wait for the Scheduler and Detokenizer to report ready.")
    max_stop_strings: int = _opt(16, "Most stop strings one request may give.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("max_total_tokens", "max_running_requests", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("--num-threads must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("--log-level must be one of debug, info, warning, error")
        if self.heartbeat_interval <= 0 or self.startup_timeout <= 0:
            raise ValueError("--heartbeat-interval and --startup-timeout must be > 0")

    @property
    def cache_dir_path(self) -> Path | None:
        return Path(self.cache_dir).expanduser() if self.cache_dir else None

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1

    # -- CLI ------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            typ = hints[f.name]
            base = next((t for t in getattr(typ, "__args__", (typ,)) if t is not type(None)), str)
            if base is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            else:
                parser.add_argument(flag, type=base, default=f.default, help=f.metadata["help"] + f" [default: {f.default}]")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
