"""`mlxspec serve`: a local completion backend for editors, chat clients and scripts."""

from __future__ import annotations

import logging
import signal

import click

from ..errors import MlxspecError
from .common import (  # noqa: F401 (parse_size: read from here too)
    distributed_option,
    exits_cleanly,
    in_range,
    load_engine,
    option,
    options,
    parse_size,
)

# Per step, the source expected to pay (n-gram arms by match length, the draft when loaded),
# else pipelined plain decoding: docs/PERFORMANCE.md has its figures against every single mode.
DEFAULT_MODE = "auto"


@click.command()
@options("model", "gguf-weights")
@option("draft-model")
@option("no-draft")
@option("mode", default=DEFAULT_MODE,
        help="Speculation mode (a request can override it with \"speculative\": {\"mode\": ...}).")
@option("num-draft")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--spec-max-concurrency", type=int, default=None,
              help="At most this many requests speculate at once (verified together in one "
                   "batched forward where the model allows, each row stepping plainly where "
                   "its proposal does not pay); above it, new requests decode plainly in the same "
                   "batch. 0: never speculate. Default 32 (2 with --no-batch-spec, where "
                   "each speculative request costs a forward of its own).")
@click.option("--max-batch", type=int, default=8, show_default=True,
              help="Most requests decoding plainly at once beyond --spec-max-concurrency; "
                   "more wait to start.")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests running or waiting before new ones get 503.")
@click.option("--prompt-cache-size", default="2GB", show_default=True,
              help="Memory budget of the prompt caches kept between requests.")
@click.option("--prompt-cache-entries", type=int, default=8, show_default=True,
              help="Most prompt caches kept (one per recent conversation or file).")
@option("memory-limit",
        help="Memory the server may use, e.g. 12GB (default: Metal's recommended working "
             "set on macOS; on Linux the control group's limit where lower than the memory "
             "available at start). Requests start while the weights, every running request's "
             "KV cache at its prompt + max_tokens, the kept prompt caches and a margin fit "
             "under it; more wait in the queue; one that cannot fit alone is answered 400.")
@click.option("--prefill-chunk", type=int, default=512, show_default=True,
              help="Long prompts are prefilled this many tokens per worker round, so other "
                   "requests keep streaming meanwhile.")
@option("max-tokens", default=512, help="Tokens generated when a request does not say.")
@option("temp", help="Temperature when a request does not say (0: greedy, exact).")
@click.option("--max-context", type=int, default=None,
              help="Context length (default: the model's max_position_embeddings).")
@click.option("--max-body-bytes", default="16MB", show_default=True,
              help="Largest request body accepted (413 above it).")
@click.option("--model-name", default=None,
              help="Name to report in /v1/models and responses (default: the model path).")
@click.option("--model-alias", "model_aliases", multiple=True,
              help="Another model name requests may use (repeatable), e.g. the name an editor "
                   "uses to pick its FIM template.")
@click.option("--api-key", default=None, envvar="MLXSPEC_API_KEY",
              help="Require this key (Authorization: Bearer KEY) on every endpoint but /health; "
                   "for use with --host. Also read from $MLXSPEC_API_KEY.")
@click.option("--accept-any-model", is_flag=True,
              help="Answer OpenAI requests whatever model name they give (default: 404 for "
                   "names other than the served one and its aliases).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="Another Host header value to answer (repeatable), e.g. the name of a "
                   "reverse proxy. Bound to loopback, only localhost, 127.0.0.1 and [::1] are "
                   "answered by default (a guard against DNS rebinding); '*' turns the check off.")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="Another browser origin allowed to read answers (repeatable), e.g. "
                   "https://chat.example.com. Local origins (http://localhost:PORT, "
                   "127.0.0.1, [::1]) always are; '*' allows every web page.")
@click.option("--log-requests", is_flag=True,
              help="Log every request (method, path, status) to stderr; never headers or keys.")
@click.option("--log-prompts", is_flag=True,
              help="With --log-requests, also log request bodies (prompts) and answers.")
@click.option("--max-connections", type=int, default=512, show_default=True,
              help="Open connections at most; more are answered 503 with Retry-After.")
@click.option("--read-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a client may take to send a request (headers and body) or keep "
                   "an idle connection open; then the connection is closed.")
