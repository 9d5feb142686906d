"""vLLM's `/tokenize`, `/detokenize` (also under `/v1/`) and `/version`.

Clients count tokens and check prompts against the context window with these before they
send a request (vLLM's bodies and answers).  Chat messages render exactly as a chat
completion renders them (the same `ChatTemplateOptions`, the same template), so a
/tokenize count is the `usage.prompt_tokens` the completion will report.  The rendering
and encoding run on the TokenizerManager's tokenize thread when large, as generation's do.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving import __version__
from serving.frontend.errors import APIError, bad_request, error_response
from serving.frontend.http.routes.generation import read_body
from serving.frontend.http.routes.openai_api import Front, check_ignored, check_request_template, front_of
from serving.frontend.http.routes.openai_chat import chat_messages, template_options
from serving.frontend.http.routes.openai_requests import ChatMessage, decode_body
from serving.frontend.http.routes.openai_tools import template_tools
from serving.frontend.http.state import ServerState
from serving.frontend.tokenizer_manager.tokenization import INLINE_CHARS

_STRICT = {"kw_only": True, "forbid_unknown_fields": True, "dict": True}


class TokenizeRequest(msgspec.Struct, **_STRICT):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # rendered as a chat completion renders them
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, **_STRICT):
    model: str | None = None
    tokens: list[int]


def _check_model(model: str | None, front: Front) -> None:
    if model is not None and model != front.served:
        raise APIError(
            400,
            f"The model `{model}` does not exist; this server serves `{front.served}`",
            param="model",
            code="model_not_found",
        )


def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    prompts, tok = state.tm.prompts, state.tm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        messages = chat_messages(body.messages)
        text = prompts.render(messages, template_options(body, messages, template_tools(body.tools)[0]))
        special = bool(body.add_special_tokens)
    else:
        text, special = body.prompt, body.add_special_tokens is not False
    ids = tok(text, add_special_tokens=special)["input_ids"]
    ready = state.engine.engine_ready
    out = {"count": len(ids), "max_model_len": ready.context_len if ready else None, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


async def _read(request: Request, typ: type, route: str) -> tuple[ServerState, Any, Front]:
    """The body decoded and checked as every request surface checks it (unknown fields, the model)."""
    state: ServerState = request.app.state.server
    body = decode_body(await read_body(request, state.args.max_request_bytes), typ)
    front = front_of(state)
    check_ignored(body, route, front)
    _check_model(body.model, front)
    return state, body, front


async def tokenize(request: Request) -> Response:
    """POST /tokenize: `{count, max_model_len, tokens, token_strs?}` of a prompt or chat messages."""
    try:
        state, body, front = await _read(request, TokenizeRequest, "/tokenize")
        check_request_template(body.chat_template, front)
        chars = len(body.prompt or "") + sum(len(str(m.content or "")) for m in body.messages or [])
        limit = state.args.max_prompt_chars
        if limit and chars > limit:
            raise bad_request(
                f"the input has {chars} characters; the limit is {limit} (--max-prompt-chars)",
                param="messages" if body.messages is not None else "prompt",
                code="context_length_exceeded",
            )
        if chars < INLINE_CHARS:
            return JSONResponse(_tokenize(state, body))
        return JSONResponse(await state.tm.prompts.off_loop(_tokenize, state, body))
    except APIError as err:
        return error_response(err)


async def detokenize(request: Request) -> Response:
    """POST /detokenize: `{prompt}`, the text of token ids (special tokens kept, as vLLM)."""
    try:
        state, body, _ = await _read(request, DetokenizeRequest, "/detokenize")
        vocab = len(state.tm.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"tokens must be token ids in [0, {vocab}), got {bad}", param="tokens", code="invalid_token_id"
            )
        return JSONResponse({"prompt": state.tm.tokenizer.decode(body.tokens)})
    except APIError as err:
        return error_response(err)


async def version(request: Request) -> Response:
    """GET /version: the server's version, as vLLM answers it."""
    return JSONResponse({"version": __version__})


async def tokenizer_info(request: Request) -> Response:
    """GET /tokenizer_info: what a client needs to tokenize and render chats as this server does (vLLM's
    answer: special tokens, the chat template in force, the context window).  lm-evaluation-harness's
    `local-completions` finds it and then tokenizes through /tokenize instead of loading the tokenizer."""
    state: ServerState = request.app.state.server
    tok = state.tm.tokenizer
    ready = state.engine.engine_ready
    return JSONResponse(
        {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": state.tm.prompts.chat_template or getattr(tok, "chat_template", None),
            "model_max_length": ready.context_len if ready else None,
            "vocab_size": len(tok),
        }
    )
