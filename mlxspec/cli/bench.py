"""`mlxspec bench`: measure every mode on every workload against mlx-lm, interleaved."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from ..errors import MlxspecError
from ..loading import default_draft
from ..loading import trained_draft as trained_draft_for
from ..policy import AUTO_MAX_K, DEFAULT_NUM_DRAFT, MAX_NUM_DRAFT
from ..proposers import MODES
from .common import (
    distributed_option,
    exits_cleanly,
    in_range,
    load_engine,
    memory_budget,
    option,
    options,
    resolve_pair,
)


def default_out_dir() -> Path:
    """Where a run's files go without --out: the user's cache, never the current directory
    (which is often a source checkout)."""
    from ..gguf.sources import cache_root

    return cache_root() / "bench" / time.strftime("%Y%m%d-%H%M%S")


def report_written(written: list[Path]) -> None:
    """Where the files went, and a word when the plots were skipped."""
    click.echo(f"wrote {', '.join(str(p) for p in written)}", err=True)
    if not any(p.suffix == ".png" for p in written):
        click.echo("plots skipped: matplotlib is not installed (pip install matplotlib)", err=True)


@click.group(invoke_without_command=True, subcommand_metavar="[editor [OPTIONS]]")
@options("model", "gguf-weights")
@option("draft-model", help="Draft (default with the bundled model, a pair or a named model "
                           "such as qwen2.5-coder-1.5b: its own).")
@option("no-draft")
@click.option("--modes", default="none,ngram,draft,mlx_lm,mlx_lm_spec", show_default=True,
              help=f"Comma-separated: {', '.join(MODES)}, mlx_lm, mlx_lm_spec; "
                   "MODE:k=N fixes k, MODE:adaptive adapts it (to compare k policies); "
                   "draft:tree and ngram:tree propose token trees.")
@click.option("--workloads", default=None,
              help="Comma-separated workloads (default: all the model has). The bundled model "
                   "(and models `mlxspec train` writes): completion, fim, edit, doc-qa, chat, "
                   "free. Any other model, through its own chat template: edit, rewrite, quote, "
                   "chat, free, completion (plain code), fim only with FIM tokens. 'mixed': all, "
                   "shuffled. 'agent' (only when named): the turns of recorded coding-agent "
                   "sessions with their tools, as the server renders them. With --distributed "
                   "also 'predicted' (edit prompts whose predicted output is the answer with "
                   "one token changed).")
@click.option("--prompts", "n_prompts", type=int, default=20, show_default=True,
              callback=in_range(1), help="Prompts per workload.")
@option("max-tokens", default=None, show_default=False,
        help="Tokens generated per prompt (default 64; the bundled model's edit and doc-qa "
             "at least 256 and 128). With a chat-template model it caps every workload; "
             "without it edit/rewrite 256, quote/chat/free 128, completion 64.")
@click.option("--temps", default="0", show_default=True, help="Temperatures, e.g. '0,1' ('free' always uses 1).")
@option("num-draft",
        help=f"Tokens proposed per step (1-{MAX_NUM_DRAFT}; default {DEFAULT_NUM_DRAFT}, and "
             f"auto chooses up to {AUTO_MAX_K}, as `generate` does). Given, it also caps "
             "auto's k.")
@click.option("--audit", "audit_prompts", type=int, default=200, show_default=True,
              callback=in_range(0), help="Prompts in the lossless audit (0 skips it).")
@click.option("--quick", is_flag=True,
              help="A smoke run of a few minutes: at most 3 prompts per workload, 32 tokens, an "
                   "audit of 10. It shows that every mode runs and is exact; its speedups are "
                   "too noisy to read (use --prompts 8 or more for figures).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for bench.json, bench.md and plots (default: "
                   "~/.cache/mlxspec/bench/DATE, or under $MLXSPEC_CACHE or $XDG_CACHE_HOME).")
@option("seed")
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Re-render the table and plots of an earlier run's bench.json (runs nothing).")
@option("memory-limit")
@click.option("--explain", is_flag=True,
              help="Also print where each mode's time goes against none's: what its plain, "
                   "accepted, rejected, probe and catch-up steps gained or lost, as a share of "
                   "none's time (always in bench.md; needs `none` in --modes).")
@distributed_option
@click.option("--collective-delay", "collective_delay", default="0", show_default=True,
              help="With --distributed: milliseconds slept after every collective on every "
                   "rank, comma-separated (e.g. 0,0.2,0.5,1): the network latency that "
                   "loopback hides. Each collective is then evaluated as it is issued.")
@click.pass_context
@exits_cleanly
def bench(ctx, model, draft_model, modes, workloads, n_prompts, max_tokens, temps, num_draft,
          audit_prompts, quick, out_dir, seed, from_json, memory_limit=None, explain=False,
          distributed=None, collective_delay="0"):
    """Benchmark speculation modes and mlx-lm on held-out workloads.

    Below the measured table, a roofline's PROJECTION of our runs from this machine's
    measured rates (not a measurement). `mlxspec bench editor` replays an editor (llama.vim) typing through files instead."""
    seed = 0 if seed is None else seed  # (benchmarks are reproducible: prompts and draws)
    if ctx.invoked_subcommand is not None:  # `bench editor`: its own options
        return
    from ..bench.workloads import DEFAULT_MAX_TOKENS

    if distributed and from_json is None:
        workloads = workloads or "completion,fim,edit,doc-qa,chat,free"
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        return bench_distributed(model, draft_model, modes, workloads, n_prompts, max_tokens,
                                 num_draft, quick, out_dir, seed, distributed, collective_delay)
    if from_json is not None:
        import json

        from ..bench.explain import explain_table
        from ..bench.run import markdown_table, write_outputs

        try:
            report = json.loads(Path(from_json).read_text())
            written = write_outputs(Path(out_dir) if out_dir else Path(from_json).parent, report)
        except (ValueError, KeyError) as e:
            raise MlxspecError(f"{from_json} is not a bench.json of mlxspec bench ({e})") from None
        click.echo(markdown_table(report["results"]))
        if explain:
            click.echo("\n" + explain_table(report["results"]))
        report_written(written)
        return
    from .. import backend
    from ..bench.run import (
        TREE_OPTIONS,
        lossless_audit,
        machine_summary,
        make_runners,
        markdown_table,
        projection_table,
        run_workloads,
        verify_cost,
        write_outputs,
    )
    from ..bench.workloads import (
        CHAT_WORKLOADS,
        EXTRA_WORKLOADS,
        WORKLOADS,
        check_workloads,
        workload_kind,
        workloads_for,
    )

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        base, _, variant = m.partition(":")
        tree = variant == "tree" and base in TREE_OPTIONS
        if base not in MODES + ("mlx_lm", "mlx_lm_spec") or (
                variant and variant != "adaptive" and not tree and not (
                    variant.startswith("k=") and variant[2:].isdigit())):
            raise MlxspecError(f"unknown mode {m!r} in --modes (MODE, MODE:k=N, MODE:adaptive, "
                               "draft:tree or ngram:tree)")
    if "none" not in mode_list:
        mode_list.insert(0, "none")  # the reference every ratio is taken against
    workload_list = [w.strip() for w in (workloads or "").split(",") if w.strip()]
    known = tuple(dict.fromkeys(WORKLOADS + CHAT_WORKLOADS + EXTRA_WORKLOADS))
    for w in workload_list:  # before loading; which ones the model has is checked once loaded
        if w not in known + ("mixed",):
            raise MlxspecError(f"unknown workload {w!r}; choose from {', '.join(known)}, mixed")
    try:
        temperatures = [float(t) for t in temps.split(",")]
    except ValueError:
        raise MlxspecError(f"--temps must be comma-separated numbers, got {temps!r}") from None
    if quick:
        n_prompts, audit_prompts = min(n_prompts, 3), min(audit_prompts, 10)
        max_tokens = min(max_tokens or DEFAULT_MAX_TOKENS, 32)
        click.echo(f"note: --quick runs {n_prompts} prompts per workload: a smoke run; its "
                   "speedup ratios are too noisy to read (use --prompts 8 or more for figures)",
                   err=True)
    out = Path(out_dir).expanduser() if out_dir else default_out_dir()
    model, draft_model, _ = resolve_pair(model, draft_model, "draft")  # -m FOLDER of a pair
    wants_draft = any(m.partition(":")[0] in ("draft", "mlx_lm_spec", "auto") for m in mode_list)
    # The bundled target comes with its draft, a target with one trained by `mlxspec train
    # --draft-for` with that; another target needs --draft-model for those rows.
    with_draft = wants_draft and not os.environ.get("MLXSPEC_NO_DRAFT") and (
        draft_model is not None or model is None or trained_draft_for(model) is not None
        or default_draft(model) is not None)
    if memory_limit is not None:  # (the models are refused, and the context cut, against it)
        memory_budget(memory_limit)
    engine = load_engine(model, draft_model if with_draft else None,
                         "draft" if with_draft else "none", num_draft)
    if workload_list:
        check_workloads(workload_list, engine.tokenizer, engine.name)
    else:
        workload_list = list(workloads_for(engine.tokenizer))
    runners = make_runners(engine, mode_list, num_draft or DEFAULT_NUM_DRAFT)
    no_draft = [m for m in mode_list if m.partition(":")[0] in ("draft", "mlx_lm_spec")]
    if engine.draft_model is None and no_draft:
        also = "; auto proposes from n-grams only" if any(
            m.partition(":")[0] == "auto" for m in mode_list) else ""
        click.echo(f"note: no draft model (--draft-model): {', '.join(no_draft)} skipped{also}",
                   err=True)
    click.echo(f"machine: {machine_summary()}", err=True)
    click.echo(f"runners: {', '.join(r.label for r in runners)}", err=True)
    click.echo(f"workloads: {', '.join(workload_list)} ({workload_kind(engine.tokenizer)})",
               err=True)
    try:
        cost = verify_cost(engine.model)
        click.echo("verification cost t(w)/t(1) over 512 cached tokens: " + ", ".join(
            f"t({w}) {r:.2f}" for w, r in cost["ratio"].items() if w > 1)
                   + f" (t(1) {1000 * cost['seconds'][1]:.1f} ms)", err=True)
    except Exception as e:  # a cache that cannot trim (recurrent layers): not measured here
        cost = {"error": f"{type(e).__name__}: {e}"}
    rates, project = roofline_projector(engine)
    results = run_workloads(engine, runners, workload_list, n_prompts, max_tokens, temperatures,
                            seed, project=project)
    report = {"machine": machine_summary(), "machine_info": backend.machine_info(),
              "verify_cost": cost, "rates": rates,
              "model": engine.name, "num_draft": num_draft or DEFAULT_NUM_DRAFT,
              "auto_max_k": num_draft or AUTO_MAX_K, "max_tokens": max_tokens,
              "prompts_per_workload": n_prompts, "workloads": workload_kind(engine.tokenizer),
              "results": results}
    if audit_prompts:
        report["audit"] = lossless_audit(engine, [r.label for r in runners], audit_prompts, seed=seed)
    written = write_outputs(out, report)
    click.echo(markdown_table(results))
    if explain:
        from ..bench.explain import explain_table

        click.echo("\n" + explain_table(results))
    if projection_table(report):
        click.echo("\n" + projection_table(report))
    if report.get("audit"):
        audit = report["audit"]
        temps = ", ".join(f"T={t:g}" for t in audit["temperatures"])
        for m, a in audit["modes"].items():
            click.echo(f"audit {m}: {a['identical']}/{audit['prompts'] * len(audit['temperatures'])}"
                       f" identical to none ({temps}, seeded), {a['bugs']} divergences with "
                       f"top-2 gap > 1e-3")
    report_written(written)


def roofline_projector(engine):
    """This machine's measured rates, and a function projecting a run's decode seconds from
    them (`bench/roofline.py`): the target's forwards, and the draft's for a drafting mode."""
    from ..bench.roofline import forward_cost, measure_rates, project_run
    from ..proposers.draft import draft_proposer

    rates = measure_rates()
    target = forward_cost(engine.model)
    drafts: dict = {}

    def draft_cost(label: str):
        mode = label.partition(":")[0]
        if mode not in drafts:
            try:
                proposer = engine.proposer_of(mode)
            except MlxspecError:
                proposer = None
            own = draft_proposer(proposer)  # the draft model's proposer, or None
            model = getattr(own, "model", None) or getattr(proposer, "draft_model", None)
            drafts[mode] = forward_cost(model) if model is not None else None
        return drafts[mode]

    def project(label: str, run) -> float:
        if "prompt_tokens" not in run.stats:  # mlx-lm's runs: no step counts to project from
            return 0.0
        return project_run(run.stats, len(run.tokens), target, rates, draft_cost(label))

    return {"bandwidth_gb_s": rates.bandwidth / 1e9, "gflops": rates.flops / 1e9}, project


def bench_distributed(model, draft_model, modes, workloads, n_prompts, max_tokens, num_draft,
                      quick, out_dir, seed, strategy, collective_delay):
    """`bench --distributed` under mlx.launch: our modes only, at each injected delay."""
    import json

    from .. import backend
    from ..bench.distributed import PREDICTED, markdown_table, run_distributed, speedup_table
    from ..bench.run import machine_summary
    from ..bench.workloads import WORKLOADS
    from ..distributed import SHARDED_MODES
    from .distributed import guarded

    try:
        delays = [float(d) for d in collective_delay.split(",") if d.strip()]
    except ValueError:
        raise MlxspecError("--collective-delay must be comma-separated milliseconds, "
                           f"got {collective_delay!r}") from None
    if not delays or any(d < 0 for d in delays):
        raise MlxspecError("--collective-delay needs one or more delays >= 0 (milliseconds)")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    skipped = [m for m in mode_list if m not in SHARDED_MODES]
    mode_list = [m for m in mode_list if m in SHARDED_MODES]
    if "none" not in mode_list:
        mode_list.insert(0, "none")
    workload_list = [w.strip() for w in workloads.split(",") if w.strip()]
    for w in workload_list:
        if w not in WORKLOADS + (PREDICTED,):
            raise MlxspecError(f"unknown workload {w!r}; choose from "
                               f"{', '.join(WORKLOADS + (PREDICTED,))}")
    if quick:
        n_prompts, max_tokens = min(n_prompts, 3), min(max_tokens, 32)
    model, draft_model, _ = resolve_pair(model, draft_model, "draft")
    with_draft = any(m in ("draft", "auto") for m in mode_list) and (
        draft_model is not None or model is None)
    if not with_draft:
        mode_list = [m for m in mode_list if m not in ("draft", "auto")]
    engine = guarded(load_engine)(model, draft_model if with_draft else None,
                                  "draft" if with_draft else "none", num_draft,
                                  distributed=strategy, meter=True)
    if getattr(engine, "coord", None) is None:
        raise MlxspecError("bench --distributed needs several ranks: start it with mlx.launch "
                           "(docs/SEVERAL_MACS.md)")
    if skipped:
        click.echo(f"note: not run sharded: {', '.join(skipped)} (mlx-lm's decoders and "
                   "quantspec cannot follow a sharded target)", err=True)
    click.echo(f"machine: {machine_summary()}; {engine.coord.size} ranks, "
               f"{engine.coord.strategy} parallel", err=True)
    click.echo(f"modes: {', '.join(mode_list)}; delays per collective: "
               f"{', '.join(f'{d:g} ms' for d in delays)}", err=True)
    report = guarded(run_distributed)(engine, mode_list, workload_list, n_prompts, max_tokens,
                                      num_draft or DEFAULT_NUM_DRAFT, delays, seed)
    report.update({"machine": machine_summary(), "machine_info": backend.machine_info(),
                   "model": engine.name, "ranks": engine.coord.size,
                   "strategy": engine.coord.strategy, "num_draft": num_draft or DEFAULT_NUM_DRAFT,
                   "max_tokens": max_tokens, "prompts_per_workload": n_prompts})
    out = Path(out_dir).expanduser() if out_dir else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    tables = (markdown_table(report)
              + "\n\nSpeedup over none (median of per-prompt ratios), as measured:\n\n"
              + speedup_table(report)
              + "\n\nThe same with each collective's sleep counted at the delay asked (sleep "
              "overshoots on a loaded machine):\n\n"
              + speedup_table(report, "speedup_nominal_median"))
    exact = ", ".join(f"{m} {e['identical']}/{e['compared']}" for m, e in report["exact"].items())
    (out / "bench_distributed.json").write_text(json.dumps(report, indent=1))
    (out / "bench_distributed.md").write_text(
        f"Machine: {report['machine']}; {report['ranks']} ranks, {report['strategy']} parallel"
        f"\n\n{tables}\n\nIdentical to none at T=0: {exact}\n")
    click.echo(tables)
    click.echo(f"identical to none at T=0: {exact}")
    click.echo(f"wrote {out / 'bench_distributed.json'}, {out / 'bench_distributed.md'}",
               err=True)


@bench.command()
@options("model", "gguf-weights")
@click.option("--modes", default="auto,none", show_default=True,
              help="The server's --mode of each configuration, comma-separated.")
@click.option("--no-suffix", is_flag=True,
              help="Also run auto (and suffix) with --suffix-scope request: no store of earlier "
                   "requests' text.")
@click.option("--no-draft", is_flag=True, help="Also run auto without its draft model.")
@click.option("--cache-reuse", type=int, default=0, show_default=True, callback=in_range(0),
              help="Also run each mode with the server's --cache-reuse N (cached chunks reused "
                   "at shifted positions; not exact), and report how its answers agree with "
                   "the exact run's.")
@click.option("--no-follow-ahead", is_flag=True,
              help="Also run auto (and suffix) with the server's --no-follow-ahead: answers cut "
                   "by t_max_predict_ms are not decoded on for the follow-up.")
@click.option("--read-ms", type=int, default=0, show_default=True, callback=in_range(0),
              help="The user reads each shown suggestion this long before the next key (the "
                   "server's idle time).")
@click.option("--accept-all", is_flag=True,
              help="The user accepts every suggestion's first line (each follow-up's guess is "
                   "right), not only those the file has next.")
@click.option("--files", "n_files", type=int, default=1, show_default=True,
              callback=in_range(1), help="Files typed through.")
@click.option("--lines", "n_lines", type=int, default=2, show_default=True,
              callback=in_range(1), help="Lines typed per file.")
@click.option("--open", "n_open", type=int, default=2, show_default=True, callback=in_range(0),
              help="Other files of the same package opened before each typed file.")
@click.option("--packages", default="click,rich", show_default=True,
              help="Installed packages whose files are typed (round robin).")
@option("seed")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every figure and request here.")
@exits_cleanly
def editor(model, modes, no_suffix, no_draft, cache_reuse, no_follow_ahead, read_ms, accept_all,
           n_files, n_lines, n_open, packages, seed, json_path):
    """The editor's wait: llama.vim typing through real files, against an in-process server.

    Types through installed packages' source files (click and rich by default) and sends
    exactly llama.vim's /infill requests: ring-buffer warm-ups, first requests, speculative
    follow-ups, its own cache of answers, t_max_predict_ms. Prints, per configuration, p50/p95
    time to the first token and to the suggestion, prompt tokens reused and recomputed, tokens
    per target forward by source, and follow-up hits (docs/SERVER.md). The defaults are sized
    for qwen2.5-coder-0.5b on 2 CPU cores; ask for more with a faster model or machine
    (--files 2 --lines 12)."""
    import json

    from ..bench.editor import run_replays
    from ..proposers import MODES as SERVER_MODES

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        if m not in SERVER_MODES:
            raise MlxspecError(f"unknown mode {m!r} in --modes; choose from "
                               f"{', '.join(SERVER_MODES)}")
    package_list = [p.strip() for p in packages.split(",") if p.strip()]
    seed = 0 if seed is None else seed
    engine = load_engine(model, None, "none", None)
    report = run_replays(engine, mode_list, no_suffix, no_draft, n_files, n_lines, n_open,
                         package_list, seed, cache_reuse=cache_reuse,
                         no_follow_ahead=no_follow_ahead, read_ms=read_ms, accept_all=accept_all)
    if json_path:
        report["args"] = {"model": model, "modes": modes, "no_suffix": no_suffix,
                          "no_draft": no_draft, "cache_reuse": cache_reuse,
                          "no_follow_ahead": no_follow_ahead, "read_ms": read_ms,
                          "accept_all": accept_all, "files": n_files, "lines": n_lines,
                          "open": n_open, "packages": packages, "seed": seed}
        Path(json_path).write_text(json.dumps(report, indent=1, default=str))
        click.echo(f"wrote {json_path}", err=True)
