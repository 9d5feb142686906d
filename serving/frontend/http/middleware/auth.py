"""Optional API keys: `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1/*, /generate, /encode, /flush_cache,
/tokenize, /detokenize, /version, /tokenizer_info,
the control endpoints, and on /debug/* and /metrics when configured.  Each key names a tenant
and a role (`serving.frontend.tenants.keys`): a `user` key opens generation and /v1/models,
only an `admin` key opens /debug/*, /flush_cache, the control endpoints and a protected
/metrics (they show or change every tenant's requests): 403 `admin_required` otherwise.
The probes (/health, /livez) are never protected, nor is the static page of /debug/ui (no
data in it: a browser opening it cannot send a header; every fetch the page makes sends
the key).

The control endpoints (`/pause_generation`, `/continue_generation`, `/control/*`: they
change what the server does for everyone) need the key when one is set; without a key
they answer only loopback clients (403 `control_forbidden` to any other) unless
`--control-from-anywhere`.

The comparison is constant-time over fixed-size SHA-256 digests (against every known key),
so neither how much of a wrong key matches nor its length changes how long the check
takes.  A key is never logged (ServerArgs hides it in its repr).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

import msgspec

from serving.args import ServerArgs
from serving.frontend.errors import refusal_for
from serving.frontend.tenants.keys import ANONYMOUS, Principal
from serving.frontend.tenants.store import KeyStore

_BODY = msgspec.json.encode(
    {
        "error": {
            "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
)


def key_matches(expected_digest: bytes, presented: str | None) -> bool:
    candidate = hashlib.sha256((presented or "").encode()).digest()
    return hmac.compare_digest(expected_digest, candidate) and presented is not None


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1") if key is not None else None


_FORBIDDEN = msgspec.json.encode(
    {
        "error": {
            "message": "The control endpoints answer only loopback clients when no API key is set "
            "(set SIGHTLINE_API_KEY, or start the server with --control-from-anywhere).",
            "type": "permission_error",
            "param": None,
            "code": "control_forbidden",
        }
    }
)
CONTROL_PATHS = ("/pause_generation", "/continue_generation")
PROBE_PATHS = ("/health", "/livez")  # kubelet and load-balancer probes send no key
API_PATHS = (
    "/generate",
    "/encode",
    "/rerank",
    "/v2/rerank",
    "/score",
    "/flush_cache",
    "/tokenize",
    "/detokenize",
    "/version",
    "/tokenizer_info",
)  # besides /v1/*


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
    if path.startswith("/v1/") or path in API_PATHS or is_control(path):
        return True
    if path.startswith("/debug"):
        return args.auth_debug and path != "/debug/ui"
    return path == "/metrics" and args.auth_metrics


PRINCIPAL = "sightline.principal"  # the scope key the request's Principal is kept under (tenant, role)
_ADMIN_ONLY = msgspec.json.encode(
    {
        "error": {
            "message": "This endpoint needs an admin key: it shows or changes what every tenant's requests see.",
            "type": "permission_error",
            "param": None,
            "code": "admin_required",
        }
    }
)


def admin_only(path: str) -> bool:
    """Of the protected endpoints, those that see or change every tenant's requests: /debug/*, /flush_cache,
    control, /metrics."""
    return path == "/flush_cache" or is_control(path) or path.startswith("/debug") or path == "/metrics"


def principal_of(scope) -> Principal:
    return scope.get(PRINCIPAL) or ANONYMOUS


async def _refuse(scope, send, status: int, body: bytes, extra: tuple = ()) -> None:
    body = refusal_for(scope["path"], status, body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *extra, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class AuthMiddleware:
    """Pure ASGI: refuses before the body is read; streams untouched.  The request's `Principal` (tenant,
    role) goes in the scope (`principal_of`): the tenant every later step counts and limits it by."""

    def __init__(self, app, args: ServerArgs, keys: KeyStore | None = None) -> None:
        self.app = app
        self.args = args
        self.keys = keys or KeyStore(args.api_keys_file, args.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, enabled = scope["path"], self.keys.enabled
        if is_control(path) and control_decision(scope, self.args, enabled) == "forbid":
            await _refuse(scope, send, 403, _FORBIDDEN)
            return
        if not enabled or not protected(path, self.args):
            scope[PRINCIPAL] = (
                ANONYMOUS if not enabled else self.keys.table.lookup(presented_key(dict(scope["headers"]))) or ANONYMOUS
            )
            await self.app(scope, receive, send)
            return
        who = self.keys.table.lookup(presented_key(dict(scope["headers"])))
        if who is None:
            await _refuse(scope, send, 401, _BODY, ((b"www-authenticate", b"Bearer"),))
            return
        if admin_only(path) and not who.admin:
            await _refuse(scope, send, 403, _ADMIN_ONLY)
            return
        scope[PRINCIPAL] = who
        await self.app(scope, receive, send)
