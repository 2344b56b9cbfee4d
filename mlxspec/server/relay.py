"""A request's answer, relayed from the worker's events: one JSON body, or server-sent events
as they come. The worker thread hands each event to the event loop (`Tagged.put`); a client
that hangs up, or stops reading for --write-timeout, cancels its jobs at once."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses

from . import answers as P
from .answers import Usage, dumps, error_message
from .protocol import ApiError
from .tools import CallArgs, CallDone, CallOpen, ToolCallSplitter
from .worker import Delta, Done, Failed, Job, Progress

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
               (b"cache-control", b"no-cache")]
GONE = object()  # the event that says the client has hung up


class ClientGone(Exception):
    pass


class Tagged:
    """A job's event sink, called on the worker thread: puts (job number, event) on the
    request's asyncio queue, on the event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, shared: asyncio.Queue, number: int):
        self.loop, self.shared, self.number = loop, shared, number

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.shared.put_nowait, (self.number, event))


class JobGroup:
    """The jobs of one request: `reqs` (one per answer, `index` 0, 1, ...) and `jobs`,
    `job_of[i]` the job that answers `reqs[i]` (greedy answers of one prompt share one)."""

    def __init__(self, reqs: list, worker):
        """One job per answer, each a row of the shared batch; greedy answers of the same
        prompt are the same text, so one job serves them all. A refused job (queue full)
        cancels the ones queued before it."""
        self.reqs = reqs
        self.req = reqs[0]
        self.jobs: list[Job] = []
        self.job_of: list[int] = []
        self.events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        by_prompt: dict[tuple, int] = {}
        try:
            for req in reqs:
                key = tuple(req.prompt) if req.temperature == 0 else None
                if key is not None and key in by_prompt:
                    self.job_of.append(by_prompt[key])
                    continue
                j = len(self.jobs)
                self.jobs.append(worker.submit(req, events=Tagged(loop, self.events, j)))
                self.job_of.append(j)
                if key is not None:
                    by_prompt[key] = j
        except ApiError:
            self.cancel()
            raise

    def answers_of(self, j: int) -> list[int]:
        return [i for i, k in enumerate(self.job_of) if k == j]

    def job_slot(self, j: int) -> int:
        slot = self.jobs[j].slot_id
        return 0 if slot is None else slot

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


class SourceSpans:
    """One job's text as spans of where its tokens came from ("speculative": {"sources":
    true}). Each token's bytes go through an incremental UTF-8 decoder (a character split
    across tokens belongs to the token that completes it) onto a queue of (text, source);
    each content piece the client gets takes its characters off the queue's front. The
    spans' texts are the content's own, so they always concatenate to it. Text the queue
    has and the content lacks (a leading space the detokenizer trims, text a stop string
    cut) is skipped where the next characters match; content beyond the queue (text the
    tokens' bytes do not spell) takes the last source."""

    LOOK_AHEAD = 8  # queued characters searched for a content character before taking it as is

    def __init__(self, token_bytes):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.queue: list[list[str]] = []  # [text, source], text not yet taken
        self.last = "target"

    def feed(self, ids: list[int], sources: list[str] | None) -> None:
        """A delta's tokens (`sources`: per token; None: the target's)."""
        for i, token in enumerate(ids):
            source = sources[i] if sources is not None and i < len(sources) else "target"
            text = self.decoder.decode(self.token_bytes(token))
            if not text:
                continue
            if self.queue and self.queue[-1][1] == source:
                self.queue[-1][0] += text
            else:
                self.queue.append([text, source])

    def _queued(self, n: int) -> str:
        out = ""
        for text, _ in self.queue:
            out += text
            if len(out) >= n:
                break
        return out[:n]

    def _drop(self, n: int) -> None:
        while n and self.queue:
            text = self.queue[0][0]
            if len(text) <= n:
                n -= len(text)
                self.queue.pop(0)
            else:
                self.queue[0][0] = text[n:]
                n = 0

    def take(self, content: str) -> list[list[str]]:
        """[[text, source], ...] of `content`, the job's next piece of text, consecutive
        characters of one source together."""
        spans: list[list[str]] = []
        for ch in content:
            skip = self._queued(self.LOOK_AHEAD).find(ch)
            self._drop(max(skip, 0))
            if self.queue:
                self.last = self.queue[0][1]
                self._drop(1)
            if spans and spans[-1][1] == self.last:
                spans[-1][0] += ch
            else:
                spans.append([ch, self.last])
        return spans


