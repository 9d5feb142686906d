"""Optional API key: `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/*, /generate, /flush_cache,
the control endpoints, and on /debug/* and /metrics when configured.  The probes (/health, /livez) are
never protected, nor is the static page of /debug/ui (no data in it: a browser opening it cannot
send a header; every fetch the page makes sends the key).

The control endpoints (`/pause_generation`, `/continue_generation`, `/control/*`: they
change what the server does for everyone) need the key when one is set; without a key
they answer only loopback clients (403 `control_forbidden` to any other) unless
`--control-from-anywhere`.

The comparison is constant-time over fixed-size SHA-256 digests, so neither how much of
a wrong key matches nor its length changes how long the check takes.  The key is never
logged (ServerArgs hides it in its repr).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

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


_FORBIDDEN = msgspec.json.encode({"error": {
    "message": "The control endpoints answer only loopback clients when no API key is set (set SIGHTLINE_API_KEY, "
               "or start the server with --control-from-anywhere).",
    "type": "permission_error", "param": None, "code": "control_forbidden"}})
CONTROL_PATHS = ("/pause_generation", "/continue_generation")
PROBE_PATHS = ("/health", "/livez")  # kubelet and load-balancer probes send no key


def is_control(path: str) -> bool:
    return path in CONTROL_PATHS or path.startswith("/control/")


def is_loopback_client(scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def control_decision(scope, args: ServerArgs, has_key: bool) -> str:
    """For a control endpoint: `key` (the API key decides), `allow`, or `forbid` (no key, not loopback)."""
    if has_key:
        return "key"
    return "allow" if args.control_from_anywhere or is_loopback_client(scope) else "forbid"


def protected(path: str, args: ServerArgs) -> bool:
    if path in PROBE_PATHS:
        return False
    if path.startswith("/v1/") or path in ("/generate", "/flush_cache") or is_control(path):
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
        if scope["type"] == "http" and is_control(scope["path"]) \
                and control_decision(scope, self.args, self.digest is not None) == "forbid":
            await send({"type": "http.response.start", "status": 403, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(_FORBIDDEN)).encode())]})
            await send({"type": "http.response.body", "body": _FORBIDDEN})
            return
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
