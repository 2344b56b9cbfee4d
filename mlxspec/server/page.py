"""The chat page at `/` for browsers: static files from `static/` (plain HTML, JS and CSS,
no build step), served with a strict Content-Security-Policy (no inline script or style)."""

from __future__ import annotations

import re
from pathlib import Path

from starlette.responses import Response

STATIC = Path(__file__).with_name("static")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
STATIC_NAME = re.compile(r"[a-z0-9_-]+\.(html|js|css|svg)")
# The page talks to this server only; nothing inline, nothing from elsewhere, not framed.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def wants_page(accept: str | None) -> bool:
    """Whether a `GET /` asks for the page (a browser's Accept names text/html), not the JSON
    index (application/json, curl's */*)."""
    return "text/html" in (accept or "").lower()


def is_public(path: str, accept: str | None) -> bool:
    """Whether a GET is answered without the API key: the page and its files hold no data
    (the page asks for the key when an API call answers 401)."""
    return path.startswith("/static/") or (path == "/" and wants_page(accept))


def static_file(name: str) -> Response | None:
    """A file of `static/` with the page's headers; None if there is no such file."""
    path = STATIC / name
    if not STATIC_NAME.fullmatch(name) or not path.is_file():
        return None
    return Response(path.read_bytes(), headers=HEADERS, media_type=TYPES[path.suffix])
