"""OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with a status; on the Messages API's
paths (`/v1/messages...`), Anthropic's `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

# how a request ends (its status, its error type) is the table in telemetry.outcomes; re-exported here
from telemetry.outcomes import ABORT_STATUS, CLIENT_GONE, ERROR_TYPES, SHUTTING_DOWN, http_status  # noqa: F401

_AT = re.compile(r"at `\$\.?([A-Za-z0-9_.\[\]]*)`")
_FIELD = re.compile(r"field `([A-Za-z0-9_]+)`")
_json = msgspec.json.Encoder()


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "internal_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None, path: str = "") -> Response:
    """The error as JSON: OpenAI's shape, or Anthropic's on the Messages API's `path`s."""
    return Response(
        _json.encode(body_for(path, err)),
        status_code=err.status,
        media_type="application/json",
        headers={**err.headers, **(headers or {})},
    )


# -- the 503s of a request the server cannot take now (decided by engine_state.check_available) --
def starting() -> APIError:
    """No engine is ready yet (the server starts, or the engine is being replaced)."""
    return APIError(503, "the server is starting; retry shortly", type="server_unavailable")


def unavailable(reason: str) -> APIError:
    """The 503 for a request refused because the server cannot take it now (its `health` reason)."""
    return APIError(
        503,
        f"server unavailable: {reason}",
        type="server_unavailable",
        code=SHUTTING_DOWN if reason == "shutting down" else "engine_unavailable",
    )


PAUSED_RETRY_AFTER = 5  # seconds: the Retry-After of a request refused while generation is paused


def paused_error(mode: str | None) -> APIError:
    """The 503 for a generation request arriving while an operator paused generation."""
    return APIError(
        503,
        f"server unavailable: generation is paused by an operator (mode {mode}); retry later",
        type="server_unavailable",
        code="paused",
        headers={"Retry-After": str(PAUSED_RETRY_AFTER)},
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_decode_error(exc: Exception) -> APIError:
    """A msgspec decode/validation failure of a request body, as a 400 naming the field."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        m = _AT.search(text) or _FIELD.search(text)
        param = m.group(1).split("[")[0].split(".")[0] if m and m.group(1) else None
        return bad_request(f"invalid request: {text}", param=param, code="invalid_type")
    return bad_request(f"request body is not valid JSON: {text}", code="invalid_json")


# -- which HTTP status a request ends with: the table of endings (telemetry.outcomes) ----
def result_error(finish_reason: str | None, error: str | None, status: int) -> APIError | None:
    """An explicit error for a request that ended without its answer (engine error, timeout, shutdown...)."""
    if finish_reason != "error" and error is None:
        return None
    status = status if status in ERROR_TYPES else 500
    return APIError(status, error or "the engine failed this request", type=ERROR_TYPES[status])


# -- the Messages API's own error shape (POST /v1/messages, /v1/messages/count_tokens) ----
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_route(path: str) -> bool:
    """A path whose clients (the `anthropic` SDK) read Anthropic's error shape, not OpenAI's."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_body(status: int, message: str) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, the type by status as Anthropic's API gives it."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(path: str, err: APIError) -> dict:
    return anthropic_body(err.status, err.message) if anthropic_route(path) else err.body()


def refusal_for(path: str, status: int, body: bytes) -> bytes:
    """A middleware's prebuilt OpenAI-shaped refusal, in Anthropic's shape on the Messages API's paths."""
    if not anthropic_route(path):
        return body
    return _json.encode(anthropic_body(status, msgspec.json.decode(body)["error"]["message"]))
