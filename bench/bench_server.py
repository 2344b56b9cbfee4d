"""The server at 1/4/8 clients (a change must keep its speed): `mlxspec serve`'s aggregate tokens/s
and mean latency against the number of concurrent clients, each configuration against plain
batched decoding; run it on both checkouts, in both orders.

    python bench/bench_server.py                       # the bundled pair (else a random model)
    python bench/bench_server.py --clients 1,2,4,8,16,32 --modes ngram,draft \
        --workloads grounded,free --configs default,spec,plain --repeat 2
    python bench/bench_server.py --no-http ...            # the worker alone, no HTTP threads

Its `workload` and `free_workload` are also the prompts of bench_versions.py (in both
checkouts) and bench_plain_batch.py. The load and abuse runs (`--burst`, `--soak`) were
bench_soak.py, since removed: run them from commit 3f5b1fb (docs/SERVER.md has the figures).

For each configuration a real server runs in this process on a free loopback port, and N client
threads each send R `/v1/completions` requests one after another (closed loop), each asking
for the speculation mode under test (`"speculative": {"mode": ...}`). Configurations:

- `spec`    every request speculative (`--spec-max-concurrency 1000 --batch-spec`): one batched
            speculative step for all active requests (`mlxspec/batch_step.py`: each proposes its
            own k, one target forward verifies every row);
- `spec-rr` every request speculative, one target forward each, round robin;
- `plain`   every request plain decoding in the batched step (k = 0, `--spec-max-concurrency
            0`): one forward per step for all active requests (continuous batching);
- `hybrid`  speculative up to two active requests, one forward each (round robin), batched
            plain decoding above (the server's default until the batched step was measured);
- `bspec8`  batched speculation up to 8 active requests, batched plain decoding above;
- `default` the server's defaults (whatever `mlxspec serve` does without options).

Workloads: `grounded` (what editors send, greedy: each prompt is a held-out function followed
by its first lines again, so the answer continues text found in the prompt), `free`
(`mlxspec bench`'s free-text starts, sampled at temperature 1, unseeded: the rejection rule,
what a client that sends no seed gets) and `retry` (greedy: each client sends a held-out
function's first lines, then the same request again, as an editor re-requesting a completion:
the second answer is in the suffix store, not in the prompt). A mode `MODE:no-suffix` sends
`"speculative": {"suffix": false}` (no proposals from earlier requests). The suffix store and
the prompt caches are cleared before every run, so that no cell feeds another.
Prints, per workload and mode, a Markdown table of tok/s and mean latency per configuration
and each one's ratio to `plain` (tok/s up, latency down: > 1 means it beats plain batching),
pooled over the sweeps and, in brackets, the median of the per-sweep ratios (steadier on a
shared machine; configurations run in reversed order every other sweep); JSON with --json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlxspec  # noqa: E402  (OpenBLAS before mlx.core)
from mlxspec.server.app import make_server  # noqa: E402


def _server_defaults() -> tuple[int, bool]:
    import inspect

    from mlxspec.server.worker import Worker

    params = inspect.signature(Worker.__init__).parameters
    return params["spec_max_concurrency"].default, params["batch_spec"].default


# name: (--spec-max-concurrency, batched speculative step)
CONFIGS = {"spec": (1000, True), "spec-rr": (1000, False), "plain": (0, True),
           "hybrid": (2, False), "bspec8": (8, True), "default": _server_defaults()}


def workload(n: int, max_chars: int = 1200) -> list[str]:
    """Input-grounded prompts: a function, then its first lines again (to be continued)."""
    sources: list[str] = []
    try:
        from mlxspec.recipe.heldout import heldout_functions

        sources = [src for _, _, src in heldout_functions(n=4 * n)]
    except Exception:
        pass
    if len(sources) < n:  # no standard library sources: the project's own code
        for p in sorted((ROOT / "mlxspec").rglob("*.py")):
            text = p.read_text()
            for block in text.split("\n\n\n"):
                if block.lstrip().startswith("def ") and 200 < len(block) < max_chars:
                    sources.append(block.strip() + "\n")
    prompts = []
    for src in sources:
        src = src[:max_chars]
        lines = src.splitlines(keepends=True)
        head = "".join(lines[: max(1, len(lines) // 4)])
        prompts.append(f"# original\n{src}\n\n# copy\n{head}")
        if len(prompts) == n:
            break
    return prompts


def free_workload(n: int) -> list[str]:
    """`mlxspec bench`'s free-text starts (sampled at temperature 1)."""
    from mlxspec.bench.workloads import build_workload

    return [item.prompt for item in build_workload("free", n)]


def random_model_dir() -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_model, save_model_dir, train_tiny_tokenizer

    d = Path(tempfile.mkdtemp(prefix="mlxspec-bench-")) / "random"
    model, cfg = build_model("qwen2", seed=3, layers=4, hidden=256, heads=8, kv_heads=4,
                             vocab=1024, scale=4.0, max_pos=4096)
    cfg["eos_token_id"] = 0
    save_model_dir(model, cfg, d)
    train_tiny_tokenizer(d, vocab=1024)
    return d