@click.option("--write-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a client may go without reading its answer (a stream); then it "
                   "is dropped and its generation cancelled.")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds from arrival after which a generation ends with its partial "
                   "answer and finish_reason \"timeout\" (default: no limit).")
@click.option("--shutdown-grace", type=float, default=10.0, show_default=True,
              help="On SIGTERM or Ctrl-C, seconds running requests may take to finish before "
                   "they are ended (finish_reason \"shutdown\"); a second Ctrl-C ends them now.")
@click.option("--batch-spec/--no-batch-spec", default=True, show_default=True,
              help="Verify concurrent speculative requests (plain-attention models) in one "
                   "batched forward, each row choosing its own k; --no-batch-spec: one forward "
                   "per request, round robin. Exact either way; a seeded request draws the "
                   "same tokens in the batch as alone.")
@click.option("--seed", "default_seed", type=int, default=-1, show_default=True,
              help="The seed of a request that sends none (llama-server's --seed): at "
                   "temperature > 0 a seeded request gives the same answer every time, in "
                   "every mode, batched or not. -1: no seed (each request draws afresh).")
@click.option("--suffix-scope", type=click.Choice(["request", "client", "global"]),
              default="client", show_default=True,
              help="Whose earlier requests and answers the suffix source (modes auto, suffix) "
                   "proposes from: the same client (the API key a request presents, else its "
                   "address), everyone, or none. Output is exact either way; see docs/SERVER.md.")
@option("suffix-cache", help="Load the suffix stores from FILE at start (if it exists) and "
                             "write them back at shutdown.")
@click.option("--suffix-budget", type=int, default=1 << 20, show_default=True,
              callback=in_range(1),
              help="Tokens of earlier requests kept for the suffix source, all scopes together "
                   "(least recently used out first; about 30-60 bytes each).")
@click.option("--cache-reuse", type=int, default=0, show_default=True, callback=in_range(0),
              help="Reuse runs of at least N tokens of a cached prompt where the new prompt "
                   "moved them (an editor's window scrolling), keys re-rotated, as llama.cpp's "
                   "--cache-reuse (0: off). Faster, but not exact: the reused entries saw the "
                   "old context. A request's n_cache_reuse overrides it. Plain-attention "
                   "RoPE models only.")
@click.option("--follow-ahead/--no-follow-ahead", default=True, show_default=True,
              help="When an answer is cut by a request's t_max_predict_ms (an editor showing a "
                   "suggestion), decode on while no other request runs and keep the text for the "
                   "editor's follow-up request to propose from (exact either way; needs the "
                   "suffix source: modes auto, suffix).")
@click.option("--slots/--no-slots", default=True, show_default=True,
              help="Answer GET /slots (llama-server's --slots): each slot's request, counts "
                   "and settings, read-only; --no-slots answers 501.")
@click.option("--slots-debug", is_flag=True,
              help="GET /slots also shows each request's prompt and answer so far (llama-"
                   "server's LLAMA_SERVER_SLOTS_DEBUG); off by default: the text is private.")
