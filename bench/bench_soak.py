"""`mlxspec serve` under load and abuse: a burst of simultaneous connections, and a soak of
mixed traffic for a given time (issue 13). Run through bench_server.py:

    python bench/bench_server.py --burst 256               # N connections at once
    python bench/bench_server.py --soak 10                 # 10 minutes of mixed traffic
    python bench/bench_server.py --soak 10 --url http://127.0.0.1:8080   # a running server

Without --url a server is started as a subprocess (`mlxspec serve`, the bundled model, or
--model), so that its resident memory is its own. The client is asyncio over raw sockets: every
connection is accounted for (answered with a status, reset, refused, or timed out), nothing is
retried. Mixed traffic: completions, FIM (/infill and `suffix`), chat with predicted outputs,
streams read to the end, streams dropped after the first chunk, clients that stall mid-stream,
and malformed bodies, from `--concurrency` clients in a closed loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict

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
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


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
        writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (path.encode(), len(body), body))
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


async def burst(url: str, n: int, max_tokens: int = 8) -> dict:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0}).encode()
    start = time.perf_counter()
    results = await asyncio.gather(*[http(host, int(port), "/v1/completions", body)
                                     for _ in range(n)])
    wall = time.perf_counter() - start
    statuses = Counter(s for s, _ in results)
    retry_after = sum(1 for s, p in results if s == 503 and b"Retry-After:" in p)
    texts = {json.loads(p.partition(b"\r\n\r\n")[2])["choices"][0]["text"]
             for s, p in results if s == 200}
    return {"connections": n, "statuses": dict(statuses), "503_with_retry_after": retry_after,
            "distinct_200_answers": len(texts), "wall_s": wall}


def soak_request(rng: random.Random, max_tokens: int) -> tuple[str, str, bytes, str]:
    """(kind, path, body, read) for one request of the mix."""
    kind = rng.choices(["completion", "fim", "infill", "chat_prediction", "stream",
                        "stream_drop", "stream_stall", "malformed"],
                       weights=[20, 10, 10, 10, 20, 10, 3, 17])[0]
    prompt = rng.choice(PROMPTS)
    if kind == "completion":
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return kind, "/v1/completions", json.dumps(body).encode(), "all"
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


def classify(kind: str, status) -> str:
    """'ok', or the kind of error."""
    if isinstance(status, str):
        return status if not (kind == "stream_stall" and status == "closed_early") else "ok"
    if kind == "malformed":
        return "ok" if 400 <= status < 500 else f"http_{status}"
    if status == 200:
        return "ok"
    return "busy_503" if status == 503 else f"http_{status}"


async def soak(url: str, seconds: float, concurrency: int, max_tokens: int, seed: int = 0,
               pid: int | None = None) -> dict:
    host, port = url.removeprefix("http://").split(":")
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
            status, payload = await http(host, int(port), path, body, read=read)
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

    def pct(v, q):
        return statistics.quantiles(v, n=100)[q - 1] if len(v) >= 2 else float("nan")

    return {
        "seconds": wall, "concurrency": concurrency, "requests": sum(outcomes.values()),
        "ok": outcomes["ok"], "errors": dict(errors), "error_examples": examples,
        "p50_s": pct(every, 50), "p99_s": pct(every, 99),
        "by_kind": {k: {"n": len(v), "p50_s": pct(v, 50), "p99_s": pct(v, 99)}
                    for k, v in sorted(latencies.items())},
        "rss_start_mb": rss0 / 1024 if rss0 else None,
        "rss_end_mb": rss_kb(pid) / 1024 if pid else None,
        "rss_samples_mb": [(t, kb / 1024) for t, kb in samples],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "serve", "--port", str(port), *extra]
    if model:
        cmd += ["-m", model]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        if "listening on" in line:
            break
    else:
        raise RuntimeError("the server did not start")
    proc.log = []  # the server's stderr from here on (read, so that the pipe never fills)

    def drain():
        for line in proc.stderr:
            proc.log.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


def run(args) -> int:
    proc = None
    url = args.url
    if url is None:
        extra = ["--write-timeout", "2", *(args.serve_args.split() if args.serve_args else [])]
        proc, url = start_server(args.model, extra)
    out: dict = {"url": url, "command": " ".join(sys.argv)}
    try:
        # warm-up (compiles, allocates): not counted
        host, port = url.removeprefix("http://").rsplit(":", 1)
        asyncio.run(http(host, int(port), "/v1/completions",
                         json.dumps({"prompt": PROMPTS[0], "max_tokens": 4}).encode()))
        if args.burst:
            out["burst"] = asyncio.run(burst(url, args.burst))
            b = out["burst"]
            print(f"burst of {b['connections']} connections: {b['statuses']} "
                  f"({b['503_with_retry_after']} 503s with Retry-After), "
                  f"{b['distinct_200_answers']} distinct answer(s), {b['wall_s']:.1f} s",
                  file=sys.stderr)
        if args.soak:
            m0 = metrics(url)
            out["soak"] = s = asyncio.run(soak(url, args.soak * 60, args.concurrency,
                                               args.max_tokens, pid=proc.pid if proc else None))
            m1 = metrics(url)
            s["server_metrics_end"] = {k: v for k, v in m1.items() if any(
                k.startswith(p) for p in ("mlxspec_prompt_cache", "mlxspec_requests_queued",
                                          "mlxspec_connections", "mlxspec_rejected",
                                          "mlxspec_timeouts", "mlxspec_client_disconnects",
                                          "mlxspec_failed"))}
            s["server_5xx"] = sum(v - m0.get(k, 0) for k, v in m1.items()
                                  if k.startswith("mlxspec_requests_total") and 'code="5' in k
                                  and 'code="503"' not in k)
            print(f"soak {s['seconds'] / 60:.1f} min, {s['concurrency']} clients: "
                  f"{s['requests']} requests, {s['ok']} ok, p50 {s['p50_s']:.3f} s, "
                  f"p99 {s['p99_s']:.3f} s, errors {s['errors']}, server 5xx {s['server_5xx']}, "
                  f"RSS {s['rss_start_mb']} -> {s['rss_end_mb']} MB", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            out["exit_code"] = proc.wait(timeout=60)
            time.sleep(0.5)
            out["server_log_tail"] = proc.log[-40:]
            if any("Traceback" in line for line in proc.log):
                print("".join(proc.log[-80:]), file=sys.stderr)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    bad = out.get("burst", {}).get("statuses", {})
    failed = any(not isinstance(k, int) for k in bad) or (
        "soak" in out and (out["soak"]["server_5xx"] or any(
            not k.endswith(("busy_503",)) for k in out["soak"]["errors"])))
    return 1 if failed or out.get("exit_code", 0) != 0 else 0
