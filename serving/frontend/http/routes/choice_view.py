"""One choice's text and logprobs as the client sees them, streamed or whole: the echoed prompt first
(completions' `echo`, with its logprobs when asked), then the output — or nothing of the output with
`max_tokens: 0`, where the engine's one token is dropped and the choice ends with `length`."""

from __future__ import annotations

from typing import Any

from protocol.io_struct import Logprobs, StrOut
from serving.frontend.http.routes.choices import Choice
from serving.frontend.http.routes.logprob_shapes import merge_parts
from serving.frontend.http.routes.openai_shapes import ResponseShape
from serving.frontend.output_parsing import OutputParsing


class ChoiceView:
    def __init__(self, shape: ResponseShape, choice: Choice, tokenizer: Any) -> None:
        self.shape = shape
        self.choice = choice
        self.tokenizer = tokenizer
        self.lp = shape.logprobs()
        self.echo_pending = choice.obj.echo
        self.prompt_only = choice.obj.max_new_tokens == 0
        self.prompt_logprobs: Logprobs | None = None  # its prompt's (the first choice of the prompt computes them)
        self.completion_tokens = 0
        parsing = choice.state.parsing  # a chat answer read for reasoning and tool calls
        self.parsing: OutputParsing | None = parsing if isinstance(parsing, OutputParsing) else None

    def _echo(self, prompt_lp: Logprobs | None) -> tuple[str, dict | None]:
        """The prompt as the client sent it (token ids decoded), and its logprobs part."""
        obj, ids = self.choice.obj, self.choice.state.prompt_ids or []
        text = obj.prompt if isinstance(obj.prompt, str) else self.tokenizer.decode(ids)
        if obj.sampling.logprobs is None:
            self.lp.skip(len(text))
            return text, None
        return text, self.lp.echo(ids, prompt_lp)

    def piece(
        self, text: str, ids: list[int], logprobs: Logprobs | None, prompt_lp: Logprobs | None
    ) -> tuple[str, dict | None]:
        """The next part of this choice: (text, logprobs object or None)."""
        head, head_lp = "", None
        if self.echo_pending:
            self.echo_pending = False
            head, head_lp = self._echo(prompt_lp)
        if self.prompt_only:
            return head, head_lp
        self.completion_tokens += len(ids)
        return head + text, merge_parts(head_lp, self.lp.part(ids, logprobs))

    def out(self, out: StrOut, prompt_lp: Logprobs | None) -> tuple[str, dict | None, str | None]:
        """(text, logprobs, finish_reason) for one streamed output."""
        text, lp = self.piece(out.text, out.output_ids, out.logprobs, prompt_lp)
        finish = "length" if self.prompt_only and out.finish_reason is not None else out.finish_reason
        if self.parsing is not None and finish is not None:
            finish = self.choice.state.finish_reason or finish  # as the TokenizerManager counted it (tool_calls)
        return text, lp, finish

    def delta(self) -> dict | None:
        """A parsed answer's new fields for the next chunk (None: the output's text is the content)."""
        return self.parsing.drain() if self.parsing is not None else None
