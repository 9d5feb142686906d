"""Incremental detokenization of one request: linear work, whole characters, stop strings.

Decoding all output tokens at every step costs O(n²) over a request.  Instead each
step decodes only a short window: the tokens since the last emitted text
(`read_offset`) plus those just before it (`prefix_offset`) for context, and emits
the difference between the window with and without the new tokens.  When the new
text ends in U+FFFD the last token split a UTF-8 character: nothing is emitted and
the window grows until the character is complete (or the request ends, when the
bytes that never completed are emitted as decoded).

Stop strings: the last `max(len(stop)) - 1` characters are held back while the
request runs, so a stop string that is only half generated is never streamed; on a
match the text is cut before it (after it with `include_stop_str_in_output`, vLLM's option:
the stop string ends the text) and the request finishes with `stop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.io_struct import DetokParams

REPLACEMENT = "\ufffd"


@dataclass
class Emitted:
    text: str  # new text to send
    consumed: int  # how many of the fed tokens it accounts for
    matched_stop: str | None = None  # set when a stop string ended the request


@dataclass
class DecodeState:
    tokenizer: Any
    params: DetokParams
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    pending: str = ""  # decoded but not yet emitted (held back for stop strings)
    consumed: int = 0  # output tokens fed so far
    stopped: bool = False

    def __post_init__(self) -> None:
        self.ids = list(self.params.prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._hold = max((len(s) for s in self.params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, final: bool) -> str:
        """Text completed by the tokens fed since the last call (all of it when final)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]

    def _find_stop(self) -> tuple[int, str] | None:
        hits = [(i, s) for s in self.params.stop if (i := self.pending.find(s)) >= 0]
        return min(hits) if hits else None

    def feed(self, new_ids: list[int], final: bool) -> Emitted:
        """Feed tokens; `final` when the engine finished the request with these."""
        if self.stopped:
            return Emitted("", 0)
        taken = 0
        for i, tok in enumerate(new_ids):
            self.ids.append(tok)
            taken += 1
            last = final and i == len(new_ids) - 1
            self.pending += self._advance(last)
            if self.params.stop and (hit := self._find_stop()) is not None:
                idx, stop = hit
                self.stopped = True
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                text, self.pending = self.pending[:end], ""
                self.consumed += taken
                return Emitted(text, taken, stop)
        if final and not new_ids:  # an abort: flush bytes held for an unfinished character
            self.pending += self._advance(True)
        self.consumed += taken
        if final or not self._hold:
            text, self.pending = self.pending, ""
        else:
            cut = max(0, len(self.pending) - self._hold)
            text, self.pending = self.pending[:cut], self.pending[cut:]
        return Emitted(text, taken)
