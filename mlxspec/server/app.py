"""`mlxspec serve`'s HTTP side: a Starlette app on uvicorn, in front of the worker thread.

The app validates and tokenizes a request (pydantic models in `protocol.py`, on a pool
thread: no MLX), puts its jobs on the worker's queue and relays their events (`relay.py`).
The event loop runs on a thread of its own, so the caller (the CLI's main thread) keeps
Ctrl-C and SIGTERM for a graceful drain.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import socket
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import __version__, backend
from ..caches.shift import check_shiftable
from ..engine import Engine
from ..errors import MlxspecError
from ..memory import serving_memory
from ..prefill import new_cache
from ..proposers import MODES
from ..suffix_store import DEFAULT_BUDGET, SuffixStores, scope_key, tokenizer_fingerprint
from ..suffix_store import load as load_suffix
from ..suffix_store import save as save_suffix
from .access import AccessPolicy, Gate, is_loopback, presented_key  # noqa: F401
from .answers import api_error, dumps, json_response
from .metrics import Metrics, memory_gauges, mlx_memory
from .page import static_file, wants_page
from .protocol import ApiError, RequestParser, ServerConfig
from .relay import JobGroup, Relay
from .worker import SPEC_MAX_CONCURRENCY, Worker

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
# Agents' API families, each a module of this package that turns its request into a chat
# completions body (`chat_body`), answers from the jobs' events (`Answer`) and words its
# errors (`error_response`): the OpenAI Responses API, the Anthropic Messages API.
FAMILY_ROUTES = {"/v1/responses": "responses", "/responses": "responses",
                 "/v1/messages": "anthropic", "/messages": "anthropic"}
# llama.cpp's utility endpoints: tokenizer work, no generation (and Anthropic's token count).
UTILITY_ROUTES = {"/tokenize": "tokenize", "/detokenize": "detokenize",
                  "/apply-template": "apply_template",
                  "/v1/messages/count_tokens": "anthropic.count_tokens"}
GET_ROUTES = ("/v1/models", "/models", "/health", "/v1/health", "/metrics", "/props", "/slots",
              "/")


class Connection(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 connection (httptools), plus what it lacks: a deadline for a
    request's headers (a client that dribbles them, or idles between requests, is closed
    after --read-timeout: slowloris holds nothing), TCP_NODELAY, and a smaller write buffer
    where --send-buffer-bytes asks for one (a client that stops reading is found sooner)."""

    def __init__(self, *args, read_timeout: float, metrics: Metrics,
                 send_buffer_bytes: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.metrics = read_timeout, metrics
        self.send_buffer_bytes = send_buffer_bytes
        self.headers_due: asyncio.TimerHandle | None = None

    def _await_headers(self) -> None:
        self.headers_due = self.loop.call_later(self.read_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self.metrics.timed_out("read")
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # uvicorn writes an answer's headers and body apart: without TCP_NODELAY the body
            # waits for the client's delayed ACK (~40 ms on a kept-alive connection)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.send_buffer_bytes:
            transport.set_write_buffer_limits(high=self.send_buffer_bytes)
        self._await_headers()

    def on_headers_complete(self) -> None:
        if self.headers_due is not None:
            self.headers_due.cancel()
            self.headers_due = None
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: the next request's headers are due
            self._await_headers()

    def connection_lost(self, exc) -> None:
        if self.headers_due is not None:
            self.headers_due.cancel()
        super().connection_lost(exc)


class MlxspecServer:
    """The server: the worker thread, the app, and uvicorn on a listening socket bound at
    construction (so `url` is known and a port in use fails here). Connections beyond
    `max_connections` are answered 503 with Retry-After; the listen backlog takes bursts of a
    thousand. A connection that takes longer than `read_timeout` to send a request's headers
    (or idles that long between requests) is closed, one that takes longer to send its body
    is answered 408; a client that does not read its answer for `write_timeout` is dropped
    and its job cancelled."""

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
                 slots_debug: bool = False, memory_limit: int | None = None,
                 memory_source: str = "is the --memory-limit"):
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
        self.engine = engine
        self.metrics = Metrics()
        self.max_body_bytes = max_body_bytes
        self.max_connections = max_connections
        self.read_timeout, self.write_timeout = read_timeout, write_timeout
        self.access = AccessPolicy(address[0], tuple(allowed_hosts), tuple(cors_origins))
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
            default_seed=default_seed, modes=MODES, accept_any_model=accept_any_model,
            max_n_cmpl=max(1, min(16, max_queue)), cache_reuse=cache_reuse)
        self.total_slots = spec_max_concurrency + max_batch
        self.parser = RequestParser(engine.tokenizer, self.config)
        self.socket = self._listen(address, send_buffer_bytes)
        self.server_address = self.socket.getsockname()
        self.routes = {*POST_ROUTES, *FAMILY_ROUTES, *UTILITY_ROUTES, *GET_ROUTES}
        self.generation_routes = {*POST_ROUTES, *FAMILY_ROUTES}
        self.app = self._app()
        self.gate = Gate(self.app, self)
        self.uvicorn = uvicorn.Server(uvicorn.Config(
            self.gate, http=functools.partial(Connection, read_timeout=read_timeout,
                                              metrics=self.metrics,
                                              send_buffer_bytes=send_buffer_bytes),
            lifespan="off", log_config=None, access_log=False, server_header=False,
            # idle keep-alive connections are closed by `Connection`'s headers deadline
            timeout_keep_alive=int(read_timeout) + 5, timeout_graceful_shutdown=2))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        # Loading leaves lazy work (e.g. the float16 -> float32 cast on the CPU backend) on this
        # thread's stream, which the worker thread cannot run: materialize the weights here.
        import mlx.core as mx

        mx.eval(engine.model.parameters())
        if engine.draft_model is not None:
            mx.eval(engine.draft_model.parameters())
        # requests are admitted by memory under `memory_limit` (what `memory.budget` said)
        self.memory = (serving_memory(engine, memory_limit, memory_source, prefill_chunk)
                       if memory_limit else None)
        self.worker = Worker(engine, spec_max_concurrency=spec_max_concurrency,
                             max_batch=max_batch, max_queue=max_queue, cache_bytes=cache_bytes,
                             cache_entries=cache_entries, prefill_chunk=prefill_chunk,
                             metrics=self.metrics, request_timeout=request_timeout,
                             batch_spec=batch_spec, suffix=self.suffix,
                             follow_ahead=follow_ahead, memory=self.memory)
        coord = getattr(engine, "coord", None)
        if coord is not None:  # --distributed: a lost rank fails the requests, then we exit
            coord.on_lost = self.worker.fail_all
            coord.watch_idle = True
        self.worker.start()

    @staticmethod
    def _listen(address, send_buffer_bytes: int | None) -> socket.socket:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if send_buffer_bytes:  # accepted connections inherit it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            sock.bind(address)
            sock.listen(2048)  # bursts of a thousand connections are queued, not reset
        except OSError:
            sock.close()
            raise
        return sock

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    # -- running and stopping
    def start(self) -> None:
        """Serve from a thread of its own; returns once the socket is being served."""
        if self.thread is not None:
            return
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self.loop.call_soon(ready.set)
            self.loop.run_until_complete(self.uvicorn.serve(sockets=[self.socket]))
            self.loop.close()

        thread = threading.Thread(target=run, name="mlxspec-http", daemon=True)
        thread.start()
        self.thread = thread
        ready.wait(10)

    def serve_forever(self) -> None:
        """Serve until `shutdown` or `drain` (Ctrl-C in the caller's thread interrupts the
        wait, not the server)."""
        self.start()
        while self.thread.is_alive():
            self.thread.join(0.5)

    def _stop_listening(self) -> None:
        """Close the listening socket (on the event loop, which owns it once serving)."""
        servers = getattr(self.uvicorn, "servers", [])
        if servers and self.loop is not None and self.loop.is_running():
            done = threading.Event()

            def close() -> None:
                for server in servers:
                    server.close()
                done.set()

            self.loop.call_soon_threadsafe(close)
            done.wait(5)
        else:
            self.socket.close()

    def _stop_serving(self) -> None:
        self.uvicorn.should_exit = True
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def shutdown(self) -> None:
        self._stop_serving()
        self.worker.stop()
        self.worker.join(timeout=10)
        self.save_suffix()

    def server_close(self) -> None:
        self._stop_listening()
        self._stop_serving()

    def drain(self, grace: float, stopping_server: bool = True) -> bool:
        """Graceful shutdown: stop accepting, refuse new requests (503), let running ones
        finish for up to `grace` seconds, then end the rest with their partial answers
        (finish_reason "shutdown", a clean end of stream). True if all finished in time.
        A KeyboardInterrupt while waiting (a second Ctrl-C) ends them at once."""
        del stopping_server  # the event loop has its own thread: the caller's is free
        self.worker.draining = True
        self._stop_listening()
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
        # Let the app write the last events (a job's final chunk) before the worker goes;
        # connections still open are answered 503 until `server_close` or the process ends.
        end = time.monotonic() + 5.0
        while (not self.worker.idle() or self.gate.in_flight) and time.monotonic() < end:
            time.sleep(0.02)
        self.worker.stop()
        self.worker.join(timeout=10)
        self.save_suffix()
        return finished

    def save_suffix(self) -> None:
        """Write the suffix stores to --suffix-cache (after the worker has stopped)."""
        if self.suffix_cache and not self.worker.is_alive():
            try:
                save_suffix(self.suffix, self.suffix_cache)
            except OSError as e:
                log.error("cannot write --suffix-cache %s: %s", self.suffix_cache,
                          e.strerror or e)

    def open_connections(self) -> int:
        return len(self.uvicorn.server_state.connections)

    # -- the app
    def _app(self) -> Starlette:
        async def missing(request: Request, exc: HTTPException) -> Response:
            path = request.url.path
            known = path in self.routes
            return api_error(ApiError(405 if known else 404,
                                      f"no such endpoint: {request.method} {path}"),
                             close=request.method == "POST")

        routes = [Route(p, functools.partial(self.generate, kind=k), methods=["POST"])
                  for p, k in POST_ROUTES.items()]
        routes += [Route(p, functools.partial(self.family, name=n), methods=["POST"])
                   for p, n in FAMILY_ROUTES.items()]
        routes += [Route(p, functools.partial(self.utility, name=n), methods=["POST"])
                   for p, n in UTILITY_ROUTES.items()]
        routes += [Route(p, self.get, methods=["GET"]) for p in GET_ROUTES]
        routes.append(Route("/static/{name}", self.static, methods=["GET"]))
        return Starlette(routes=routes, exception_handlers={404: missing, 405: missing})

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object: at most --max-body-bytes (413), sent within
        --read-timeout (408); Content-Length or chunked."""
        length = request.headers.get("content-length")
        limit = self.max_body_bytes
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, "bad Content-Length header")
            if int(length) > limit:
                raise ApiError(413, f"the request body is {int(length)} bytes; the limit is "
                                    f"{limit} bytes (--max-body-bytes)", code="body_too_large")
        raw = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                raw.extend(chunk)
                if len(raw) > limit:
                    raise ApiError(413, f"the request body is over the limit of {limit} bytes "
                                        "(--max-body-bytes)", code="body_too_large")

        try:
            await asyncio.wait_for(read(), self.read_timeout)
        except asyncio.TimeoutError:
            self.metrics.timed_out("read")
            raise ApiError(408, f"the body did not arrive within --read-timeout "
                                f"({self.read_timeout:g} s): {len(raw)} bytes came",
                           code="request_timeout") from None
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

    async def _submit(self, request: Request, kind: str, body: dict | None = None,
                      convert=None) -> JobGroup:
        """Read (unless given), validate and tokenize a request (`convert`: the family's body
        as a chat completions body) and queue its jobs."""
        if body is None:
            body = await self.read_json(request)
        if self.log_prompts:
            log.info("%s %s request: %s", request.client.host if request.client else "-",
                     request.url.path, dumps(body))

        def parse() -> list:
            return self.parser.requests(kind, convert(body) if convert else body)

        reqs = await asyncio.to_thread(parse)
        scope = scope_key(self.suffix_scope, presented_key(request.scope),
                          request.client.host if request.client else "")
        for req in reqs:
            req.suffix_scope = scope
        return JobGroup(reqs, self.worker)

    async def generate(self, request: Request, kind: str) -> Response | Relay:
        try:
            group = await self._submit(request, kind)
        except ApiError as e:
            return api_error(e)
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("request parsing failed")
            return api_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        return Relay(group, kind, self.parser, self.metrics, self.write_timeout)

    async def family(self, request: Request, name: str):
        """An agent API family's request (`FAMILY_ROUTES`), served as a chat completion."""
        family = importlib.import_module(f".{name}", __package__)
        try:
            body = await self.read_json(request)
            group = await self._submit(request, "chat", body, family.chat_body)
        except ApiError as e:
            return family.error_response(e)
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("request parsing failed")
            return family.error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        return family.Answer(group, body, self.parser, self.metrics, self.write_timeout)

    async def utility(self, request: Request, name: str) -> Response:
        """/tokenize, /detokenize, /apply-template: the parser's; `module.function`: a
        family's (called with the parser and the body)."""
        try:
            body = await self.read_json(request)
            if "." in name:
                module, function = name.split(".")
                work = functools.partial(getattr(importlib.import_module(
                    f".{module}", __package__), function), self.parser)
            else:
                work = getattr(self.parser, name)
            answer = await asyncio.to_thread(work, body)
        except ApiError as e:
            if "." in name:  # in the family's words
                return importlib.import_module(
                    f".{name.split('.')[0]}", __package__).error_response(e)
            return api_error(e)
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("%s failed", request.url.path)
            return api_error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        return json_response(answer)

    async def static(self, request: Request) -> Response:
        """The chat page's files (`page.py`)."""
        found = static_file(request.path_params["name"])
        if found is None:
            raise HTTPException(404)
        return found

    async def get(self, request: Request) -> Response:
        path = request.url.path
        w, engine, cfg = self.worker, self.engine, self.config
        if path in ("/v1/models", "/models"):
            return json_response({"object": "list", "data": [{
                "id": cfg.model_name, "object": "model", "created": int(self.started),
                "owned_by": "mlxspec",
                "meta": {"mode": engine.mode, "num_draft": engine.num_draft,
                         "n_ctx_train": engine.max_context,
                         "fim": self.parser.fim.style if self.parser.fim else None}}]})
        if path in ("/health", "/v1/health"):
            if w.draining:  # for load balancers
                return json_response({"status": "shutting_down", "model": cfg.model_name},
                                     503, {"Retry-After": "5"})
            return json_response({"status": "ok", "model": cfg.model_name, "mode": engine.mode,
                                  "active": w.active(), "queued": w.inbox.qsize()})
        if path == "/metrics":
            return Response(self.metrics.render({
                "mlxspec_requests_active": ("Requests being generated.", w.active()),
                "mlxspec_requests_speculative_active": ("Requests speculating.",
                                                        w.speculating()),
                "mlxspec_requests_batched_active": (
                    "Requests decoded plainly (over --spec-max-concurrency).",
                    sum(w.over_limit(j) for j in w.jobs)),
                "mlxspec_requests_queued": ("Requests waiting for the worker.", w.inbox.qsize()),
                "mlxspec_connections_open": ("Open HTTP connections (--max-connections).",
                                             self.open_connections()),
                "mlxspec_connections_busy": ("Connections being answered.", self.gate.in_flight),
                "mlxspec_prompt_cache_entries": ("Prompt caches kept.", len(w.cache.entries)),
                "mlxspec_prompt_cache_bytes": ("Bytes held by kept prompt caches.",
                                               w.cache.nbytes()),
                **mlx_memory(), **memory_gauges(self.memory, self.worker),
            }), media_type="text/plain; version=0.0.4; charset=utf-8")
        if path == "/props":
            return json_response(self._props())
        if path == "/slots":
            if not self.slots_endpoint:  # llama-server's answer without --slots
                return api_error(ApiError(501, "This server does not support slots endpoint.",
                                          type="not_supported_error"))
            return json_response(self._slots())
        if wants_page(request.headers.get("accept")):  # a browser: the chat page
            return static_file("index.html")
        return json_response({"name": "mlxspec", "version": __version__,
                              "endpoints": sorted([*POST_ROUTES, *FAMILY_ROUTES,
                                                   *UTILITY_ROUTES])
                              + list(GET_ROUTES[:-1])})

    def _slots(self) -> list[dict]:
        """llama-server's `GET /slots`: each slot (a job's place, `--spec-max-concurrency`
        + `--max-batch` of them) and the request it serves; the prompt's and answer's text
        only with --slots-debug (llama-server's LLAMA_SERVER_SLOTS_DEBUG)."""
        srv = self
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
        # then the requests waiting for memory, in their order (not slots: they have none yet)
        m = srv.memory
        for job in [j for j in list(srv.worker.jobs) if j.waiting_for_memory and not j.opened]:
            out.append({"id": None, "id_task": job.task_id, "is_processing": False,
                        "waiting_for": "memory", "n_prompt_tokens": len(job.req.prompt),
                        "params": {"n_predict": job.req.max_tokens},
                        "paused": job.paused, "n_decoded": len(job.generated),
                        "memory": {"needed_bytes": m.alone(job.tokens),
                                   "limit_bytes": m.limit,
                                   "reserved_bytes": srv.worker.reserved()}})
        return out

    def _props(self) -> dict:
        """llama.cpp's `GET /props` (what llama.vscode reads the context size from)."""
        srv = self
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
            "webui": True,  # the chat page at / (page.py)
            "chat_template": template if isinstance(template, str) else "",
            "bos_token": getattr(tok, "bos_token", None) or "",
            "eos_token": getattr(tok, "eos_token", None) or "",
            "build_info": f"mlxspec {__version__}",
            # mlxspec's own: where MLX computes (metal, cuda, cpu) and the CPU's BLAS
            "backend": backend.device_name(), "blas": backend.blas_in_use,
        }



def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8080,
                **options) -> MlxspecServer:
    return MlxspecServer((host, port), engine, **options)