class Answer:
    """The ASGI answer of a generation request, relayed from its jobs' events; an endpoint
    family's subclass says what the client gets by its `async relay() -> int` (the HTTP
    status)."""

    def __init__(self, group: JobGroup, metrics, write_timeout: float):
        self.group, self.metrics, self.write_timeout = group, metrics, write_timeout
        self.send = None

    async def __call__(self, scope, receive, send) -> None:
        self.send = send
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            scope["mlxspec.status"] = await self.relay()
        except ClientGone:
            self.group.cancel()
            self.metrics.disconnected()
            scope["mlxspec.status"] = 499
            # A client that stopped reading holds the connection: drop it (uvicorn's cycle
            # is the receive's owner), and let the loop see it closed before returning.
            transport = getattr(getattr(receive, "__self__", None), "transport", None)
            if transport is not None:
                transport.abort()
                await asyncio.sleep(0)
        finally:
            watch.cancel()
            self.group.cancel()  # nothing left to do if it ended; a bug must not leave jobs

    async def _watch(self, receive) -> None:
        """Wait for the client to hang up (the body was read before the relay starts)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.group.events.put_nowait((None, GONE))

    async def next_event(self) -> tuple[int, object]:
        """(job number, event) of the request's next event; ClientGone once it hung up."""
        j, ev = await self.group.events.get()
        if ev is GONE:
            raise ClientGone
        return j, ev

    async def _send(self, message: dict) -> None:
        try:
            await asyncio.wait_for(self.send(message), self.write_timeout)
        except asyncio.TimeoutError:  # not reading for --write-timeout
            self.metrics.timed_out("write")
            raise ClientGone from None
        except OSError:
            raise ClientGone from None

    async def _start_sse(self) -> None:
        await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _sse(self, payload, event: str | None = None) -> None:
        """One server-sent event: `data: JSON` (a str as it is), after `event: NAME` if given."""
        data = payload if isinstance(payload, str) else dumps(payload)
        text = f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"
        await self._send({"type": "http.response.body", "body": text.encode(),
                          "more_body": True})

    async def _end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _json(self, status: int, body, headers: dict | None = None) -> int:
        for message in error_message(status, body, headers):
            await self._send(message)
        return status


