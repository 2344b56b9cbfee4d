"""`mlxspec serve` under load and abuse: a burst of simultaneous connections, a soak of mixed
traffic for a given time, and slow clients (restored from commit 3f5b1fb, where bench_server.py
ran it; docs/SERVER.md "Reliability, measured" has the figures and commands of that time).

    python bench/bench_soak.py --burst 256                  # N connections at once
    python bench/bench_soak.py --burst 1024 --soak 10       # docs/SERVER.md's 10-minute run
    python bench/bench_soak.py --slow 16                    # slowloris and a stalled body
    python bench/bench_soak.py --checkout /tmp/old --burst 256   # another checkout
    python bench/bench_soak.py --soak 10 --url http://127.0.0.1:8080     # a running server

Without --url a server is started as a subprocess from --checkout (default: this one; its
`mlxspec serve`, the bundled model or --model, `--write-timeout 2` and --serve-args), so that
its resident memory is its own and is sampled. The client is asyncio over raw sockets on
loopback: every connection is accounted for (answered with a status, reset, refused, or timed
out), nothing is retried.

- burst: N connections at once, each posting an 8-token greedy completion; statuses, 503s with
  Retry-After, resets, timeouts, distinct answers, wall time.
- soak: --concurrency clients in a closed loop, one connection per request, mixed traffic:
  completions, FIM (`suffix` and /infill), chat with predicted outputs, streams read to the
  end, streams dropped after the first chunk, clients that stall mid-stream, malformed bodies;
  p50/p99 latency (overall and per kind), errors by kind, 5xx, server RSS over time.
- slow: N connections send headers a byte at a time (slowloris) and one sends half its body,
  while a normal completion is sent every few seconds: its latency, and when (and how) the
  server closed each slow connection (it should by its --read-timeout, 30 s by default).
Exits 1 on a reset, timeout, error other than 503 or 5xx, a failed normal request or a slow
connection still open after --slow-wait.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import statistics
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from bench_http import ROOT, serve

BURST_TOKENS = 8  # as in 3f5b1fb
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\ndef list_files(path):\n    ",
    "class Cache:\n    def __init__(self, size):\n        ",
    "def parse_size(text):\n    m = re.fullmatch(",
]
CHAT = [{"role": "user", "content": "Rename x to total:\ndef f(x):\n    return x + 1\n"}]
PREDICTION = "def f(total):\n    return total + 1\n"
MALFORMED = [b"{", b"[]", b'{"prompt": 5}', b'{"max_tokens": -3, "prompt": "x"}',
             b'{"prompt": "x", "temperature": NaN}', b"\xff\xfe", b'{"messages": "hi"}',
             b'{"prompt": "x", "stop": [1, 2]}', b'{"prompt": "\\ud800"}',
             b"[" * 5000 + b"]" * 5000]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus counters ({} if it has no /metrics)."""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def deltas(m0: dict[str, float], m1: dict[str, float], prefix: str) -> dict[str, float]:
    """How much the counters starting with `prefix` grew between two /metrics reads."""
    return {k: v - m0.get(k, 0) for k, v in m1.items()
            if k.startswith(prefix) and v != m0.get(k, 0)}


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


def body_of(response: bytes) -> bytes:
    """The body of a whole HTTP/1.1 response, de-chunked if need be."""
    head, _, body = response.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return body
    out = b""
    while body:
        size, _, body = body.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, body = out + body[:n], body[n + 2:]
    return out


