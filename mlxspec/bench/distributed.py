"""`mlxspec bench --distributed`: a sharded target under mlx.launch. Collectives per generated
token and tok/s for `none` against the speculative modes, at each injected delay per collective
(`CollectiveMeter`: loopback hides the network, so a delay stands in for its latency).

Only our engine's modes run (mlx-lm's own decoders would call the sharded model on rank 0
alone and leave the other ranks behind). Exactness is checked on the runs themselves: at
temperature 0 every mode's tokens must equal `none`'s on the same prompt.
"""

from __future__ import annotations

import statistics

from .. import admission
from ..engine import PromptCache
from .run import Progress, summarize, weight_bytes
from .runners import Run
from .workloads import build_workload


class MeteredRunner:
    """An engine mode whose runs also count the collectives issued while decoding (after the
    prompt's prefill) and the injected delay really slept."""

    def __init__(self, engine, mode: str, num_draft: int | None):
        self.engine, self.mode, self.label, self.num_draft = engine, mode, mode, num_draft
        self.meter = engine.coord.meter

    def run(self, tokens, max_tokens, temperature, seed, prediction=None) -> Run:
        engine, meter = self.engine, self.meter
        marks = {}
        inner = admission.prefill  # (what the batch calls: the module's name)

        def prefill(*args, **kwargs):  # rank 0's prefill; the followers' mirrors it
            try:
                return inner(*args, **kwargs)
            finally:
                marks["count"], marks["waited"] = meter.count, meter.waited

        admission.prefill = prefill
        try:
            result = engine.generate(tokens, max_tokens=max_tokens, temperature=temperature,
                                     seed=seed, mode=self.mode, prediction=prediction,
                                     num_draft=self.num_draft, prompt_cache=PromptCache())
        finally:
            admission.prefill = inner
        s = result.stats
        stats = s.to_dict()
        stats["collectives"] = meter.count - marks.get("count", meter.count)
        stats["waited"] = meter.waited - marks.get("waited", meter.waited)
        return Run(result.tokens, s.decode_seconds, s.target_forwards, s.drafted, s.accepted,
                   stats)


PREDICTED = "predicted"  # edit prompts whose predicted output is the answer with one change


def predicted_output(answer: list[int], vocab: int) -> list[int]:
    """What an editor applying an edit sends as the predicted output: the text it expects
    back, here the target's own greedy answer with one token in the middle changed (as if the
    edit changed a word there). Prediction-driven proposals then copy it, as a model that
    copies its input (which the bundled model cannot) would let them copy the file."""
    changed = list(answer)
    if changed:
        mid = len(changed) // 2
        changed[mid] = (changed[mid] + 1) % vocab
    return changed


def _nominal_tps(run: Run, delay_ms: float) -> float:
    seconds = (run.decode_seconds - run.stats["waited"]
               + delay_ms / 1000 * run.stats["collectives"])
    return len(run.tokens) / seconds if seconds > 0 and run.tokens else 0.0