class Relay(Answer):
    """OpenAI's completions and chat, llama.cpp's `/completion` and `/infill`: one JSON body,
    or a stream of the answers' chunks interleaved, each with its index."""

    def __init__(self, group: JobGroup, kind: str, parser, metrics, write_timeout: float):
        super().__init__(group, metrics, write_timeout)
        self.kind, self.parser = kind, parser
        # a chat with tools: each job's text split into content and calls
        tools = group.req.tools if kind == "chat" else None
        self.splitters = [ToolCallSplitter(parser.tool_syntax, tools, group.req.tool_parallel)
                          if tools else None
                          for _ in group.jobs]
        self.calls: list[list[dict]] = [[] for _ in group.jobs]
        self.spans = ([SourceSpans(parser.token_bytes) for _ in group.jobs]
                      if kind == "chat" and group.req.stream and group.req.return_sources
                      else None)

    def split(self, j: int, ev: Delta | Done) -> tuple[Delta | None, list]:
        """A job's delta (at its end, what is still held back) as content and the calls'
        parts (`CallOpen`, `CallArgs`, `CallDone`); the finished calls kept for the answer."""
        splitter = self.splitters[j]
        if splitter is None:
            return (ev if isinstance(ev, Delta) else None), []
        parts = splitter.feed(ev.text) if isinstance(ev, Delta) else splitter.flush()
        text = "".join(p for p in parts if isinstance(p, str))
        calls = [p for p in parts if not isinstance(p, str)]
        self.calls[j] += [p.call for p in calls if isinstance(p, CallDone)]
        if isinstance(ev, Delta):
            return dataclasses.replace(ev, text=text), calls
        return (Delta(text, 0) if text else None), calls

    async def _stream_calls(self, j: int, parts: list) -> None:
        """The calls' parts as `delta.tool_calls` chunks: an opened call's index, id and name
        (arguments ""), then its argument pieces; a call that comes whole, whole."""
        for part in parts:
            if isinstance(part, CallOpen):
                entry = {"index": part.index, "id": part.id, "type": "function",
                         "function": {"name": part.name, "arguments": ""}}
            elif isinstance(part, CallArgs):
                entry = {"index": part.index, "function": {"arguments": part.text}}
            elif not part.streamed:
                entry = {"index": part.index, **part.call}
            else:
                continue
            for i in self.group.answers_of(j):
                req = self.group.reqs[i]
                await self._sse(P.chat_chunk(req, {"tool_calls": [entry]}, None,
                                             index=req.index))

    async def relay(self) -> int:
        group, kind = self.group, self.kind
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
            j, ev = await self.next_event()
            if isinstance(ev, Failed):
                group.cancel()
                err = ev.error
                if not started:
                    retry = {"Retry-After": err.retry_after} if err.retry_after else None
                    return await self._json(err.status, err.body(), retry)
                await self._sse({"error": err.body()["error"]})
                await self._end()
                return err.status
            if stream and not started:
                started = True
                await self._start_stream(kind, group)
            if isinstance(ev, Done) and self.splitters[j] is not None:
                rest, calls = self.split(j, ev)
                if self.calls[j] and ev.finish_reason == "stop":
                    ev = dataclasses.replace(ev, finish_reason="tool_calls")
                if rest is not None:  # the held-back text, as a delta of its own
                    await self._on_delta(j, rest, texts, ids, lps, unsent, stream)
                if calls and stream:
                    await self._stream_calls(j, calls)
            if isinstance(ev, Delta):
                ev, calls = self.split(j, ev)
                await self._on_delta(j, ev, texts, ids, lps, unsent, stream)
                if calls and stream:
                    await self._stream_calls(j, calls)
            elif isinstance(ev, Progress):
                if stream:
                    await self._sse(self._progress_chunk(
                        kind, group.reqs[group.answers_of(j)[0]], ev, group.job_slot(j)))
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
                        await self._finish_answer(kind, group, i, "".join(texts[j]), ev,
                                                  timings, unsent[j])
                    unsent[j] = []
        if stream:
            await self._finish_stream(kind, group, dones)
            await self._end()
            return 200
        return await self._json(200, self._final_body(kind, group, texts, ids, dones, lps))

    async def _on_delta(self, j: int, ev: Delta, texts, ids, lps, unsent, stream) -> None:
        group, kind = self.group, self.kind
        spans = None
        if self.spans is not None:
            self.spans[j].feed(ev.ids, ev.sources)
            spans = self.spans[j].take(ev.text)
        texts[j].append(ev.text)
        ids[j] += ev.ids
        got = self._logprobs_of(group, j, ev)
        lps[j] += got
        unsent[j] += got
        if stream and (ev.text or kind in ("completion", "llama_completion", "infill")):
            for i in group.answers_of(j):
                await self._sse(self._chunk(kind, group.reqs[i], ev, group.job_slot(j),
                                            unsent[j], len("".join(texts[j])) - len(ev.text),
                                            spans))
            unsent[j] = []

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
        piece = self.parser.token_bytes
        if kind in ("chat", "fim"):
            return P.chat_logprobs(entries, piece)
        if kind == "completion":
            return P.completion_logprobs(entries, piece, offset)
        return P.token_entries(entries, piece, req.post_probs)

    def _llama_final(self, group: JobGroup, i: int, text: str, done: Done,
                     tokens: list[int] | None, stream: bool, lps: list | None = None) -> dict:
        req = group.reqs[i]
        prompt = self.parser.prompt_text(req.prompt) if P.wants_prompt(req) else None
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
                        self._logprobs_json(kind, r, lps[job_of[i]]), self.calls[job_of[i]])
                       for i, r in enumerate(reqs)]
            make = P.completion_body if kind == "completion" else P.chat_body
            return make(group.req, choices, self._usage(group, dones))
        bodies = [self._llama_final(group, i, "".join(texts[job_of[i]]), dones[job_of[i]],
                                    ids[job_of[i]], stream=False, lps=lps[job_of[i]])
                  for i in range(len(reqs))]
        # llama.cpp: one answer is an object, several a list
        return bodies[0] if len(bodies) == 1 else bodies

    async def _start_stream(self, kind: str, group: JobGroup) -> None:
        await self._start_sse()
        if kind in ("chat", "fim"):
            # llama-server's first chunk: the role, content null; Mistral's FIM API (and
            # Tabby's mistral/completion reader, which requires it) has a string
            # delta.content in every chunk.
            for r in group.reqs:
                await self._sse(P.chat_chunk(r, {"role": "assistant",
                                           "content": "" if kind == "fim" else None},
                                       None, index=r.index))

    def _chunk(self, kind: str, req, ev: Delta, slot: int, lps: list | None = None,
               offset: int = 0, spans: list | None = None) -> dict:
        """A streamed chunk of a delta; `lps`: the log-probabilities of its tokens (and of
        tokens before it that no chunk carried), `offset`: where its text starts, `spans`:
        its text's sources (`SourceSpans`, asked for)."""
        timings = ev.timings if req.timings_per_token else None
        logprobs = self._logprobs_json(kind, req, lps or [], offset)
        if kind in ("chat", "fim"):
            delta = {"content": ev.text} if spans is None else {"content": ev.text,
                                                                 "sources": spans}
            return P.chat_chunk(req, delta, None, index=req.index,
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

    async def _finish_answer(self, kind: str, group: JobGroup, i: int, text: str,
                       done: Done, timings: dict | None = None, lps: list | None = None) -> None:
        """One answer of a stream is done: its last chunk (llama.cpp: the final object),
        with the log-probabilities no chunk carried yet."""
        req = group.reqs[i]
        logprobs = self._logprobs_json(kind, req, lps or [], len(text)) if lps else None
        if kind in ("chat", "fim"):
            await self._sse(P.chat_chunk(req, {"content": ""} if kind == "fim" else {},
                                   done.finish_reason, index=req.index, timings=timings,
                                   logprobs=logprobs))
        elif kind == "completion":
            await self._sse(P.completion_chunk(req, "", done.finish_reason, index=req.index,
                                         timings=timings, logprobs=logprobs))
        else:  # llama.cpp streams end with the full final object, stop = true, no [DONE]
            await self._sse(self._llama_final(group, i, text, done, None, stream=True))

    async def _finish_stream(self, kind: str, group: JobGroup, dones: list) -> None:
        """After the answers' last chunks: the usage chunk (`include_usage`; llama-server's
        `timings` with it) and [DONE], on the OpenAI endpoints."""
        if kind not in ("chat", "fim", "completion"):
            return
        if group.req.include_usage:
            usage = self._usage(group, dones)
            make = P.completion_chunk if kind == "completion" else P.chat_chunk
            await self._sse(make(group.req, None, None, usage, timings=usage.timings()))
        await self._sse("[DONE]")
