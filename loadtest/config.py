"""Workloads, scenarios and SLOs from `loadtest/workloads.yaml`, as typed dataclasses.

A workload says what one request looks like (endpoint, prompt and output lengths, a
prefix shared by all its requests, `ignore_eos`); a scenario mixes workloads under an arrival mode (closed-loop users or
open-loop Poisson arrivals) and a load shape (constant, steps, sweep).  The `Plan` is a
scenario resolved against the server (model name, context window) and handed to the
Locust process as JSON, so the locustfile never reads YAML or guesses.  Under plain
`locust -f loadtest/locustfile.py` there is no plan file: the locustfile builds a Plan
from its own command-line arguments and this config.

Per-request goodput thresholds (`ttft_ms`, `tpot_ms`) and the objective (the fraction of
requests that must meet them) default to the TTFT and TPOT SLOs of
`dashboards/slo.yaml`, the spec the alerts are generated from, so a load test judges
what production pages on; `goodput:` in the config (or a scenario) overrides them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from telemetry.slo_spec import SLO_SPEC, slo_spec_goodput, spec_found

DEFAULT_CONFIG = Path(__file__).with_name("workloads.yaml")
FALLBACK_OBJECTIVE = 0.99  # only when the SLO spec is absent (an install without the dashboards package)
CONTEXT_MARGIN = 8  # "near the context": context − max_tokens − this many tokens
Range = tuple[int, int]


class ConfigError(ValueError):
    """A config or command-line value that makes no sense; the CLI exits 2."""


def parse_mix(text: str) -> dict[str, float]:
    """`chat` or `chat=3,fixed=1` → {workload: weight} (a bare name weighs 1)."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError(f"mix {text!r}: want NAME or NAME=WEIGHT,..., e.g. chat=3,fixed=1") from None
    if not mix:
        raise ConfigError("the mix names no workload")
    return mix


def _range(value: Any, what: str) -> Range:
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ConfigError(f"{what}: want a positive int or [lo, hi], got {value!r}")
    return lo, hi


def _max_tokens(value, what: str) -> Range | None:
    """A range, or None (`max_tokens: none`): the field is left out of the requests."""
    return None if value is None or value == "none" else _range(value, what)


@dataclass(frozen=True)
class Workload:
    name: str
    endpoint: str  # chat | completions | embeddings
    max_tokens: Range | None  # None: the requests set no max_tokens (the openai client's default)
    prompt_tokens: Range | str | None = None  # completions: token-id prompt length, or "context"
    prompts: tuple[str, ...] = ()  # chat: user messages to draw from
    # a prefix every request of the workload starts with (the prefix cache's case): chat, a system
    # message of about this many tokens; completions, exactly this many fixed token ids
    system_prompt_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    timeout_s: float = 300.0
    inputs: Range | None = None  # embeddings: inputs per request

    @classmethod
    def from_dict(cls, name: str, d: dict) -> "Workload":
        d = dict(d)
        endpoint = d.pop("endpoint", "chat")
        if endpoint not in ("chat", "completions", "embeddings"):
            raise ConfigError(f"workload {name}: endpoint must be chat, completions or embeddings")
        pt = d.pop("prompt_tokens", None)
        if pt is not None and pt != "context":
            pt = _range(pt, f"workload {name}: prompt_tokens")
        if endpoint == "embeddings":  # `inputs` token-id inputs of `prompt_tokens` each; nothing generated
            if pt is None or pt == "context":
                raise ConfigError(f"workload {name}: embeddings workloads take prompt_tokens (per input)")
            inputs = _range(d.pop("inputs", 1), f"workload {name}: inputs")
            try:
                return cls(name=name, endpoint=endpoint, prompt_tokens=pt, max_tokens=None, inputs=inputs, **d)
            except TypeError as exc:
                raise ConfigError(f"workload {name}: {exc}") from None
        if (endpoint == "completions") != (pt is not None):
            raise ConfigError(
                f"workload {name}: completions workloads take prompt_tokens (exact lengths), "
                "chat workloads take prompts"
            )
        spt = d.pop("system_prompt_tokens", 0)
        if not (isinstance(spt, int) and not isinstance(spt, bool) and spt >= 0):
            raise ConfigError(f"workload {name}: system_prompt_tokens: want a whole number ≥ 0, got {spt!r}")
        try:
            return cls(
                name=name,
                endpoint=endpoint,
                prompt_tokens=pt,
                system_prompt_tokens=spt,
                max_tokens=_max_tokens(d.pop("max_tokens", 128), f"workload {name}: max_tokens"),
                prompts=tuple(d.pop("prompts", ())),
                **d,
            )
        except TypeError as exc:
            raise ConfigError(f"workload {name}: {exc}") from None

    def resolve(self, context_len: int | None) -> "Workload":
        """Turn prompt_tokens: context into a number (the shared prefix counted), and refuse what cannot fit."""
        if self.prompt_tokens != "context":
            return self
        if not context_len:
            raise ConfigError(f"workload {self.name}: prompt_tokens: context needs the server's max_model_len")
        if self.max_tokens is None:
            raise ConfigError(f"workload {self.name}: prompt_tokens: context needs a max_tokens")
        n = context_len - self.max_tokens[1] - CONTEXT_MARGIN - self.system_prompt_tokens
        if n < 1:
            raise ConfigError(f"workload {self.name}: max_tokens leaves no room for a prompt in {context_len}")
        return replace(self, prompt_tokens=(n, n))


