"""The stored responses of `/v1/responses` (`store: true`, OpenAI's default): a bounded in-memory LRU.

Each entry is what a later turn needs: the response object (GET /v1/responses/{id}), its input items
(GET .../input_items) and the conversation as chat messages, its own output included, which a request
naming it in `previous_response_id` continues.  At `--responses-store-size` entries the least recently
used one is evicted (counted in `sightline_responses_store_evictions_total`); 0 stores nothing.  The
store is per front-end process: with several tokenizer workers a response is found only by the worker
that made it, and a restart forgets every response.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict
    items: list[dict]  # its input, as items with ids
    messages: list[dict]  # the conversation up to and including its output, as chat messages
    call_names: dict[str, str] = field(default_factory=dict)  # call_id → function name, for later outputs


class ResponseStore:
    def __init__(self, size: int, metrics: Any = None) -> None:
        self.size = max(0, size)
        self.m = metrics
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def put(self, rid: str, entry: StoredResponse) -> None:
        if self.size == 0:
            return
        self._entries[rid] = entry
        self._entries.move_to_end(rid)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
            if self.m is not None:
                self.m.responses_evicted.inc()
        self._gauge()

    def delete(self, rid: str) -> bool:
        found = self._entries.pop(rid, None) is not None
        self._gauge()
        return found

    def __len__(self) -> int:
        return len(self._entries)

    def _gauge(self) -> None:
        if self.m is not None:
            self.m.responses_stored.set(len(self._entries))
