"""Sampling parameters: what a request asks of the sampler, and the ranges allowed.

Plain data on the wire (no torch here: the front end validates with it and never loads
the engine).  `SamplingParams.validate` bounds every field, so no value can make the
batched sampler (`serving.engine.sampling`) raise for its batch mates: top_k is -1, 0 or
in [1, MAX_TOP_K] (the sampler clamps it to the vocabulary), floats are finite and in
range, seed is in [0, 2**63), at most MAX_STOP_TOKEN_IDS stop token ids are valid ids,
logprobs and prompt_logprobs ask for at most MAX_LOGPROBS alternatives, logit_bias holds at
most MAX_LOGIT_BIAS valid ids with finite biases in [-100, 100] (OpenAI's range: +100 forces a
token, -100 bans it), and min_tokens is at most max_new_tokens.  A temperature under
GREEDY_TEMPERATURE is greedy (dividing logits by it would overflow float32 into NaN).
"""

from __future__ import annotations

import math

import msgspec

MAX_TOP_K = 2**31 - 1
MAX_STOP_TOKEN_IDS = 64  # per request; the engine checks each sampled token against them
MAX_TOKEN_ID = 2**31 - 1  # bound on a token id when the vocabulary is not known
GREEDY_TEMPERATURE = 1e-5  # below it sampling is greedy
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 256 * 1024  # a structured-output spec larger than this is refused (400) by the front end


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on a request's output, compiled by the engine's grammar backend (serving.structured).

    `kind` is one of GRAMMAR_KINDS: `json_schema` (`spec` is a JSON Schema as JSON text; `json_object` is
    `{"type": "object"}`), `regex`, `choice` (`spec` is a JSON list of strings) or `grammar` (Lark as
    llguidance reads it, or GBNF).  While `after_token_ids` is not empty the output is free until that
    token sequence has been generated (a reasoning model's end-of-thinking marker), then constrained.
    Frozen and hashable: the engine caches compiled grammars by it.
    """

    kind: str
    spec: str
    after_token_ids: tuple[int, ...] = ()


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # per output token its logprob and this many top alternatives (0: its own only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before anything else
    min_tokens: int = 0  # EOS and stop token ids cannot end it before this many tokens
    structured: StructuredOutput | None = None  # a grammar the output must follow (masks in the sampler)
    speculative: bool = True  # may be speculated when the server speculates (--speculative); False opts out

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError "<field> <why>, got <value>" for the first out-of-range field (the API's 400)."""
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in floats:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        checks = [
            (1 <= self.max_new_tokens <= 2**31 - 1, "max_new_tokens", "must be in [1, 2147483647]"),
            (0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (
                self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K,
                "top_k",
                f"must be -1 or 0 (disabled) or in [1, {MAX_TOP_K}]",
            ),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (0 <= self.min_tokens <= self.max_new_tokens, "min_tokens", "must be in [0, max_new_tokens]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got {len(ids)}")
        limit = vocab_size if vocab_size is not None else MAX_TOKEN_ID + 1
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be token ids in [0, {limit}), got {bad!r}")
        self._validate_logit_bias(limit)
        self._validate_structured()

    def _validate_structured(self) -> None:
        """Shape only (kind, size): whether the spec compiles is the grammar backend's check (serving.structured)."""
        so = self.structured
        if so is None:
            return
        if so.kind not in GRAMMAR_KINDS:
            raise ValueError(f"structured.kind must be one of {list(GRAMMAR_KINDS)}, got {so.kind!r}")
        if len(so.spec.encode()) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"structured.spec must be at most {MAX_GRAMMAR_BYTES} bytes, got {len(so.spec.encode())}")

    def _validate_logit_bias(self, limit: int) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        bad = next((t for t in bias if not 0 <= t < limit), None)
        if bad is not None:
            raise ValueError(f"logit_bias must map token ids in [0, {limit}), got {bad!r}")
        bad_value = next((v for v in bias.values() if not (math.isfinite(v) and -100.0 <= v <= 100.0)), None)
        if bad_value is not None:
            raise ValueError(f"logit_bias must map to finite numbers in [-100, 100], got {bad_value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
