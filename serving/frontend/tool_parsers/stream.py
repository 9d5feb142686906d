"""One choice's content and tool calls as they grow: OpenAI's stream deltas and the final answer.

Every update re-scans the text so far with the format's `scan` and sends what is new: content
past what was sent, a call's first delta once its name is known (index, id, type, name, the
arguments so far), then the rest of its arguments in pieces.  The final scan decides the answer;
a call that began but does not parse makes the whole text content (a stream has then already
sent part of it as a call, and sends the rest as content), unless max_tokens cut it after complete
calls: those are the answer.
"""

from __future__ import annotations

from serving.frontend.tool_parsers.base import Scan, ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls  # 1 without parallel_tool_calls: later calls are dropped
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []  # per call whose first delta went out: argument characters sent
        self.ids: list[str] = []
        self.final: Scan | None = None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """More content text: (content to send, tool-call deltas)."""
        self.text += text
        return self._diff(self.parser.scan(self.text, False))

    def finish(self, truncated: bool = False) -> tuple[str, list[dict]]:
        """The text is complete: what is left to send (the answer is then `final`).  `truncated` (max_tokens
        cut it): the calls completed before the cut are the answer's, the unfinished one is dropped (a stream
        has sent its beginning)."""
        scan = self.parser.scan(self.text, True)
        if scan.failed and truncated:
            partial = self.parser.scan(self.text, False)
            done = [
                c
                for c in partial.calls[
                    : next((i for i, c in enumerate(partial.calls) if not c.done), len(partial.calls))
                ]
            ]
            if done:
                scan = type(scan)(partial.content, done, started=True)
        scan.calls = scan.calls[: self.max_calls]
        self.final = scan
        return self._diff(scan)

    def _id(self, i: int) -> str:
        while len(self.ids) <= i:
            self.ids.append(self.parser.new_id())
        return self.ids[i]

    def _diff(self, scan: Scan) -> tuple[str, list[dict]]:
        content = scan.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(scan.content))
        deltas = []
        for i, call in enumerate(scan.calls[: self.max_calls]):
            if i < len(self.sent_args):
                piece = call.arguments[self.sent_args[i] :]
                if piece:
                    deltas.append({"index": i, "function": {"arguments": piece}})
                    self.sent_args[i] = len(call.arguments)
            elif call.name is not None and i == len(self.sent_args):
                deltas.append(
                    {
                        "index": i,
                        "id": self._id(i),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                self.sent_args.append(len(call.arguments))
        return content, deltas

    def tool_calls(self) -> list[dict]:
        """The final answer's calls, as `message.tool_calls` (the ids the stream used)."""
        calls = self.final.calls if self.final is not None else []
        return [
            {"id": self._id(i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)
        ]
