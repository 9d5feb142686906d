"""The response counter: every HTTP response by route template, method and status."""

from __future__ import annotations

from starlette.routing import BaseRoute, Match

from serving.frontend.http.state import ServerState

# Label values come from bounded sets: anything else a client sends counts as "other".
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HTTPMetricsMiddleware:
    """Counts every HTTP response by route template, method and status (pure ASGI: streams untouched)."""

    def __init__(self, app, state: ServerState, routes: list[BaseRoute]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    def route_of(self, scope) -> str:
        """The template of the route the request matches (even with a wrong method), else `unmatched`."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "unmatched"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.state.metrics is None:
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope)
        counter = self.state.metrics.http_requests

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
                counter.labels(route, method, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