def spec_field(mode: str) -> dict:
    """The request's "speculative" field for a bench mode (`MODE:no-suffix`: suffix off)."""
    name, _, flag = mode.partition(":")
    return {"mode": name, "suffix": False} if flag == "no-suffix" else {"mode": name}


def one_request(url: str, prompt: str, max_tokens: int, mode: str | None = None,
                temperature: float = 0.0, seed: int | None = None) -> tuple[float, dict]:
    host, port = url.removeprefix("http://").split(":")
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:  # (a seeded sampled request draws by position: the keyed rule)
        request["seed"] = seed
    if mode:
        request["speculative"] = spec_field(mode)
    body = json.dumps(request)
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return time.perf_counter() - start, data["usage"]


def worker_request(srv, prompt: str, max_tokens: int, mode: str | None = None,
                   temperature: float = 0.0, seed: int | None = None) -> tuple[float, dict]:
    """`one_request` without HTTP: the request goes to the server's worker directly, as its
    handler would queue it (--no-http: the worker's own figures, without the handler threads'
    share of 2 cores)."""
    from mlxspec.server.protocol import GenRequest
    from mlxspec.server.worker import Done, Failed

    ids = srv.engine.encode(prompt)
    start = time.perf_counter()
    spec = spec_field(mode) if mode else {}
    job = srv.worker.submit(GenRequest("completions", ids, max_tokens, temperature=temperature,
                                       seed=seed, mode=spec.get("mode"),
                                       use_suffix=spec.get("suffix", True),
                                       suffix_scope="bench"))  # (a handler sets the client's)
    while True:
        event = job.events.get()
        if isinstance(event, Done):
            return time.perf_counter() - start, event.usage.openai()
        if isinstance(event, Failed):
            raise RuntimeError(f"HTTP {event.error.status}: {event.error}")


