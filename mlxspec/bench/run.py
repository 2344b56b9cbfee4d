"""Run the benchmark: interleaved runners, paired ratios, the lossless audit, the report."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import backend
from ..engine import Engine, PromptCache
from ..policy import AdaptiveK, FixedK
from ..sampling import SamplingParams, keyed_logits, position_gumbel, position_salts
from .explain import account, explain_table
from .runners import EngineRunner, MlxLmRunner, MlxLmSpeculativeRunner, Run
from .workloads import build_workload

PEERS = ("mlx_lm", "mlx_lm_spec")
AUDIT_TEMPERATURES = (0.0, 1.0)  # the audit's: greedy, and sampled with a seed


# `MODE:tree`: the mode proposing token trees
TREE_OPTIONS = {"draft": {"tree_width": 2}, "ngram": {"tree": True}}


def make_runners(engine: Engine, modes: list[str], num_draft: int) -> list:
    """Runners for mode labels: a mode name, `mlx_lm`, `mlx_lm_spec`, `MODE:k=N` (fixed k)
    / `MODE:adaptive` (adaptive k capped at 2 * num_draft) to compare k policies, or
    `draft:tree` / `ngram:tree` (token trees)."""
    runners = []
    for label in modes:
        mode, _, variant = label.partition(":")
        if variant:
            if variant == "adaptive":
                adaptive = AdaptiveK(max_k=2 * num_draft, cost=engine.cost)
                runners.append(EngineRunner(engine, mode, label, policy=adaptive))
            elif variant.startswith("k="):
                runners.append(EngineRunner(engine, mode, label,
                                            policy=FixedK(int(variant[2:]))))
            elif variant == "tree" and mode in TREE_OPTIONS:
                if mode == "draft" and engine.draft_model is None:
                    continue
                trees = engine.clone()  # the same weights (and draft), its own proposers
                trees.set_mode(mode, **TREE_OPTIONS[mode])
                runners.append(EngineRunner(trees, mode, label, num_draft=num_draft))
            else:
                raise ValueError(f"unknown variant {variant!r} in {label!r}")
            continue
        if mode == "mlx_lm":
            runners.append(MlxLmRunner(engine))
        elif mode == "mlx_lm_spec":
            if engine.draft_model is not None:
                runners.append(MlxLmSpeculativeRunner(engine, num_draft))
        elif mode == "draft" and engine.draft_model is None:
            continue
        else:  # auto brings its own adaptive policy; the others propose num_draft tokens
            runners.append(EngineRunner(engine, mode, num_draft=None if mode == "auto" else num_draft))
    return runners


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def measure_bandwidth(mb: int = 256) -> float:
    """Bytes/s of a large elementwise read+write: the ceiling of memory-bound decoding."""
    a = mx.ones((mb * 2**20 // 4,), mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(a * 1.0001)
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best


def verify_cost(model, context: int = 512, widths=(1, 5, 9, 17), reps: int = 3) -> dict:
    """Seconds of one forward of w tokens over `context` cached tokens (median of `reps`) and
    t(w)/t(1): what verifying w - 1 drafted tokens costs against a plain step, on which every
    policy's arithmetic rests (split by op: docs/PERFORMANCE.md)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    vocab = model.args.vocab_size
    for i in range(0, context, 512):
        model(mx.random.randint(0, vocab, (1, min(512, context - i))), cache=cache)
        mx.eval([c.state for c in cache])
    seconds = {}
    for w in widths:
        rows = mx.random.randint(0, vocab, (1, w))
        times = []
        for _ in range(reps + 1):  # the first one warms up
            start = time.perf_counter()
            mx.eval(model(rows, cache=cache))
            times.append(time.perf_counter() - start)
            if any(c.trim(w) != w for c in cache):  # (recurrent state: not measurable here)
                raise ValueError("this model's cache cannot trim a step back")
        seconds[w] = statistics.median(times[1:])
    return {"context": context, "seconds": seconds,
            "ratio": {w: seconds[w] / seconds[widths[0]] for w in widths}}


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.perf_counter()
        if enabled:  # shown at once: a real model's first prompt can take a while
            sys.stderr.write(f"\r[{'':<30}] 0/{total}")
            sys.stderr.flush()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            frac = self.done / max(1, self.total)
            bar = "#" * int(30 * frac)
            eta = (time.perf_counter() - self.start) / self.done * (self.total - self.done)
            sys.stderr.write(f"\r[{bar:<30}] {self.done}/{self.total} {label:<28} eta {eta:4.0f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def summarize(runs: dict[str, list[Run]], weights: int, project=None) -> dict[str, dict]:
    """Per-runner figures; speedup is the median of per-prompt ratios against `none`.
    `project(label, run)`: a run's projected decode seconds (0: none), `roofline.py`."""
    out = {}
    base = runs.get("none")
    for label, rs in runs.items():
        tokens = sum(len(r.tokens) for r in rs)
        seconds = sum(r.decode_seconds for r in rs)
        forwards = sum(r.target_forwards for r in rs)
        drafted = sum(r.drafted for r in rs)
        accepted = sum(r.accepted for r in rs)
        ratios = [r.tps / b.tps for r, b in zip(rs, base) if b.tps > 0 and r.tokens] if base else []
        by_pos_d, by_pos_a = defaultdict(int), defaultdict(int)
        for r in rs:
            for i, d in enumerate(r.stats.get("drafted_by_position", [])):
                by_pos_d[i] += d
            for i, a in enumerate(r.stats.get("accepted_by_position", [])):
                by_pos_a[i] += a
        out[label] = {
            "prompts": len(rs),
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "speedup_median": statistics.median(ratios) if ratios else None,
            "speedup_ratios": ratios,
            # the decode time of none's tokens over this mode's (the same tokens: exact modes)
            "speedup_total": (sum(b.decode_seconds for b in base) / seconds
                              if base and seconds else None),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": tokens / forwards if forwards else None,
            "forwards_per_token": forwards / tokens if tokens else None,
            "drafted": drafted,
            "accepted": accepted,
            "drafted_wasted": drafted - accepted,
            "acceptance_by_position": [by_pos_a[i] / by_pos_d[i] for i in sorted(by_pos_d)],
            "peak_memory_gb": max((r.stats.get("peak_memory_gb", 0.0) for r in rs), default=0.0),
            "weight_bandwidth_gb_s": weights * forwards / seconds / 1e9 if seconds else 0.0,
        }
        if base and label != "none" and (acc := account(rs, base)) is not None:
            out[label]["account"] = acc  # where its time went against none's (`explain.py`)
        projected = [project(label, r) for r in rs] if project else []
        if projected and all(projected):
            out[label]["projected_tokens_per_s"] = tokens / sum(projected)
    return out


def run_workloads(engine: Engine, runners: list, workloads: list[str], n_prompts: int,
                  max_tokens: int | None, temperatures: list[float], seed: int = 0,
                  show_progress: bool = True, project=None) -> dict:
    results = {}
    plan = []
    for w in workloads:
        for temp in ([1.0] if w == "free" else temperatures):
            plan.append((w, temp, build_workload(w, n_prompts, max_tokens, seed,
                                                 engine.tokenizer)))
    progress = Progress(sum(len(items) for *_, items in plan) * len(runners), show_progress)
    weights = weight_bytes(engine.model)
    for w, temp, items in plan:
        runs: dict[str, list[Run]] = {r.label: [] for r in runners}
        exact = {r.label: {"identical": 0, "divergences": []} for r in runners
                 if isinstance(r, EngineRunner) and r.label != "none"}
        session, shared = None, None
        for i, item in enumerate(items):
            tokens = item.tokens or engine.encode(item.prompt)
            order = runners[i % len(runners):] + runners[: i % len(runners)]  # A B C, B C A, ...
            # the prompt prefilled once for our modes (untimed anyway); a recorded session's
            # turns share one, as a server's prompt cache serves a conversation's next turn
            if item.meta.get("session") is None or item.meta["session"] != session:
                session, shared = item.meta.get("session"), PromptCache()
            for runner in order:
                runs[runner.label].append(runner.run(tokens, item.max_tokens, temp, seed + i,
                                                     item.prediction, prompt_cache=shared,
                                                     grammar=item.grammar))
                progress.step(f"{w} t={temp:g} {runner.label}")
            if "none" in runs:  # every mode of ours must give none's tokens, item by item
                ref = runs["none"][-1].tokens
                for label, e in exact.items():
                    got = runs[label][-1].tokens
                    if got == ref:
                        e["identical"] += 1
                        continue
                    step = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b),
                                min(len(got), len(ref)))
                    e["divergences"].append({"prompt": i, "step": step, "top2_gap": _top2_gap(
                        engine, tokens + ref[:step], temp, seed + i)})
        results[f"{w}@{temp:g}"] = {"workload": w, "temperature": temp,
                                    "max_tokens": max(it.max_tokens for it in items),
                                    "modes": summarize(runs, weights, project)}
        if "none" in runs:
            results[f"{w}@{temp:g}"]["exact"] = exact
        kinds = [it.meta.get("kind") for it in items]
        if all(kinds):  # turns of recorded sessions: the figures per turn kind too
            results[f"{w}@{temp:g}"]["by_kind"] = {
                k: summarize({label: [r for r, kk in zip(rs, kinds) if kk == k]
                              for label, rs in runs.items()}, weights)
                for k in dict.fromkeys(kinds)}
    progress.close()
    return results