@dataclass(frozen=True)
class Shape:
    """Stages of offered load: users (closed loop) or requests/s (Poisson), each held for seconds."""

    levels: tuple[float, ...]
    stage_seconds: float

    @classmethod
    def from_dict(cls, d: dict) -> "Shape":
        kind, secs = d.get("kind", "constant"), float(d.get("stage_seconds", d.get("seconds", 60)))
        if kind == "constant":
            levels = (d.get("level", 1),)
        elif kind == "sweep":
            levels = tuple(d.get("levels") or ())
        elif kind == "steps":
            start, step, stop = d.get("start", 1), d.get("step", 1), d.get("stop", 1)
            levels = tuple(start + i * step for i in range(int((stop - start) // step) + 1)) if step > 0 else ()
        else:
            raise ConfigError(f"shape kind must be constant, steps or sweep, not {kind!r}")
        if not levels or any(lv <= 0 for lv in levels) or secs <= 0:
            raise ConfigError(f"shape {d}: needs positive levels and stage_seconds")
        return cls(tuple(float(lv) for lv in levels), secs)

    @property
    def duration(self) -> float:
        return len(self.levels) * self.stage_seconds


@dataclass(frozen=True)
class Search:
    """A goodput search: the highest load (requests/s for Poisson arrivals, users for a closed
    loop) at which at least `objective` of the requests meet every goodput threshold.  Each step
    holds one level for `step_seconds`; the levels go start, start × factor, ... until a step
    fails or reaches `max_level`, then bisect between the last pass and the first failure until
    the gap is ≤ `precision` × the failing level (one user for a closed loop), `max_steps` in all."""

    objective: float
    start: float = 1.0
    factor: float = 2.0
    max_level: float = 256.0
    max_steps: int = 8
    step_seconds: float = 20.0
    precision: float = 0.1

    @classmethod
    def from_dict(cls, d: dict, objective: float, arrival: str) -> "Search":
        d = {"objective": objective, **d}
        try:
            s = cls(**{k: (int(v) if k == "max_steps" else float(v)) for k, v in d.items()})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"search {d}: {exc}") from None
        if not (
            0 < s.objective <= 1
            and 0 < s.start <= s.max_level
            and s.factor > 1
            and s.max_steps >= 1
            and s.step_seconds > 0
            and 0 < s.precision < 1
        ):
            raise ConfigError(
                f"search {d}: want 0 < objective ≤ 1, 0 < start ≤ max_level, factor > 1, "
                "max_steps ≥ 1, step_seconds > 0, 0 < precision < 1"
            )
        if arrival == "closed" and (s.start != int(s.start) or s.max_level != int(s.max_level)):
            raise ConfigError(f"search {d}: closed-loop levels are user counts, whole numbers")
        return s


@dataclass(frozen=True)
class Scenario:
    name: str
    mix: dict[str, float]  # workload name → weight
    arrival: str  # closed | poisson
    shape: Shape
    slo: dict[str, float] = field(default_factory=dict)  # gate thresholds (see loadtest/gate.py)
    goodput: dict[str, float] = field(default_factory=dict)  # per-request SLOs: ttft_ms, tpot_ms, e2e_ms
    search: Search | None = None  # a goodput search instead of the shape's stages (loadtest/search.py)


@dataclass
class Config:
    workloads: dict[str, Workload]
    scenarios: dict[str, dict]
    slo: dict[str, float]
    goodput: dict[str, float]  # slo.yaml's thresholds, then the config's `goodput:` over them
    objective: float = FALLBACK_OBJECTIVE  # slo.yaml's, unless `goodput: {objective: ...}`
    slo_spec_found: bool = True

    @classmethod
    def load(cls, path: Path = DEFAULT_CONFIG, slo_spec: Traversable | Path | None = SLO_SPEC) -> "Config":
        raw = yaml.safe_load(Path(path).read_text()) or {}
        workloads = {n: Workload.from_dict(n, d or {}) for n, d in (raw.get("workloads") or {}).items()}
        thresholds, objective = slo_spec_goodput(slo_spec)
        goodput = {**thresholds, **(raw.get("goodput") or {})}
        objective = float(goodput.pop("objective", objective or FALLBACK_OBJECTIVE))
        return cls(
            workloads,
            raw.get("scenarios") or {},
            dict(raw.get("slo") or {}),
            {k: float(v) for k, v in goodput.items()},
            objective,
            spec_found(slo_spec),
        )

    def scenario(self, name: str, **overrides: Any) -> Scenario:
        """The named scenario with command-line overrides (None means: keep the config's)."""
        if name not in self.scenarios:
            raise ConfigError(f"no scenario {name!r} (have: {', '.join(self.scenarios)})")
        d = {**self.scenarios[name], **{k: v for k, v in overrides.items() if v is not None}}
        mix = {str(k): float(v) for k, v in (d.get("mix") or {}).items()}
        if not mix or any(w not in self.workloads for w in mix) or any(v <= 0 for v in mix.values()):
            raise ConfigError(
                f"scenario {name}: mix {mix} must name workloads ({', '.join(self.workloads)}) with positive weights"
            )
        if d.get("arrival", "closed") not in ("closed", "poisson"):
            raise ConfigError(f"scenario {name}: arrival must be closed or poisson")
        shape = d["shape"] if isinstance(d.get("shape"), Shape) else Shape.from_dict(d.get("shape") or {})
        if d.get("arrival", "closed") == "closed" and any(lv != int(lv) for lv in shape.levels):
            raise ConfigError(f"scenario {name}: closed-loop levels are user counts, whole numbers")
        goodput = {**self.goodput, **(d.get("goodput") or {})}
        objective = float(goodput.pop("objective", self.objective))
        if set(goodput) - {"ttft_ms", "tpot_ms", "e2e_ms"}:
            raise ConfigError(
                f"scenario {name}: goodput keys are ttft_ms, tpot_ms, e2e_ms, objective; "
                f"not {', '.join(sorted(set(goodput) - {'ttft_ms', 'tpot_ms', 'e2e_ms'}))}"
            )
        search = d.get("search")
        if search is not None and not isinstance(search, Search):
            search = Search.from_dict(search or {}, objective, d.get("arrival", "closed"))
        return Scenario(
            name,
            mix,
            d.get("arrival", "closed"),
            shape,
            {**self.slo, **(d.get("slo") or {})},
            {k: float(v) for k, v in goodput.items()},
            search,
        )


@dataclass
class Plan:
    """Everything the Locust process needs, resolved; written to `plan.json` in the results folder."""

    url: str
    model: str
    scenario: Scenario
    workloads: list[Workload]  # the mixed ones, resolved
    records_path: str
    seed: int = 0
    max_in_flight: int = 512  # Poisson: arrivals beyond this many open requests wait for a slot
    failure_backoff_s: float = 1.0  # closed loop: pause after a failed request (no hot loop of 503s)
    token_id_range: Range = (1000, 20000)  # random completions prompts draw token ids from here

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        sc = d.pop("scenario")
        sc["shape"] = Shape(tuple(sc["shape"]["levels"]), sc["shape"]["stage_seconds"])
        sc["search"] = Search(**sc["search"]) if sc.get("search") else None
        wls = [
            Workload(
                **{
                    **w,
                    "max_tokens": tuple(w["max_tokens"]) if w["max_tokens"] else None,
                    "prompts": tuple(w["prompts"]),
                    "prompt_tokens": tuple(w["prompt_tokens"]) if w["prompt_tokens"] else None,
                }
            )
            for w in d.pop("workloads")
        ]
        return cls(scenario=Scenario(**sc), workloads=wls, token_id_range=tuple(d.pop("token_id_range")), **d)
