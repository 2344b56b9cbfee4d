"""Per-request overhead of `mlxspec serve`, one checkout's server against another's.

Each checkout's server runs as a subprocess (`python -m mlxspec.cli.main serve`, cwd and
PYTHONPATH set to the checkout, so that its code is what runs, whatever is installed) on the
bundled model (or --model), on a free loopback port, a fresh server per run. Per run:

- round trip: a 1-token greedy `/v1/completions`, N requests one after another on one
  keep-alive `http.client` connection, after a warm-up; p50 and p95; then the same with a new
  connection per request. The client sets TCP_NODELAY (http.client writes a request's
  headers and body apart, and without it the body waits for the server's delayed ACK, about
  40 ms: that would be measured instead of the server);
- time to first token: a `stream: true` completion on a new connection, from sending it to the
  first `data:` line carrying text (connecting is included); p50 and p95 over N requests;
- concurrent streams: C client threads in a closed loop, each sending R greedy streamed
  completions of T tokens; generated tokens (the usage chunk's) per second of wall time.

Runs alternate between checkouts (old, new, then new, old, ...; --rounds), and the Markdown table
gives each metric's median over the rounds per checkout and the ratio new / old (< 1 is faster
for times, > 1 for tok/s). The client shares the machine with the server: on a busy machine use
several rounds and read the spread in the JSON.

    python bench/bench_http.py --old /tmp/old                 # this checkout against old
    python bench/bench_http.py --old /tmp/old --new /tmp/old   # the noise
    python bench/bench_http.py --only /tmp/old --json base.json        # one checkout
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):\n    ", "import os\n\ndef list_files(path):\n    ",
           "class Cache:\n    def __init__(self, size):\n        ",
           "def parse_size(text):\n    m = re.fullmatch("]
METRICS = [  # key, label, unit
    ("rt_p50_ms", "round trip p50", "ms"), ("rt_p95_ms", "round trip p95", "ms"),
    ("rt_new_conn_p50_ms", "round trip, new connection p50", "ms"),
    ("rt_new_conn_p95_ms", "round trip, new connection p95", "ms"),
    ("ttft_p50_ms", "first token p50", "ms"), ("ttft_p95_ms", "first token p95", "ms"),
    ("streams_tok_s", "concurrent streams", "tok/s")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that makes `python` import mlxspec from `checkout`, checked."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    where = subprocess.run([sys.executable, "-c", "import mlxspec; print(mlxspec.__file__)"],
                           env=env, cwd=checkout, capture_output=True, text=True, timeout=120,
                           check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"with PYTHONPATH={checkout}, mlxspec is {where}")
    return env


@contextlib.contextmanager
def serve(checkout: Path, serve_args: list[str], startup_timeout: float = 300.0):
    """Run `mlxspec serve` from `checkout`; yield (process, url, its stderr lines so far)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, cwd=checkout, env=checkout_env(checkout), text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    log: list[str] = []
    listening = threading.Event()

    def drain():  # read the whole stderr, so that the pipe never fills
        for line in proc.stderr:
            log.append(line)
            if "listening on" in line:
                listening.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not listening.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {''.join(log[-20:])}")
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def completion(prompt: str, max_tokens: int, **extra) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **extra}).encode()


def post(conn: http.client.HTTPConnection, body: bytes) -> http.client.HTTPResponse:
    if conn.sock is None:  # http.client writes headers and body apart: without TCP_NODELAY
        conn.connect()     # the body waits for the server's delayed ACK (~40 ms)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    return resp


