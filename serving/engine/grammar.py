"""Structured outputs in the engine: every request's grammar, from its compile to its last token.

One `Grammars` per SchedulerCore owns it all (the requests' `GrammarState`s are its records):

1. compile: `start` looks the request's `StructuredOutput` (kind and spec) up in a bounded LRU
   cache of compiled grammars (an llguidance matcher in its initial state; `after_token_ids` is
   not part of the key).  A miss compiles on a small thread pool, off the step loop (llguidance
   drops the GIL while it builds a matcher), and warms the first mask there too; requests that
   ask for a grammar already compiling share that compile (a hit).  The LLTokenizer is built once,
   in that pool, from the model directory's tokenizer.json.
2. wait: a request whose grammar is not compiled yet stays in the queue with the wait reason
   `grammar` (serving.engine.wait_reasons); admission passes over it, not blocked behind it.
   Each step `poll`s the compiles: a request's matcher is a copy of the compiled one; a compile
   error ends that request alone, its message naming the problem.
3. mask: in the step, after logit_bias, penalties and min_tokens (`sampling.adjust`) and before
   temperature and the cuts (`sampling.pick`), `mask` fills every active row's bitmask (llguidance
   drops the GIL for it) and adds it to the logits as a 0/-inf bias (serving.engine.token_mask),
   so `--logprobs-mode processed` sees it.  Rows without a grammar are not touched, and a step
   with no grammar anywhere does nothing here.  A row whose mask leaves no token that can be drawn
   is a dead end.
4. consume: `advance` feeds each sampled token to its matcher.  With `after_token_ids`, the matcher
   starts (and masks apply) once the output ends with that sequence.  A matcher that stops (the
   grammar is complete, EOS consumed or nothing may follow) finishes the request with `stop`; a
   dead end, or a token the matcher refuses, ends that request alone with an error.

A retracted request keeps its output tokens, and its matcher has consumed exactly those: it resumes
where it was.  Tokens are consumed only once the step that sampled them succeeded, so a failed step
rerun for its other requests (ForwardPass.isolate) consumes nothing twice.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Protocol, Sequence

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from protocol.io_struct import GrammarCacheCount, GrammarErrorCount
from protocol.sampling_params import SamplingParams, StructuredOutput
from serving.engine.token_mask import MaskBias, allowed_counts, apply_bias
from serving.structured import GrammarError, to_backend_grammar
from serving.structured.backend import limits
from telemetry.stats import PhaseTimes

CACHE_SIZE = 64  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2
# Masks filled by llguidance's thread pool (one call for the batch) or one call per row.  On 2 cores, 16 json_schema
# rows (bench.structured): the grammar phase 2.11 ms a decode step with the pool, 2.09 per row, the same within the
# noise; profiled, the fill itself takes ~1.2 ms either way, and the pool's threads, spinning after it, slowed the
# torch ops that follow (the bias ~0.6 ms instead of ~0.4).  One call per row: no threads beside torch's.
PARALLEL_FILL = False
DEAD_END = "structured output: the grammar allows no further token: "


def fill_mask(matcher: LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of the int32 `bitmask` [R, words] (contiguous, on the CPU) set to the tokens `matcher` allows.

    llguidance.torch has the same wrappers, but importing it wraps a helper in `torch.compile`, which loads
    torch._dynamo: ~2.5 s more for every Scheduler start and restart."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)


def _first_line(text: str) -> str:
    """llguidance's message in one line: its first, and the `error:` line its regex parser adds (the lines
    between quote the grammar: they can be long, and they are the client's own)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return " ".join(lines[:1] + [detail] if detail else lines[:1])[:500]


@dataclass
class GrammarState:
    """One request's grammar: its compile, then its matcher, and what they cost."""

    so: StructuredOutput
    requested: int  # monotonic ns: when the request asked for it (its arrival)
    future: Future | None  # the compile it waits for (None once its matcher is set)
    cache_hit: bool  # the compiled grammar was cached, or already compiling for another request
    matcher: LLMatcher | None = None
    active: bool = False  # masks apply and tokens are consumed (after `after_token_ids`, if any)
    wait_ns: int = 0  # arrival → its matcher was set (0 when the compiled grammar was cached)
    forced: bool = False  # the latest mask allowed exactly one token
    dead: str | None = None  # why the latest mask left no token to draw (the request ends with it)

    @property
    def pending(self) -> bool:
        return self.matcher is None

    @property
    def complete(self) -> bool:
        """The grammar is done: nothing but the end may follow (the request finishes with `stop`)."""
        return self.active and self.matcher is not None and self.matcher.is_stopped()

    def attributes(self) -> dict[str, str | float | bool]:
        """Its span attributes (the request's first `queue` span)."""
        return {
            "sightline.grammar.kind": self.so.kind,
            "sightline.grammar.compile_wait_ms": self.wait_ns / 1e6,
            "sightline.grammar.cache_hit": self.cache_hit,
        }


