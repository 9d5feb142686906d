"""A TokenizerManager and EngineMonitor with everything real but the sockets: the real
tiny-random tokenizer, real telemetry and metrics, and an in-memory transport that
encodes and decodes every message with the wire codec (so what it records is exactly
what the Scheduler would receive)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import generate_latest

from protocol.io_struct import BatchStrOutput, DetokenizerStats, Message, Ready, ReqMeta, SchedulerStats, StrOut
from protocol.sampling_params import SamplingParams
from serving.args import ServerArgs
from serving.frontend.supervision.engine_monitor import EngineMonitor
from serving.frontend.tokenizer_manager.manager import TokenizerManager
from serving.frontend.tokenizer_manager.req_state import GenerateReqInput, ReqState
from serving.ipc import Codec
from serving.model_files import load_tokenizer
from telemetry.clock import now_ns
from telemetry.metrics import Metrics
from telemetry.request_telemetry import RequestTelemetry
from telemetry.timeline import Timeline
from telemetry.tracing import Tracing

CONTEXT = 256
VOCAB = 49152
_tokenizer = None


def tokenizer():
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = load_tokenizer("tiny-random")[0]
    return _tokenizer


class MemoryTransport:
    """The TM's EngineTransport, in memory: `sent` holds what went to the Scheduler."""

    def __init__(self) -> None:
        self.codec = Codec("tokenizer_manager")
        self.sent: list[Message] = []
        self.ranks: list[int] = []  # the Scheduler rank each of `sent` went to
        self.to_hub_sent: list[Message] = []
        self.on_message: Callable[[Message], None] | None = None
        self.reconnects = 0

    def start(self, on_message: Callable[[Message], None]) -> None:
        self.on_message = on_message

    def send(self, msg: Message, dp_rank: int = 0) -> None:
        self.sent.append(self.codec.decode(self.codec.encode(msg)))
        self.ranks.append(dp_rank)

    def to_hub(self, msg: Message) -> None:
        self.to_hub_sent.append(self.codec.decode(self.codec.encode(msg)))

    def reconnect(self) -> None:
        self.reconnects += 1

    async def close(self) -> None:
        self.on_message = None

    def deliver(self, msg: Message) -> None:
        """A message from a child, through the wire codec, as the receive loop hands it over."""
        self.on_message(self.codec.decode(self.codec.encode(msg)))


@dataclass
class Proc:
    """A child process as the monitor sees one (pid, alive or exited)."""

    pid: int
    exitcode: int | None = None
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive


@dataclass
class Front:
    tm: TokenizerManager
    monitor: EngineMonitor
    transport: MemoryTransport
    metrics: Metrics
    timeline: Timeline
    procs: dict[str, Proc] = field(default_factory=dict)

    def ready(self, context_len: int = CONTEXT) -> None:
        """Both children spawned and ready, as the supervisor and the children would make it."""
        self.procs = {"scheduler": Proc(101), "detokenizer": Proc(102)}
        self.monitor.expect(self.procs)
        self.transport.deliver(Ready(role="scheduler", pid=101, context_len=context_len, vocab_size=VOCAB))
        self.transport.deliver(Ready(role="detokenizer", pid=102))

    async def submit(self, prompt: str = "The capital of France is", max_new_tokens: int | None = 8, **kw) -> ReqState:
        obj = GenerateReqInput(
            sampling=SamplingParams(temperature=0.0), prompt=prompt, max_new_tokens=max_new_tokens, **kw
        )
        return await self.tm.submit(
            obj, ReqState(route="/v1/completions", operation="text_completion", arrival=now_ns())
        )

    def output(self, state: ReqState, text: str, ids: list[int], finish_reason: str | None = None, **kw) -> None:
        """The Detokenizer's output for one rid."""
        out = StrOut(
            rid=state.rid,
            text=text,
            output_ids=ids,
            finish_reason=finish_reason,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens + len(ids),
            meta=ReqMeta(trace=state.meta.trace, stamps=state.meta.stamps),
            **kw,
        )
        self.transport.deliver(BatchStrOutput(outputs=[out]))

    def scheduler_stats(self, generated: int = 0, **kw) -> None:
        fields = {"num_running": 0, "num_waiting": 0, "kv_used": 0, "kv_reserved": 0, "kv_total": 64, **kw}
        self.transport.deliver(SchedulerStats(generation_tokens_total=generated, **fields))

    def detok_stats(self, **kw) -> None:
        self.transport.deliver(DetokenizerStats(active_rids=0, **kw))

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def exposition(self) -> str:
        return generate_latest(self.metrics.registry).decode()


def make_front(**flags) -> Front:
    args = ServerArgs(model="tiny-random", **flags)
    timeline = Timeline(100)
    metrics = Metrics("tiny-random")
    tel = RequestTelemetry(
        Tracing("main", enabled=False, sink=timeline.add_span), metrics, timeline, "tiny-random", False
    )
    monitor = EngineMonitor(args.stall_timeout, args.watchdog_timeout, on_stats=tel.on_stats, dp_size=args.dp_size)
    transport = MemoryTransport()
    tm = TokenizerManager(args, transport, tokenizer(), monitor, tel)
    tm.start()
    front = Front(tm, monitor, transport, metrics, timeline)
    metrics.watch(lambda: monitor.view(tm.counts()), lambda: len(tm.rid_to_state))
    return front


def ready_front(**flags) -> Front:
    """`make_front` with both children spawned and ready."""
    front = make_front(**flags)
    front.ready()
    return front