def run_config(srv, config: tuple[int, bool], clients: int, requests: int, prompts: list[str],
               max_tokens: int, mode: str | None = None, temperature: float = 0.0,
               http: bool = True) -> dict:
    # One server (one worker thread) for all runs; the policy threshold is set per run.
    srv.worker.spec_max_concurrency, srv.worker.batch_spec = config
    send = one_request if http else worker_request
    target = srv.url if http else srv
    send(target, prompts[-1], 4, mode)  # warm-up (compiles, allocates)
    # No run starts from another's prompt caches or stored answers (the same prompts recur
    # across cells: a store kept between them would copy earlier cells' answers).
    srv.worker.cache.clear()
    srv.worker.suffix.scopes.clear()
    latencies, usages, errors = [], [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            i = c * requests + r
            try:
                t, u = send(target, prompts[i % len(prompts)], max_tokens, mode, temperature)
            except Exception as e:  # reported, not hidden
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                latencies.append(t)
                usages.append(u)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    batch = srv.worker.spec_batch
    steps = batch.steps if batch is not None else 0
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    # the batched step's target forwards (the worker's batch; a new one counts from 0)
    now = srv.worker.spec_batch
    forwards = 0 if now is None else now.steps - (steps if now is batch else 0)
    return {
        "clients": clients, "latencies": latencies, "errors": errors, "wall_s": wall,
        "forwards": forwards,
        "tokens": sum(u["completion_tokens"] for u in usages),
        "drafted": sum(u["speculative"]["drafted_tokens"] for u in usages),
        "accepted": sum(u["speculative"]["accepted_tokens"] for u in usages),
        "batched": sum(u["speculative"]["batched"] for u in usages),
    }


def merge(runs: list[dict]) -> dict:
    """Several repeats of one cell: mean latency over all requests, tokens over total wall."""
    lat = [t for r in runs for t in r["latencies"]]
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
    forwards = sum(r["forwards"] for r in runs)
    return {
        "clients": runs[0]["clients"], "requests": len(lat),
        "errors": [e for r in runs for e in r["errors"]],
        "mean_latency_s": statistics.mean(lat) if lat else float("nan"),
        "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "forwards": forwards, "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "batched": sum(r["batched"] for r in runs), "runs": runs,
    }


def sweep_ratios(runs: list[dict], plain: list[dict]) -> tuple[float, float]:
    """The median over sweeps of each sweep's ratio to plain (tok/s up, latency down): the two
    runs of a sweep ran minutes apart at most, so this is steadier than the pooled ratio
    when the machine's speed drifts."""
    tps = [r["tokens"] / r["wall_s"] / (p["tokens"] / p["wall_s"]) for r, p in zip(runs, plain)]
    lat = [statistics.mean(p["latencies"]) / statistics.mean(r["latencies"])
           for r, p in zip(runs, plain)]
    return statistics.median(tps), statistics.median(lat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: bundled, else random)")
    ap.add_argument("--modes", default="ngram", help="speculation modes of the requests")
    ap.add_argument("--workloads", default="grounded", help="grounded, free (comma-separated)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="default,spec,plain")
    ap.add_argument("--repeat", type=int, default=1,
                    help="sweeps; cells are measured interleaved and pooled over sweeps")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--no-http", action="store_true",
                    help="submit to the server's worker directly (no HTTP handler threads "
                         "sharing the cores: steadier cells)")
    args = ap.parse_args(argv)

    model = args.model
    label = model
    if model is None:
        try:
            from mlxspec.models import bundled_model_path

            model = str(bundled_model_path("target"))
            label = f"bundled pair ({Path(model).parent})"
            model = str(Path(model).parent)  # the pair folder: its draft too
        except Exception:
            model = str(random_model_dir())
            label = f"random-weight qwen2 (d=256, 4 layers, vocab 1024) at {model}"
    modes = [m for m in args.modes.split(",") if m]
    engine = mlxspec.load(model, mode=modes[0].partition(":")[0])
    for mode in modes:  # load what each mode needs (a draft) before the clock starts
        engine.proposer_for(mode.partition(":")[0])
    clients = [int(c) for c in args.clients.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    n_prompts = max(clients) * args.requests + 1
    heads = [p[p.index("# copy\n") + len("# copy\n"):] for p in workload(n_prompts)]
    retries = [heads[i // 2] for i in range(n_prompts)]  # each client: a prompt, then again
    workloads = {"grounded": (workload(n_prompts), 0.0), "free": (free_workload(n_prompts), 1.0),
                 "retry": (retries, 0.0)}
    chosen = [w for w in args.workloads.split(",") if w]
    for w in chosen:
        if w not in workloads:
            raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(workloads)}")
    print(f"model: {label}; modes {', '.join(modes)}; {args.requests} requests of "
          f"{args.max_tokens} tokens per client, {args.repeat} sweep(s); server defaults: "
          f"--spec-max-concurrency {CONFIGS['default'][0]}, batched speculation "
          f"{'on' if CONFIGS['default'][1] else 'off'}", file=sys.stderr)
    srv = make_server(engine, "127.0.0.1", 0, max_batch=max(8, max(clients)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cells = [(w, m) for w in chosen for m in modes]
    for w, m in cells:  # warm-up: every configuration once, not counted
        for cfg in configs:
            run_config(srv, CONFIGS[cfg], 1, 1, workloads[w][0], args.max_tokens, m,
                       workloads[w][1], http=not args.no_http)
    raw = {(w, m, c, n): [] for w, m in cells for c in configs for n in clients}
    for sweep in range(args.repeat):
        # Configurations interleaved, so that drift hits all alike, in reversed order every
        # other sweep, so that no configuration always runs right after another.
        order = configs if sweep % 2 == 0 else configs[::-1]
        for n in clients:
            for w, m in cells:
                prompts, temperature = workloads[w]
                for cfg in order:
                    r = run_config(srv, CONFIGS[cfg], n, args.requests, prompts,
                                   args.max_tokens, m, temperature, http=not args.no_http)
                    raw[(w, m, cfg, n)].append(r)
                    print(f"{w} {m} {cfg:7s} clients={n}: {r['tokens'] / r['wall_s']:.1f} "
                          f"tok/s, mean latency {statistics.mean(r['latencies']):.2f}s, "
                          f"batched {r['batched']}, target forwards {r['forwards']}, drafted "
                          f"{r['drafted']}, accepted {r['accepted']}, errors "
                          f"{len(r['errors'])}", file=sys.stderr)
    srv.shutdown()
    srv.server_close()
    results = {f"{w}/{m}/{c}": [merge(raw[(w, m, c, n)]) for n in clients]
               for w, m in cells for c in configs}
    for w, m in cells:
        print(f"\n### {w} ({'greedy' if workloads[w][1] == 0 else 'T=1'}), mode {m}\n")
        others = [c for c in configs if c != "plain"]
        head = "| clients |" + "".join(f" {c} tok/s | {c} latency (s) |" for c in configs)
        if "plain" in configs:
            head += "".join(f" {c} vs plain: tok/s, latency (median of sweeps) |"
                            for c in others)
        print(head)
        print("|---:|" + "---:|---:|" * len(configs) + "---:|" * (len(others) if "plain" in configs else 0))
        for i, n in enumerate(clients):
            row = f"| {n} |"
            for c in configs:
                r = results[f"{w}/{m}/{c}"][i]
                row += f" {r['tokens_per_s']:.1f} | {r['mean_latency_s']:.2f} |"
            if "plain" in configs:
                p = results[f"{w}/{m}/plain"][i]
                for c in others:
                    r = results[f"{w}/{m}/{c}"][i]
                    tps, lat = sweep_ratios(r["runs"], p["runs"])
                    row += (f" {r['tokens_per_s'] / p['tokens_per_s']:.2f}×, "
                            f"{p['mean_latency_s'] / r['mean_latency_s']:.2f}× "
                            f"({tps:.2f}×, {lat:.2f}×) |")
            print(row)
        if "spec" in configs:
            acc = ", ".join(f"{r['acceptance']:.2f}" for r in results[f"{w}/{m}/spec"])
            print(f"\nacceptance in the `spec` runs (by clients): {acc}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": label, "args": vars(args),
                                               "results": results}, indent=2))
    return 0 if all(not r["errors"] for rs in results.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