def lossless_audit(engine: Engine, modes: list[str], n_prompts: int, max_tokens: int = 32,
                   seed: int = 0, show_progress: bool = True,
                   temperatures: tuple[float, ...] = AUDIT_TEMPERATURES) -> dict:
    """Every speculative mode against `none`, token by token, at each temperature: greedy, and
    sampled with a seed (every mode then draws `none`'s tokens). A divergence is reported with
    the reference's top-2 gap at that step, in the logits (T = 0) or the keyed scores the draw
    maximizes (T > 0): > 1e-3 in float32 is a bug."""
    items = build_workload("mixed", n_prompts, max_tokens, seed, engine.tokenizer)
    modes = [m for m in modes if m not in ("none",) + PEERS and ":" not in m]
    progress = Progress(len(items), show_progress)
    report = {"prompts": len(items), "temperatures": list(temperatures),
              "modes": {m: {"identical": 0, "divergences": []} for m in modes}}
    for i, item in enumerate(items):
        tokens = engine.encode(item.prompt)
        for temp in temperatures:
            ref = EngineRunner(engine, "none").run(tokens, item.max_tokens, temp, seed + i).tokens
            for mode in modes:
                got = EngineRunner(engine, mode).run(tokens, item.max_tokens, temp, seed + i,
                                                     item.prediction).tokens
                if got == ref:
                    report["modes"][mode]["identical"] += 1
                    continue
                step = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b),
                            min(len(got), len(ref)))
                report["modes"][mode]["divergences"].append(
                    {"prompt": i, "temperature": temp, "step": step,
                     "top2_gap": _top2_gap(engine, tokens + ref[:step], temp, seed + i)})
        progress.step("audit")
    progress.close()
    for m in modes:
        divs = report["modes"][m]["divergences"]
        report["modes"][m]["bugs"] = sum(1 for d in divs if d["top2_gap"] > 1e-3)
    return report


