"""`x-request-id` and `traceparent` on every response, whoever made it."""

from __future__ import annotations

from serving.frontend.http.server import id_headers

IDS_SCOPE_KEY = "sightline.response_ids"  # scope: this HTTP request's fallback (x-request-id, traceparent)


def response_ids(scope) -> list[tuple[bytes, bytes]]:
    """This HTTP request's own x-request-id and traceparent, made on first use and kept in the
    scope (the 500 handler, which runs outside the middleware stack, finds them there)."""
    ids = scope.get(IDS_SCOPE_KEY)
    if ids is None:
        incoming = next((v for k, v in scope["headers"] if k == b"traceparent"), b"")
        ids = scope[IDS_SCOPE_KEY] = id_headers(incoming.decode("latin-1"))
    return ids


class ResponseIdsMiddleware:
    """Every response carries `x-request-id` and `traceparent`, including those no handler
    made (401, 415, 404, 405, CORS preflights): a client can always quote one in a report.
    A generation handler sets its own (the rid; the server span's context when one was
    sampled); whichever of the two a response lacks gets this HTTP request's own."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_ids(message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers", ())
                have = {name.lower() for name, _ in headers}
                if b"x-request-id" not in have or b"traceparent" not in have:
                    message = {
                        **message,
                        "headers": [*headers, *((k, v) for k, v in response_ids(scope) if k not in have)],
                    }
            await send(message)

        await self.app(scope, receive, send_with_ids)
