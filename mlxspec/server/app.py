"""HTTP and server-sent events on the standard library's `ThreadingHTTPServer`.

Each connection gets a handler thread. A handler parses and validates the body (no MLX), puts
a job on the worker's queue and relays the job's events: as one JSON body, or as SSE. While it
waits it watches its socket, so a client that hangs up cancels its job at once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import queue
import select
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .. import __version__
from ..engine import Engine
from ..proposers import MODES
from . import protocol as P
from .metrics import Metrics
from .protocol import ApiError, RequestParser, ServerConfig, Usage
from .worker import Delta, Done, Failed, Job, Worker

log = logging.getLogger("mlxspec.server")

POST_ROUTES = {
    "/v1/completions": "completion",
    "/completions": "completion",
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/fim/completions": "fim",
    "/fim/completions": "fim",
    "/infill": "infill",
    "/completion": "llama_completion",
}
GET_ROUTES = ("/v1/models", "/models", "/health", "/v1/health", "/metrics", "/")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MlxspecHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine: Engine, *, spec_max_concurrency: int = 2,
                 max_batch: int = 8, max_queue: int = 64, cache_bytes: int = 2 << 30,
                 cache_entries: int = 8, prefill_chunk: int = 512,
                 max_body_bytes: int = 16 << 20,
                 default_max_tokens: int = 512, default_temperature: float = 0.0,
                 cors_origin: str | None = "*", model_name: str | None = None,
                 model_aliases: tuple[str, ...] = (), api_key: str | None = None):
        host = address[0]
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.engine = engine
        self.metrics = Metrics()
        self.max_body_bytes = max_body_bytes
        self.cors_origin = cors_origin
        self.api_key = api_key
        self.started = time.time()
        name = model_name or engine.name
        aliases = {name, engine.name, Path(str(engine.name)).name, "mlxspec", "default",
                   *model_aliases}
        if engine.name.startswith("bundled:"):
            aliases.add("bundled")
        self.config = ServerConfig(
            model_name=name, model_aliases=aliases, max_context=engine.max_context,
            default_max_tokens=default_max_tokens, default_temperature=default_temperature,
            modes=MODES)
        self.parser = RequestParser(engine.tokenizer, self.config)
        # Loading leaves lazy work (e.g. the float16 -> float32 cast on the CPU backend) on this
        # thread's stream, which the worker thread cannot run: materialize the weights here.
        import mlx.core as mx

        mx.eval(engine.model.parameters())
        if engine.draft_model is not None:
            mx.eval(engine.draft_model.parameters())
        self.worker = Worker(engine, spec_max_concurrency=spec_max_concurrency,
                             max_batch=max_batch, max_queue=max_queue, cache_bytes=cache_bytes,
                             cache_entries=cache_entries, prefill_chunk=prefill_chunk,
                             metrics=self.metrics)
        self.worker.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def shutdown(self) -> None:
        super().shutdown()
        self.worker.stop()
        self.worker.join(timeout=10)

    def handle_error(self, request, client_address) -> None:  # quiet about vanished clients
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8080,
                **options) -> MlxspecHTTPServer:
    return MlxspecHTTPServer((host, port), engine, **options)


class ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    server: MlxspecHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = f"mlxspec/{__version__}"
    timeout = 600  # idle keep-alive connections are closed after this

    _last_check = 0.0

    def log_message(self, format, *args):  # noqa: A002
        log.info("%s %s", self.address_string(), format % args)

    # -- plumbing
    def _headers(self, status: int, content_type: str, length: int | None = None,
                 close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if self.server.cors_origin:
            self.send_header("Access-Control-Allow-Origin", self.server.cors_origin)
        if length is not None:
            self.send_header("Content-Length", str(length))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _send_json(self, status: int, body: dict, close: bool = False) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self._headers(status, "application/json; charset=utf-8", len(data), close=close)
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, err: ApiError, endpoint: str, close: bool = False) -> None:
        self.server.metrics.request(endpoint, err.status)
        try:
            self._send_json(err.status, err.body(), close=close)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _client_gone(self) -> bool:
        """True once the peer has closed its side (readable, and a peek reads nothing)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next_event(self, job: Job):
        """The job's next event; raises ClientGone once the client has hung up (checked at
        least every 50 ms, also while events keep coming)."""
        while True:
            now = time.monotonic()
            if now - self._last_check >= 0.05:
                self._last_check = now
                if self._client_gone():
                    raise ClientGone
            try:
                return job.events.get(timeout=0.05)
            except queue.Empty:
                continue

    def _sse(self, payload) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        try:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise ClientGone from None

    # -- verbs
    def do_OPTIONS(self) -> None:  # CORS preflight
        self.send_response(204)
        if self.server.cors_origin:
            self.send_header("Access-Control-Allow-Origin", self.server.cors_origin)
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _authorized(self, path: str) -> bool:
        key = self.server.api_key
        if not key or path in ("/health", "/v1/health"):
            return True
        given = self.headers.get("Authorization", "")
        if given == f"Bearer {key}" or self.headers.get("x-api-key") == key:
            return True
        self._send_error(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                  type="authentication_error"), "other", close=True)
        return False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        srv = self.server
        if not self._authorized(path):
            return
        if path in ("/v1/models", "/models"):
            body = {"object": "list", "data": [{
                "id": srv.config.model_name, "object": "model", "created": int(srv.started),
                "owned_by": "mlxspec",
                "meta": {"mode": srv.engine.mode, "num_draft": srv.engine.num_draft,
                         "n_ctx_train": srv.engine.max_context,
                         "fim": srv.parser.fim.style if srv.parser.fim else None}}]}
            self._send_json(200, body)
        elif path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok", "model": srv.config.model_name,
                                  "mode": srv.engine.mode, "active": srv.worker.active(),
                                  "queued": srv.worker.inbox.qsize()})
        elif path == "/metrics":
            w = srv.worker
            text = srv.metrics.render({
                "mlxspec_requests_active": ("Requests being generated.", w.active()),
                "mlxspec_requests_speculative_active": (
                    "Requests generated on an engine slot (speculative).", len(w.spec_jobs)),
                "mlxspec_requests_batched_active": (
                    "Requests in the batch of plain decoding.", len(w.batch_jobs)),
                "mlxspec_requests_queued": ("Requests waiting for the worker.", w.inbox.qsize()),
                "mlxspec_prompt_cache_entries": ("Prompt caches kept.", len(w.cache.entries)),
                "mlxspec_prompt_cache_bytes": ("Bytes held by kept prompt caches.",
                                               w.cache.nbytes()),
            }).encode()
            self._headers(200, "text/plain; version=0.0.4; charset=utf-8", len(text))
            self.wfile.write(text)
        elif path == "/":
            self._send_json(200, {"name": "mlxspec", "version": __version__,
                                  "endpoints": sorted(POST_ROUTES) + list(GET_ROUTES[:-1])})
        else:
            code = 405 if path in POST_ROUTES else 404
            self._send_error(ApiError(code, f"no such endpoint: GET {path}"), "other")
            return
        self.server.metrics.request(path, 200)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if not self._authorized(path):
            return
        kind = POST_ROUTES.get(path)
        if kind is None:
            code = 405 if path in GET_ROUTES else 404
            self._send_error(ApiError(code, f"no such endpoint: POST {path}"), "other",
                             close=True)
            return
        start = time.perf_counter()
        try:
            body = self._read_body()
            req = getattr(self.server.parser, "fim_completion" if kind == "fim" else kind)(body)
            job = self.server.worker.submit(req)
        except ApiError as e:
            self._send_error(e, path, close=e.status in (411, 413))
            return
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("request parsing failed")
            self._send_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"), path)
            return
        try:
            status = self._relay(job, kind)
        except ClientGone:
            job.cancel()
            self.close_connection = True
            self.server.metrics.disconnected()
            self.server.metrics.request(path, 499)
            return
        except Exception:
            job.cancel()
            raise
        self.server.metrics.request(path, status, time.perf_counter() - start)

    def _read_body(self) -> dict:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise ApiError(411, "send the body with a Content-Length (chunked bodies are not "
                                "accepted)")
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "a Content-Length header is required")
        try:
            n = int(length)
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if n < 0:
            raise ApiError(400, "bad Content-Length header")
        if n > self.server.max_body_bytes:
            raise ApiError(413, f"the request body is {n} bytes; the limit is "
                                f"{self.server.max_body_bytes} bytes (--max-body-bytes)",
                           code="body_too_large")
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    # -- answering
    def _relay(self, job: Job, kind: str) -> int:
        req = job.req
        first = self._next_event(job)
        if isinstance(first, Failed):
            return self._answer_error(first.error)
        if not req.stream:
            text, ev = [], first
            while not isinstance(ev, Done):
                if isinstance(ev, Failed):
                    return self._answer_error(ev.error)
                text.append(ev.text)
                ev = self._next_event(job)
            try:
                self._send_json(200, self._final_body(kind, req, "".join(text), ev))
            except (BrokenPipeError, ConnectionResetError):
                raise ClientGone from None
            return 200
        self._headers(200, "text/event-stream; charset=utf-8", close=True)
        try:
            self.wfile.write(b"")
        except OSError:
            raise ClientGone from None
        if kind in ("chat", "fim"):
            self._sse(P.chat_chunk(req, {"role": "assistant", "content": ""}, None))
        ev = first
        while True:
            if isinstance(ev, Delta):
                if ev.text:
                    self._sse(self._chunk(kind, req, ev.text))
            elif isinstance(ev, Failed):
                self._sse({"error": ev.error.body()["error"]})
                return ev.error.status
            elif isinstance(ev, Done):
                self._finish_stream(kind, req, ev)
                return 200
            ev = self._next_event(job)

    def _answer_error(self, err: ApiError) -> int:
        try:
            self._send_json(err.status, err.body())
        except (BrokenPipeError, ConnectionResetError):
            raise ClientGone from None
        return err.status

    def _final_body(self, kind: str, req, text: str, done: Done) -> dict:
        if kind in ("chat", "fim"):
            return P.chat_body(req, text, done.finish_reason, done.usage)
        if kind == "completion":
            return P.completion_body(req, text, done.finish_reason, done.usage)
        return P.llama_body(req, text, done.finish_reason, done.usage, done.stopping_word)

    def _chunk(self, kind: str, req, text: str) -> dict:
        if kind in ("chat", "fim"):
            return P.chat_chunk(req, {"content": text}, None)
        if kind == "completion":
            return P.completion_chunk(req, text, None)
        return P.llama_body(req, text, None, None)

    def _finish_stream(self, kind: str, req, done: Done) -> None:
        usage: Usage = done.usage
        if kind in ("chat", "fim", "completion"):
            chat = kind != "completion"
            if chat:
                self._sse(P.chat_chunk(req, {}, done.finish_reason))
            else:
                self._sse(P.completion_chunk(req, "", done.finish_reason))
            if req.include_usage:
                make = P.chat_chunk if chat else P.completion_chunk
                self._sse(make(req, None, None, usage))
            self._sse("[DONE]")
        else:  # llama.cpp streams end with the full final object, stop = true, no [DONE]
            self._sse(P.llama_body(req, "", done.finish_reason, usage, done.stopping_word))
