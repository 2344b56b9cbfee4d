"""HTTP helpers the server tests share: a POST, server-sent events, a server in a thread."""

from __future__ import annotations

import http.client
import json
import socket
import threading

from mlxspec.server.app import make_server


def post(url: str, path: str, body, raw: bytes | None = None, headers=None, timeout=60):
    """(status, payload bytes, response) of one POST to a server at `url`."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    return resp.status, payload, resp


def sse_events(payload: bytes) -> list:
    """The `data:` events of a streamed answer (JSON, or the "[DONE]" string)."""
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in payload.decode().splitlines() if line.startswith("data: ")]


def call(srv, path: str, body) -> tuple[int, dict]:
    """(status, JSON answer) of one POST to a server started by `start`."""
    status, payload, _ = post(srv.url, path, body)
    return status, json.loads(payload)


def stream(srv, path: str, body) -> list:
    """The events of one streamed POST (`"stream": true` added) that answers 200."""
    status, payload, _ = post(srv.url, path, {**body, "stream": True})
    assert status == 200, payload
    return sse_events(payload)


def start(engine, **options):
    """`make_server` on a free loopback port, serving from a daemon thread."""
    srv = make_server(engine, "127.0.0.1", 0, **options)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def stop(srv) -> None:
    srv.shutdown()
    srv.server_close()


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