def completion(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()


def request_bytes(path: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


async def http(host: str, port: int, path: str, body: bytes, *, read: str = "all",
               timeout: float = 120.0) -> tuple[int | str, bytes]:
    """One request on its own connection. read: 'all', 'first' (drop after the first
    chunk), 'stall' (read the headers, then stop reading and hold the connection)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (ConnectionRefusedError, ConnectionResetError):
        return "refused", b""
    except (asyncio.TimeoutError, OSError):
        return "connect_timeout", b""
    try:
        writer.write(request_bytes(path, body))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split()[1])
        if read == "first":
            await asyncio.wait_for(reader.readuntil(b"\n\n"), timeout)
            return status, head
        if read == "stall":
            await asyncio.sleep(5.0)  # not reading: the server's --write-timeout decides
            return status, head
        payload = await asyncio.wait_for(reader.read(), timeout)
        return status, head + payload
    except ConnectionResetError:
        return "reset", b""
    except asyncio.TimeoutError:
        return "timeout", b""
    except asyncio.IncompleteReadError:
        return "closed_early", b""
    except OSError as e:
        return f"oserror:{e.errno}", b""
    finally:
        writer.close()


async def burst(url: str, n: int, timeout: float) -> dict:
    """N connections at once, each posting a completion."""
    host, port = host_port(url)
    body = completion(PROMPTS[0], BURST_TOKENS)
    start = time.perf_counter()
    results = await asyncio.gather(*[http(host, port, "/v1/completions", body, timeout=timeout)
                                     for _ in range(n)])
    wall = time.perf_counter() - start
    statuses = Counter(s for s, _ in results)
    retry_after = sum(1 for s, p in results if s == 503 and b"\r\nretry-after:" in p.lower())
    texts = {json.loads(body_of(p))["choices"][0]["text"] for s, p in results if s == 200}
    return {"connections": n, "statuses": dict(statuses), "ok_200": statuses[200],
            "busy_503": statuses[503], "503_with_retry_after": retry_after,
            "reset": statuses["reset"], "timeout": statuses["timeout"],
            "distinct_200_answers": len(texts), "wall_s": wall}


def soak_request(rng: random.Random, max_tokens: int) -> tuple[str, str, bytes, str]:
    """(kind, path, body, read) for one request of the mix."""
    kind = rng.choices(["completion", "fim", "infill", "chat_prediction", "stream",
                        "stream_drop", "stream_stall", "malformed"],
                       weights=[20, 10, 10, 10, 20, 10, 3, 17])[0]
    prompt = rng.choice(PROMPTS)
    if kind == "completion":
        return kind, "/v1/completions", completion(prompt, max_tokens), "all"
    if kind == "fim":
        body = {"prompt": prompt, "suffix": "\n    return result\n", "max_tokens": max_tokens}
        return kind, "/v1/completions", json.dumps(body).encode(), "all"
    if kind == "infill":
        body = {"input_prefix": prompt, "input_suffix": "\n", "prompt": "", "n_predict": max_tokens,
                "n_indent": 4, "input_extra": [{"filename": "a.py", "text": rng.choice(PROMPTS)}]}
        return kind, "/infill", json.dumps(body).encode(), "all"
    if kind == "chat_prediction":
        body = {"messages": CHAT, "prediction": {"type": "content", "content": PREDICTION},
                "max_tokens": max_tokens}
        return kind, "/v1/chat/completions", json.dumps(body).encode(), "all"
    if kind.startswith("stream"):
        body = {"prompt": prompt, "max_tokens": max_tokens * (8 if kind != "stream" else 1),
                "stream": True}
        read = {"stream": "all", "stream_drop": "first", "stream_stall": "stall"}[kind]
        return kind, "/v1/completions", json.dumps(body).encode(), read
    return kind, rng.choice(["/v1/completions", "/v1/chat/completions"]), \
        rng.choice(MALFORMED), "all"


def classify(kind: str, status: int | str) -> str:
    """'ok', or the kind of error."""
    if isinstance(status, str):
        return status if not (kind == "stream_stall" and status == "closed_early") else "ok"
    if kind == "malformed":
        return "ok" if 400 <= status < 500 else f"http_{status}"
    if status == 200:
        return "ok"
    return "busy_503" if status == 503 else f"http_{status}"


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else float("nan")


async def soak(url: str, seconds: float, concurrency: int, max_tokens: int, seed: int = 0,
               pid: int | None = None) -> dict:
    """`concurrency` clients of mixed traffic in a closed loop for `seconds`."""
    host, port = host_port(url)
    rng = random.Random(seed)
    latencies: dict[str, list[float]] = defaultdict(list)
    outcomes: Counter = Counter()
    errors: Counter = Counter()
    end = time.monotonic() + seconds
    samples = []
    examples: list = []
    rss0 = rss_kb(pid) if pid else None

    async def client():
        while time.monotonic() < end:
            kind, path, body, read = soak_request(rng, max_tokens)
            t = time.perf_counter()
            status, payload = await http(host, port, path, body, read=read)
            outcome = classify(kind, status)
            if outcome != "ok" and len(examples) < 20:
                examples.append((kind, path, body[:200].decode("utf-8", "replace"), str(status),
                                 payload[-300:].decode("utf-8", "replace")))
            outcomes[outcome] += 1
            if outcome == "ok":
                latencies[kind].append(time.perf_counter() - t)
            else:
                errors[f"{kind}:{outcome}"] += 1

    async def sampler():
        while time.monotonic() < end:
            await asyncio.sleep(min(30.0, max(1.0, seconds / 20)))
            if pid:
                samples.append((round(seconds - (end - time.monotonic())), rss_kb(pid)))

    start = time.perf_counter()
    await asyncio.gather(sampler(), *[client() for _ in range(concurrency)])
    wall = time.perf_counter() - start
    every = [t for v in latencies.values() for t in v]
    return {
        "seconds": wall, "concurrency": concurrency, "requests": sum(outcomes.values()),
        "ok": outcomes["ok"], "errors": dict(errors), "error_examples": examples,
        "client_5xx": sum(n for k, n in errors.items() if ":http_5" in k),
        "p50_s": pct(every, 50), "p99_s": pct(every, 99),
        "by_kind": {k: {"n": len(v), "p50_s": pct(v, 50), "p99_s": pct(v, 99)}
                    for k, v in sorted(latencies.items())},
        "rss_start_mb": rss0 / 1024 if rss0 else None,
        "rss_end_mb": rss_kb(pid) / 1024 if pid else None,
        "rss_samples_mb": [(t, kb / 1024) for t, kb in samples],
    }


async def slow_connection(host: str, port: int, stalled_body: bool, wait: float,
                          dribble: float) -> tuple[float | None, str]:
    """Headers a byte every `dribble` s (or a body that stops half way), until the server
    closes the connection: (seconds until then, what it answered), or (None, 'open')."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), wait)
    body = completion(PROMPTS[0], BURST_TOKENS)
    request = request_bytes("/v1/completions", body)

    async def feed():
        if stalled_body:
            writer.write(request[:len(request) - len(body) // 2])
            return
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for byte in itertools.cycle(b"X-Slow: 1\r\n"):
            await asyncio.sleep(dribble)
            writer.write(bytes([byte]))
            await writer.drain()

    feeding = asyncio.create_task(feed())
    try:
        answer = await asyncio.wait_for(reader.read(), wait)  # until the server closes
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else None
        return time.perf_counter() - t0, f"http_{status}" if status else "closed"
    except asyncio.TimeoutError:
        return None, "open"
    except OSError:
        return time.perf_counter() - t0, "reset"
    finally:
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
        writer.close()


async def slow(url: str, n: int, wait: float, dribble: float, every: float,
               timeout: float) -> dict:
    """N slowloris connections and a stalled body; a normal request every `every` s meanwhile."""
    host, port = host_port(url)
    slow_ones = [asyncio.create_task(slow_connection(host, port, i == n, wait, dribble))
                 for i in range(n + 1)]
    normal: list[tuple[float, int | str, float]] = []  # (sent at, status, latency)
    t0 = time.perf_counter()
    while not all(task.done() for task in slow_ones):
        await asyncio.sleep(min(1.0, every))
        if normal and time.perf_counter() - t0 < normal[-1][0] + every:
            continue
        t = time.perf_counter()
        status, _ = await http(host, port, "/v1/completions", completion(PROMPTS[1], 8),
                               timeout=timeout)
        normal.append((t - t0, status, time.perf_counter() - t))
    closed = [await task for task in slow_ones]
    times = [s for s, _ in closed if s is not None]
    latencies = [lat for _, _, lat in normal]
    return {"slow_connections": n, "stalled_bodies": 1,
            "slowloris_closed": dict(Counter(how for _, how in closed[:n])),
            "stalled_body_closed": closed[n][1], "stalled_body_closed_s": closed[n][0],
            "closed_s_min": min(times, default=None), "closed_s_max": max(times, default=None),
            "still_open": sum(s is None for s, _ in closed),
            "normal_requests": [{"at_s": at, "status": s, "latency_s": lat}
                                for at, s, lat in normal],
            "normal_first_s": latencies[0] if latencies else None,
            "normal_max_s": max(latencies, default=None),
            "normal_failed": sum(s != 200 for _, s, _ in normal)}


def summarise(out: dict) -> None:
    """One line per check on stderr."""
    if b := out.get("burst"):
        print(f"burst of {b['connections']}: {b['statuses']} ({b['503_with_retry_after']} 503s "
              f"with Retry-After; server: {b['server_rejected']}), {b['distinct_200_answers']} "
              f"distinct answer(s), {b['wall_s']:.1f} s", file=sys.stderr)
    if s := out.get("soak"):
        print(f"soak {s['seconds'] / 60:.1f} min, {s['concurrency']} clients: {s['requests']} "
              f"requests, {s['ok']} ok, p50 {s['p50_s']:.3f} s, p99 {s['p99_s']:.3f} s, errors "
              f"{s['errors']}, 5xx {s['client_5xx']} (server: {s['server_5xx']}), "
              f"RSS {s['rss_start_mb']} -> {s['rss_end_mb']} MB", file=sys.stderr)
    if w := out.get("slow"):
        print(f"slow {w['slow_connections']} + 1 stalled body: slowloris {w['slowloris_closed']}, "
              f"stalled body {w['stalled_body_closed']} at {w['stalled_body_closed_s']} s, closed "
              f"{w['closed_s_min']}-{w['closed_s_max']} s, {w['still_open']} still open; "
              f"normal requests {len(w['normal_requests'])}, first {w['normal_first_s']} s, "
              f"max {w['normal_max_s']} s, {w['normal_failed']} failed", file=sys.stderr)


def failed(out: dict) -> bool:
    burst_bad = any(not isinstance(k, int) for k in out.get("burst", {}).get("statuses", {}))
    soak_bad = "soak" in out and bool(out["soak"]["client_5xx"] or out["soak"]["server_5xx"] or any(
        not k.endswith("busy_503") for k in out["soak"]["errors"]))
    slow_bad = "slow" in out and bool(out["slow"]["normal_failed"] or out["slow"]["still_open"])
    return burst_bad or soak_bad or slow_bad or out.get("exit_code", 0) != 0


def checks(url: str, args, pid: int | None) -> dict:
    """Warm up, then the checks asked for, in order: burst, slow, soak."""
    out: dict = {}
    host, port = host_port(url)
    asyncio.run(http(host, port, "/v1/completions", completion(PROMPTS[0], 4)))  # not counted
    if args.burst:
        m0 = metrics(url)
        out["burst"] = asyncio.run(burst(url, args.burst, args.timeout))
        out["burst"]["server_rejected"] = deltas(m0, metrics(url), "mlxspec_rejected")
    if args.slow:
        out["slow"] = asyncio.run(slow(url, args.slow, args.slow_wait, args.dribble,
                                       args.normal_every, args.timeout))
    if args.soak:
        m0 = metrics(url)
        out["soak"] = s = asyncio.run(soak(url, args.soak * 60, args.concurrency,
                                           args.max_tokens, pid=pid))
        m1 = metrics(url)
        s["server_metrics_end"] = {k: v for k, v in m1.items() if k.startswith((
            "mlxspec_prompt_cache", "mlxspec_requests_queued", "mlxspec_connections",
            "mlxspec_rejected", "mlxspec_timeouts", "mlxspec_client_disconnects",
            "mlxspec_failed"))}
        s["server_5xx"] = sum(v for k, v in deltas(m0, m1, "mlxspec_requests_total").items()
                              if 'code="5' in k and 'code="503"' not in k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--checkout", type=Path, default=ROOT,
                    help="the checkout whose server to start (default: this one)")
    ap.add_argument("-m", "--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--serve-args", default="", help="more `mlxspec serve` options")
    ap.add_argument("--burst", type=int, default=0, help="N simultaneous connections")
    ap.add_argument("--soak", type=float, default=0, help="minutes of mixed traffic")
    ap.add_argument("--concurrency", type=int, default=16, help="soak clients")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per soak answer")
    ap.add_argument("--slow", type=int, default=0, help="N slowloris connections")
    ap.add_argument("--slow-wait", type=float, default=60.0,
                    help="seconds to wait for the server to close the slow connections")
    ap.add_argument("--dribble", type=float, default=0.5, help="seconds between slow bytes")
    ap.add_argument("--normal-every", type=float, default=5.0,
                    help="seconds between normal requests during --slow")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any read may wait")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if not (args.burst or args.soak or args.slow):
        ap.error("give --burst, --soak and/or --slow")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a burst's sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.burst + 256)), hard))
    out: dict = {"command": " ".join(sys.argv)}
    if args.url:
        out |= {"url": args.url, **checks(args.url, args, None)}
    else:
        serve_args = ["--write-timeout", "2", *args.serve_args.split()]
        serve_args += ["-m", args.model] if args.model else []
        with serve(args.checkout, serve_args) as (proc, url, log):
            out |= {"url": url, "checkout": str(args.checkout), **checks(url, args, proc.pid)}
        out["exit_code"] = proc.returncode
        out["server_log_tail"] = log[-40:]
        if any("Traceback" in line for line in log):
            print("".join(log[-80:]), file=sys.stderr)
    summarise(out)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if failed(out) else 0


if __name__ == "__main__":
    sys.exit(main())
