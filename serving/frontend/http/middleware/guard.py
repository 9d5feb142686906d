"""Cross-site guards (pure ASGI, before auth and before the body is read).

* **Host allow-list** against DNS rebinding: a page on `evil.example` that rebinds its
  name to 127.0.0.1 sends `Host: evil.example`; without this check it could read
  `/debug/*` and generate with a key-less loopback server.  `--allowed-hosts` names the
  accepted host names (port ignored; `*` allows any); by default a server bound to a
  loopback address accepts only loopback names, and one bound elsewhere accepts any
  (probes and scrapers in a cluster address pods by IP).
* **JSON only** on POSTs that carry a body: a cross-site form or `fetch` with
  `text/plain` skips the CORS preflight; requiring `application/json` (or `+json`)
  makes the browser ask first, and only an origin named in `--allowed-origins` gets a
  yes (by default none: no page elsewhere can read an answer).  Body-less POSTs pass.
"""

from __future__ import annotations

import ipaddress

import msgspec

from serving.frontend.errors import APIError, body_for

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, configured: str | None) -> frozenset[str] | None:
    """The accepted host names (lower case, no port), or None for no restriction."""
    if configured is not None:
        names = {h.strip().lower().strip("[]") for h in configured.split(",") if h.strip()}
        return None if "*" in names else frozenset(names)
    if _is_loopback(bind_host):
        return frozenset(LOOPBACK_NAMES)
    return None


def allowed_origins(configured: str | None) -> list[str]:
    """`--allowed-origins` as CORSMiddleware takes it; a trailing slash is dropped, since
    browsers send origins without one."""
    return [o.strip().rstrip("/") for o in (configured or "").split(",") if o.strip()]


def host_name(header: str) -> str:
    """`Host` header value → host name without port, brackets or case ("[::1]:80" → "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length", b"").strip()
    return b"transfer-encoding" in headers or (length not in (b"", b"0"))


async def send_error(scope, send, err: APIError) -> None:
    body = msgspec.json.encode(body_for(scope["path"], err))
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    def __init__(self, app, hosts: frozenset[str] | None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.hosts is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                await send_error(
                    scope,
                    send,
                    APIError(
                        400,
                        f"Host {host!r} is not allowed on this server (see --allowed-hosts)",
                        param="host",
                        code="invalid_host",
                    ),
                )
                return
        if (
            scope["method"] == "POST"
            and has_body(headers)
            and not is_json(headers.get(b"content-type", b"").decode("latin-1"))
        ):
            await send_error(
                scope,
                send,
                APIError(
                    415,
                    "Content-Type must be application/json",
                    type="invalid_request_error",
                    param="content-type",
                    code="unsupported_media_type",
                ),
            )
            return
        await self.app(scope, receive, send)