def run_distributed(engine, modes: list[str], workloads: list[str], n_prompts: int,
                    max_tokens: int, num_draft: int, delays_ms: list[float], seed: int = 0,
                    show_progress: bool = True) -> dict:
    """Every delay × workload × mode, modes interleaved per prompt; one warm-up generation per
    mode first. Returns {"delays": [...], "results": {"W@D": {...}}, "exact": {...}}."""
    meter = engine.coord.meter
    runners = [MeteredRunner(engine, m, None if m == "auto" else num_draft) for m in modes]
    plan = [(w, build_workload("edit" if w == PREDICTED else w, n_prompts, max_tokens, seed))
            for w in workloads]
    for _, items in plan:  # every collective is dear here: --max-tokens caps every workload
        for item in items:
            item.max_tokens = min(item.max_tokens, max_tokens)
    progress = Progress(len(delays_ms) * len(runners) * sum(len(i) for _, i in plan),
                        show_progress)
    weights = weight_bytes(engine.model)
    warm = engine.encode(plan[0][1][0].prompt)
    for r in runners:
        r.run(warm, 8, 0.0, seed)
    none = next(r for r in runners if r.label == "none")
    vocab = len(engine.tokenizer.get_vocab())
    for w, items in plan:  # every rank computes the same answers (rank 0's tokens)
        for i, item in enumerate(items if w == PREDICTED else []):
            answer = none.run(engine.encode(item.prompt), item.max_tokens, 0.0, seed + i).tokens
            item.prediction = predicted_output(answer, vocab)
    results, exact = {}, {m: {"identical": 0, "compared": 0} for m in modes if m != "none"}
    for delay in delays_ms:
        meter.delay = delay / 1000
        for w, items in plan:
            runs: dict[str, list[Run]] = {r.label: [] for r in runners}
            for i, item in enumerate(items):
                tokens = engine.encode(item.prompt)
                order = runners[i % len(runners):] + runners[: i % len(runners)]
                for runner in order:
                    runs[runner.label].append(runner.run(tokens, item.max_tokens,
                                                         item.temperature, seed + i,
                                                         item.prediction))
                    progress.step(f"{w} {delay:g} ms {runner.label}")
                if item.temperature == 0:
                    ref = runs["none"][-1].tokens
                    for m in exact:
                        exact[m]["compared"] += 1
                        exact[m]["identical"] += runs[m][-1].tokens == ref
            modes_out = summarize(runs, weights)
            # Sleep overshoots short delays on a loaded machine: the nominal figures replace the
            # time really slept by `delay` per collective (measured compute + the delay asked).
            nominal = {label: [_nominal_tps(r, delay) for r in rs] for label, rs in runs.items()}
            for label, rs in runs.items():
                tokens = sum(len(r.tokens) for r in rs)
                coll = sum(r.stats["collectives"] for r in rs)
                waited = sum(r.stats["waited"] for r in rs)
                modes_out[label]["collectives_per_token"] = coll / tokens if tokens else None
                modes_out[label]["collectives_per_forward"] = (
                    coll / sum(r.target_forwards for r in rs) if tokens else None)
                modes_out[label]["slept_per_collective_ms"] = 1000 * waited / coll if coll and \
                    delay else 0.0
                secs = sum(len(r.tokens) / t for r, t in zip(rs, nominal[label]) if t)
                modes_out[label]["tokens_per_s_nominal"] = tokens / secs if secs else 0.0
                ratios = [t / b for r, t, b in zip(rs, nominal[label], nominal["none"])
                          if b and r.tokens]
                modes_out[label]["speedup_nominal_median"] = (
                    statistics.median(ratios) if ratios else None)
            results[f"{w}@{delay:g}ms"] = {"workload": w, "delay_ms": delay, "modes": modes_out}
    progress.close()
    return {"delays_ms": delays_ms, "results": results, "exact": exact}


def markdown_table(report: dict) -> str:
    lines = ["| workload | delay/collective | mode | tok/s | speedup (median) | tok/s nominal | "
             "speedup nominal | tok/forward | collectives/token | collectives/forward | "
             "slept/collective |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"].values():
        for mode, f in r["modes"].items():
            sp = f"{f['speedup_median']:.2f}×" if f["speedup_median"] is not None else "–"
            tpf = f"{f['mean_accepted_length']:.2f}" if f["mean_accepted_length"] else "–"
            cpt = f"{f['collectives_per_token']:.1f}" if f["collectives_per_token"] else "–"
            cpf = f"{f['collectives_per_forward']:.1f}" if f["collectives_per_forward"] else "–"
            slept = f"{f['slept_per_collective_ms']:.2f} ms" if r["delay_ms"] else "–"
            spn = (f"{f['speedup_nominal_median']:.2f}×"
                   if f["speedup_nominal_median"] is not None else "–")
            lines.append(f"| {r['workload']} | {r['delay_ms']:g} ms | {mode} | "
                         f"{f['tokens_per_s']:.1f} | {sp} | {f['tokens_per_s_nominal']:.1f} | "
                         f"{spn} | {tpf} | {cpt} | {cpf} | {slept} |")
    return "\n".join(lines)


def speedup_table(report: dict, key: str = "speedup_median") -> str:
    """Median speedup over `none` by delay (rows) and workload × mode (columns); `key`
    "speedup_nominal_median" for the figures with the delay exactly as asked."""
    results = report["results"].values()
    cols = []
    for r in results:
        for m in r["modes"]:
            if m != "none" and (r["workload"], m) not in cols:
                cols.append((r["workload"], m))
    head = "| delay/collective | " + " | ".join(f"{w} {m}" for w, m in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    for d in report["delays_ms"]:
        row = []
        for w, m in cols:
            f = next((r["modes"].get(m) for r in results
                      if r["workload"] == w and r["delay_ms"] == d), None)
            sp = f and f[key]
            row.append(f"{sp:.2f}×" if sp else "–")
        lines.append(f"| {d:g} ms | " + " | ".join(row) + " |")
    return "\n".join(lines)

