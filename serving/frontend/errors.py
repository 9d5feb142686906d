"""OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

import re

import msgspec

_AT = re.compile(r"at `\$\.?([A-Za-z0-9_.\[\]]*)`")
_FIELD = re.compile(r"field `([A-Za-z0-9_]+)`")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "internal_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
