"""A `/v1/messages` record replayed as a Messages API body.

The flight recorder keeps the chat messages a Messages request was rendered from (the server turns
`system` into a system message, `tool_use` blocks into an assistant's `tool_calls`, `tool_result`
blocks into `tool` messages); this turns them back, so the replayed body renders to the same prompt.
Only the sampling fields the Messages API takes are sent (temperature, top_p, top_k, and the server's `seed`).
"""

from __future__ import annotations

import json
from typing import Any

SAMPLING = ("temperature", "top_p", "top_k", "seed")


def _assistant_blocks(m: dict) -> list[dict]:
    blocks: list[dict] = []
    if m.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        blocks.append({"type": "text", "text": m["content"]})
    for call in m.get("tool_calls") or ():
        args = call["function"].get("arguments") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": call["function"]["name"],
                "input": json.loads(args) if isinstance(args, str) else args,
            }
        )
    return blocks


def turns(messages: list[dict]) -> tuple[str, list[dict]]:
    """(system, turns): tool messages become tool_result blocks of the user turn after the assistant's calls."""
    system = "".join(m.get("content") or "" for m in messages if m["role"] in ("system", "developer"))
    out: list[dict] = []
    for m in messages:
        if m["role"] in ("system", "developer"):
            continue
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": _assistant_blocks(m)})
            continue
        block = (
            {"type": "tool_result", "tool_use_id": m.get("tool_call_id") or "", "content": m.get("content") or ""}
            if m["role"] == "tool"
            else {"type": "text", "text": m.get("content") or ""}
        )
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(block)
        else:
            out.append({"role": "user", "content": [block]})
    return system, out


def messages_body(
    prompt: Any, model: str, sampling: dict, max_tokens: int, ignore_eos: bool, stop: list | None, stream: bool
) -> dict:
    """The body of one replayed Messages request (`ignore_eos`: the server's extension, for exact lengths)."""
    system, msgs = turns(prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}])
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": msgs,
        "stream": stream,
        **{k: sampling[k] for k in SAMPLING if k in sampling and sampling[k] != -1},
    }
    if system:
        body["system"] = system
    if ignore_eos:
        body["ignore_eos"] = True
    if stop:
        body["stop_sequences"] = stop
    return body