def _top2_gap(engine: Engine, context: list[int], temp: float, seed: int) -> float:
    """The gap between the two best scores of the draw after `context`: the logits (T = 0), or
    the keyed scores at that position (T > 0)."""
    logits = engine.model(mx.array(context)[None])[0, -1:].astype(mx.float32)
    if temp > 0:
        salts = mx.array(position_salts(seed, [len(context)]), mx.uint32)
        logits = keyed_logits(logits, SamplingParams(temp)) + position_gumbel(
            salts, logits.shape[-1])
    top2 = mx.sort(logits[0])[-2:].tolist()
    return top2[1] - top2[0]


def markdown_table(results: dict) -> str:
    lines = ["| workload | T | mode | tok/s | speedup (median) | acceptance | tok/forward | wasted drafts |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results.values():
        for mode, f in r["modes"].items():
            sp = f"{f['speedup_median']:.2f}×" if f["speedup_median"] is not None else "–"
            acc = f"{100 * f['acceptance_rate']:.0f}%" if f["acceptance_rate"] is not None else "–"
            tpf = f"{f['mean_accepted_length']:.2f}" if f["mean_accepted_length"] else "–"
            lines.append(f"| {r['workload']} | {r['temperature']:g} | {mode} | "
                         f"{f['tokens_per_s']:.1f} | {sp} | {acc} | {tpf} | {f['drafted_wasted']} |")
    for r in results.values():
        if r.get("by_kind"):
            lines += ["", kind_table(r)]
    return "\n".join(lines)


def kind_table(r: dict) -> str:
    """A recorded-sessions workload (`agent`) per mode: tokens per forward and speedup over
    none (median of the turns' ratios, and total decode time), over all turns and per turn
    kind, with the turns identical to none's."""
    groups = {"all": r["modes"], **r["by_kind"]}
    head = " | ".join(f"{k} ({groups[k]['none']['prompts'] if 'none' in groups[k] else '?'})"
                      for k in groups)
    lines = [f"{r['workload']}, T = {r['temperature']:g}: tokens per forward / speedup over none "
             "(median of turns; total decode time), per turn kind (turns)", "",
             f"| mode | {head} | identical to none |",
             "|---" * (len(groups) + 2) + "|"]
    for mode in r["modes"]:
        cells = []
        for g in groups.values():
            f = g.get(mode)
            if not f or not f["tokens"]:
                cells.append("–")
                continue
            tpf = f"{f['mean_accepted_length']:.2f}" if f["mean_accepted_length"] else "–"
            med = f"{f['speedup_median']:.2f}×" if f["speedup_median"] is not None else "–"
            tot = f"{f['speedup_total']:.2f}×" if f.get("speedup_total") else "–"
            cells.append(f"{tpf} / {med}; {tot}")
        e = r.get("exact", {}).get(mode)
        same = (f"{e['identical']}/{e['identical'] + len(e['divergences'])}" if e else "–")
        lines.append(f"| {mode} | {' | '.join(cells)} | {same} |")
    return "\n".join(lines)


def projection_table(report: dict) -> str:
    """The roofline's projection next to what was measured (labelled: not a measurement)."""
    rates = report.get("rates")
    rows = [(r, m, f) for r in report["results"].values() for m, f in r["modes"].items()
            if f.get("projected_tokens_per_s")]
    if not rates or not rows:
        return ""
    lines = [f"PROJECTION (not measured): each run's forwards, their width and context, and its "
             f"draft forwards, at this machine's measured rates: {rates['bandwidth_gb_s']:.1f} "
             f"GB/s streamed by a one-row product, {rates['gflops']:.0f} GFLOP/s for a verify's "
             "further rows (mlxspec/bench/roofline.py)", "",
             "| workload | T | mode | measured tok/s | projected tok/s | measured / projected |",
             "|---|---|---|---|---|---|"]
    for r, mode, f in rows:
        p = f["projected_tokens_per_s"]
        lines.append(f"| {r['workload']} | {r['temperature']:g} | {mode} | "
                     f"{f['tokens_per_s']:.1f} | {p:.1f} | {f['tokens_per_s'] / p:.2f} |")
    return "\n".join(lines)


def write_outputs(out_dir: Path, report: dict) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.json", out_dir / "bench.md"]
    written[0].write_text(json.dumps(report, indent=1))
    md = [f"Machine: {report['machine']}", "", markdown_table(report["results"]),
          "", "Where each mode's time goes against none's (`mlxspec bench --explain`):", "",
          explain_table(report["results"])]
    if projection_table(report):
        md += ["", projection_table(report)]
    if report.get("audit"):
        audit = report["audit"]
        temps = audit.get("temperatures", [0.0])
        md += ["", "Lossless audit (vs none, token by token, at "
               + ", ".join(f"T = {t:g}" for t in temps) + "; sampled with a seed):"]
        for m, a in audit["modes"].items():
            md.append(f"- {m}: {a['identical']}/{audit['prompts'] * len(temps)} identical, "
                      f"{len(a['divergences'])} divergences, {a['bugs']} with top-2 gap > 1e-3")
    written[1].write_text("\n".join(md) + "\n")
    written += plot(out_dir, report)
    return written


def plot(out_dir: Path, report: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    results = report["results"]
    fig, ax = plt.subplots(figsize=(9, 4))
    keys = list(results)
    modes = sorted({m for r in results.values() for m in r["modes"]})
    width = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        ys = [results[k]["modes"].get(m, {}).get("speedup_median") or 0 for k in keys]
        ax.bar([i + j * width for i in range(len(keys))], ys, width, label=m)
    ax.set_xticks([i + 0.4 for i in range(len(keys))], keys, rotation=20)
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("speedup over none")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "speedup_by_workload.png"
    fig.savefig(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in modes:
        for k in keys[:1]:
            pos = results[k]["modes"].get(m, {}).get("acceptance_by_position") or []
            if pos:
                ax.plot(range(1, len(pos) + 1), pos, marker="o", label=f"{m} ({k})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path2 = out_dir / "acceptance_by_position.png"
    fig.savefig(path2)
    return [path, path2]


def machine_summary() -> str:
    info = backend.machine_info()
    return (f"{info['processor']} ({info['cpu_count']} cores), backend {info['backend']}, "
            f"BLAS {info['blas']}, MLX {info['mlx']}, mlx-lm {info['mlx_lm']}")
