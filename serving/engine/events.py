"""What the engine reports: per request, what a step (or an abort) produced (`TokenEvent`),
and per step, what the step did (`StepStats`, the latest one is `SchedulerCore.last_step`)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.io_struct import Logprobs, TokenOut
from protocol.reasons import FinishReason
from serving.engine.request import Req
from telemetry.outcomes import ending_for


@dataclass
class TokenEvent:
    """What one step (or an abort) produced for one request."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    req: Req  # for its timestamps and counts; the Scheduler process serialises what it needs
    error: str | None = None  # with FinishReason.ERROR: what the client is told
    logprobs: Logprobs | None = None  # of `new_token_ids`, when the request asked (SamplingParams.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def end_with_error(out: TokenOut, error_type: str | None, error: str) -> None:
    """How a request the engine ended with a cause the client must hear is answered (`ending_for`): a timeout
    stays an abort (its `abort_reason`), anything else (an engine error) finishes it with `error`."""
    ending = ending_for(error_type)
    out.error = error
    if ending.abort_reason is not None:
        out.abort_reason = ending.abort_reason
    else:
        out.finish_reason = ending.finish_reason


@dataclass
class StepStats:
    """What the latest engine step did (its batch, its phases' durations)."""

    batch_size: int = 0
    num_decode: int = 0
    num_prefill_tokens: int = 0
    num_prefill_reqs: int = 0
    step_seconds: float = 0.0
    schedule_seconds: float = 0.0  # admission and chunking
    forward_seconds: float = 0.0  # KV allocation, batch metadata, the model's forward
    sample_seconds: float = 0.0  # logits → tokens, finish checks
    logprobs_seconds: float = 0.0  # log-probabilities of sampled and prompt tokens (not part of sample_seconds)
    grammar_seconds: float = 0.0  # grammar masks filled and applied, tokens consumed (not part of sample_seconds)
    verify_seconds: float = 0.0  # speculative drafts judged by the acceptance rule (not part of sample_seconds)
    started_ns: int = 0
    ended_ns: int = 0
    rids: tuple[str, ...] = ()  # every request in the batch (for the batch span's links), decodes first
    prefill_rids: tuple[str, ...] = ()  # the requests it fed prefill chunks (the last of `rids`)
    num_retracted: int = 0  # requests taken out of the batch before it ran
    tokens: tuple[int, ...] = ()  # tokens it fed each of `rids` (1 per decode, a prefill chunk's length)
    starts: tuple[int, ...] = ()  # positions each of `rids` had computed before it (where its tokens went)
    num_sampled: int = 0  # requests it sampled for (every decode, and the prefills it completed)

    def stats(self) -> dict[str, int | float]:
        """The step's part of `SchedulerStats`, by field name."""
        return {
            "batch_size": self.batch_size,
            "num_decode": self.num_decode,
            "num_prefill_tokens": self.num_prefill_tokens,
            "step_seconds": self.step_seconds,
        }
