"""The one thread that owns the model and runs every MLX computation of the server.

Handlers submit a `Job` and read its events from the job's own queue. Each round the worker
opens new jobs as rows (of the shared `BatchSpeculator`, or a batch of one from `Engine.open`),
steps every batch once and hands each request its new text; a cancelled job is closed before
its next step. See docs/HOW_IT_WORKS.md, "Several requests".
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import wired_limit

from ..batch_step import BatchSpeculator
from ..caches.prompt import PromptCache, PromptCacheStore
from ..engine import Engine
from ..errors import MlxspecError
from ..memory import GB, ServingMemory, shortfall
from ..planning import BatchPolicy
from ..row import BatchRow
from ..stats import Stats
from ..suffix_store import SuffixStores
from .answers import Usage
from .metrics import Metrics
from .protocol import ApiError, GenRequest, IndentStop

log = logging.getLogger("mlxspec.server")
# Requests speculating at once by default; above it a request decodes plainly in the batch. An
# upper bound, not the switch: the batch steps plainly where proposals do not pay.
SPEC_MAX_CONCURRENCY = 32


@dataclass
class Delta:
    text: str
    tokens: int
    ids: list[int] = field(default_factory=list)  # the tokens' ids
    timings: dict | None = None  # llama.cpp's timings so far (`timings_per_token`)
    logprobs: list | None = None  # per token its `constrain.TokenLogprob` (asked for)
    sources: list[str] | None = None  # per token where it came from (`StepOutput.sources`)


@dataclass
class Progress:
    """Prompt processing so far (llama.cpp's `prompt_progress`, `return_progress`)."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def json(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": self.time_ms}


@dataclass
class Done:
    finish_reason: str
    usage: Usage
    stopping_word: str = ""


@dataclass
class Failed:
    error: ApiError


@dataclass
class Job:
    req: GenRequest
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # worker-side state
    # opened: its row, in the shared batch or a batch of its own (`Engine.open`)
    row: BatchRow | None = None
    batch: BatchSpeculator | None = None  # the batch its row is in
    # the mode its row decodes in, decided when it opens: "none" (k = 0) over
    # --spec-max-concurrency, else the request's (or the server's default)
    mode: str | None = None
    slot: Engine | None = None
    cache: PromptCache | None = None
    stats: Stats | None = None
    text_so_far: str = ""
    first_token: float = 0.0
    indent: IndentStop | None = None
    deadline: float | None = None  # perf_counter time after which it ends ("timeout")
    # answered (cut by t_max_predict_ms): its row decodes on while no other job runs, and
    # what it adds goes into the scope's store for the follow-up's proposals (`_look_ahead`)
    ahead: bool = False
    slot_id: int | None = None  # its place among the open jobs (`GET /slots`, `id_slot`)
    task_id: int = 0  # a number per submitted job (`GET /slots`' id_task)
    opened_at: float = 0.0  # perf_counter time it opened (prompt_progress's time_ms)
    reported: int = -1  # the prompt tokens processed at its last prompt_progress
    prompt_cached: int = 0  # of them, reused from the prompt cache
    waiting_for_memory: bool = False  # its memory does not fit yet: it waits to open
    # paused when memory ran short (`Worker._pause`): the tokens it generated so far (its row
    # reopens on its prompt + these, for the rest of max_tokens) and its text's state
    generated: list[int] = field(default_factory=list)
    detok: object | None = None  # its row's `stopstrings.Detokenizer`, carried to the next row
    pauses: int = 0
    base: int = 0  # of them, generated before the row its `stats` count (opened after a pause)

    @property
    def tokens(self) -> int:
        """The tokens its caches hold at most: its prompt and max_tokens."""
        return len(self.req.prompt) + (1 if self.req.warmup else self.req.max_tokens)

    def __post_init__(self) -> None:
        if self.req.n_indent > 0:
            self.indent = IndentStop(self.req.n_indent)

    @property
    def opened(self) -> bool:
        return self.row is not None

    @property
    def prompt(self) -> list[int]:
        """What its row opens on: its prompt, and the tokens it generated before a pause."""
        return self.req.prompt + self.generated if self.generated else self.req.prompt

    @property
    def paused(self) -> bool:
        """Paused when memory ran short: it waits to reopen where it stopped."""
        return self.pauses > 0 and not self.opened

    def cut(self, text: str) -> tuple[str, bool]:
        """The text to emit after the n_indent rule, and whether it ends the answer."""
        return self.indent.feed(text) if self.indent is not None else (text, False)

    def cancel(self) -> None:
        self.cancelled.set()


# ----------------------------------------------------------------------------- the worker


class Worker(threading.Thread):
    def __init__(self, engine: Engine, *, spec_max_concurrency: int = SPEC_MAX_CONCURRENCY,
                 max_batch: int = 8,
                 max_queue: int = 64, cache_bytes: int = 2 << 30, cache_entries: int = 8,
                 prefill_chunk: int = 512, metrics=None, request_timeout: float | None = None,
                 batch_spec: bool = True, suffix: SuffixStores | None = None,
                 follow_ahead: bool = True, memory: ServingMemory | None = None,
                 memory_probe=None, probe_interval: float = 1.0):
        super().__init__(name="mlxspec-worker", daemon=True)
        self.engine = engine
        # earlier requests' text per scope, for the suffix source (this thread only)
        self.suffix = suffix if suffix is not None else SuffixStores()
        self.spec_max_concurrency = spec_max_concurrency
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics or Metrics()
        self.request_timeout = request_timeout  # seconds from submission; None: no limit
        self.draining = False  # shutting down: new jobs are refused
        self.ending: str | None = None  # set: every job ends at its next step with this reason
        self.inbox: queue.Queue[Job | None] = queue.Queue()
        self.cache = PromptCacheStore(cache_bytes, cache_entries)
        # set: a job opens only when its memory fits beside the open jobs' (`_may_open`)
        self.memory = memory
        # with a budget: every probe_interval s, the bytes memory runs short by (<= 0: none;
        # `memory.shortfall`); while it does the newest rows are paused (`_relieve`)
        self.memory_probe = memory_probe or (
            (lambda: shortfall(memory.limit)) if memory is not None else None)
        self.probe_interval = probe_interval
        self._probed = 0.0  # perf_counter time of the last probe
        self.short = False  # memory ran short: jobs open only where the probe shows room
        self.pauses = 0  # rows paused so far
        self.jobs: list[Job] = []
        # made on this thread (their proposers' arrays live there) from the engine's weights
        self.idle_slots: list[Engine] = []
        self.batch_spec = batch_spec  # requests share one batch where they can
        self.follow_ahead = follow_ahead  # answers cut by time decode on while idle
        self.spec_batch: BatchSpeculator | None = None
        self._stopping = False
        self.last_prompt: list[int] = []  # the most recent job's prompt ids (for tests, logs)
        self.tasks = 0  # jobs submitted
        # (sliding-window and recurrent models: each request on its own cache, `shareable`)
        self.batchable = engine.target.shareable(None)

    # -- handler side
    def submit(self, req: GenRequest, events=None) -> Job:
        """Queue a generation; its events go to `events` (anything with `put`) when given,
        else to a queue of its own (`job.events`)."""
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise ApiError(503, "the server is shutting down; retry shortly",
                           type="server_busy", code="shutting_down", retry_after=5)
        if self.inbox.qsize() + self.active() >= self.max_queue:
            self.metrics.rejected("queue_full")
            raise ApiError(503, f"the server is busy ({self.max_queue} requests queued or "
                                "running); retry shortly", type="server_busy",
                           code="queue_full", retry_after=1)
        job = Job(req) if events is None else Job(req, events=events)
        self._check_memory(job)
        self.tasks += 1
        job.task_id = self.tasks
        if self.request_timeout:
            job.deadline = job.submitted + self.request_timeout
        self.inbox.put(job)
        return job

    def idle(self) -> bool:
        return self.active() == 0 and self.inbox.qsize() == 0

    def end_all(self, reason: str = "shutdown") -> None:
        """End every job at its next step with its partial answer and this finish_reason;
        new jobs are refused."""
        self.draining = True
        self.ending = reason
        self.inbox.put(None)  # wakes the worker's wait

    def fail_all(self, message: str) -> None:
        """Another rank is lost (from any thread): every request ends with `message` (503),
        new ones are refused; nothing waits for the worker (it may be stuck in a collective)."""
        self.draining = True
        error = ApiError(503, message, code="rank_lost")
        jobs = list(self.jobs)
        while True:
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                jobs.append(job)
        for job in jobs:
            job.events.put(Failed(error))

    def _end_reason(self, job: Job) -> str | None:
        """Why this job must end now (its time is up, the server is stopping), or None."""
        if self.ending is not None:
            return self.ending
        if job.deadline is not None and time.perf_counter() > job.deadline:
            self.metrics.timed_out("request")
            return "timeout"
        return None

    def active(self) -> int:
        """Requests queued to the worker and not answered (looking ahead is not one)."""
        return sum(1 for job in self.jobs if not job.ahead)

    def start(self) -> None:
        super().start()
        # stopped before exit even without stop(): one killed inside MLX aborts the process
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        if self.is_alive():
            self.stop()
            self.join(timeout=10)

    def stop(self) -> None:
        self._stopping = True
        self.inbox.put(None)
        atexit.unregister(self._stop_at_exit)

    # -- the loop
    def run(self) -> None:
        # All MLX work runs here, on a stream of its own, destroyed before the thread ends
        # (or the process may abort at exit: "terminate called without an active exception").
        # The weights stay wired (Metal) while it runs, for every request alike.
        stream = mx.new_stream(mx.default_device())
        # with a memory budget MLX's allocator frees the buffers it keeps for reuse before the
        # process's MLX memory passes it
        previous = (mx.set_memory_limit(self.memory.limit - self.memory.margin)
                    if self.memory is not None else None)
        try:
            with mx.stream(stream), wired_limit(self.engine.model, [stream]):
                self._loop(stream)
        finally:
            mx.synchronize(stream)
            if previous is not None:
                mx.set_memory_limit(previous)
            if hasattr(mx, "clear_streams"):
                mx.clear_streams()

    def _loop(self, stream) -> None:
        while not self._stopping:
            try:
                self._admit(block=not self.jobs)
                # Every new job opens before any steps (a round's joiners prefill in one
                # forward); above spec_max_concurrency + max_batch a job waits to open.
                opened, blocked = sum(1 for j in self.jobs if j.opened), False
                for job in list(self.jobs):
                    if (not job.opened and self._live(job)
                            and opened < self.spec_max_concurrency + self.max_batch):
                        if blocked or not self._may_open(job):
                            # first come, first served: the jobs after it wait with it
                            blocked = job.waiting_for_memory = True
                            continue
                        opened += 1
                        self._guarded(job, self._open_job)
                self._step_all()
                self._relieve()
            except Exception:  # never let the worker die: fail the requests in flight
                log.error("worker error:\n%s", traceback.format_exc())
                for job in list(self.jobs):
                    job.cache = None  # state unknown: not kept
                    self._fail(job, ApiError(500, "internal error during generation"))
                self.spec_batch = None
        for job in list(self.jobs):
            self._close_engine_job(job)

    def _admit(self, block: bool) -> None:
        while True:
            try:
                job = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            if job is None:  # stop() or a wake-up: the loop looks again
                return
            block = False
            self._end_look_ahead()  # a request waits: what they decoded so far is kept
            if job.cancelled.is_set():
                self.metrics.cancelled()
                continue
            reason = self._end_reason(job)
            if reason is not None:  # its time ran out in the queue: an empty answer
                self._done(job, Done(reason, Usage(prompt_tokens=len(job.req.prompt))))
                continue
            self.last_prompt = job.req.prompt
            self.metrics.queue_seconds(time.perf_counter() - job.submitted)
            try:
                self._start_engine(job)
            except Exception as e:
                log.error("cannot start a generation:\n%s", traceback.format_exc())
                if job.slot is not None:  # (it joins the jobs last: it is not one)
                    self.idle_slots.append(job.slot)
                job.events.put(Failed(ApiError(500, f"cannot start: {type(e).__name__}: {e}")))

    # -- jobs (each on an engine slot)
    def _start_engine(self, job: Job) -> None:
        # a slot: the same weights, its own proposers, policies and prompt cache
        job.slot = self.idle_slots.pop() if self.idle_slots else self.engine.clone()
        self.jobs.append(job)

    # -- memory (`ServingMemory`: docs/SERVER.md, "Memory")
    def _check_memory(self, job: Job) -> None:
        """Refuse (400, with the numbers) a request that does not fit even alone."""
        m = self.memory
        if m is None:
            return
        shared = self._shares(job)
        need = m.alone(job.tokens, shared)
        if need <= m.room:
            return
        prompt = len(job.req.prompt)
        longest = m.longest_max_tokens(prompt, shared)
        self.metrics.rejected("memory")
        raise ApiError(
            400, f"this request needs about {need / GB:.2f} GB ({prompt} prompt tokens + "
                 f"max_tokens {job.req.max_tokens}: KV cache and prefill working set) but the "
                 f"server leaves {max(m.room, 0) / GB:.2f} GB for requests (its "
                 f"{m.limit / GB:.1f} GB limit, {m.source}, less {m.weights / GB:.2f} GB of "
                 f"weights and a {m.margin / GB:.2f} GB margin): "
                 + (f"max_tokens {longest} would fit" if longest >= 0 else
                    "its prompt alone does not fit"),
            param="max_tokens", code="exceeds_memory",
            extra={"memory": {"prompt_tokens": prompt, "max_tokens": job.req.max_tokens,
                              "needed_bytes": need, "available_bytes": max(m.room, 0),
                              "limit_bytes": m.limit, "longest_max_tokens": longest}})

    def _take_cache(self, job: Job) -> None:
        """The job takes the kept prompt cache sharing most of its prompt (once)."""
        if job.cache is None:
            job.cache = self.cache.take(job.prompt, job.req.cache_reuse)

    def _may_open(self, job: Job) -> bool:
        """Whether the job's memory fits beside the open jobs' (the prompt caches kept give
        theirs back first, least recently used out; its own taken first). A job that does not
        fit waits, and the jobs after it with it (first come, first served)."""
        if self.memory is None:
            return True
        self._take_cache(job)
        left = self.memory.room - self.reserved(job)
        self.cache.shrink(left)
        job.waiting_for_memory = self.cache.nbytes() > left or self._still_short(job)
        return not job.waiting_for_memory

    def reserved(self, joining: Job | None = None) -> int:
        """Bytes the open jobs (and `joining`) hold at their prompt + max_tokens
        (`ServingMemory.need`)."""
        jobs = [j for j in self.jobs if j.opened] + ([joining] if joining is not None else [])
        return self.memory.need([j.tokens for j in jobs if self._shares(j)],
                                [j.tokens for j in jobs if not self._shares(j)])

    def _shares(self, job: Job) -> bool:
        """Whether the job's row is (or will be) in the shared batch."""
        if job.opened:
            return job.batch is self.spec_batch
        return self.batchable and self.batch_spec and not job.req.warmup

    def waiting_for_memory(self) -> int:
        return sum(1 for j in list(self.jobs) if j.waiting_for_memory and not j.opened)

    def paused(self) -> int:
        """Jobs paused when memory ran short, waiting to resume."""
        return sum(1 for j in list(self.jobs) if j.paused)

    # -- memory running short anyway (another process took it): docs/SERVER.md, "Memory"
    def _relieve(self) -> None:
        """Every probe_interval s: where memory runs short, MLX's kept buffers go back first,
        then the newest row is paused (one a probe; never the last open one)."""
        if self.memory_probe is None or not self.jobs:
            return
        now = time.perf_counter()
        if now - self._probed < self.probe_interval:
            return
        self._probed = now
        if self.memory_probe() <= 0:
            return
        mx.clear_cache()
        if self.memory_probe() <= 0:
            return
        self._end_look_ahead()  # answered already: they go first
        open_ = [j for j in self.jobs if j.opened]
        pausable = [j for j in open_ if self._pausable(j)]
        if len(open_) > 1 and pausable:
            self._pause(max(pausable, key=lambda j: j.task_id))

    def _pausable(self, job: Job) -> bool:
        """Whether the job's row can be paused and recomputed to the same answer: a request
        (not a warm-up, not answered already), decoding or prefilling, all its output read,
        and no grammar (its matcher's state is not carried)."""
        row = job.row
        return (not job.ahead and not job.req.warmup and row.live and row.error is None
                and not row.outputs and row.detok is not None
                and getattr(row.sampling.state, "constraint", None) is None)

    def _pause(self, job: Job) -> None:
        """Close the job's row, its cache dropped (memory is short), and put it back at the
        head of the waiting jobs with the tokens it generated: it reopens on its prompt + them
        for the rest of max_tokens (its seeded draws by position unchanged) and its text goes
        on from its detokenizer's state (a character or a stop string split at the pause)."""
        row = job.row
        job.generated = list(row.context[len(job.req.prompt):])
        job.detok, job.pauses = row.detok, job.pauses + 1
        self.pauses += 1
        try:
            job.batch.close(row)
        except Exception:
            log.error("pausing a generation failed:\n%s", traceback.format_exc())
        if job.cache is not None:
            job.cache.drop()
        # (it keeps its engine slot: it is still a job)
        job.cache, job.row, job.batch, job.mode, job.slot_id = None, None, None, None, None
        self.jobs.remove(job)  # before the jobs waiting to open
        at = next((i for i, j in enumerate(self.jobs) if not j.opened), len(self.jobs))
        self.jobs.insert(at, job)
        job.waiting_for_memory = self.short = True
        mx.clear_cache()
        self.metrics.paused()
        log.warning("memory runs short: request %d paused after %d tokens (requeued)",
                    job.task_id, len(job.generated))

    def _still_short(self, job: Job) -> bool:
        """Memory ran short: a job opens only where the probe shows room for it alone, or
        where nothing else is open."""
        if not self.short:
            return False
        if (any(j.opened for j in self.jobs)
                and self.memory_probe() + self.memory.alone(job.tokens, self._shares(job)) > 0):
            return True
        self.short = False
        return False

    def _open_job(self, job: Job) -> None:
        """Open the job as a row, speculating unless spec_max_concurrency requests do (a
        paused one: on its prompt + what it generated, for the rest of max_tokens)."""
        r = job.req
        prompt, resumed = job.prompt, len(job.generated)
        self._take_cache(job)
        over = (self.batchable and not r.warmup
                and self.speculating() >= self.spec_max_concurrency)
        job.mode = "none" if over else r.mode or job.slot.mode
        used = {j.slot_id for j in self.jobs if j.slot_id is not None}
        job.slot_id = next(i for i in range(len(used) + 1) if i not in used)
        job.opened_at = time.perf_counter()
        self._bind_suffix(job)
        kwargs = dict(max_tokens=1 if r.warmup else r.max_tokens - resumed,
                      temperature=r.temperature,
                      top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, seed=r.seed, stop=r.stop,
                      prediction=r.prediction, num_draft=r.num_draft, prompt_cache=job.cache,
                      mode=job.mode, prefill_chunk=self.prefill_chunk,
                      cache_reuse=r.cache_reuse, **r.engine_options())
        if r.return_progress and not resumed:
            # the last prompt token is always processed (the first step feeds it)
            job.prompt_cached = min(self._cached(job), len(r.prompt) - 1)
            self._progress(job, job.prompt_cached)

            def progress(done: int, todo: int) -> None:  # a prompt prefilled at open
                self._progress(job, len(r.prompt) - 1 - todo + done)

            kwargs["progress"] = progress
        # (a seeded request draws the same tokens in the shared batch as alone: by position)
        if ((self.batch_spec or over) and not r.warmup
                and job.slot.accepts(kwargs["mode"])):
            if self.spec_batch is None:
                self.spec_batch = BatchSpeculator(self.engine.model, BatchPolicy(self.engine.cost))
            job.batch, job.row = self.spec_batch, job.slot.join(self.spec_batch, prompt,
                                                                 **kwargs)
        else:  # a batch of one on its own cache, of any kind (a sharded one: on every rank)
            job.batch, job.row = job.slot.open(prompt, **kwargs)
        if job.detok is not None:  # resumed: its text goes on where it paused
            job.detok.stats, job.row.detok = job.row.stats, job.detok
            job.base, job.stats = resumed, None  # (its stats count from here)

    def speculating(self) -> int:
        """Open jobs decoding in a speculative mode (what --spec-max-concurrency bounds)."""
        return sum(1 for j in self.jobs if j.mode not in (None, "none"))

    def over_limit(self, job: Job) -> bool:
        """Whether the job decodes plainly because --spec-max-concurrency requests speculate."""
        return job.mode == "none" != (job.req.mode or self.engine.mode)

    def _live(self, job: Job) -> bool:
        """Whether the job goes on; a cancelled or ended one is closed or finished here."""
        if job.ahead:  # answered: ends quietly with the server or its request's time
            if self.ending is not None or (job.deadline is not None
                                           and time.perf_counter() > job.deadline):
                self._close_engine_job(job)
                return False
            return True
        if job.cancelled.is_set():
            self.metrics.cancelled()
            self._close_engine_job(job)
            return False
        reason = self._end_reason(job)
        if reason is not None:  # the partial answer, its cache kept
            self._finish_engine(job, reason, job.stats)
            return False
        return True

    def _guarded(self, job: Job, work):
        """work(job), or None where it raised and the job failed."""
        try:
            return work(job)
        except MlxspecError as e:
            if getattr(e, "fatal", False):  # --distributed: a rank was lost; the process ends
                job.cache = None
                self._fail(job, ApiError(503, str(e), code="rank_lost"))
            else:
                self._fail(job, ApiError(400, str(e)))
        except Exception as e:
            log.error("generation failed:\n%s", traceback.format_exc())
            job.cache = None  # possibly half-updated: not kept
            self._fail(job, ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
        return None

    def _step_all(self) -> None:
        """One step of every batch (the shared one: one target forward for all its rows),
        then each job's new text to its request."""
        if any(not job.ahead for job in self.jobs):  # requests running: they go first
            self._end_look_ahead()
        live = [job for job in list(self.jobs) if job.opened and self._live(job)]
        produced = {}
        for batch in {id(job.batch): job.batch for job in live}.values():
            try:
                produced.update(batch.step())
            except Exception as e:  # its rows fail (their `output` raises), not other batches'
                log.error("a step failed:\n%s", traceback.format_exc())
                batch.fail(e)
        for job in live:
            self._emit(job, produced)

    # -- llama.cpp's prompt_progress
    @staticmethod
    def _cached(job: Job) -> int:
        """The prompt tokens its prompt cache holds already (the common prefix)."""
        held = job.cache.tokens if job.cache is not None and job.cache.cache is not None else []
        n = 0
        for a, b in zip(held, job.req.prompt):
            if a != b:
                break
            n += 1
        return n

    def _progress(self, job: Job, processed: int) -> None:
        """A `prompt_progress` event, once per new count of processed prompt tokens."""
        if processed <= job.reported:
            return
        job.reported = processed
        job.events.put(Progress(len(job.req.prompt), job.prompt_cached, processed,
                                1000 * (time.perf_counter() - job.opened_at)))

    def _emit(self, job: Job, produced: dict) -> None:
        if job.ahead:
            self._look_ahead_step(job, produced)
            return
        out = self._guarded(job, lambda j: j.row.output(produced))
        if out is None:
            if job.req.return_progress and job.row is not None and job.row.pc is not None:
                # a long prompt prefilled a chunk a step: what its cache holds so far
                self._progress(job, len(job.row.pc.tokens))
            return
        job.stats = out.stats
        if job.req.warmup:  # prefilled and cached; the token is not wanted
            self._finish_engine(job, "length", out.stats, drop_output=True)
            return
        if not job.first_token:
            job.first_token = time.perf_counter()
            if job.req.return_progress:  # the whole prompt is processed
                self._progress(job, len(job.req.prompt))
        text, cut = job.cut(out.text)
        if text or out.tokens:
            job.text_so_far += text
            timings = (Usage.from_stats(out.stats).timings() if job.req.timings_per_token
                       else None)
            job.events.put(Delta(text, len(out.tokens), list(out.tokens), timings,
                                 out.logprobs, out.sources))
        if cut:  # n_indent: llama.cpp reports it as a limit
            self._finish_engine(job, "length", out.stats)
        elif out.finish_reason:
            self._finish_engine(job, out.finish_reason, out.stats, stop_string=out.stop_string)
        elif self._over_time(job):
            if self._looks_ahead(job):
                self._answer(job, "length", out.stats)
                job.ahead = True
            else:
                self._finish_engine(job, "length", out.stats)

    def _over_time(self, job: Job) -> bool:
        """llama.cpp's t_max_predict_ms: stop once over time and a newline was generated."""
        t = job.req.t_max_predict_ms
        return bool(t) and job.first_token > 0 and "\n" in job.text_so_far and (
            time.perf_counter() - job.first_token) * 1000 > t

    # -- looking ahead for an editor's follow-up
    def _looks_ahead(self, job: Job) -> bool:
        """Whether a job cut by t_max_predict_ms decodes on after its answer. An editor shows
        the cut answer and asks next for the text after it (llama.vim's speculative
        follow-up, and again each time the user accepts one): decoded while the editor reads,
        it is in the scope's store, and the follow-up's suffix source proposes it whole."""
        r = job.req
        return (self.follow_ahead and r.use_suffix and r.suffix_scope is not None
                and job.row.proposer is not None and len(job.row.context) + 1 < job.row.end)

    def _look_ahead_step(self, job: Job, produced: dict) -> None:
        try:
            out = job.row.output(produced)
        except Exception:  # answered already: nothing to tell, its cache not kept
            log.warning("looking ahead failed:\n%s", traceback.format_exc())
            job.cache = None
            self._close_engine_job(job)
            return
        if out is None:
            return
        self.metrics.looked_ahead(len(out.tokens))
        if out.finish_reason:
            self._close_engine_job(job)

    def _end_look_ahead(self) -> None:
        """Close the rows decoding ahead (a request waits or runs): their text goes into the
        store, their caches back to the prompt cache store."""
        for job in [j for j in self.jobs if j.ahead]:
            self._close_engine_job(job)

    def _bind_suffix(self, job: Job) -> None:
        """The store of the request's scope for its suffix source (none: opted out)."""
        try:
            proposer = job.slot.proposer_of(job.mode)
        except Exception:  # the engine reports a bad mode itself
            return
        if hasattr(proposer, "set_store"):
            r = job.req
            use = r.use_suffix and r.suffix_scope is not None
            proposer.set_store(self.suffix.get(r.suffix_scope) if use else None)

    def _close_engine_job(self, job: Job) -> None:
        try:
            if job.row is not None:
                job.batch.close(job.row)  # the cache holds every committed token but the last
        except Exception:
            log.error("closing a generation failed:\n%s", traceback.format_exc())
            job.cache = None
        if job.opened and job.slot is not None:
            try:  # the proposer put the prompt and answer into the scope's store
                r = job.req
                if (job.row.proposer is None and r.use_suffix  # no proposer kept it
                        and r.suffix_scope is not None):
                    self.suffix.get(r.suffix_scope).add(job.row.context)
                self.suffix.evict_to_budget()
            except Exception:
                log.error("keeping a request's text failed:\n%s", traceback.format_exc())
        if job in self.jobs:
            self.jobs.remove(job)
        self.cache.put(job.cache)
        if job.slot is not None:
            self.idle_slots.append(job.slot)
            job.slot = None

    def _finish_engine(self, job: Job, finish: str, stats: Stats | None,
                       drop_output: bool = False, stop_string: str = "") -> None:
        self._close_engine_job(job)
        self._answer(job, finish, stats, drop_output, stop_string)

    def _answer(self, job: Job, finish: str, stats: Stats | None, drop_output: bool = False,
                stop_string: str = "") -> None:
        """The request's last event (its row may decode on: `_looks_ahead`)."""
        stats = stats or job.stats or Stats(prompt_tokens=len(job.req.prompt))
        usage = Usage.from_stats(stats)
        if job.pauses:  # paused (and resumed): its own prompt, and every token generated
            usage.prompt_tokens = len(job.req.prompt)
            usage.cached_tokens = min(usage.cached_tokens, usage.prompt_tokens)
            usage.generated_tokens += job.base
        usage.batched = self.over_limit(job)  # decoded plainly, over --spec-max-concurrency
        usage.batched_speculative = job.batch is self.spec_batch and not usage.batched
        pc = job.cache
        usage.context_tokens = (len(pc.tokens) if pc is not None and pc.cache is not None
                                and job not in self.jobs
                                else len(job.req.prompt) + max(0, usage.generated_tokens - 1))
        if drop_output:
            usage.completion_tokens = 0
        self._done(job, Done(finish, usage, stopping_word=stop_string))

    def _fail(self, job: Job, error: ApiError) -> None:
        if job in self.jobs:
            self._close_engine_job(job)
        job.events.put(Failed(error))
        self.metrics.failed()

    def _done(self, job: Job, done: Done) -> None:
        self.metrics.generation(done.usage)  # counted before the client can see the answer
        job.events.put(done)