def events(resp: http.client.HTTPResponse):
    """The JSON payloads of a server-sent event stream, up to `[DONE]`."""
    for line in resp:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def round_trips(port: int, n: int, warmup: int, timeout: float, keep_alive: bool) -> dict:
    """1-token completions one after another, on one keep-alive connection or each on its own."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = completion(PROMPTS[0], 1)
    times, reconnects = [], 0
    key = "rt" if keep_alive else "rt_new_conn"
    try:
        for i in range(warmup + n):
            if not keep_alive:
                conn.close()
            elif i and conn.sock is None:  # the server closed the connection after an answer
                reconnects += 1
            t = time.perf_counter()
            post(conn, body).read()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    finally:
        conn.close()
    out = {f"{key}_p50_ms": 1e3 * pct(times, 50), f"{key}_p95_ms": 1e3 * pct(times, 95)}
    return out | ({"rt_reconnects": reconnects} if keep_alive else {})


def first_tokens(port: int, n: int, warmup: int, timeout: float) -> dict:
    """Streamed completions, each on a new connection, timed to the first text."""
    body = completion(PROMPTS[1], 4, stream=True)
    times = []
    for i in range(warmup + n):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            t = time.perf_counter()
            stream = events(post(conn, body))
            if not any(c["choices"] and c["choices"][0]["text"] for c in stream):
                raise RuntimeError("a stream without text")
            if i >= warmup:
                times.append(time.perf_counter() - t)
            for _ in stream:  # the rest, untimed
                pass
        finally:
            conn.close()
    return {"ttft_p50_ms": 1e3 * pct(times, 50), "ttft_p95_ms": 1e3 * pct(times, 95)}


def concurrent_streams(port: int, clients: int, requests: int, max_tokens: int,
                       mode: str, timeout: float) -> dict:
    """Aggregate generated tok/s of `clients` threads streaming in a closed loop."""
    spec = {} if mode == "server" else {"speculative": {"mode": mode}}
    tokens = [0] * clients
    failures: list[BaseException] = []
    start = threading.Barrier(clients + 1)

    def client(i: int):
        body = completion(PROMPTS[i % len(PROMPTS)], max_tokens, stream=True,
                          stream_options={"include_usage": True}, **spec)
        start.wait(timeout)
        try:
            for _ in range(requests):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                try:
                    for chunk in events(post(conn, body)):
                        if chunk.get("usage"):
                            tokens[i] += chunk["usage"]["completion_tokens"]
                finally:
                    conn.close()
        except Exception as e:  # reported below, in the main thread
            failures.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait(timeout)
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout * requests)
    wall = time.perf_counter() - t0
    if failures or any(t.is_alive() for t in threads):
        raise RuntimeError(f"concurrent streams failed: {failures[:3]}")
    return {"streams_tok_s": sum(tokens) / wall, "streams_tokens": sum(tokens),
            "streams_wall_s": wall}


def run_once(checkout: Path, args) -> dict:
    """Start `checkout`'s server, measure every metric on it, stop it."""
    serve_args = ["--mode", args.mode, "--max-batch", str(args.clients)]
    if args.model:
        serve_args += ["-m", args.model]
    with serve(checkout, serve_args) as (_, url, _):
        port = int(url.rsplit(":", 1)[1])
        out = {"checkout": str(checkout)}
        out.update(round_trips(port, args.n, args.warmup, args.timeout, keep_alive=True))
        out.update(round_trips(port, args.n, args.warmup, args.timeout, keep_alive=False))
        out.update(first_tokens(port, args.n, args.warmup, args.timeout))
        out.update(concurrent_streams(port, args.clients, args.requests, args.max_tokens,
                                      args.stream_mode, args.timeout))
    return out


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: per metric, each checkout's median over its runs (range), and new / old."""
    names = list(runs)
    ratio = names == ["old", "new"]
    head = ["metric", *(f"{n}: median (range) of {len(runs[n])}" for n in names)]
    lines = ["| " + " | ".join(head + ["new / old"] * ratio) + " |",
             "|---" * (len(head) + ratio) + "|"]
    for key, label, unit in METRICS:
        values = {n: [r[key] for r in runs[n]] for n in names}
        med = {n: statistics.median(v) for n, v in values.items()}
        cells = [f"{label} ({unit})",
                 *(f"{med[n]:.2f} ({min(values[n]):.2f}-{max(values[n]):.2f})" for n in names)]
        if ratio:
            cells.append(f"{med['new'] / med['old']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=Path, default=ROOT, help="checkout (default: this one)")
    ap.add_argument("--old", type=Path, default=None, help="the checkout to compare against")
    ap.add_argument("--only", type=Path, default=None, help="measure this checkout alone")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds; odd ones run old then new, even ones new then old")
    ap.add_argument("-n", type=int, default=200, help="requests per latency metric")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests before those")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=16, help="streamed requests per client")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed request")
    ap.add_argument("--mode", default="none", help="the server's --mode")
    ap.add_argument("--stream-mode", default="none",
                    help='"speculative" mode the concurrent streams ask for ("server": none sent)')
    ap.add_argument("-m", "--model", default=None, help="model (default: the bundled one)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any read may wait")
    ap.add_argument("--json", default=None, help="also write every run here")
    args = ap.parse_args()
    if args.only:
        checkouts = {"only": args.only}
    elif args.old:
        checkouts = {"old": args.old, "new": args.new}
    else:
        ap.error("give --old PATH (to compare with --new) or --only PATH")
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for r in range(args.rounds):
        for name in list(checkouts)[:: 1 if r % 2 == 0 else -1]:
            result = run_once(checkouts[name], args)
            runs[name].append(result)
            print(f"round {r + 1} {name}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float)),
                file=sys.stderr, flush=True)
    print("\n".join(f"- {name}: {path}" for name, path in checkouts.items()))
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
