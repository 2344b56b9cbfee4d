"""HTTP and server-sent events on the standard library's `ThreadingHTTPServer`.

Each connection gets a handler thread. A handler parses and validates the body (no MLX), puts
a job on the worker's queue and relays the job's events: as one JSON body, or as SSE. While it
waits it watches its socket, so a client that hangs up cancels its job at once.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import queue
import re
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .. import __version__
from ..caches.shift import check_shiftable
from ..engine import Engine
from ..errors import MlxspecError
from ..prefill import new_cache
from ..proposers import MODES
from ..suffix_store import (
    DEFAULT_BUDGET,
    SuffixStores,
    scope_key,
    tokenizer_fingerprint,
)
from ..suffix_store import load as load_suffix
from ..suffix_store import save as save_suffix
from . import protocol as P
from .metrics import Metrics
from .protocol import ApiError, RequestParser, ServerConfig, Usage
from .worker import SPEC_MAX_CONCURRENCY, Delta, Done, Failed, Job, Progress, Worker

SUFFIX_SCOPES = ("request", "client", "global")

log = logging.getLogger("mlxspec.server")

POST_ROUTES = {
    "/v1/completions": "completion",
    "/completions": "llama_completion",  # llama-server answers it natively
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/fim/completions": "fim",
    "/fim/completions": "fim",
    "/infill": "infill",
    "/completion": "llama_completion",
}
# llama.cpp's utility endpoints: answered on the handler thread, no generation.
UTILITY_ROUTES = {"/tokenize": "tokenize", "/detokenize": "detokenize",
                  "/apply-template": "apply_template"}
GET_ROUTES = ("/v1/models", "/models", "/health", "/v1/health", "/metrics", "/props", "/slots",
              "/")


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


OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; "
                 b"charset=utf-8\r\nRetry-After: 1\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s")


class MlxspecHTTPServer(ThreadingHTTPServer):
    """The HTTP server: a handler thread per connection, up to `max_connections` open at
    once (beyond that a connection is answered 503 with Retry-After and closed, never reset).
    The listen backlog takes bursts of a thousand connections. A connection that takes longer
    than `read_timeout` to send its request (headers and body; an idle keep-alive connection
    too) is closed, so slow or stuck clients cannot hold handler threads; a client that does
    not read its answer for `write_timeout` is dropped and its job cancelled."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the listen backlog (the standard library's is 5)

    def __init__(self, address, engine: Engine, *, spec_max_concurrency: int | None = None,
                 max_batch: int = 8, max_queue: int = 64, cache_bytes: int = 2 << 30,
                 cache_entries: int = 8, prefill_chunk: int = 512,
                 max_body_bytes: int = 16 << 20,
                 default_max_tokens: int = 512, default_temperature: float = 0.0,
                 default_seed: int | None = None,
                 cors_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = (),
                 model_name: str | None = None, model_aliases: tuple[str, ...] = (),
                 accept_any_model: bool = False, api_key: str | None = None,
                 log_prompts: bool = False, max_connections: int = 512,
                 read_timeout: float = 30.0, write_timeout: float = 30.0,
                 request_timeout: float | None = None, send_buffer_bytes: int | None = None,
                 batch_spec: bool = True, suffix_scope: str = "client",
                 suffix_budget: int = DEFAULT_BUDGET, suffix_cache: str | None = None,
                 cache_reuse: int = 0, follow_ahead: bool = True, slots: bool = True,
                 slots_debug: bool = False):
        if spec_max_concurrency is None:  # batched: an upper bound; round robin: a forward each
            spec_max_concurrency = SPEC_MAX_CONCURRENCY if batch_spec else 2
        # Earlier requests' text for the suffix source, one store per scope: `client` (the
        # API key a request presents, else its address), `global` or `request` (none kept).
        if suffix_scope not in SUFFIX_SCOPES:
            raise MlxspecError(f"--suffix-scope must be one of {', '.join(SUFFIX_SCOPES)}, "
                               f"got {suffix_scope!r}")
        self.suffix_scope, self.suffix_cache = suffix_scope, suffix_cache
        self.suffix = SuffixStores(suffix_budget, tokenizer_fingerprint(engine.tokenizer))
        if cache_reuse < 0:
            raise MlxspecError(f"--cache-reuse must be >= 0, got {cache_reuse}")
        if cache_reuse:  # a model that cannot shift its cache says so before listening
            check_shiftable(engine.model, new_cache(engine, engine.proposer_of(None)))
        if suffix_cache:
            load_suffix(self.suffix, suffix_cache)  # a bad file: one error line, before listening
        host = address[0]
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.engine = engine
        self.metrics = Metrics()
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.read_timeout, self.write_timeout = read_timeout, write_timeout
        self.send_buffer_bytes = send_buffer_bytes
        # Open connections: socket -> [phase, since]; phase "read" (waiting for a request, or
        # reading one) or "busy" (answering). The reaper closes "read" ones past read_timeout.
        self.conns: dict[socket.socket, list] = {}
        self.conn_lock = threading.Lock()
        self._closing = threading.Event()
        self.access = AccessPolicy(host, tuple(allowed_hosts), tuple(cors_origins))
        self.api_key = api_key
        self.log_prompts = log_prompts
        # GET /slots (llama-server's --slots / --no-slots); prompt text only with slots_debug
        self.slots_endpoint, self.slots_debug = slots, slots_debug
        self.started = time.time()
        name = model_name or engine.name
        aliases = {name, engine.name, Path(str(engine.name)).name, "mlxspec", "default",
                   *model_aliases}
        if engine.name.startswith("bundled:"):
            aliases.add("bundled")
        self.config = ServerConfig(
            model_name=name, model_aliases=aliases, max_context=engine.max_context,
            default_max_tokens=default_max_tokens, default_temperature=default_temperature,
            default_seed=default_seed,
            modes=MODES, accept_any_model=accept_any_model,
            max_n_cmpl=max(1, min(16, max_queue)), cache_reuse=cache_reuse)
        self.total_slots = spec_max_concurrency + max_batch
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
                             metrics=self.metrics, request_timeout=request_timeout,
                             batch_spec=batch_spec, suffix=self.suffix,
                             follow_ahead=follow_ahead)
        coord = getattr(engine, "coord", None)
        if coord is not None:  # --distributed: a lost rank fails the requests, then we exit
            coord.on_lost = self.worker.fail_all
            coord.watch_idle = True
        self.worker.start()
        threading.Thread(target=self._reap, name="mlxspec-reaper", daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def shutdown(self) -> None:
        super().shutdown()
        self._closing.set()
        self.worker.stop()
        self.worker.join(timeout=10)
        self.save_suffix()

    def save_suffix(self) -> None:
        """Write the suffix stores to --suffix-cache (after the worker has stopped)."""
        if self.suffix_cache and not self.worker.is_alive():
            try:
                save_suffix(self.suffix, self.suffix_cache)
            except OSError as e:
                log.error("cannot write --suffix-cache %s: %s", self.suffix_cache,
                          e.strerror or e)

    # -- connections
    def open_connections(self) -> int:
        with self.conn_lock:
            return len(self.conns)

    def busy_connections(self) -> int:
        with self.conn_lock:
            return sum(1 for phase, _ in self.conns.values() if phase == "busy")

    def mark(self, sock: socket.socket, phase: str) -> None:
        with self.conn_lock:
            if sock in self.conns:
                self.conns[sock] = [phase, time.monotonic()]

    def process_request(self, request, client_address) -> None:
        with self.conn_lock:
            over = len(self.conns) >= self.max_connections
            if not over:
                self.conns[request] = ["read", time.monotonic()]
        if over:
            self.metrics.rejected("connections")
            threading.Thread(target=self._turn_away, args=(request,), daemon=True).start()
            return
        if self.send_buffer_bytes:
            request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        super().process_request(request, client_address)

    def _turn_away(self, sock: socket.socket) -> None:
        """Over max_connections: a 503 with Retry-After, then read what the client sends
        until it closes (closing with unread data would reset the connection)."""
        body = dumps(ApiError(503, f"the server has {self.max_connections} connections open "
                                   "(--max-connections); retry shortly", type="server_busy",
                              code="too_many_connections").body()).encode()
        try:
            sock.settimeout(2.0)
            sock.sendall(OVER_CAPACITY % (len(body), body))
            sock.shutdown(socket.SHUT_WR)
            end = time.monotonic() + 2.0
            while time.monotonic() < end and sock.recv(65536):
                pass
        except OSError:
            pass
        finally:
            super().shutdown_request(sock)

    def shutdown_request(self, request) -> None:
        with self.conn_lock:
            self.conns.pop(request, None)
        super().shutdown_request(request)

    def _reap(self) -> None:
        """Close connections that have been sending a request (or idling) too long."""
        while not self._closing.wait(min(0.25, self.read_timeout / 4)):
            now = time.monotonic()
            with self.conn_lock:
                late = [s for s, (phase, since) in self.conns.items()
                        if phase == "read" and now - since > self.read_timeout]
                for s in late:
                    self.conns[s] = ["reaped", now]
            for s in late:
                self.metrics.timed_out("read")
                try:
                    s.shutdown(socket.SHUT_RD)  # the handler's read returns at once (408)
                except OSError:
                    pass

    def drain(self, grace: float, stopping_server: bool = True) -> bool:
        """Graceful shutdown: stop accepting, refuse new requests (503), let running ones
        finish for up to `grace` seconds, then end the rest with their partial answers
        (finish_reason "shutdown", a clean end of stream). True if all finished in time.
        A KeyboardInterrupt while waiting (a second Ctrl-C) ends them at once."""
        self.worker.draining = True
        if stopping_server:
            super().shutdown()  # serve_forever has returned (or returns now)
        self.socket.close()
        finished = True
        try:
            end = time.monotonic() + grace
            while not self.worker.idle() and time.monotonic() < end:
                time.sleep(0.02)
        except KeyboardInterrupt:
            pass
        if not self.worker.idle():
            finished = False
            self.worker.end_all("shutdown")
        # Let the handlers write the last events (a job's final chunk) before the worker goes.
        end = time.monotonic() + 5.0
        while (not self.worker.idle() or self.busy_connections()) and time.monotonic() < end:
            time.sleep(0.02)
        self._closing.set()
        self.worker.stop()
        self.worker.join(timeout=10)
        self.save_suffix()
        return finished

    def handle_error(self, request, client_address) -> None:  # quiet about vanished clients
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def mlx_memory() -> dict:
    """MLX's allocator: arrays alive, and freed buffers it keeps for reuse (counted in the
    process's resident memory, and not given back to the system by itself)."""
    import mlx.core as mx

    out = {}
    for name, fn, help_ in (("active", "get_active_memory", "Bytes of live MLX arrays."),
                            ("cache", "get_cache_memory",
                             "Bytes of freed buffers MLX's allocator keeps for reuse."),
                            ("peak", "get_peak_memory", "Peak bytes of live MLX arrays.")):
        if hasattr(mx, fn):
            out[f"mlxspec_mlx_{name}_memory_bytes"] = (help_, getattr(mx, fn)())
    return out


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8080,
                **options) -> MlxspecHTTPServer:
    return MlxspecHTTPServer((host, port), engine, **options)


