"""`GET /debug/ui`: the live request inspector, one self-contained page (inline CSS and
vanilla JS in `inspector.html`, shipped as package data; no CDN, no build step).

The page holds no data: it polls `/debug/state`, `/debug/requests?in_flight=1`,
`/debug/requests` and `/debug/requests/{rid}` once a second and draws the in-flight and
recent requests and, for the chosen rid, a waterfall of its spans from every process
(stale drops marked), or its summary breakdown when no span was recorded.  So the page
itself is served without the API key (a browser cannot send a header when it opens a
URL: `auth.protected`), while every fetch it makes carries `Authorization: Bearer <key>`
from the tab's sessionStorage (`/debug/ui#key=<key>`, or the form the page shows on a
401).  Its Content-Security-Policy allows only its own inline script and style (by
hash) and fetches to this origin.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

PAGE = Path(__file__).with_name("inspector.html")


def _hashes(html: str, tag: str) -> str:
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    )


@functools.cache
def page() -> tuple[bytes, dict[str, str]]:
    html = PAGE.read_text(encoding="utf-8")
    csp = (
        f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode(), {
        "content-security-policy": csp,
        "cache-control": "no-store",
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
    }


async def debug_ui(request: Request) -> Response:
    body, headers = page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
