"""What the Scheduler process makes of each engine step: the step's plain record (`StepStats`) and its
events go to these observers, which keep every number the step feeds and nothing the step needs.

    the counters       steps, prompt / prefill / generation tokens, the latest token (`SchedulerStats`)
    the forward span   one per step, linked to every request in its batch (`telemetry.engine_spans`)
    decode gaps        long inter-token gaps and their causes (`serving.engine.decode_gaps`)
    step phases        schedule, forward, sample, grammar, logprobs, verify, output (`sightline_step_phase_seconds`)
    the step's work    FLOPs and bytes by phase, counted from the model's shape (`serving.engine.utilisation`),
                       beside the machine's peak measured at start (`serving.engine.peak_probe`)
    the step timeline  the last steps, for GET /debug/timeline (`telemetry.step_timeline`)

`ran` is told before the step's outputs are built (a finished request's spans read its gaps, and the
forward span links requests whose span context their finish removes); `sent` after they are sent (the
output phase is the time that took).
"""

from __future__ import annotations

from protocol.io_struct import STEP_PHASES, PhaseWork
from serving.args import ServerArgs
from serving.engine.decode_gaps import DecodeGaps, GapRules
from serving.engine.events import StepStats, TokenEvent
from serving.engine.peak_probe import Peak
from serving.engine.utilisation import ModelShape, phase_work
from telemetry.buckets import DEFAULT_BUCKETS, parse_bucket_overrides
from telemetry.clock import now_ns
from telemetry.engine_spans import SchedulerSpans
from telemetry.stats import PhaseTimes
from telemetry.step_timeline import PHASES, StepRing


class StepObservers:
    def __init__(
        self, args: ServerArgs, spans: SchedulerSpans, shape: ModelShape | None = None, peak: Peak | None = None
    ) -> None:
        self.spans = spans
        self.shape = shape  # None: no work counted (an encoder's steps are not the decoder's count)
        self.peak = peak
        self.flops = dict.fromkeys(STEP_PHASES, 0.0)
        self.bytes = dict.fromkeys(STEP_PHASES, 0.0)
        self.steps = 0
        self.prompt_tokens_total = 0
        self.prefill_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_token_at: int | None = None
        on = bool(args.step_timeline_steps)
        self.gaps = DecodeGaps(GapRules(args.decode_gap_factor, args.decode_gap_floor)) if on else None
        self.ring = StepRing(args.step_timeline_steps) if on else None
        stage = {**DEFAULT_BUCKETS, **parse_bucket_overrides(args.histogram_buckets)}["stage"]
        self.phases = PhaseTimes(PHASES, stage)

    def ran(self, st: StepStats, events: list[TokenEvent]) -> None:
        """A step ran (`st`) and produced `events`; their outputs are not built yet."""
        self.steps += 1
        self.prefill_tokens_total += st.num_prefill_tokens
        if self.shape is not None and st.tokens:
            for phase, work in phase_work(self.shape, st.num_decode, st.tokens, st.starts, st.num_sampled).items():
                self.flops[phase] += work.flops
                self.bytes[phase] += work.bytes
        if self.gaps is not None:
            self.gaps.stepped(st, events)
        if st.rids:
            self.spans.forward(
                list(st.rids),
                st.started_ns,
                st.ended_ns,
                {
                    "sightline.batch.size": st.batch_size,
                    "sightline.batch.decode": st.num_decode,
                    "sightline.batch.prefill_tokens": st.num_prefill_tokens,
                    "sightline.batch.retracted": st.num_retracted,
                },
            )
        self.generation_tokens_total += sum(len(ev.new_token_ids) for ev in events)
        if events:
            self.last_token_at = now_ns()

    def sent(self, st: StepStats, traces: tuple[str, ...], output_ns: int) -> None:
        """The step's outputs went out, `output_ns` after it ran; `traces`: its requests' trace ids, in its order."""
        if not st.batch_size:
            return
        for phase, seconds in (
            ("schedule", st.schedule_seconds),
            ("forward", st.forward_seconds),
            ("sample", st.sample_seconds),
            ("grammar", st.grammar_seconds),
            ("logprobs", st.logprobs_seconds),
            ("verify", st.verify_seconds),
            ("output", output_ns / 1e9),
        ):
            self.phases.observe(phase, seconds)
        if self.ring is not None:
            self.ring.add(st, traces, output_ns)

    def resumed(self, paused_at: int) -> None:
        """Generation was paused from `paused_at` until now: a gap spanning it has that cause."""
        if self.gaps is not None:
            self.gaps.paused(paused_at, now_ns())

    def stats(self) -> dict[str, object]:
        """The observers' part of `SchedulerStats`, by field name."""
        return {
            "steps_total": self.steps,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "last_token_at": self.last_token_at,
            "prefill_tokens_total": self.prefill_tokens_total,
            "step_phases": self.phases.snapshot(),
            **({"decode_gaps": self.gaps.snapshot()} if self.gaps is not None else {}),
            "work_flops": [PhaseWork(p, v) for p, v in self.flops.items()],
            "work_bytes": [PhaseWork(p, v) for p, v in self.bytes.items()],
            "peak_flops": self.peak.flops if self.peak is not None else 0.0,
            "peak_bytes_per_second": self.peak.bytes_per_second if self.peak is not None else 0.0,
        }