class ClientGone(Exception):
    pass


class Tagged:
    """A job's event sink that tags its events with the job's number on a shared queue (so
    one handler waits on all its jobs at once)."""

    def __init__(self, shared: queue.Queue, number: int):
        self.shared, self.number = shared, number

    def put(self, event) -> None:
        self.shared.put((self.number, event))


class JobGroup:
    """The jobs of one request: `reqs` (one per answer, `index` 0, 1, ...) and `jobs`,
    `job_of[i]` the job that answers `reqs[i]` (greedy answers of one prompt share one)."""

    def __init__(self, reqs: list):
        self.reqs = reqs
        self.req = reqs[0]
        self.jobs: list[Job] = []
        self.job_of: list[int] = []
        self.events: queue.Queue = queue.Queue()

    def tagged(self, number: int) -> Tagged:
        return Tagged(self.events, number)

    def answers_of(self, j: int) -> list[int]:
        return [i for i, k in enumerate(self.job_of) if k == j]

    def job_slot(self, j: int) -> int:
        slot = self.jobs[j].slot_id
        return 0 if slot is None else slot

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


def dumps(body) -> str:
    """JSON as llama.cpp writes it: compact (llama.vim checks replies against
    `"content"\\s*:"`, no space after the colon) and UTF-8."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class Handler(BaseHTTPRequestHandler):
    server: MlxspecHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = f"mlxspec/{__version__}"
    _last_check = 0.0

    def setup(self) -> None:
        # Sends block at most this long (a client not reading its stream is dropped); reads
        # too, and the server's reaper bounds a whole request's reading by --read-timeout.
        self.timeout = max(self.server.write_timeout, 0.001)
        super().setup()

    def handle_one_request(self) -> None:
        self.server.mark(self.connection, "read")
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.command != "POST":
            self.server.mark(self.connection, "busy")
        return ok

    def log_message(self, format, *args):  # noqa: A002
        pass  # one line per request is written by log_request, without headers or query

    def log_request(self, code="-", size="-") -> None:
        """`--log-requests`: method, path (no query string), status. Headers (the API key,
        `Authorization`) are never logged; prompts only with `--log-prompts`."""
        path = (getattr(self, "path", "") or "").split("?", 1)[0]
        log.info("%s %s %s %s", self.address_string(), self.command, path,
                 getattr(code, "value", code))

    def _cors(self) -> None:
        allow = self.server.access.allow_origin_header(self.headers.get("Origin"))
        if allow:
            self.send_header("Access-Control-Allow-Origin", allow)
            if allow != "*":
                self.send_header("Vary", "Origin")

    # -- plumbing
    def _headers(self, status: int, content_type: str, length: int | None = None,
                 close: bool = False, retry_after: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self._cors()
        if length is not None:
            self.send_header("Content-Length", str(length))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()

    def _send_json(self, status: int, body: dict | list, close: bool = False,
                   retry_after: int | None = None) -> None:
        data = dumps(body).encode()
        self._headers(status, "application/json; charset=utf-8", len(data), close=close,
                      retry_after=retry_after)
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, err: ApiError, endpoint: str, close: bool = False) -> None:
        self.server.metrics.request(endpoint, err.status)
        try:
            self._send_json(err.status, err.body(), close=close, retry_after=err.retry_after)
        except OSError:  # gone, reset, or not reading (a send timeout)
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

    def _sse(self, payload) -> None:
        data = payload if isinstance(payload, str) else dumps(payload)
        try:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()
        except OSError as e:  # gone, or not reading for --write-timeout
            if isinstance(e, TimeoutError):
                self.server.metrics.timed_out("write")
            raise ClientGone from None

    # -- verbs
    def do_OPTIONS(self) -> None:  # CORS preflight
        if not self._host_ok():
            return
        origin = self.headers.get("Origin")
        if origin is not None and not self.server.access.origin_allowed(origin):
            self._send_error(ApiError(
                403, f"cross-origin requests from {origin} are not allowed; start the server "
                     f"with --cors-origin {origin} to allow them", type="permission_error",
                code="origin_not_allowed"), "other", close=True)
            return
        self.send_response(204)
        if origin is not None:
            self._cors()
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers",
                             self.headers.get("Access-Control-Request-Headers")
                             or "Authorization, Content-Type")
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Allow", "GET, POST, OPTIONS")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _host_ok(self) -> bool:
        """The Host check (DNS rebinding): a 403 that says how to allow the name."""
        value = self.headers.get("Host")
        if self.server.access.host_allowed(value):
            return True
        name = split_host(value or "")
        self._send_error(ApiError(
            403, f"requests addressed to host {value!r} are not answered: this server only "
                 "answers requests addressed to localhost, 127.0.0.1 or [::1] (a guard against "
                 "DNS rebinding); if you reach it under this name on purpose, start it with "
                 f"--allowed-host {name}", type="permission_error", code="host_not_allowed"),
            "other", close=True)
        return False

    def _authorized(self, path: str) -> bool:
        key = self.server.api_key
        if not key or path in ("/health", "/v1/health"):
            return True
        want = f"Bearer {key}".encode()
        given = self.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        alt = self.headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
        # Both compared in constant time (no early exit on the first differing byte).
        ok_bearer = hmac.compare_digest(given, want)
        ok_alt = hmac.compare_digest(alt, key.encode())
        if ok_bearer or ok_alt:
            return True
        self._send_error(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                  type="authentication_error"), "other", close=True)
        return False

    def _presented_key(self) -> str | None:
        """The API key the request carries (Authorization: Bearer, or x-api-key), if any."""
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            return auth[7:].strip()
        return self.headers.get("x-api-key") or None

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        srv = self.server
        if not self._host_ok() or not self._authorized(path):
            return
        if path in ("/v1/models", "/models"):
            body = {"object": "list", "data": [{
                "id": srv.config.model_name, "object": "model", "created": int(srv.started),
                "owned_by": "mlxspec",
                "meta": {"mode": srv.engine.mode, "num_draft": srv.engine.num_draft,
                         "n_ctx_train": srv.engine.max_context,
                         "fim": srv.parser.fim.style if srv.parser.fim else None}}]}
            self._send_json(200, body)
        elif path in ("/health", "/v1/health") and srv.worker.draining:
            self._send_json(503, {"status": "shutting_down", "model": srv.config.model_name},
                            retry_after=5)
            self.server.metrics.request(path, 503)
            return
        elif path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok", "model": srv.config.model_name,
                                  "mode": srv.engine.mode, "active": srv.worker.active(),
                                  "queued": srv.worker.inbox.qsize()})
        elif path == "/metrics":
            w = srv.worker
            text = srv.metrics.render({
                "mlxspec_requests_active": ("Requests being generated.", w.active()),
                "mlxspec_requests_speculative_active": (
                    "Requests speculating.", w.speculating()),
                "mlxspec_requests_batched_active": (
                    "Requests decoded plainly (over --spec-max-concurrency).",
                    sum(w.over_limit(j) for j in w.jobs)),
                "mlxspec_requests_queued": ("Requests waiting for the worker.", w.inbox.qsize()),
                "mlxspec_connections_open": ("Open HTTP connections (--max-connections).",
                                             srv.open_connections()),
                "mlxspec_connections_busy": ("Connections being answered.",
                                             srv.busy_connections()),
                "mlxspec_prompt_cache_entries": ("Prompt caches kept.", len(w.cache.entries)),
                "mlxspec_prompt_cache_bytes": ("Bytes held by kept prompt caches.",
                                               w.cache.nbytes()),
                **mlx_memory(),
            }).encode()
            self._headers(200, "text/plain; version=0.0.4; charset=utf-8", len(text))
            self.wfile.write(text)
        elif path == "/props":
            self._send_json(200, self._props())
        elif path == "/slots":
            if not srv.slots_endpoint:  # llama-server's answer without --slots
                self._send_error(ApiError(501, "This server does not support slots endpoint.",
                                          type="not_supported_error"), path)
                return
            self._send_json(200, self._slots())
        elif path == "/":
            self._send_json(200, {"name": "mlxspec", "version": __version__,
                                  "endpoints": sorted([*POST_ROUTES, *UTILITY_ROUTES])
                                  + list(GET_ROUTES[:-1])})
        else:
            code = 405 if path in POST_ROUTES or path in UTILITY_ROUTES else 404
            self._send_error(ApiError(code, f"no such endpoint: GET {path}"), "other")
            return
        self.server.metrics.request(path, 200)

    def _slots(self) -> list[dict]:
        """llama-server's `GET /slots`: each slot (a job's place, `--spec-max-concurrency`
        + `--max-batch` of them) and the request it serves; the prompt's and answer's text
        only with --slots-debug (llama-server's LLAMA_SERVER_SLOTS_DEBUG)."""
        srv = self.server
        ctx = srv.config.max_context or 0
        jobs = {j.slot_id: j for j in list(srv.worker.jobs)
                if j.slot_id is not None and not j.ahead}
        out = []
        for i in range(max(srv.total_slots, max(jobs, default=-1) + 1)):
            slot: dict = {"id": i, "n_ctx": ctx,
                          "speculative": srv.engine.mode != "none", "is_processing": i in jobs}
            job = jobs.get(i)
            if job is not None:
                r, st = job.req, job.stats
                generated = st.generated_tokens if st is not None else 0
                slot.update({
                    "id_task": job.task_id,
                    "n_prompt_tokens": len(r.prompt),
                    "n_prompt_tokens_processed": len(r.prompt) - (st.cached_tokens if st else 0),
                    "n_prompt_tokens_cache": st.cached_tokens if st is not None else 0,
                    "params": {"n_predict": r.max_tokens, "temperature": r.temperature,
                               "top_k": r.top_k, "top_p": r.top_p, "min_p": r.min_p,
                               "seed": r.seed, "stop": r.stop, "n_indent": r.n_indent,
                               "stream": r.stream, "speculative.mode": r.mode or srv.engine.mode},
                    "next_token": [{"has_next_token": True,
                                    "has_new_line": "\n" in job.text_so_far,
                                    "n_remain": max(0, r.max_tokens - generated),
                                    "n_decoded": generated}],
                })
                if srv.slots_debug:
                    slot["prompt"] = srv.parser.prompt_text(r.prompt)
                    slot["generated"] = job.text_so_far
            out.append(slot)
        return out

    def _props(self) -> dict:
        """llama.cpp's `GET /props` (what llama.vscode reads the context size from)."""
        srv = self.server
        tok = srv.engine.tokenizer
        cfg = srv.config
        template = getattr(tok, "chat_template", None)
        return {
            "default_generation_settings": {
                "n_ctx": cfg.max_context or 0,
                "params": {"n_predict": cfg.default_max_tokens,
                           "temperature": cfg.default_temperature, "top_k": 0, "top_p": 1.0,
                           "min_p": 0.0, "stop": [], "n_indent": 0,
                           "seed": -1 if cfg.default_seed is None else cfg.default_seed,
                           "speculative.mode": srv.engine.mode,
                           "speculative.n_max": srv.engine.num_draft},
            },
            "total_slots": srv.total_slots,
            "model_alias": cfg.model_name,
            "model_path": str(srv.engine.name),
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": srv.slots_endpoint,
            "endpoint_props": True,
            "endpoint_metrics": True,
            "webui": False,
            "chat_template": template if isinstance(template, str) else "",
            "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "",
            "build_info": f"mlxspec {__version__}",
        }

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if not self._host_ok() or not self._authorized(path):
            return
        if path in UTILITY_ROUTES:
            self._utility(path)
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
            self.server.mark(self.connection, "busy")
            if self.server.log_prompts:
                log.info("%s %s request: %s", self.address_string(), path, dumps(body))
            reqs = self.server.parser.requests(kind, body)
            scope = scope_key(self.server.suffix_scope, self._presented_key(),
                              self.client_address[0])
            for req in reqs:
                req.suffix_scope = scope
            group = self._submit(reqs)
        except ApiError as e:
            self._send_error(e, path, close=e.status in (408, 411, 413))
            return
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("request parsing failed")
            self._send_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"), path)
            return
        try:
            status = self._relay(group, kind)
        except ClientGone:
            group.cancel()
            self.close_connection = True
            self.server.metrics.disconnected()
            self.server.metrics.request(path, 499)
            return
        except Exception:
            group.cancel()
            raise
        self.server.metrics.request(path, status, time.perf_counter() - start)

    def _utility(self, path: str) -> None:
        """/tokenize, /detokenize, /apply-template: tokenizer work, answered here."""
        try:
            body = self._read_body()
            self.server.mark(self.connection, "busy")
            answer = getattr(self.server.parser, UTILITY_ROUTES[path])(body)
        except ApiError as e:
            self._send_error(e, path, close=e.status in (408, 411, 413))
            return
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("%s failed", path)
            self._send_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"), path)
            return
        self._send_json(200, answer)
        self.server.metrics.request(path, 200)

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
        try:
            raw = self.rfile.read(n)
        except OSError:
            raw = b""
        if len(raw) < n:  # the client stopped sending, or --read-timeout closed it
            raise ApiError(408, f"the body ended after {len(raw)} of {n} bytes (a request must "
                                f"arrive within --read-timeout, {self.server.read_timeout:g} s)",
                           code="request_timeout")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:  # a lone surrogate (\ud800) is valid JSON but no text a tokenizer can take
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the body contains a string that is not valid Unicode (a lone "
                                "surrogate escape such as \\ud800)", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply", code="invalid_json") from None
        except ValueError:  # NaN or infinity are checked field by field
            pass
        return body

    # -- answering
    def _submit(self, reqs: list) -> JobGroup:
        """One job per answer, each a row of the shared batch; greedy answers of the same
        prompt are the same text, so one job serves them all. A refused job (queue full)
        cancels the ones queued before it."""
        worker = self.server.worker
        group = JobGroup(reqs)
        by_prompt: dict[tuple, int] = {}
        try:
            for req in reqs:
                key = tuple(req.prompt) if req.temperature == 0 else None
                if key is not None and key in by_prompt:
                    group.job_of.append(by_prompt[key])
                    continue
                j = len(group.jobs)
                group.jobs.append(worker.submit(req, events=group.tagged(j)))
                group.job_of.append(j)
                if key is not None:
                    by_prompt[key] = j
        except ApiError:
            group.cancel()
            raise
        return group

    def _next(self, group: JobGroup):
        """(job number, event) of the group's next event; raises ClientGone once the client
        has hung up (checked at least every 50 ms, also while events keep coming)."""
        while True:
            now = time.monotonic()
            if now - self._last_check >= 0.05:
                self._last_check = now
                if self._client_gone():
                    raise ClientGone
            try:
                return group.events.get(timeout=0.05)
            except queue.Empty:
                continue

    def _relay(self, group: JobGroup, kind: str) -> int:
        """Answer a request's jobs: one JSON body, or server-sent events as they come (the
        answers' chunks interleaved, each with its index)."""
        n_jobs = len(group.jobs)
        texts: list[list[str]] = [[] for _ in range(n_jobs)]
        ids: list[list[int]] = [[] for _ in range(n_jobs)]
        # log-probabilities per job: all of them, and those not sent in a chunk yet
        lps: list[list] = [[] for _ in range(n_jobs)]
        unsent: list[list] = [[] for _ in range(n_jobs)]
        dones: list[Done | None] = [None] * n_jobs
        stream = group.req.stream
        started = False
        while any(d is None for d in dones):
            j, ev = self._next(group)
            if isinstance(ev, Failed):
                group.cancel()
                if not started:
                    return self._answer_error(ev.error)
                self._sse({"error": ev.error.body()["error"]})
                return ev.error.status
            if stream and not started:
                started = True
                self._start_stream(kind, group)
            if isinstance(ev, Delta):
                texts[j].append(ev.text)
                ids[j] += ev.ids
                got = self._logprobs_of(group, j, ev)
                lps[j] += got
                unsent[j] += got
                if stream and (ev.text or kind in ("completion", "llama_completion", "infill")):
                    for i in group.answers_of(j):
                        self._sse(self._chunk(kind, group.reqs[i], ev, group.job_slot(j),
                                              unsent[j], len("".join(texts[j])) - len(ev.text)))
                    unsent[j] = []
            elif isinstance(ev, Progress):
                if stream:
                    self._sse(self._progress_chunk(kind, group.reqs[group.answers_of(j)[0]],
                                                   ev, group.job_slot(j)))
            elif isinstance(ev, Done):
                dones[j] = ev
                if stream:
                    answers = group.answers_of(j)
                    last = all(d is not None for d in dones)
                    for i in answers:
                        # llama-server: the timings ride on the last chunk (the usage one
                        # when asked for)
                        timings = (self._usage(group, dones).timings()
                                   if last and i == answers[-1] and not group.req.include_usage
                                   else None)
                        self._finish_answer(kind, group, i, "".join(texts[j]), ev, timings,
                                            unsent[j])
                    unsent[j] = []
        if stream:
            self._finish_stream(kind, group, dones)
            return 200
        try:
            self._send_json(200, self._final_body(kind, group, texts, ids, dones, lps))
        except OSError:
            raise ClientGone from None
        return 200

    def _answer_error(self, err: ApiError) -> int:
        try:
            self._send_json(err.status, err.body(), retry_after=err.retry_after)
        except OSError:
            raise ClientGone from None
        return err.status

    def _usage(self, group: JobGroup, dones: list) -> Usage:
        """The usage of the whole answer: every answer's, the prompts counted once."""
        usages = [dones[group.job_of[i]].usage for i in range(len(group.reqs))]
        prompts = {r.index // max(1, r.n_cmpl): u.prompt_tokens
                   for r, u in zip(group.reqs, usages)}
        return P.total_usage(usages, sum(prompts.values()))

    def _logprobs_of(self, group: JobGroup, j: int, ev: Delta) -> list:
        """The log-probabilities of a delta's tokens (`constrain.TokenLogprob`), where its
        request asked for them."""
        req = group.reqs[group.answers_of(j)[0]]
        if req.logprobs is None or not ev.tokens or ev.logprobs is None:
            return []
        return [e for e in ev.logprobs if e is not None]

    def _logprobs_json(self, kind: str, req, entries: list, offset: int = 0):
        """A choice's or chunk's log-probabilities as its endpoint answers them (None where
        none were asked)."""
        if req.logprobs is None:
            return None
        piece = self.server.parser.token_bytes
        if kind in ("chat", "fim"):
            return P.chat_logprobs(entries, piece)
        if kind == "completion":
            return P.completion_logprobs(entries, piece, offset)
        return P.token_entries(entries, piece, req.post_probs)

    def _llama_final(self, group: JobGroup, i: int, text: str, done: Done,
                     tokens: list[int] | None, stream: bool, lps: list | None = None) -> dict:
        req = group.reqs[i]
        prompt = self.server.parser.prompt_text(req.prompt) if P.wants_prompt(req) else None
        probs = None if stream else self._logprobs_json("llama", req, lps or [])
        return P.llama_body(req, "" if stream else text, done.finish_reason, done.usage,
                            done.stopping_word, index=req.index,
                            tokens=tokens if req.return_tokens and not stream else None,
                            prompt=prompt, id_slot=group.job_slot(group.job_of[i]),
                            whole=text, probs=probs)

    def _final_body(self, kind: str, group: JobGroup, texts, ids, dones, lps) -> dict | list:
        reqs, job_of = group.reqs, group.job_of
        if kind in ("chat", "fim", "completion"):
            choices = [(r.index, "".join(texts[job_of[i]]), dones[job_of[i]].finish_reason,
                        self._logprobs_json(kind, r, lps[job_of[i]]))
                       for i, r in enumerate(reqs)]
            make = P.completion_body if kind == "completion" else P.chat_body
            return make(group.req, choices, self._usage(group, dones))
        bodies = [self._llama_final(group, i, "".join(texts[job_of[i]]), dones[job_of[i]],
                                    ids[job_of[i]], stream=False, lps=lps[job_of[i]])
                  for i in range(len(reqs))]
        # llama.cpp: one answer is an object, several a list
        return bodies[0] if len(bodies) == 1 else bodies

    def _start_stream(self, kind: str, group: JobGroup) -> None:
        self._headers(200, "text/event-stream; charset=utf-8", close=True)
        try:
            self.wfile.write(b"")
        except OSError:
            raise ClientGone from None
        if kind in ("chat", "fim"):
            # llama-server's first chunk: the role, content null; Mistral's FIM API (and
            # Tabby's mistral/completion reader, which requires it) has a string
            # delta.content in every chunk.
            for r in group.reqs:
                self._sse(P.chat_chunk(r, {"role": "assistant",
                                           "content": "" if kind == "fim" else None},
                                       None, index=r.index))

    def _chunk(self, kind: str, req, ev: Delta, slot: int, lps: list | None = None,
               offset: int = 0) -> dict:
        """A streamed chunk of a delta; `lps`: the log-probabilities of its tokens (and of
        tokens before it that no chunk carried), `offset`: where its text starts."""
        timings = ev.timings if req.timings_per_token else None
        logprobs = self._logprobs_json(kind, req, lps or [], offset)
        if kind in ("chat", "fim"):
            return P.chat_chunk(req, {"content": ev.text}, None, index=req.index,
                                timings=timings, logprobs=logprobs)
        if kind == "completion":
            return P.completion_chunk(req, ev.text, None, index=req.index, timings=timings,
                                      logprobs=logprobs)
        return P.llama_body(req, ev.text, None, None, index=req.index, tokens=ev.ids,
                            timings=timings, id_slot=slot, probs=logprobs)

    def _progress_chunk(self, kind: str, req, ev: Progress, slot: int) -> dict:
        """llama.cpp's `prompt_progress` chunk (`return_progress`)."""
        if kind in ("chat", "fim"):
            return {**P.chat_chunk(req, None, None), "prompt_progress": ev.json()}
        if kind == "completion":
            return {**P.completion_chunk(req, None, None), "prompt_progress": ev.json()}
        return P.llama_body(req, "", None, None, index=req.index, progress=ev.json(),
                            id_slot=slot)

    def _finish_answer(self, kind: str, group: JobGroup, i: int, text: str,
                       done: Done, timings: dict | None = None, lps: list | None = None) -> None:
        """One answer of a stream is done: its last chunk (llama.cpp: the final object),
        with the log-probabilities no chunk carried yet."""
        req = group.reqs[i]
        logprobs = self._logprobs_json(kind, req, lps or [], len(text)) if lps else None
        if kind in ("chat", "fim"):
            self._sse(P.chat_chunk(req, {"content": ""} if kind == "fim" else {},
                                   done.finish_reason, index=req.index, timings=timings,
                                   logprobs=logprobs))
        elif kind == "completion":
            self._sse(P.completion_chunk(req, "", done.finish_reason, index=req.index,
                                         timings=timings, logprobs=logprobs))
        else:  # llama.cpp streams end with the full final object, stop = true, no [DONE]
            self._sse(self._llama_final(group, i, text, done, None, stream=True))

    def _finish_stream(self, kind: str, group: JobGroup, dones: list) -> None:
        """After the answers' last chunks: the usage chunk (`include_usage`; llama-server's
        `timings` with it) and [DONE], on the OpenAI endpoints."""
        if kind not in ("chat", "fim", "completion"):
            return
        if group.req.include_usage:
            usage = self._usage(group, dones)
            make = P.completion_chunk if kind == "completion" else P.chat_chunk
            self._sse(make(group.req, None, None, usage, timings=usage.timings()))
        self._sse("[DONE]")
