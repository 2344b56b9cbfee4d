"""`mlxspec serve` under a memory limit it cannot exceed: a burst of long requests that together
need more than the limit leaves for requests, then each request alone, compared token for token
(docs/SERVER.md, "Memory").

    python bench/bench_memory.py --limit 3.4GB                     # a cgroup of 3.4 GB
    python bench/bench_memory.py --limit 3.4GB --no-cgroup         # --memory-limit instead
    python bench/bench_memory.py --limit 3.4GB --requests 8 --max-tokens 64 \\
        --chars 3000:5000 --model qwen2.5-coder-0.5b

The server runs as a subprocess of this checkout (`python -m mlxspec.cli.main serve`, the
coder 0.5B by default, --serve-args for more). With a cgroup (Linux, as root: v1's
`memory.limit_in_bytes` or v2's `memory.max` on a group made for the run, swap off) the kernel
kills it if it goes over; without one it is given `--memory-limit` and its peak resident memory
(VmHWM) is checked against the limit. The prompts are third-party code from `site-packages`
(one file per package, cut to lengths spread over --chars), sent as llama.cpp `/completion`
streams (T = 0, the token ids in each chunk) all at once, then again one at a time. Reported:
the requests, what they reserve together by the server's rule against what the limit leaves
for requests, the limit, the peak (the cgroup's `memory.max_usage_in_bytes` / `memory.peak`, the server's VmHWM), the kernel's
refusals (failcnt), the longest wait for memory (from /slots, sampled every 0.5 s), rows paused,
whether the server survived, every request answered, and every answer identical to the same
request alone. Exits 1 when one is not.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path

from bench_http import ROOT, free_port

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def size(text: str) -> int:
    m = re.fullmatch(r"([\d.]+)\s*([kmgt]?)i?b?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(m[1]) * 1000 ** " kmgt".index(m[2] or " "))


def prompts(n: int, low: int, high: int) -> list[tuple[str, str]]:
    """(file, text) of n third-party source files from site-packages, one per package (the
    largest of each, packages in name order), cut to lengths from low to high characters."""
    site = Path(sysconfig.get_paths()["purelib"])
    skip = {"mlx", "mlx_lm", "mlxspec", "pip", "setuptools", "_pytest", "pytest"}
    found = []
    for pkg in sorted(p for p in site.iterdir() if p.is_dir() and p.name.isidentifier()):
        if pkg.name in skip:
            continue
        files = [f for f in pkg.rglob("*.py") if f.stat().st_size >= high]
        if files:
            best = max(files, key=lambda f: (f.stat().st_size, str(f)))
            found.append(best)
        if len(found) == n:
            break
    if len(found) < n:
        raise SystemExit(f"only {len(found)} packages with a file of {high} characters")
    out = []
    for i, f in enumerate(found):
        chars = low + (high - low) * i // max(n - 1, 1)
        out.append((str(f.relative_to(site)), f.read_text(errors="replace")[:chars]))
    return out


class Group:
    """A memory cgroup made for the run (v1, else v2); None where this machine allows none."""

    def __init__(self, name: str, limit: int):
        self.dir = None
        for root, files in ((V1, ("memory.limit_in_bytes",)), (V2, ("memory.max",
                                                                    "memory.swap.max"))):
            if not (root / ("memory.limit_in_bytes" if root == V1 else "cgroup.controllers")
                    ).exists():
                continue
            d = root / name
            try:
                d.mkdir(exist_ok=True)
                (d / files[0]).write_text(str(limit))
                if len(files) > 1:
                    (d / files[1]).write_text("0")
            except OSError as e:
                print(f"no cgroup at {d}: {e}", file=sys.stderr)
                continue
            self.dir, self.v1 = d, root == V1
            return

    def join(self) -> None:  # (in the child, before exec)
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def read(self, name: str) -> int | None:
        try:
            return int((self.dir / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def peak(self) -> int | None:
        return self.read("memory.max_usage_in_bytes" if self.v1 else "memory.peak")

    def failcnt(self) -> int | None:
        if self.v1:
            return self.read("memory.failcnt")
        try:
            events = (self.dir / "memory.events").read_text()
            return int(re.search(r"^oom_kill (\d+)", events, re.M)[1])
        except (OSError, TypeError):
            return None

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.2)


def get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def ask(url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streamed llama.cpp /completion at T = 0: its tokens, text, times."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    out = {"tokens": [], "text": "", "status": None, "first": None, "error": None}
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        conn.request("POST", "/completion", json.dumps({
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = resp.read().decode()[:500]
            return out
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("tokens") and out["first"] is None:
                out["first"] = time.perf_counter() - start
            out["tokens"] += event.get("tokens") or []
            out["text"] += event.get("content") or ""
            if event.get("stop"):
                out["prompt_tokens"] = event.get("tokens_evaluated")
                out["stop_type"] = event.get("stop_type")
        conn.close()
    except Exception as e:  # a reset, a timeout: reported
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - start
    return out


def need(tokens: list[int], model: str) -> int | None:
    """What the server's budget counts for these requests running together
    (`memory.ServingMemory.need`, from the model's shape), None where its shape is unknown."""
    sys.path.insert(0, str(ROOT))
    from mlxspec import memory

    found = memory.info_for(model)
    if found is None:
        return None
    m = memory.ServingMemory(0, "", 0, (found[0],), 4, 512)  # (the CPU computes in float32)
    return m.need(tokens, [])


def status_of(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=size, default=size("3.4GB"))
    ap.add_argument("--no-cgroup", action="store_true", help="--memory-limit, no cgroup")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chars", default="3000:5000", help="LOW:HIGH prompt characters")
    ap.add_argument("--timeout", type=float, default=3600, help="client timeout, s")
    ap.add_argument("--serve-args", default="", help="more `mlxspec serve` arguments")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    low, high = (int(x) for x in args.chars.split(":"))
    work = prompts(args.requests, low, high)

    group = None if args.no_cgroup else Group(f"mlxspec-bench-{os.getpid()}", args.limit)
    if group is not None and group.dir is None:
        group = None
    # (no prompt caches kept: each request alone is computed afresh, not from the burst's)
    cmd = [sys.executable, "-m", "mlxspec.cli.main", "serve", "--model", args.model,
           "--port", str(port := free_port()), "--prompt-cache-size", "0",
           *args.serve_args.split()]
    if group is None:
        cmd += ["--memory-limit", str(args.limit)]
    print(("cgroup " + str(group.dir)) if group else "--memory-limit", " ".join(cmd),
          file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=group.join if group else None)
    log: list[str] = []
    listening = threading.Event()

    def drain():
        for line in proc.stderr:
            log.append(line)
            print("  server: " + line.rstrip(), file=sys.stderr)
            if "listening on" in line:
                listening.set()

    threading.Thread(target=drain, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    result: dict = {"limit": args.limit, "cgroup": str(group.dir) if group else None,
                    "model": args.model, "requests": args.requests,
                    "max_tokens": args.max_tokens, "files": [f for f, _ in work]}
    try:
        while not listening.wait(0.5):
            if proc.poll() is not None:
                raise SystemExit("the server did not start:\n" + "".join(log[-20:]))
        result["startup"] = next((ln.strip() for ln in log if "memory: limit" in ln), "")
        # what the server leaves for requests: the limit less what it reserves idle
        idle = get(url, "/metrics")
        room = args.limit - int(float(re.search(r"^mlxspec_memory_reserved_bytes (\S+)", idle,
                                                re.M)[1]))

        # sampled every 0.5 s: who waits for memory, the server's memory
        waited: dict[int, float] = {}
        most = {"waiting": 0, "paused": 0, "rss": 0}
        sampling = threading.Event()
        t0 = time.perf_counter()

        def sample():
            while not sampling.is_set():
                try:
                    for s in get(url, "/slots"):
                        if s.get("waiting_for") == "memory":
                            waited[s["id_task"]] = time.perf_counter() - t0
                    text = get(url, "/metrics")
                    for key, name in (("waiting", "mlxspec_requests_waiting_for_memory"),
                                      ("paused", "mlxspec_requests_paused_for_memory")):
                        g = re.search(rf"^{name} ([\d.]+)", text, re.M)
                        most[key] = max(most[key], float(g[1]) if g else 0)
                except Exception:
                    pass
                most["rss"] = max(most["rss"], status_of(proc.pid, "VmRSS") or 0)
                sampling.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        burst: list[dict] = [{} for _ in work]
        threads = [threading.Thread(target=lambda i=i: burst.__setitem__(
            i, ask(url, work[i][1], args.max_tokens, args.timeout))) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        burst_seconds = time.perf_counter() - t0
        sampling.set()
        sampler.join()
        metrics = get(url, "/metrics") if proc.poll() is None else ""
        paused = re.search(r"^mlxspec_paused_generations_total (\d+)", metrics, re.M)
        print(f"burst done in {burst_seconds:.0f} s", file=sys.stderr)

        alone = []
        for _, prompt in work:
            alone.append(ask(url, prompt, args.max_tokens, args.timeout))
            print(f"alone {len(alone)}: {alone[-1]['seconds']:.0f} s", file=sys.stderr)
        alive = proc.poll() is None
        prompt_tokens = [b.get("prompt_tokens") or a.get("prompt_tokens")
                         for b, a in zip(burst, alone)]
        answered = [b["status"] == 200 and not b["error"] for b in burst]
        identical = [b["tokens"] == a["tokens"] and b["text"] == a["text"] and bool(b["tokens"])
                     for b, a in zip(burst, alone)]
        together = need([(p or 0) + args.max_tokens for p in prompt_tokens], args.model)
        result.update({
            "prompt_tokens": prompt_tokens, "room": room, "need_together": together,
            "need_over_room": round(together / room, 2) if together and room > 0 else None,
            "burst_seconds": round(burst_seconds, 1),
            "burst_latency_s": [round(b.get("seconds", 0), 1) for b in burst],
            "burst_first_token_s": [round(b["first"], 1) if b.get("first") else None
                                    for b in burst],
            "alone_latency_s": [round(a.get("seconds", 0), 1) for a in alone],
            "longest_wait_s": round(max(waited.values(), default=0.0), 1),
            "most_waiting": most["waiting"], "most_paused": most["paused"],
            "paused_total": int(paused[1]) if paused else None,
            "cgroup_peak": group.peak() if group else None,
            "cgroup_failcnt": group.failcnt() if group else None,
            "rss_peak": status_of(proc.pid, "VmHWM") or most["rss"],
            "server_alive": alive, "answered": sum(answered), "identical": sum(identical),
            "errors": [b["error"] for b in burst if b["error"]] + [
                a["error"] for a in alone if a["error"]],
            "tokens_generated": [len(b["tokens"]) for b in burst],
        })
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        if group is not None:
            result.setdefault("cgroup_peak", group.peak())
            result.setdefault("cgroup_failcnt", group.failcnt())
            group.remove()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    peak = result.get("cgroup_peak") or result.get("rss_peak") or 0
    ok = (result.get("server_alive") and result.get("answered") == args.requests
          and result.get("identical") == args.requests and peak <= args.limit)
    print(f"{args.requests} requests ({min(p or 0 for p in result['prompt_tokens'])}-"
          f"{max(p or 0 for p in result['prompt_tokens'])} prompt tokens, max_tokens "
          f"{args.max_tokens}; together {result.get('need_over_room')}x what the limit leaves "
          f"for requests), "
          f"limit {args.limit / 1e9:.2f} GB: peak {peak / 1e9:.2f} GB, longest wait "
          f"{result.get('longest_wait_s')} s, {result.get('answered')} answered, "
          f"{result.get('identical')} identical alone, paused {result.get('paused_total')}, "
          f"server {'alive' if result.get('server_alive') else 'LOST'}"
          if "prompt_tokens" in result else "incomplete", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