@distributed_option
@exits_cleanly
def serve(model, draft_model, mode, num_draft, host, port, spec_max_concurrency, max_batch,
          max_queue, prompt_cache_size, prompt_cache_entries, memory_limit, prefill_chunk,
          max_tokens, temp, max_context,
          max_body_bytes, model_name, model_aliases, api_key, accept_any_model, allowed_hosts,
          cors_origins, log_requests, log_prompts, max_connections, read_timeout,
          write_timeout, request_timeout, shutdown_grace, batch_spec=True, suffix_scope="client",
          suffix_cache=None, suffix_budget=1 << 20, cache_reuse=0, follow_ahead=True,
          default_seed=-1, slots=True, slots_debug=False, distributed=None):
    """Serve OpenAI /v1/completions (with FIM `suffix`), /v1/chat/completions (with predicted
    outputs), llama.cpp /infill, /v1/models, /health and /metrics over HTTP."""
    from .. import memory
    from ..server.app import is_loopback, make_server

    if (spec_max_concurrency or 0) < 0 or max_batch < 1 or max_queue < 1:
        raise MlxspecError("--spec-max-concurrency must be >= 0, --max-batch and --max-queue >= 1")
    if max_connections < 1 or read_timeout <= 0 or write_timeout <= 0 or shutdown_grace < 0 or (
            request_timeout is not None and request_timeout <= 0):
        raise MlxspecError("--max-connections must be >= 1, --read-timeout, --write-timeout and "
                           "--request-timeout > 0, --shutdown-grace >= 0")
    logging.basicConfig(level=logging.INFO if log_requests or log_prompts else logging.WARNING,
                        format="%(asctime)s %(message)s")
    if memory_limit is not None:
        memory.set_limit(parse_size(memory_limit))
    # the limit before loading (the memory available afterwards has the weights taken out)
    limit, source = memory.budget()
    # --distributed: only rank 0 returns here and serves HTTP; the others follow its worker
    # (the server prefills --prefill-chunk tokens a forward: the working set checked at load)
    # (a sharded load takes no prefill size: its ranks check their own shard)
    engine = load_engine(model, draft_model, mode, num_draft, max_context=max_context,
                         distributed=distributed,
                         **({"interactive": True} if distributed
                            else {"prefill_step_size": max(1, prefill_chunk)}))
    try:
        server = make_server(
            engine, host, port, spec_max_concurrency=spec_max_concurrency, max_batch=max_batch,
            batch_spec=batch_spec,
            max_queue=max_queue, cache_bytes=parse_size(prompt_cache_size),
            cache_entries=prompt_cache_entries, prefill_chunk=max(1, prefill_chunk),
            max_body_bytes=parse_size(max_body_bytes),
            default_max_tokens=max_tokens, default_temperature=temp,
            default_seed=default_seed if default_seed >= 0 else None,
            cors_origins=tuple(o for o in cors_origins if o), model_name=model_name,
            model_aliases=tuple(model_aliases), accept_any_model=accept_any_model,
            allowed_hosts=tuple(h for h in allowed_hosts if h), api_key=api_key or None,
            log_prompts=log_prompts, max_connections=max_connections,
            read_timeout=read_timeout, write_timeout=write_timeout,
            request_timeout=request_timeout, suffix_scope=suffix_scope,
            suffix_cache=suffix_cache, suffix_budget=suffix_budget, cache_reuse=cache_reuse,
            follow_ahead=follow_ahead, slots=slots, slots_debug=slots_debug,
            # (a sharded target's memory is each rank's: not admitted by this one's)
            memory_limit=None if distributed else limit, memory_source=source)
    except OSError as e:
        raise MlxspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if getattr(engine, "coord", None) is not None:
        # a sharded target runs no shared batch: every request on a slot of its own
        server.worker.batchable = False
    fim = server.parser.fim
    click.echo(f"mlxspec serve: model {server.config.model_name} | mode {engine.mode} "
               f"(k={engine.num_draft}, speculative up to {server.worker.spec_max_concurrency} "
               f"concurrent requests, then batched plain decoding) | FIM "
               f"{fim.style if fim else 'none'}",
               err=True)
    click.echo(server.memory.describe() if server.memory is not None else
               "memory: no limit known; requests are not admitted by memory (--memory-limit)",
               err=True)
    if "*" in cors_origins:
        click.echo("warning: --cors-origin '*': every web page open in a browser on this "
                   "machine can use the model and read its answers", err=True)
    if "*" in allowed_hosts:
        click.echo("warning: --allowed-host '*': the Host check is off, so a web page can "
                   "reach the server through DNS rebinding", err=True)
    if is_loopback(host):
        click.echo(f"listening on {server.url} (loopback only; --host 0.0.0.0 to expose it)",
                   err=True)
    else:
        click.echo(f"listening on {server.url} -- reachable from other machines, "
                   + ("API key required" if api_key else "with no authentication (--api-key)"),
                   err=True)

    def stop(signum, frame):  # SIGTERM: the same clean shutdown as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    # Stop accepting; running requests get --shutdown-grace to finish, the rest end with
    # their partial answers (finish_reason "shutdown"); exit 0.
    click.echo(f"shutting down (up to {shutdown_grace:g} s for running requests)", err=True)
    try:
        finished = server.drain(shutdown_grace, stopping_server=False)
    except KeyboardInterrupt:  # interrupted again while ending them: no more waiting
        server.worker.end_all("shutdown")
        finished = False
    if not finished:
        click.echo("requests still running at the end of the grace period were ended",
                   err=True)
