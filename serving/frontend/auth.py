"""Optional API key: `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/*, /generate, /flush_cache,
and on /debug/* and /metrics when configured.  /health is never protected (probes), nor is the
static page of /debug/ui (no data in it: a browser opening it cannot send a header; every fetch
the page makes sends the key).

The comparison is constant-time over fixed-size SHA-256 digests, so neither how much of
a wrong key matches nor its length changes how long the check takes.  The key is never
logged (ServerArgs hides it in its repr).
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from serving.args import ServerArgs

_BODY = msgspec.json.encode({"error": {
    "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})


def key_matches(expected_digest: bytes, presented: str | None) -> bool:
    candidate = hashlib.sha256((presented or "").encode()).digest()
    return hmac.compare_digest(expected_digest, candidate) and presented is not None


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1") if key is not None else None


def protected(path: str, args: ServerArgs) -> bool:
    if path.startswith("/v1/") or path in ("/generate", "/flush_cache"):
        return True
    if path.startswith("/debug"):
        return args.auth_debug and path != "/debug/ui"
    return path == "/metrics" and args.auth_metrics


class AuthMiddleware:
    """Pure ASGI: refuses before the body is read; streams untouched."""

    def __init__(self, app, args: ServerArgs) -> None:
        self.app = app
        self.args = args
        self.digest = hashlib.sha256(args.api_key.encode()).digest() if args.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.digest is None or scope["type"] != "http" or not protected(scope["path"], self.args):
            await self.app(scope, receive, send)
            return
        if key_matches(self.digest, presented_key(dict(scope["headers"]))):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
            (b"content-length", str(len(_BODY)).encode())]})
        await send({"type": "http.response.body", "body": _BODY})
