"""The editor's wait: llama.vim typing through real files, replayed against `mlxspec serve`.

    mlxspec bench editor                                    # the bundled model
    mlxspec bench editor -m qwen2.5-coder-0.5b --modes auto,none --json editor.json
    mlxspec bench editor -m qwen2.5-coder-0.5b --modes auto --no-suffix --no-draft

An editor's completion backend is judged by how long after a keystroke the suggestion
appears. This replay types through source files nobody here wrote (installed third-party
packages: `click` and `rich` by default, `--packages`) and sends, over HTTP, to an in-process
server (`make_server`, what `mlxspec serve` runs; one fresh server per configuration) exactly
the requests llama.vim sends (github.com/ggml-org/llama.vim `autoload/llama.vim` at commit
a1c8e6e: `llama#fim`, `s:fim_ctx_local`, `s:fim_try_hint`, `s:fim_render`, `s:pick_chunk`,
`s:ring_update`), with its client-side logic ported line for line:

- the user opens a few other files of the same package (`--open`; llama.vim's BufEnter /
  BufLeave pick a chunk of up to 33 lines around the cursor into the ring queue), then the file
  to type; in normal mode `s:ring_update` moves each queued chunk into the ring (at most
  `ring_n_chunks` 16) and sends a warm-up `/infill` with the ring as `input_extra` and
  `n_predict` 0;
- the user writes a block of `--lines` real lines at the start of a paragraph (a non-blank
  line after a blank one) as new code: the buffer holds the file without that block, and the
  block is typed line by line, a word at a time (`\\s*\\S+`), into a new line. Each time the
  cursor rests llama.vim first looks in its own cache of answers (the exact context, up to 3
  lines of scrolled prefix, or an answer from up to 128 characters back that the typed text
  matches): a hit shows at once. Otherwise it sends the first request (`input_prefix`: up to
  256 lines before the cursor line, `input_suffix`: the rest of the line and up to 64 lines
  after, `prompt`: the line up to the cursor, `input_extra`: the ring, `n_predict` 128,
  `n_indent`, `top_k` 40, `top_p` 0.90, `samplers`, `cache_prompt`, `t_max_prompt_ms` 500,
  `t_max_predict_ms` 250), shows its answer, then sends the speculative follow-up (the
  context as if the suggestion were accepted, `t_max_predict_ms` 1000) whose answer is cached
  for when the user gets there; the first request at a moving cursor also picks far chunks of
  the file into the ring queue, and evicts ring chunks similar to the text around the cursor;
- the user accepts the suggestion's first line (llama.vim's accept-line) when it is a
  non-empty start of what the file really has next on that line, otherwise types the next
  word; at the end of a line the user pauses (3 s without moving the cursor: `s:ring_update`
  moves one queued chunk into the ring and warms it up), then Enter (the 256-line prefix
  window moves down a line).

Requests run one at a time: the user rests at each stop until the suggestion is shown and the
follow-up has finished (the best case; a faster typist's next request would also wait for
the follow-up, whose time is reported). The requests are streamed (`"stream": true`, an
addition: llama.vim waits for the whole answer) to measure the time to the first token, and
`response_fields` adds `timings/cache_n`, `timings/draft_n`, `timings/draft_n_accepted`,
`tokens_evaluated` and `stop_type` to llama.vim's list. Temperature is the server's default
(0: greedy), as llama.vim sends none. `t_max_prompt_ms` is sent and ignored, as documented.
Target forwards and the proposal source of each accepted token are read in process from the
worker's per-request statistics (`Usage`, which the HTTP answer does not carry).

Configurations: each `--modes` entry (the server's `--mode`), plus, with `--no-suffix`, each
speculative one with `--suffix-scope request` (no store of earlier requests' text) and, with
`--no-draft`, with no draft model. Every configuration types the same files with the same
seed; since `t_max_predict_ms` cuts answers by time, faster configurations see longer
suggestions and the sequences can diverge (what the user would see).

The defaults (1 file, 2 lines, `auto` and `none`) are sized for qwen2.5-coder-0.5b on a
2-core CPU, where every keystroke's request re-reads the ~400 tokens of the 64 lines after
the cursor (tens of seconds there: docs/SERVER.md has the figures); with the bundled model or
faster hardware, ask for more (`--files 2 --lines 12`).

Figures per configuration: requests (warm-ups, first, follow-ups); p50/p95 time to the first
token and to the whole suggestion of first requests; the wait at each stop (0 when the
suggestion came from llama.vim's cache); prompt tokens reused from the prompt cache
(`timings.cache_n` over `tokens_evaluated`) and recomputed (`timings.prompt_n`); generated
tokens per target forward (answer tokens over forwards: `none` reads a little under 1, since
an end-of-sequence token or text cut by `n_indent` costs a forward and is not in the answer);
accepted proposals by source; follow-up hits: stops whose
suggestion came from a follow-up's cached answer, and the share of the follow-ups' tokens
the suffix store (earlier requests' text) proposed and the model accepted.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import click

from .. import backend
from ..engine import Engine
from ..errors import MlxspecError
from ..server.app import make_server

# llama.vim's defaults (autoload/llama.vim, s:default_config, commit a1c8e6e)
N_PREFIX, N_SUFFIX, N_PREDICT = 256, 64, 128
T_MAX_PROMPT_MS, T_MAX_PREDICT_MS, T_MAX_PREDICT_FIRST_MS = 500, 1000, 250
MAX_LINE_SUFFIX, MAX_CACHE_KEYS = 8, 250
RING_N_CHUNKS, RING_CHUNK_SIZE, RING_SCOPE, RING_QUEUE = 16, 64, 1024, 16
RESPONSE_FIELDS = [
    "content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
    "tokens_cached"]
MEASURED_FIELDS = ["timings/cache_n", "timings/draft_n", "timings/draft_n_accepted",
                   "tokens_evaluated", "stop_type"]  # added to llama.vim's list
WARMUP_MEASURED = ["timings/prompt_n", "timings/prompt_ms", *MEASURED_FIELDS]
WORD = re.compile(r"\s*\S+")
CURSOR = "Î"  # llama.vim's separator of the two halves of a cache key


# ----------------------------------------------------------------------------- the client


@dataclass
class Reply:
    """One request as the client saw it, and what the server counted."""

    kind: str  # "warmup", "first", "follow"
    content: str = ""
    ttft: float | None = None  # seconds to the first non-empty content (streamed requests)
    total: float = 0.0  # seconds to the whole answer
    fields: dict = field(default_factory=dict)  # the final object's response_fields
    forwards: int = 0  # target forwards (in process)
    accepted_by_source: dict = field(default_factory=dict)
    drafted_by_source: dict = field(default_factory=dict)

    def num(self, key: str) -> float:
        v = self.fields.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


class Server:
    """An in-process `make_server` on a free loopback port, with the worker's per-request
    statistics recorded as each generation ends (before its answer is sent)."""

    def __init__(self, engine: Engine, **options):
        self.srv = make_server(engine, "127.0.0.1", 0, **options)
        self.host, self.port = self.srv.server_address[:2]
        self.usages: list = []
        self.lock = threading.Lock()
        metrics = self.srv.worker.metrics  # told each answer's usage (`Metrics.generation`)
        count = metrics.generation

        def generation(usage) -> None:
            with self.lock:
                self.usages.append(usage)
            count(usage)

        metrics.generation = generation
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()

    def infill(self, body: dict, kind: str) -> Reply:
        reply = Reply(kind)
        with self.lock:
            self.usages.clear()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/infill", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"/infill answered {resp.status}: {resp.read()[:300]!r}")
        if body.get("stream"):
            parts = []
            while True:
                line = resp.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop") is True or "content" not in ev or "index" not in ev:
                    reply.fields = ev  # the final object: response_fields only
                    continue
                if ev["content"]:
                    if reply.ttft is None:
                        reply.ttft = time.perf_counter() - t0
                    parts.append(ev["content"])
            reply.content = "".join(parts)
        else:
            reply.fields = json.loads(resp.read())
            reply.content = reply.fields.get("content", "") or ""
        reply.total = time.perf_counter() - t0
        conn.close()
        with self.lock:
            usages, self.usages = self.usages, []
        for u in usages:
            reply.forwards += u.target_forwards
            for src, n in u.accepted_by_source.items():
                reply.accepted_by_source[src] = reply.accepted_by_source.get(src, 0) + n
            for src, n in u.drafted_by_source.items():
                reply.drafted_by_source[src] = reply.drafted_by_source.get(src, 0) + n
        return reply


# ----------------------------------------------------------------------------- llama.vim


def chunk_sim(c0: list[str], c1: list[str]) -> float:
    """s:chunk_sim: 0 no similarity, 1 the same lines."""
    common = sum(1 for line0 in c0 if line0 in c1)
    return 2.0 * common / (len(c0) + len(c1)) if c0 or c1 else 1.0


@dataclass
class Hint:
    content: list[str]
    can_accept: bool
    pos_x: int
    pos_y: int
    line_cur: str
    source: str  # the kind of request whose answer it is ("first" or "follow")
    from_cache: bool  # shown from llama.vim's cache without a request of its own


class Editor:
    """llama.vim's FIM client on one buffer (lines 1-based as in Vim, ASCII assumed: Vim's
    string functions count bytes)."""

    def __init__(self, server: Server, rng: random.Random, log: list, read_ms: int = 0,
                 accept_all: bool = False):
        self.server, self.rng, self.log = server, rng, log
        # the user reads a shown suggestion this long before the next key; accepts every one
        self.read_ms, self.accept_all = read_ms, accept_all
        self.lines: list[str] = []
        self.filename = ""
        self.modified = False
        self.cur_y = 1  # the cursor's line (line('.'))
        self.ring_chunks: list[dict] = []
        self.ring_queued: list[dict] = []
        self.ring_n_evict = 0
        self.cache: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (content, kind)
        self.pos_y_pick = -9999
        self.indent_last = 0
        self.hint: Hint | None = None
        self.stops: list[dict] = []

    # -- the buffer
    def getline(self, a: int, b: int | None = None):
        if b is None:
            return self.lines[a - 1] if 1 <= a <= len(self.lines) else ""
        a = max(a, 1)
        return self.lines[a - 1:b] if b >= a else []

    def rand(self, i0: int, i1: int) -> int:
        return i0 + self.rng.randrange(i1 - i0 + 1)

    def around_cursor(self) -> list[str]:
        half = RING_CHUNK_SIZE // 2
        return self.getline(max(1, self.cur_y - half), min(self.cur_y + half, len(self.lines)))

    # -- the cache of answers (s:cache_insert, s:cache_get)
    def cache_insert(self, key: str, value: tuple[str, str]) -> None:
        if key not in self.cache and len(self.cache) > MAX_CACHE_KEYS - 1:
            self.cache.popitem(last=False)
        self.cache[key] = value
        self.cache.move_to_end(key)

    def cache_get(self, key: str):
        if key not in self.cache:
            return None
        self.cache.move_to_end(key)
        return self.cache[key]

    # -- the ring buffer of extra context
    def pick_chunk(self, text: list[str], no_mod: bool, do_evict: bool) -> None:
        """s:pick_chunk."""
        if no_mod and self.modified:
            return
        if len(text) < 3:
            return
        if len(text) + 1 < RING_CHUNK_SIZE:
            chunk = list(text)
        else:
            l0 = self.rand(0, max(0, len(text) - RING_CHUNK_SIZE // 2))
            l1 = min(l0 + RING_CHUNK_SIZE // 2, len(text))
            chunk = text[l0:l1 + 1]
        if any(c["data"] == chunk for c in self.ring_chunks + self.ring_queued):
            return
        for pool in (self.ring_queued, self.ring_chunks):
            for i in range(len(pool) - 1, -1, -1):
                if chunk_sim(pool[i]["data"], chunk) > 0.9:
                    if not do_evict:
                        return
                    del pool[i]
                    self.ring_n_evict += 1
        if len(self.ring_queued) == RING_QUEUE:
            del self.ring_queued[0]
        self.ring_queued.append({"data": chunk, "str": "\n".join(chunk) + "\n",
                                 "time": int(time.time()), "filename": self.filename})

    def ring_extra(self) -> list[dict]:
        return [{"text": c["str"], "time": c["time"], "filename": c["filename"]}
                for c in self.ring_chunks]

    def ring_update(self) -> Reply | None:
        """s:ring_update: one queued chunk into the ring, and a warm-up request with it."""
        if not self.ring_queued:
            return None
        if len(self.ring_chunks) == RING_N_CHUNKS:
            del self.ring_chunks[0]
        self.ring_chunks.append(self.ring_queued.pop(0))
        body = {"id_slot": 0, "input_prefix": "", "input_suffix": "",
                "input_extra": self.ring_extra(), "prompt": "", "n_predict": 0,
                "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
                "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
                "response_fields": ["", *WARMUP_MEASURED]}
        return self.send(body, "warmup")

    def send(self, body: dict, kind: str, prev: list[str] | None = None) -> Reply:
        reply = self.server.infill(body, kind)
        self.log.append({"kind": kind, "file": self.filename, "line": self.cur_y,
                         "ring": len(body.get("input_extra") or []), "body": body,
                         "prev": prev, "reply": reply})
        return reply

    # -- FIM
    def ctx_local(self, pos_x: int, pos_y: int, prev: list[str]) -> dict:
        """s:fim_ctx_local: the local context at a position, or (prev) as if the suggestion
        `prev` had been accepted there."""
        max_y = len(self.lines)
        if not prev:
            line_cur = self.getline(pos_y)
            line_cur_prefix, line_cur_suffix = line_cur[:pos_x], line_cur[pos_x:]
            lines_prefix = self.getline(max(1, pos_y - N_PREFIX), pos_y - 1)
            lines_suffix = self.getline(pos_y + 1, min(max_y, pos_y + N_SUFFIX))
            if line_cur.strip() == "":
                indent, line_cur_prefix, line_cur_suffix = 0, "", ""
            else:
                indent = len(line_cur) - len(line_cur.lstrip(" \t"))
        else:
            line_cur = self.getline(pos_y) + prev[0] if len(prev) == 1 else prev[-1]
            line_cur_prefix, line_cur_suffix = line_cur, ""
            lines_prefix = self.getline(max(1, pos_y - N_PREFIX + len(prev) - 1), pos_y - 1)
            if len(prev) > 1:
                lines_prefix = lines_prefix + [self.getline(pos_y) + prev[0]] + prev[1:-1]
            lines_suffix = self.getline(pos_y + 1, min(max_y, pos_y + N_SUFFIX))
            indent = self.indent_last
        return {"prefix": "\n".join(lines_prefix) + "\n", "middle": line_cur_prefix,
                "suffix": line_cur_suffix + "\n" + "\n".join(lines_suffix) + "\n",
                "indent": indent, "line_cur": line_cur, "line_cur_suffix": line_cur_suffix}

    def fim(self, pos_x: int, pos_y: int, prev: list[str], kind: str) -> Reply | None:
        """llama#fim(pos_x, pos_y, is_auto=true, prev, use_cache=true): a request unless its
        answer is cached, the answer then cached under the context's keys."""
        ctx = self.ctx_local(pos_x, pos_y, prev)
        prefix, middle, suffix = ctx["prefix"], ctx["middle"], ctx["suffix"]
        if len(ctx["line_cur_suffix"]) > MAX_LINE_SUFFIX:
            return None
        t_max_predict_ms = T_MAX_PREDICT_MS if prev else T_MAX_PREDICT_FIRST_MS
        keys = [prefix + middle + CURSOR + suffix]
        trimmed = prefix
        for _ in range(3):
            trimmed = trimmed.split("\n", 1)[1] if "\n" in trimmed else trimmed
            if not trimmed:
                break
            keys.append(trimmed + middle + CURSOR + suffix)
        if any(self.cache_get(k) is not None for k in keys):
            return None
        self.indent_last = ctx["indent"]
        # evict ring chunks very similar to the text around the cursor
        text = self.around_cursor()
        l0 = self.rand(0, max(0, len(text) - RING_CHUNK_SIZE // 2))
        l1 = min(l0 + RING_CHUNK_SIZE // 2, len(text))
        chunk = text[l0:l1 + 1]
        for i in range(len(self.ring_chunks) - 1, -1, -1):
            if chunk_sim(self.ring_chunks[i]["data"], chunk) > 0.5:
                del self.ring_chunks[i]
                self.ring_n_evict += 1
        body = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix,
                "input_extra": self.ring_extra(), "prompt": middle, "n_predict": N_PREDICT,
                "stop": [], "n_indent": ctx["indent"], "top_k": 40, "top_p": 0.90,
                "samplers": ["top_k", "top_p", "infill"], "stream": True,
                "cache_prompt": True, "t_max_prompt_ms": T_MAX_PROMPT_MS,
                "t_max_predict_ms": t_max_predict_ms,
                "response_fields": RESPONSE_FIELDS + MEASURED_FIELDS}
        reply = self.send(body, kind, prev)
        for k in keys:
            self.cache_insert(k, (reply.content, kind))
        if abs(pos_y - self.pos_y_pick) > 32:  # gather far chunks of this file
            max_y = len(self.lines)
            self.pick_chunk(self.getline(max(1, pos_y - RING_SCOPE), max(1, pos_y - N_PREFIX)),
                            False, False)
            self.pick_chunk(self.getline(min(max_y, pos_y + N_SUFFIX),
                                         min(max_y, pos_y + N_SUFFIX + RING_CHUNK_SIZE)),
                            False, False)
            self.pos_y_pick = pos_y
        return reply

    def try_hint(self, pos_x: int, pos_y: int) -> Hint | None:
        """s:fim_try_hint: a cached answer for this position (exact, or from up to 128
        characters back when what was typed since matches it), rendered."""
        ctx = self.ctx_local(pos_x, pos_y, [])
        pm, suffix = ctx["prefix"] + ctx["middle"], ctx["suffix"]
        found = self.cache_get(pm + CURSOR + suffix)
        if found is None:
            best = 0
            for i in range(128):
                if i + 1 >= len(pm):
                    break
                removed = pm[-(1 + i):]
                cached = self.cache_get(pm[:-(1 + i)] + CURSOR + suffix)
                if cached is None or cached[0] == "":
                    continue
                if cached[0][:i + 1] != removed:
                    continue
                rest = cached[0][i + 1:]
                if rest:
                    if found is None:
                        found = (rest, cached[1])
                    elif len(rest) > best:
                        best, found = len(rest), (rest, cached[1])
            from_cache = found is not None
        else:
            from_cache = True
        if found is None:
            return None
        return self.render(pos_x, pos_y, found[0], found[1], from_cache)

    def render(self, pos_x: int, pos_y: int, text: str, source: str, from_cache: bool) -> Hint:
        """s:fim_render: what is shown, and whether it can be accepted."""
        can_accept = True
        content = text.split("\n")
        while content and content[-1] == "":
            content.pop()
        if not content:
            content, can_accept = [""], False
        line_cur = self.getline(pos_y)
        if line_cur.strip() == "":
            first = content[0]
            lead = min(len(first) - len(first.lstrip()), len(line_cur))
            line_cur, content[0] = first[:lead], first[lead:]
        line_cur_prefix, line_cur_suffix = line_cur[:pos_x], line_cur[pos_x:]
        if len(content) == 1 and content[0] == "":
            content = [""]
        if (len(content) > 1 and content[0] == ""
                and content[1:] == self.getline(pos_y + 1, pos_y + len(content) - 1)):
            content = [""]
        if len(content) == 1 and content[0] == line_cur_suffix:
            content = [""]
        cmp_y = pos_y + 1
        while cmp_y < len(self.lines) and self.getline(cmp_y).strip() == "":
            cmp_y += 1
        if line_cur_prefix + content[0] == self.getline(cmp_y):
            nxt = self.getline(cmp_y + 1)
            if len(content) == 1:
                content = [""]
            elif len(content) == 2 and content[-1] == (nxt[:len(content[-1])] if content[-1]
                                                        else nxt):
                content = [""]
            elif len(content) > 2 and "\n".join(content[1:]) == "\n".join(
                    self.getline(cmp_y + 1, cmp_y + len(content) - 1)):
                content = [""]
        content[-1] += line_cur_suffix
        if "\n".join(content).strip() == "":
            can_accept = False
        return Hint(content, can_accept, pos_x, pos_y, line_cur, source, from_cache)

    # -- the user
    def rest(self, pos_x: int, pos_y: int) -> Hint | None:
        """The cursor rests at (pos_x, pos_y): CursorMovedI's s:on_move (a cached suggestion,
        and the speculative follow-up for it), then llama#fim (a request unless cached), and
        on its answer the suggestion and its follow-up. Returns what is shown."""
        self.cur_y = pos_y
        t0 = time.perf_counter()
        wait = None
        hint = self.try_hint(pos_x, pos_y)
        if hint is not None:
            wait = 0.0
            self.fim(pos_x, pos_y, hint.content, "follow")
        reply = self.fim(pos_x, pos_y, [], "first")
        if reply is not None and (hint is None or not hint.can_accept):
            shown = self.try_hint(pos_x, pos_y)
            if shown is not None:
                if hint is None:
                    wait = reply.total
                    shown.from_cache = False
                hint = shown
                self.fim(pos_x, pos_y, hint.content, "follow")
        self.stops.append({"file": self.filename, "line": pos_y, "col": pos_x,
                           "wait": wait, "hint_from": None if hint is None else (
                               ("cache:" if hint.from_cache else "request:") + hint.source),
                           "can_accept": bool(hint and hint.can_accept),
                           "busy": time.perf_counter() - t0})
        self.hint = hint
        if hint is not None and self.read_ms:
            time.sleep(self.read_ms / 1000)
        return hint

    def type_block(self, target_lines: list[str], at: int) -> dict:
        """Type `target_lines` into a new line opened before line `at` (1-based); returns
        how many characters were typed and how many accepted."""
        typed_chars = accepted_chars = accepts = 0
        self.lines.insert(at - 1, "")
        self.modified = True
        y = at
        for n, target in enumerate(target_lines):
            x = 0
            hint = self.rest(x, y)
            while self.lines[y - 1] != target:
                line = self.lines[y - 1]
                if hint is not None and hint.can_accept and hint.content[0]:
                    keep = hint.line_cur[:hint.pos_x] if hint.pos_x > 0 else hint.line_cur
                    new = keep + hint.content[0]
                    if len(new) > len(line) and (target.startswith(new) or self.accept_all):
                        if not target.startswith(new):  # --accept-all: the line is the model's
                            target = new
                        self.lines[y - 1] = new  # accept the first line
                        accepted_chars += len(new) - len(line)
                        accepts += 1
                        x = len(new)
                        if new == target and len(hint.content) > 1:
                            break  # accept-line feeds Enter
                        hint = self.rest(x, y)
                        continue
                word = WORD.match(target, len(line))
                end = word.end() if word else len(target)
                typed_chars += end - len(line)
                self.lines[y - 1] = target[:end]
                x = end
                hint = self.rest(x, y)
            # the user pauses at the line's end: with the cursor still for 3 s, s:ring_update
            # moves a queued chunk into the ring (in insert mode too) and warms it up
            self.ring_update()
            if n + 1 < len(target_lines):  # Enter: a new line below
                self.lines.insert(y, "")
                y += 1
        return {"typed_chars": typed_chars, "accepted_chars": accepted_chars,
                "accepts": accepts}

    def open_file(self, name: str, lines: list[str], cursor: int, others) -> None:
        """BufLeave of the buffer being left, the other files opened (BufEnter and BufLeave
        at a cursor line each), BufEnter of `name`; then, in normal mode, s:ring_update for
        every queued chunk (one warm-up each)."""
        if self.lines:
            self.pick_chunk(self.around_cursor(), True, True)
        for other_name, other_lines, other_cursor in others:
            self.filename, self.lines, self.modified = other_name, other_lines, False
            self.cur_y = other_cursor
            self.pick_chunk(self.around_cursor(), True, True)  # BufEnter
            self.pick_chunk(self.around_cursor(), True, True)  # BufLeave
        self.filename, self.lines, self.modified, self.cur_y = name, list(lines), False, cursor
        self.pick_chunk(self.around_cursor(), True, True)
        self.hint = None
        while self.ring_update() is not None:
            pass


# ----------------------------------------------------------------------------- files


def package_files(packages: list[str], min_lines: int) -> dict[str, list[Path]]:
    """The .py files of each installed package with at least `min_lines` lines."""
    import importlib.util

    out = {}
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise MlxspecError(f"--packages: {pkg!r} is not an installed package "
                               "(pip install it, or name another)")
        root = Path(next(iter(spec.submodule_search_locations)))
        files = [p for p in sorted(root.rglob("*.py"))
                 if len(read_lines(p)) >= min_lines]
        if not files:
            raise MlxspecError(f"--packages: {pkg!r} has no .py file of {min_lines} lines")
        out[pkg] = files
    return out


def read_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace").expandtabs(4)
    return [line.rstrip() for line in text.splitlines()]


def plan_files(packages: list[str], n_files: int, n_lines: int, n_open: int, seed: int) -> list:
    """Per typed file: its name, its lines, where the block to type starts (a non-blank line
    after a blank one, with room for the block), and the other files opened before it."""
    files = package_files(packages, n_lines + 24)
    rng = random.Random(seed)
    plan = []
    for i in range(n_files):
        pkg = packages[i % len(packages)]
        path = rng.choice(files[pkg])
        lines = read_lines(path)
        starts = [j for j in range(8, len(lines) - n_lines - 4)
                  if lines[j - 1] == "" and lines[j].strip() and lines[j + n_lines - 1].strip()]
        start = rng.choice(starts) if starts else rng.randrange(8, len(lines) - n_lines - 4)
        others = []
        for other in rng.sample([p for p in files[pkg] if p != path],
                                min(n_open, len(files[pkg]) - 1)):
            other_lines = read_lines(other)
            others.append((rel(other), other_lines, rng.randrange(1, len(other_lines) + 1)))
        plan.append({"name": rel(path), "lines": lines, "start": start, "others": others})
    return plan


def rel(path: Path) -> str:
    """The file's name as the editor shows it: from its package's folder on (`click/core.py`)."""
    parts = path.parts
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == "site-packages" or parts[i] == "dist-packages":
            return "/".join(parts[i + 1:])
    return path.name


# ----------------------------------------------------------------------------- a run


@dataclass
class Config:
    mode: str
    suffix: bool = True
    draft: bool = True
    cache_reuse: int = 0  # the server's --cache-reuse
    follow_ahead: bool = True  # the server's --follow-ahead

    @property
    def label(self) -> str:
        return (self.mode + ("" if self.suffix else " -suffix") + ("" if self.draft else " -draft")
                + (f" --cache-reuse {self.cache_reuse}" if self.cache_reuse else "")
                + ("" if self.follow_ahead else " --no-follow-ahead"))


def engine_for(base: Engine, cfg: Config) -> Engine:
    """A fresh engine on the base's weights (its own proposers, policies and prompt cache)."""
    draft = base.draft_model if cfg.draft else None
    source = base.draft_source if cfg.draft else None
    return Engine(base.model, base.tokenizer, mode=cfg.mode, draft_model=draft,
                  num_draft=base.num_draft if base.num_draft_set else None, config=base.config,
                  name=base.name, max_context=base.max_context, draft_source=source,
                  load_draft=base.load_draft)


def replay(base: Engine, cfg: Config, plan: list, n_lines: int, seed: int, read_ms: int = 0,
           accept_all: bool = False) -> dict:
    """Type through `plan` against a fresh server in configuration `cfg`: the editor's
    request log (bodies and replies), its stops and what was typed and accepted."""
    engine = engine_for(base, cfg)
    server = Server(engine, suffix_scope="client" if cfg.suffix else "request",
                    cache_reuse=cfg.cache_reuse, follow_ahead=cfg.follow_ahead)
    log: list = []
    editor = Editor(server, random.Random(seed), log, read_ms, accept_all)
    typing = {"typed_chars": 0, "accepted_chars": 0, "accepts": 0}
    t0 = time.perf_counter()
    try:
        for f in plan:
            start = f["start"]
            block = f["lines"][start:start + n_lines]
            buffer = f["lines"][:start] + f["lines"][start + n_lines:]
            editor.open_file(f["name"], buffer, start + 1, f["others"])
            got = editor.type_block(block, start + 1)
            for k in typing:
                typing[k] += got[k]
    finally:
        server.close()
    return {"cfg": cfg, "log": log, "stops": editor.stops, "typing": typing,
            "seconds": time.perf_counter() - t0,
            "drafting": engine.draft_model is not None and cfg.mode in ("auto", "draft")}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summarize(run: dict) -> dict:
    """The figures of one configuration's replay."""
    cfg, log, stops, typing = run["cfg"], run["log"], run["stops"], run["typing"]
    by_kind = {k: [e["reply"] for e in log if e["kind"] == k] for k in ("warmup", "first", "follow")}
    gen = by_kind["first"] + by_kind["follow"]

    def kind_figures(replies: list[Reply]) -> dict:
        evaluated = sum(r.num("tokens_evaluated") for r in replies)
        cached = sum(r.num("timings/cache_n") for r in replies)
        predicted = sum(r.num("timings/predicted_n") for r in replies)
        forwards = sum(r.forwards for r in replies)
        return {
            "requests": len(replies),
            "ttft_p50": pct([r.ttft for r in replies if r.ttft is not None], 50),
            "ttft_p95": pct([r.ttft for r in replies if r.ttft is not None], 95),
            "total_p50": pct([r.total for r in replies], 50),
            "total_p95": pct([r.total for r in replies], 95),
            "seconds": sum(r.total for r in replies),
            "prompt_tokens": evaluated, "reused_tokens": cached,
            "recomputed_tokens": sum(r.num("timings/prompt_n") for r in replies),
            "recomputed_p50": pct([r.num("timings/prompt_n") for r in replies], 50),
            "reused_pct": 100 * cached / evaluated if evaluated else None,
            "prefill_seconds": sum(r.num("timings/prompt_ms") for r in replies) / 1000,
            "decode_seconds": sum(r.num("timings/predicted_ms") for r in replies) / 1000,
            "predicted_tokens": predicted, "target_forwards": forwards,
            "tokens_per_forward": predicted / forwards if forwards else None,
            "drafted": sum(r.num("timings/draft_n") for r in replies),
            "accepted": sum(r.num("timings/draft_n_accepted") for r in replies),
            "truncated": sum(1 for r in replies if r.fields.get("truncated")),
            "empty": sum(1 for r in replies if not r.content),
        }

    def by_source(replies: list[Reply], attr: str) -> dict:
        out: dict[str, int] = {}
        for r in replies:
            for src, n in getattr(r, attr).items():
                fam = src.split(":")[0]
                out[fam] = out.get(fam, 0) + n
        return out

    follow = by_kind["follow"]
    follow_pred = sum(r.num("timings/predicted_n") for r in follow)
    follow_suffix = sum(n for r in follow for s, n in r.accepted_by_source.items()
                        if s.startswith("suffix"))
    waits = [s["wait"] for s in stops if s["wait"] is not None]
    hint_from: dict[str, int] = {}
    for s in stops:
        key = s["hint_from"] or "none"
        hint_from[key] = hint_from.get(key, 0) + 1
    chars = typing["typed_chars"] + typing["accepted_chars"]
    return {
        "config": cfg.label, "mode": cfg.mode, "suffix_store": cfg.suffix,
        "draft": run["drafting"], "seconds": run["seconds"],
        "kinds": {k: kind_figures(v) for k, v in by_kind.items()},
        "generation": kind_figures(gen),
        "accepted_by_source": by_source(gen, "accepted_by_source"),
        "drafted_by_source": by_source(gen, "drafted_by_source"),
        "stops": len(stops), "wait_p50": pct(waits, 50), "wait_p95": pct(waits, 95),
        "busy_p50": pct([s["busy"] for s in stops], 50),
        "busy_p95": pct([s["busy"] for s in stops], 95),
        "stops_shown_from_cache": sum(1 for s in stops if (s["hint_from"] or "").startswith(
            "cache:")),
        "stops_from_follow_up": sum(1 for s in stops if s["hint_from"] == "cache:follow"),
        "hint_from": hint_from,
        "follow_up_tokens": follow_pred, "follow_up_tokens_from_store": follow_suffix,
        "follow_ups_with_store_tokens": sum(1 for r in follow if any(
            s.startswith("suffix") and n for s, n in r.accepted_by_source.items())),
        "typing": {**typing, "accepted_pct": 100 * typing["accepted_chars"] / chars
                   if chars else 0.0},
        "requests": [{"kind": e["kind"], "file": e["file"], "line": e["line"],
                      "ring": e["ring"], "ttft": e["reply"].ttft, "total": e["reply"].total,
                      "content": e["reply"].content, "fields": e["reply"].fields,
                      "body": e["body"],
                      "forwards": e["reply"].forwards,
                      "accepted_by_source": e["reply"].accepted_by_source}
                     for e in log],
        "stop_log": stops,
    }


def fmt_s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def fmt_pair(a, b) -> str:
    return f"{fmt_s(a)} / {fmt_s(b)}"


def table(results: list[dict]) -> str:
    """The compact table: one row per configuration."""
    cols = ["config", "requests warm/first/follow", "first: TTFT p50/p95 s",
            "first: suggestion p50/p95 s", "follow-up p50/p95 s", "wait per stop p50/p95 s",
            "prompt reused", "first: recomputed p50 tokens", "tok/forward", "hints from follow-ups", "follow-up tokens from store"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        k, g = r["kinds"], r["generation"]
        reused = "-" if g["reused_pct"] is None else f"{g['reused_pct']:.0f} %"
        tpf = "-" if g["tokens_per_forward"] is None else f"{g['tokens_per_forward']:.2f}"
        cells = [
            r["config"],
            f"{k['warmup']['requests']}/{k['first']['requests']}/{k['follow']['requests']}",
            fmt_pair(k["first"]["ttft_p50"], k["first"]["ttft_p95"]),
            fmt_pair(k["first"]["total_p50"], k["first"]["total_p95"]),
            fmt_pair(k["follow"]["total_p50"], k["follow"]["total_p95"]),
            fmt_pair(r["wait_p50"], r["wait_p95"]),
            reused, "-" if k["first"]["recomputed_p50"] is None else
            f"{k['first']['recomputed_p50']:.0f}", tpf,
            f"{r['stops_from_follow_up']}/{r['stops']} stops",
            f"{r['follow_up_tokens_from_store']}/{r['follow_up_tokens']}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def where_time_goes(r: dict) -> str:
    """One line per configuration: prefill vs decode per kind of request, sources."""
    parts = []
    for kind in ("warmup", "first", "follow"):
        f = r["kinds"][kind]
        if not f["requests"]:
            continue
        parts.append(f"{kind} {f['seconds']:.1f} s (prefill {f['prefill_seconds']:.1f} s for "
                     f"{f['recomputed_tokens']} tokens of {f['prompt_tokens']}, decode "
                     f"{f['decode_seconds']:.1f} s for {f['predicted_tokens']} tokens)")
    g = r["generation"]
    src = ", ".join(f"{s} {n}" for s, n in sorted(r["accepted_by_source"].items())) or "none"
    acc = f"{100 * g['accepted'] / g['drafted']:.0f} %" if g["drafted"] else "-"
    t = r["typing"]
    return (f"{r['config']}: " + "; ".join(parts)
            + f"; accepted proposals by source: {src} (acceptance {acc}); "
            f"suggestions accepted {t['accepts']} times, {t['accepted_pct']:.0f} % of the "
            f"characters; {r['stops_shown_from_cache']}/{r['stops']} stops shown from "
            f"llama.vim's cache; {r['follow_ups_with_store_tokens']}/"
            f"{r['kinds']['follow']['requests']} follow-ups took tokens from the store; "
            f"a stop keeps the server busy {fmt_pair(r['busy_p50'], r['busy_p95'])} s "
            f"(p50 / p95: what a faster typist's next keystroke would wait behind); "
            f"{g['truncated']} prompts truncated")


def configs_for(modes: list[str], no_suffix: bool, no_draft: bool,
                cache_reuse: int = 0, no_follow_ahead: bool = False) -> list[Config]:
    out = []
    for mode in modes:
        out.append(Config(mode))
        if no_suffix and mode in ("auto", "suffix"):
            out.append(Config(mode, suffix=False))
        if no_draft and mode == "auto":
            out.append(Config(mode, draft=False))
        if cache_reuse:
            out.append(Config(mode, cache_reuse=cache_reuse))
        if no_follow_ahead and mode in ("auto", "suffix"):
            out.append(Config(mode, follow_ahead=False))
    return out


def agreement(run: dict, exact: dict) -> dict:
    """How a --cache-reuse run's answers agree with the exact run's, over the requests both
    sent with the same body (time limits make the runs drift apart): answers identical up to
    the shorter one, and the share of their common length that agrees."""
    def key(body: dict) -> str:  # what the model sees (the ring's chunks carry a time)
        return json.dumps([body.get(k) for k in ("input_prefix", "input_suffix", "prompt")]
                          + [c.get("text") for c in body.get("input_extra") or []])

    answers = {key(r["body"]): r["content"] for r in exact["requests"] if r["kind"] != "warmup"}
    same = matched = agreed = compared = 0
    for r in run["requests"]:
        want = answers.get(key(r["body"]))
        if r["kind"] == "warmup" or want is None:
            continue
        got, n = r["content"], min(len(r["content"]), len(want))
        common = next((i for i in range(n) if got[i] != want[i]), n)
        matched += 1
        same += common == n
        agreed, compared = agreed + common, compared + n
    return {"matched_requests": matched, "identical_answers": same,
            "agreeing_chars_pct": 100 * agreed / compared if compared else None}


def machine() -> str:
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs, MLX {backend.device_name()}, BLAS {backend.blas_in_use}, "
            f"load average {load1:.1f}")


def run_replays(base: Engine, modes: list[str], no_suffix: bool, no_draft: bool, n_files: int,
                n_lines: int, n_open: int, packages: list[str], seed: int,
                cache_reuse: int = 0, no_follow_ahead: bool = False, read_ms: int = 0,
                accept_all: bool = False) -> dict:
    """`mlxspec bench editor`: every configuration types the same plan on `base`'s weights.
    Prints the table (progress on stderr); returns every figure and request."""
    say = click.echo
    plan = plan_files(packages, n_files, n_lines, n_open, seed)
    base.generate("def f(x):\n    return", max_tokens=4)  # warm MLX's kernels up
    before = machine()
    results = []
    for cfg in configs_for(modes, no_suffix, no_draft, cache_reuse, no_follow_ahead):
        results.append(summarize(replay(base, cfg, plan, n_lines, seed, read_ms, accept_all)))
        say(f"# {cfg.label}: {results[-1]['seconds']:.0f} s", err=True)
        if cfg.cache_reuse:  # against the same mode's exact run (just before it)
            exact = next(r for r in results if r["config"] == cfg.mode)
            results[-1]["agreement"] = agreement(results[-1], exact)
    files = ", ".join(f"{f['name']}:{f['start'] + 1}" for f in plan)
    say(f"# {base.name}: llama.vim replay, {n_files} files x {n_lines} lines ({files}), "
        f"{n_open} other files opened each, seed {seed}"
        + (f", {read_ms} ms read per suggestion" if read_ms else "")
        + (", every suggestion accepted" if accept_all else "") + f"; {before} at the start, "
        f"{machine().rsplit(', ', 1)[1]} at the end")
    say(table(results))
    say("")
    for r in results:
        say("- " + where_time_goes(r))
        a = r.get("agreement")
        if a:
            pct_chars = "-" if a["agreeing_chars_pct"] is None else \
                f"{a['agreeing_chars_pct']:.1f} %"
            say(f"- {r['config']} against {r['mode']} (exact): {a['identical_answers']}/"
                f"{a['matched_requests']} answers to the same request identical up to the "
                f"shorter one; {pct_chars} of the characters compared agree")
    return {"model": base.name, "machine": before,
            "files": [{k: v for k, v in f.items() if k != "lines"} | {
                "others": [o[0] for o in f["others"]]} for f in plan],
            "results": results}
