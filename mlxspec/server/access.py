"""Who may use the server, as ASGI middleware: the Host check (DNS rebinding), CORS (local
origins by default), the API key, the connection cap, and one log line per request."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import time

from .answers import error_message
from .page import is_public

log = logging.getLogger("mlxspec.server")


def is_loopback(host: str) -> bool:
    """Whether a bind address or a host name names this machine's loopback interface."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> str:
    """The host part of a `Host` header value (`name`, `name:port`, `[v6]`, `[v6]:port`),
    lower-cased, without brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :] if end >= 0 else ""
        if end < 0 or (rest and not re.fullmatch(r":\d{1,5}", rest)):
            return value  # malformed: matches no name
        return value[1:end]
    name, colon, port = value.partition(":")
    return name if colon and port.isdigit() and len(port) <= 5 else value


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


# Browser front ends served from this machine, on any port.
LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?", re.I)


class AccessPolicy:
    """Which `Host` headers and browser `Origin`s the server answers (a guard against DNS
    rebinding and against web pages reading the local model through CORS).

    Host: bound to a loopback address, only loopback names (`localhost`, `127.0.0.1`,
    `[::1]`, any port) and the `--allowed-host` names are answered. Bound to another address,
    any Host is answered unless `--allowed-host` names some: then those, loopback names and IP
    literals. `--allowed-host '*'` turns the check off.

    CORS: `Access-Control-Allow-Origin` echoes local origins (http(s)://localhost,
    127.0.0.1 or [::1], any port) and the `--cors-origin` ones; `--cors-origin '*'` answers
    every origin with `*`."""

    def __init__(self, bind_host: str, allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = ()):
        self.loopback = is_loopback(bind_host)
        self.any_host = "*" in allowed_hosts
        self.allowed_hosts = {h.strip().lower() for h in allowed_hosts if h.strip() != "*"}
        self.check_host = not self.any_host and (self.loopback or bool(self.allowed_hosts))
        self.any_origin = "*" in cors_origins
        self.origins = {o.strip().rstrip("/").lower() for o in cors_origins if o.strip() != "*"}

    def host_allowed(self, value: str | None) -> bool:
        """Whether a request with this `Host` header may be answered (no header: HTTP/1.0
        clients; browsers always send one)."""
        if not self.check_host or value is None:
            return True
        value = value.strip().lower()
        host = split_host(value)
        if is_loopback(host) or value in self.allowed_hosts or host in self.allowed_hosts:
            return True
        return not self.loopback and is_ip_literal(host)

    def origin_allowed(self, origin: str | None) -> bool:
        if not origin:
            return False
        origin = origin.strip().rstrip("/")
        return (self.any_origin or LOCAL_ORIGIN.fullmatch(origin) is not None
                or origin.lower() in self.origins)

    def allow_origin_header(self, origin: str | None) -> str | None:
        """The `Access-Control-Allow-Origin` value for a request from `origin` (None: none)."""
        if self.any_origin:
            return "*"
        return origin.strip() if self.origin_allowed(origin) else None


def refusal(path: str, status: int, message: str, type: str, code: str | None = None) -> dict:
    """A refusal's body, in the shape the path's API family words errors in."""
    if path.startswith(("/v1/messages", "/messages")):
        from .anthropic import error_body
        from .protocol import ApiError

        return error_body(ApiError(status, message, type=type, code=code))
    return {"error": {"message": message, "type": type, "param": None,
                      "code": code if code is not None else status}}


def header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class Gate:
    """ASGI middleware in front of every route: answers what no route should see (a foreign
    Host, a CORS preflight, a missing API key, a connection over the cap), adds the CORS
    header to allowed origins, and counts and logs each request (method, path, status;
    never headers, query strings or keys)."""

    def __init__(self, app, server):
        self.app, self.server = app, server
        self.in_flight = 0  # requests being answered (drain waits for them)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv = self.server
        path = scope["path"].rstrip("/") or "/"
        scope["path"] = path
        started, status = time.perf_counter(), [0]
        origin = header(scope, b"origin")
        allow = srv.access.allow_origin_header(origin)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if allow:
                    extra = [(b"access-control-allow-origin", allow.encode())]
                    if allow != "*":
                        extra.append((b"vary", b"Origin"))
                    message = {**message, "headers": [*message["headers"], *extra]}
            await send(message)

        self.in_flight += 1
        try:
            refused = self.refuse(scope, path, origin)
            if refused is not None:
                for message in refused:
                    await send_with_cors(message)
            else:
                await self.app(scope, receive, send_with_cors)
        finally:
            self.in_flight -= 1
            code = scope.get("mlxspec.status") or status[0]
            label = path if path in srv.routes else "other"
            seconds = time.perf_counter() - started if label in srv.generation_routes else None
            srv.metrics.request(label, code, seconds)
            client = scope.get("client") or ("-",)
            log.info("%s %s %s %s", client[0], scope["method"], path, code)

    def refuse(self, scope, path: str, origin: str | None):
        """The messages of an answer given here, or None to go on to the route."""
        srv = self.server
        value = header(scope, b"host")
        if not srv.access.host_allowed(value):
            name = split_host(value or "")
            return error_message(403, refusal(
                path, 403, f"requests addressed to host {value!r} are not answered: this server "
                     "only answers requests addressed to localhost, 127.0.0.1 or [::1] (a guard "
                     "against DNS rebinding); if you reach it under this name on purpose, start "
                     f"it with --allowed-host {name}", "permission_error", "host_not_allowed"),
                close=True)
        if scope["method"] == "OPTIONS":  # a CORS preflight (or a client asking what it may)
            if origin is not None and not srv.access.origin_allowed(origin):
                return error_message(403, refusal(
                    path, 403, f"cross-origin requests from {origin} are not allowed; start the "
                         f"server with --cors-origin {origin} to allow them", "permission_error",
                    "origin_not_allowed"), close=True)
            headers = [(b"allow", b"GET, POST, OPTIONS"), (b"content-length", b"0")]
            if origin is not None:
                asked = header(scope, b"access-control-request-headers")
                headers += [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                            (b"access-control-allow-headers",
                             (asked or "Authorization, Content-Type").encode()),
                            (b"access-control-max-age", b"600")]
            return ({"type": "http.response.start", "status": 204, "headers": headers},
                    {"type": "http.response.body", "body": b""})
        if (srv.api_key and path not in ("/health", "/v1/health") and not self.key_ok(scope)
                and not (scope["method"] == "GET"
                         and is_public(path, header(scope, b"accept")))):
            return error_message(401, refusal(
                path, 401, "missing or wrong API key (Authorization: Bearer ...)",
                "authentication_error"), close=True)
        if srv.open_connections() > srv.max_connections:
            srv.metrics.rejected("connections")
            return error_message(503, refusal(
                path, 503, f"the server has {srv.max_connections} connections open "
                     "(--max-connections); retry shortly", "server_busy",
                "too_many_connections"), {"Retry-After": 1}, close=True)
        return None

    def key_ok(self, scope) -> bool:
        key = self.server.api_key
        given = (header(scope, b"authorization") or "").encode("latin-1")
        alt = (header(scope, b"x-api-key") or "").encode("latin-1")
        # Both compared in constant time (no early exit on the first differing byte).
        ok_bearer = hmac.compare_digest(given, f"Bearer {key}".encode())
        ok_alt = hmac.compare_digest(alt, key.encode())
        return ok_bearer or ok_alt


def presented_key(scope) -> str | None:
    """The API key a request carries (Authorization: Bearer, or x-api-key), if any."""
    auth = header(scope, b"authorization") or ""
    if auth.lower().startswith("bearer ") and auth[7:].strip():
        return auth[7:].strip()
    return header(scope, b"x-api-key") or None
