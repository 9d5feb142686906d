"""A replay's schedule as the command and the Locust users share it: the items (what is sent,
when), the queue they are handed out from, the files and names both sides use."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEDULE_FILE = "replay_schedule.jsonl"
SENT_FILE = "replay_sent.jsonl"
CHAT, COMPLETIONS, GENERATE, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings"
RESPONSES = "/v1/responses"
RERANK_PATHS, SCORE_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank"), ("/v1/score", "/score")
POOLING_PATHS = (EMBEDDINGS, *RERANK_PATHS, *SCORE_PATHS)  # the routes that embed and generate nothing
MESSAGES = "/v1/messages"  # Anthropic's Messages API: its record holds the chat messages it was rendered from
ENDPOINTS = {
    CHAT: "chat",
    COMPLETIONS: "completions",
    GENERATE: "generate",
    EMBEDDINGS: "embeddings",
    MESSAGES: "messages",
    RESPONSES: "responses",
    **dict.fromkeys(RERANK_PATHS, "rerank"),
    **dict.fromkeys(SCORE_PATHS, "score"),
}
CONVERSATIONS = (CHAT, MESSAGES, RESPONSES)  # routes whose records hold chat messages
SUCCESS = ("stop", "length")
LATE_S = 0.1  # a request sent more than this after its due time counts as late


@dataclass
class ReplayItem:
    """One request of the schedule: what is sent, when (seconds after the replay's start)."""

    index: int
    rid: str  # the recorded request's id
    due: float
    path: str
    body: dict
    stream: bool
    prompt_source: str  # recorded | synthetic
    prompt_tokens: int  # recorded
    prompt_tokens_sent: int | None  # what is sent, as the server will count it (None: unknown)
    recorded_e2e_s: float = 0.0

    @property
    def endpoint(self) -> str:
        return ENDPOINTS[self.path]

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "ReplayItem":
        return cls(**json.loads(line))


class ReplayQueue:
    """The Locust process's side: the schedule in due order, handed out one request at a time."""

    def __init__(self, items: list[ReplayItem]) -> None:
        self.items = sorted(items, key=lambda it: (it.due, it.index))
        self.next = 0
        self.ended = 0
        self.t0: float | None = None  # perf_counter() at the replay's start

    @classmethod
    def load(cls, path: Path) -> "ReplayQueue":
        return cls([ReplayItem.from_json(line) for line in path.read_text().splitlines() if line.strip()])

    def start(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = now

    def take(self) -> ReplayItem | None:
        if self.next >= len(self.items):
            return None
        self.next += 1
        return self.items[self.next - 1]

    @property
    def finished(self) -> bool:
        return self.ended >= len(self.items)
