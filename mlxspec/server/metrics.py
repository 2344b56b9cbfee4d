"""Counters for `GET /metrics`, in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections import defaultdict

from .answers import Usage

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.sum:.6f}", f"{name}_count{lab} {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)
        self.queue_wait = Histogram()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.generations: dict[str, int] = defaultdict(int)
        self.drafted: dict[str, int] = defaultdict(int)
        self.accepted: dict[str, int] = defaultdict(int)
        self.prediction_accepted = 0
        self.prediction_rejected = 0
        self.forwards: dict[str, int] = defaultdict(int)
        self.batched = 0
        self.batched_speculative = 0
        self.disconnects = 0
        self.cancels = 0
        self.failures = 0
        self.rejections: dict[str, int] = defaultdict(int)  # 503s by reason
        self.timeouts: dict[str, int] = defaultdict(int)  # by kind: request, read, write
        self.ahead_tokens = 0  # decoded past a t_max_predict_ms cut, for follow-ups
        self.pauses = 0  # rows paused when memory ran short (requeued with their tokens)

    # -- recording (handlers and the worker)
    def request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1
            if seconds is not None and status < 400:
                self.latency[endpoint].observe(seconds)

    def generation(self, u: Usage) -> None:
        with self.lock:
            self.generations[u.mode] += 1
            self.prompt_tokens += u.prompt_tokens
            self.cached_tokens += u.cached_tokens
            self.generated_tokens += u.completion_tokens
            self.drafted[u.mode] += u.drafted
            self.accepted[u.mode] += u.accepted
            self.forwards[u.mode] += u.target_forwards
            accepted, rejected = u.prediction_counts
            self.prediction_accepted += accepted
            self.prediction_rejected += rejected
            self.batched += u.batched
            self.batched_speculative += u.batched_speculative

    def queue_seconds(self, seconds: float) -> None:
        with self.lock:
            self.queue_wait.observe(seconds)

    def disconnected(self) -> None:
        with self.lock:
            self.disconnects += 1

    def cancelled(self) -> None:
        with self.lock:
            self.cancels += 1

    def rejected(self, reason: str) -> None:
        with self.lock:
            self.rejections[reason] += 1

    def timed_out(self, kind: str) -> None:
        with self.lock:
            self.timeouts[kind] += 1

    def looked_ahead(self, tokens: int) -> None:
        with self.lock:
            self.ahead_tokens += tokens

    def paused(self) -> None:
        with self.lock:
            self.pauses += 1

    def failed(self) -> None:
        with self.lock:
            self.failures += 1

    # -- exposition
    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        with self.lock:
            metric("mlxspec_requests_total", "counter", "HTTP requests by endpoint and status.",
                   [f'mlxspec_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())])
            metric("mlxspec_generations_total", "counter",
                   "Finished generations by speculation mode.",
                   [f'mlxspec_generations_total{{mode="{m}"}} {n}'
                    for m, n in sorted(self.generations.items())])
            metric("mlxspec_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"mlxspec_prompt_tokens_total {self.prompt_tokens}"])
            metric("mlxspec_prompt_cached_tokens_total", "counter",
                   "Prompt tokens reused from the prompt cache (not prefilled again).",
                   [f"mlxspec_prompt_cached_tokens_total {self.cached_tokens}"])
            metric("mlxspec_generated_tokens_total", "counter", "Generated tokens.",
                   [f"mlxspec_generated_tokens_total {self.generated_tokens}"])
            metric("mlxspec_drafted_tokens_total", "counter", "Proposed (drafted) tokens by mode.",
                   [f'mlxspec_drafted_tokens_total{{mode="{m}"}} {n}'
                    for m, n in sorted(self.drafted.items())])
            metric("mlxspec_accepted_tokens_total", "counter", "Accepted draft tokens by mode.",
                   [f'mlxspec_accepted_tokens_total{{mode="{m}"}} {n}'
                    for m, n in sorted(self.accepted.items())])
            metric("mlxspec_target_forwards_total", "counter", "Target model forwards by mode.",
                   [f'mlxspec_target_forwards_total{{mode="{m}"}} {n}'
                    for m, n in sorted(self.forwards.items())])
            metric("mlxspec_prediction_tokens_total", "counter",
                   "Predicted-output tokens accepted or rejected.",
                   [f'mlxspec_prediction_tokens_total{{result="accepted"}} {self.prediction_accepted}',
                    f'mlxspec_prediction_tokens_total{{result="rejected"}} {self.prediction_rejected}'])
            metric("mlxspec_batched_generations_total", "counter",
                   "Generations run by batched plain decoding (above --spec-max-concurrency).",
                   [f"mlxspec_batched_generations_total {self.batched}"])
            metric("mlxspec_batched_speculative_generations_total", "counter",
                   "Generations verified in the batched speculative step (one target forward "
                   "for every such request).",
                   [f"mlxspec_batched_speculative_generations_total {self.batched_speculative}"])
            metric("mlxspec_client_disconnects_total", "counter",
                   "Requests whose client went away before the answer was complete.",
                   [f"mlxspec_client_disconnects_total {self.disconnects}"])
            metric("mlxspec_follow_ahead_tokens_total", "counter",
                   "Tokens decoded past an answer cut by t_max_predict_ms while the server was "
                   "idle, kept for the follow-up's proposals.",
                   [f"mlxspec_follow_ahead_tokens_total {self.ahead_tokens}"])
            metric("mlxspec_paused_generations_total", "counter",
                   "Rows paused when memory ran short (requeued with their tokens, resumed "
                   "where they stopped).", [f"mlxspec_paused_generations_total {self.pauses}"])
            metric("mlxspec_failed_generations_total", "counter", "Generations that failed.",
                   [f"mlxspec_failed_generations_total {self.failures}"])
            metric("mlxspec_rejected_requests_total", "counter",
                   "Requests answered 503 by reason (queue_full, connections, shutting_down).",
                   [f'mlxspec_rejected_requests_total{{reason="{r}"}} {self.rejections[r]}'
                    for r in sorted({"queue_full", "connections", "shutting_down",
                                     *self.rejections})])
            metric("mlxspec_timeouts_total", "counter",
                   "Timeouts by kind: request (--request-timeout ended a generation), read (a "
                   "client too slow sending its request), write (a client not reading its "
                   "answer).",
                   [f'mlxspec_timeouts_total{{kind="{k}"}} {self.timeouts[k]}'
                    for k in sorted({"request", "read", "write", *self.timeouts})])
            lat = []
            for e, h in sorted(self.latency.items()):
                lat += h.lines("mlxspec_request_duration_seconds", f'endpoint="{e}"')
            metric("mlxspec_request_duration_seconds", "histogram",
                   "Time from request to last byte of successful generation requests.", lat)
            metric("mlxspec_queue_wait_seconds", "histogram",
                   "Time a request waited before the worker took it.",
                   self.queue_wait.lines("mlxspec_queue_wait_seconds"))
        for name, (help_, value) in gauges.items():
            metric(name, "gauge", help_, [f"{name} {value}"])
        return "\n".join(out) + "\n"


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


def memory_gauges(memory, worker) -> dict:
    """The memory budget's gauges (`memory.ServingMemory`; none without one)."""
    if memory is None:
        return {}
    return {
        "mlxspec_requests_waiting_for_memory": (
            "Requests waiting to start until their memory fits.", worker.waiting_for_memory()),
        "mlxspec_requests_paused_for_memory": (
            "Requests paused when memory ran short, waiting to resume where they stopped.",
            worker.paused()),
        "mlxspec_memory_limit_bytes": ("The memory limit requests are admitted under.",
                                       memory.limit),
        "mlxspec_memory_reserved_bytes": (
            "Weights, margin, and what open requests and kept prompt caches reserve.",
            memory.limit - memory.room + worker.reserved() + worker.cache.nbytes()),
    }