class Req(Protocol):
    """What the grammars read and keep of a request (serving.engine.request.Req satisfies it)."""

    params: SamplingParams
    output_ids: list[int]
    grammar: GrammarState | None


class Grammars:
    """The engine's grammars: the tokenizer, the compile pool and cache, the masks, the counters."""

    def __init__(
        self, model_dir: Path, eos_ids: frozenset[int], logits_width: int, compile_bounds: Sequence[float]
    ) -> None:
        self.model_dir = model_dir
        self.eos_ids = sorted(eos_ids)
        self.width = logits_width
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first compile
        self._executor: LLExecutor | None = None  # llguidance's own threads, for the batch's masks (PARALLEL_FILL)
        self.parallel_fill = PARALLEL_FILL
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)
        self._bias = MaskBias()
        self._compiled: list[float] = []  # compile seconds, appended by the pool, observed by `poll`
        self.pending: list[Req] = []  # waiting for their compile
        self.live = 0  # requests holding a grammar, not finished: while 0 the step pays nothing here
        self.compile_times = PhaseTimes(("compile",), tuple(compile_bounds))
        self.hits = self.misses = self.compile_errors = self.dead_ends = self.forced_tokens = 0

    # -- compile -------------------------------------------------------------------------
    def tokenizer(self) -> LLTokenizer:
        """llguidance's tokenizer, built once from the model's tokenizer.json (raises GrammarError).

        Its vocabulary is the logits' width when the file has no more tokens (the ids past the file's are
        never allowed), else the file's own (`token_mask` gives the ids past the logits -inf)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                eos = self.eos_ids or None
                try:
                    text = (self.model_dir / "tokenizer.json").read_text()
                    try:
                        self._tokenizer = LLTokenizer(text, n_vocab=self.width, eos_token=eos)
                    except Exception:  # noqa: BLE001 - "vocab size too small": the file has more tokens
                        self._tokenizer = LLTokenizer(text, eos_token=eos)
                except Exception as exc:  # noqa: BLE001 - whatever the file or llguidance raised
                    raise GrammarError(f"structured outputs need the model's tokenizer.json: {exc}") from None
            return self._tokenizer

    def _compile(self, so: StructuredOutput) -> LLMatcher:
        """On the pool: the grammar's matcher in its initial state, its first mask computed (raises GrammarError)."""
        tok = self.tokenizer()
        t0 = perf_counter()
        try:
            matcher = LLMatcher(tok, to_backend_grammar(so), limits=limits(), log_level=0)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - llguidance's constructor, the schema converter
            raise GrammarError(_first_line(str(exc)) or type(exc).__name__) from None
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()) or "the grammar is invalid")
        warm = torch.empty(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
        fill_mask(matcher.deep_copy(), warm, 0)  # builds the lexer states the first step needs
        self._compiled.append(perf_counter() - t0)
        return matcher

    def start(self, req: Req, now: int) -> GrammarState:
        """The request's grammar: ready at once when cached, else compiling (the request is `pending`)."""
        so = req.params.structured
        key = (so.kind, so.spec)
        fut = self._cache.get(key)
        hit = fut is not None
        if hit:
            self.hits += 1
            self._cache.move_to_end(key)
        else:
            self.misses += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            fut = self._cache[key] = self._pool.submit(self._compile, so)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        state = GrammarState(so, now, fut, cache_hit=hit)
        self.live += 1
        if fut.done() and fut.exception() is None:
            self._ready(state, now)
        else:
            self.pending.append(req)  # a failed compile is reported by the next `poll`
        return state

    def _ready(self, g: GrammarState, now: int) -> None:
        g.matcher = g.future.result().deep_copy()
        g.future = None
        g.active = not g.so.after_token_ids
        g.wait_ns = max(0, now - g.requested)

    def poll(self, now: int) -> list[tuple[Req, str]]:
        """Set the matchers whose compile finished; the requests whose compile failed, with their error."""
        while self._compiled:
            self.compile_times.observe("compile", self._compiled.pop())
        if not self.pending:
            return []
        failed, still = [], []
        for req in self.pending:
            g = req.grammar
            if g.future.done():
                exc = g.future.exception()
                if exc is None:
                    self._ready(g, now)
                else:
                    self.compile_errors += 1
                    failed.append((req, f"structured output: the grammar does not compile: {exc}"))
            else:
                still.append(req)
        self.pending = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes, at most `timeout` seconds (a step with nothing else to do)."""
        if self.pending:
            wait([r.grammar.future for r in self.pending], timeout, return_when=FIRST_COMPLETED)

    def release(self, req: Req) -> None:
        """The request ended (finished, failed or aborted)."""
        self.live -= 1
        if req.grammar.pending:
            self.pending = [r for r in self.pending if r is not req]

    # -- mask --------------------------------------------------------------------------------
    def mask(
        self, logits: torch.Tensor, adjusted: torch.Tensor, rows: Sequence[Req], keep_raw: bool
    ) -> tuple[torch.Tensor, list[bool] | None]:
        """`adjusted` (the sampler's logits [R, V], `sampling.adjust`) with every active row's grammar mask
        added, rows without one untouched; and which rows were masked (None: none, for `sampling.pick`).
        `logits` (the model's) are copied first only when `adjusted` is them and `keep_raw` (a masked row
        reports raw logprobs); else the masks are added in place."""
        idx = [i for i, r in enumerate(rows) if r.grammar is not None and r.grammar.active]
        if not idx:
            return adjusted, None
        matchers = [rows[i].grammar.matcher for i in idx]
        vocab = self.tokenizer().vocab_size  # built: a matcher exists
        words = (vocab + 31) // 32
        if self._bitmask.shape[0] < len(idx) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(len(idx), 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(idx)]
        if self.parallel_fill:
            if self._executor is None:
                self._executor = LLExecutor(max(1, min(COMPILE_THREADS, os.cpu_count() or 1)))
            self._executor.unsafe_compute_mask_ptr(
                [(m, j) for j, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
            )
        else:
            for j, m in enumerate(matchers):
                fill_mask(m, bitmask, j)
        if adjusted is logits and keep_raw:
            adjusted = logits.clone()
        at = None if len(idx) == len(rows) else torch.tensor(idx, dtype=torch.int64)
        apply_bias(adjusted, at, self._bias(bitmask, vocab, adjusted.shape[-1], adjusted.dtype))
        empty, single = allowed_counts(bitmask)
        for j, i in enumerate(idx):
            g = rows[i].grammar
            g.forced = single[j]
            if empty[j]:
                why = _first_line(g.matcher.get_error()) if g.matcher.is_error() else "its mask is empty"
            elif len(rows[i].output_ids) < rows[i].params.min_tokens and not torch.isfinite(adjusted[i]).any():
                why = "every token it allows is masked by min_tokens (EOS and the stop token ids)"
            else:
                continue
            g.dead = DEAD_END + why
            adjusted[i] = 0.0  # something to draw from: the token is discarded, the request ends
        masked = [False] * len(rows)
        for i in idx:
            masked[i] = True
        return adjusted, masked

    # -- consume -------------------------------------------------------------------------------
    def advance(self, req: Req, tok: int) -> str | None:
        """Feed `tok`, just sampled and not yet appended to `req.output_ids`, to the request's matcher (or
        look for the end of `after_token_ids`); the error that ends the request, None when it goes on."""
        g = req.grammar
        if g.dead is not None:
            self.dead_ends += 1
            return g.dead
        if not g.active:
            trigger = g.so.after_token_ids
            k = len(trigger)
            if tok == trigger[-1] and (k == 1 or tuple(req.output_ids[-(k - 1) :]) == trigger[:-1]):
                g.active = True
            return None
        if g.forced:
            self.forced_tokens += 1
            g.forced = False
        if not g.matcher.consume_token(tok):
            self.dead_ends += 1
            return DEAD_END + (_first_line(g.matcher.get_error()) or f"token {tok} is not allowed")
        return None

    # -- telemetry ------------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """The grammar part of `SchedulerStats`, by field name."""
        return {
            "grammar_compile_seconds": self.compile_times.snapshot(),
            "grammar_cache": [GrammarCacheCount("hit", self.hits), GrammarCacheCount("miss", self.misses)],
            "grammar_forced_tokens_total": self.forced_tokens,
            "grammar_errors": [
                GrammarErrorCount("compile", self.compile_errors),
                GrammarErrorCount("dead_end", self.dead_ends),
            ],
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
