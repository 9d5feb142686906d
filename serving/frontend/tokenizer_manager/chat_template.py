"""Rendering chat messages with a chat template, with the options vLLM's chat API accepts.

`ChatTemplateOptions` travels on `GenerateReqInput.template` (and is built by /tokenize
too), so both render exactly the same prompt.  The template is the request's own
`chat_template` if it sent one (vLLM accepts it), else `--chat-template` (a file or the
template text), else the tokenizer's.  Jinja errors, including a template's own
`raise_exception(...)`, become a 400 quoting the template's message: a template refusing
these messages is the client's problem, not a server error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.frontend.errors import bad_request

log = logging.getLogger(__name__)

# apply_chat_template's own arguments: a `chat_template_kwargs` naming one would change how we call it
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


@dataclass
class ChatTemplateOptions:
    """How one request's messages are rendered (vLLM's chat-template fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # `chat_template_kwargs`: extra template variables
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # the request's own template, instead of the server's
    tools: list[dict[str, Any]] | None = None  # the request's tools ({"type": "function", "function": {...}})


def check_options(opts: ChatTemplateOptions, messages: list[dict[str, Any]]) -> None:
    """The 400s vLLM answers before rendering (field-named, so a client can tell what to fix)."""
    reserved = sorted(RESERVED_KWARGS & set(opts.kwargs))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: use the request field instead",
            param="chat_template_kwargs",
        )
    if opts.continue_final_message:
        if opts.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        if not messages or messages[-1]["role"] != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be an assistant message",
                param="continue_final_message",
            )


def load_template(spec: str | None) -> str | None:
    """`--chat-template`: a path to a file, else the template's text itself (as vLLM reads it)."""
    if not spec:
        return None
    path = Path(spec)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template string too long to be a file name, or not readable
        pass
    if "{" not in spec:
        raise ValueError(f"--chat-template: {spec!r} is neither a readable file nor a Jinja template")
    return spec


def render(
    tokenizer: Any, messages: list[dict[str, Any]], opts: ChatTemplateOptions | None, server_template: str | None
) -> str:
    """The prompt text of `messages`, or a 400 naming the field at fault."""
    opts = opts or ChatTemplateOptions()
    check_options(opts, messages)
    template = opts.chat_template or server_template or getattr(tokenizer, "chat_template", None)
    if not template:  # base models ship none
        raise bad_request(
            "this model's tokenizer has no chat template, so messages cannot be rendered; "
            "send a prompt to /v1/completions instead, or a chat_template",
            param="messages",
            code="chat_template_missing",
        )
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            chat_template=template,
            add_generation_prompt=opts.add_generation_prompt,
            continue_final_message=opts.continue_final_message,
            documents=opts.documents,
            tools=opts.tools,
            **opts.kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages (or a broken template)
        param = "chat_template" if opts.chat_template else "messages"
        raise bad_request(
            f"the chat template failed to render these messages: {exc}", param=param, code="chat_template_error"
        ) from None
