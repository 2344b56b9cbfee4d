"""QuantSpec's acceptance, memory and the hierarchical cache's own cost, at length.
QuantSpec on the bundled model: acceptance (by draft position) within the model's trained
positions, step times of every cache at longer contexts, the bytes each step reads (fp16 weights
and fp16 KV as on Apple silicon, next to what this CPU run used), KV memory, and how far the
lossless reference (the hierarchical cache's 8-bit view) is from the fp-cache target.

    python bench/bench_quantspec.py [--model DIR] [--contexts 256,512,896] \\
        [--long-contexts 4096,16384] [--prompts 8] [--max-tokens 64] [--num-draft 16]

Acceptance is measured only where prompt + generation fit in the model's trained positions
(`max_position_embeddings`, 1024 for the bundled target); longer contexts report step times
and memory (the cost of a step does not depend on what the text means). k is chosen so that
tokens per target forward stay below the cap k + 1, and acceptance is reported by position.
Every quantspec run is asserted token-identical to its reference (`none` + hierarchical cache).
Prints Markdown tables.

    python bench/bench_quantspec.py --cache-cost --model qwen2.5-coder-0.5b \\
        [--cost-contexts 1024,2048,4096] [--cost-reps 3] [--cost-tokens 32] [--cost-steps 64]

    python bench/bench_quantspec.py --acceptance --model qwen2.5-coder-0.5b \\
        --contexts 1024,4096 [--ks 2,4,8] [--weight-bits 4,8] [--prompts 4] [--max-tokens 32] \\
        [--skip-prompts N]

    python bench/bench_quantspec.py --verify-audit --model qwen2.5-coder-0.5b \\
        --contexts 4096,16384 [--ks 4,8] [--dtypes float16,bfloat16,float32]

`--acceptance` only measures QuantSpec's acceptance (by position, tokens per target forward)
at each k, for the draft as shipped and with 8-bit weights (the 4-bit KV view's own share),
every run asserted token-identical to `none` on the hierarchical cache.

`--cache-cost` only measures what the hierarchical cache costs a user who is not drafting:
prefill time and decode tokens/s of `none` on the hierarchical cache against `none` on the
plain cache, the same weights in one process, interleaved (the order alternates each
repetition); medians and ratios, in wall time and in this process's CPU time (steadier when
other work shares the machine); then decode steps of the two caches interleaved token by token
(`--cost-steps`), which keeps drift on a shared machine out of the decode ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core: imported first, see backend.py)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxspec import backend
from mlxspec.engine import Engine, PromptCache
from mlxspec.loading import load
from mlxspec.prefill import prefill
from mlxspec.quant.memory import format_memory_table, hybrid_memory_table, kv_memory_for_model
from mlxspec.quant.report import quality_report, step_bytes
from mlxspec.recipe.heldout import heldout_eval_texts


def context_prompts(engine, length: int, n: int) -> list[list[int]]:
    """`n` prompts of `length` held-out tokens, starting at different offsets."""
    text = "".join(heldout_eval_texts(max_bytes=max(256_000, length * 6 * (n + 1))))
    tokens = engine.encode(text)
    step = max(1, (len(tokens) - length) // max(1, n))
    return [tokens[i * step : i * step + length] for i in range(n)]


def mlx_lm_step_ms(model, prompt: list[int], max_tokens: int, bits: int) -> float:
    """Median decode step (ms) of mlx-lm's own loop with its QuantizedKVCache from the start."""
    times, last = [], None
    for _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, kv_bits=bits,
                           kv_group_size=64, quantized_kv_start=0, prefill_step_size=2048):
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return 1000 * statistics.median(times)


def run_context(engine, ref, length, args, trained: bool, mlx_lm: bool) -> list[str]:
    rows = {"none": [], "none+hier": [], "quantspec": []}
    peak = {}
    for prompt in context_prompts(engine, length, args.prompts if trained else args.long_prompts):
        for label, eng, mode in (("none", engine, "none"), ("none+hier", ref, "none"),
                                 ("quantspec", engine, "quantspec")):
            r = eng.generate(prompt, max_tokens=args.max_tokens, mode=mode,
                             prompt_cache=PromptCache())
            rows[label].append(r)
            peak[label] = max(peak.get(label, 0.0), r.stats.peak_memory_gb)
        assert rows["quantspec"][-1].tokens == rows["none+hier"][-1].tokens, "not lossless"
        assert rows["none+hier"][-1].stats.mode == "none"
    out = []
    for label, rs in rows.items():
        gen = sum(r.stats.generated_tokens for r in rs)
        secs = sum(r.stats.decode_seconds for r in rs)
        fwd = sum(r.stats.target_forwards for r in rs)
        drafted = sum(r.stats.drafted for r in rs)
        acc = (f"{100 * sum(r.stats.accepted for r in rs) / drafted:.1f}%"
               if drafted and trained else ("(untrained positions)" if drafted else "–"))
        by_pos = "–"
        if drafted and trained:
            a = [sum(x) for x in zip(*(r.stats.accepted_by_position for r in rs))]
            d = [sum(x) for x in zip(*(r.stats.drafted_by_position for r in rs))]
            by_pos = " ".join(f"{100 * ai / di:.0f}" for ai, di in zip(a, d) if di)
        out.append(f"| {length} | {label} | {1000 * secs / max(fwd, 1):.1f} | "
                   f"{gen / secs:.1f} | {acc} | {by_pos} | {gen / fwd:.2f} | "
                   f"{peak[label]:.3f} |")
    if mlx_lm:
        prompt = context_prompts(engine, length, 1)[0]
        for bits in (8, 4):
            ms = mlx_lm_step_ms(engine.model, prompt, min(args.max_tokens, 24), bits)
            out.append(f"| {length} | mlx-lm QuantizedKVCache {bits}-bit | {ms:.1f} | "
                       f"{1000 / ms:.1f} | – | – | 1.00 | – |")
    return out


def calibration_tokens(engine, n: int = 8, length: int = 256) -> list[list[int]]:
    """`n` sequences of `length` tokens of the bundled models' training text (not held out)."""
    from mlxspec.recipe.heldout import read_source, training_files

    tokens: list[int] = []
    for path in training_files()[::7]:
        tokens += engine.encode(read_source(path) or "")
        if len(tokens) >= n * length:
            break
    return [tokens[i * length : (i + 1) * length] for i in range(n)]


def compare_weights(engine, ref, contexts, args, G) -> None:
    """Acceptance of the draft with round-to-nearest vs GPTQ 4-bit MLP weights."""
    from mlxspec.proposers.quantspec import QuantSpecProposer
    from mlxspec.quant.report import quality_report

    calib = calibration_tokens(engine)
    print(f"k = {args.num_draft}, G = {G}; GPTQ calibrated on {len(calib)} x {len(calib[0])} "
          "training-text tokens\n")
    print("| draft weights | context | acceptance | acceptance by draft position (%) | "
          "tokens / target forward | draft greedy agreement | draft bits/token |")
    print("|---|---:|---:|---|---:|---:|---:|")
    text = "".join(heldout_eval_texts(max_bytes=16_000))
    window = engine.encode(text)[:1024]
    for method in ("rtn", "gptq"):
        t0 = time.perf_counter()
        prop = QuantSpecProposer(engine.model, group_size=G, weight_method=method,
                                 calibration=calib if method == "gptq" else None)
        made = time.perf_counter() - t0
        q = quality_report(engine.model, prop.draft_model, window, G)
        for length in contexts:
            rs = []
            for prompt in context_prompts(engine, length, args.prompts):
                engine.proposer = prop
                r = engine.generate(prompt, max_tokens=args.max_tokens, mode="quantspec",
                                    prompt_cache=PromptCache())
                want = ref.generate(prompt, max_tokens=args.max_tokens, prompt_cache=PromptCache())
                assert r.tokens == want.tokens, "not lossless"
                rs.append(r)
            drafted = sum(r.stats.drafted for r in rs)
            a = [sum(x) for x in zip(*(r.stats.accepted_by_position for r in rs))]
            d = [sum(x) for x in zip(*(r.stats.drafted_by_position for r in rs))]
            tpf = sum(r.stats.generated_tokens for r in rs) / sum(r.stats.target_forwards for r in rs)
            print(f"| {method} (built in {made:.1f} s) | {length} | "
                  f"{100 * sum(r.stats.accepted for r in rs) / drafted:.1f}% | "
                  + " ".join(f"{100 * ai / di:.0f}" for ai, di in zip(a, d) if di)
                  + f" | {tpf:.2f} | {q['greedy_agreement_draft_vs_fp']:.4f} | {q['draft']:.4f} |",
                  flush=True)


def _timed_run(eng, prompt, max_tokens) -> tuple[float, float, float, float]:
    """(prefill s, prefill CPU s, decode tok/s, decode CPU ms/token) of one generation. CPU
    time (this process, all threads) counts the work only, so it is steadier than wall time
    on a shared machine; the first output comes after the prefill and the first forward."""
    t0, first, out, n_first = time.process_time(), None, None, 0
    for out in eng.stream_steps(prompt, max_tokens=max_tokens, prompt_cache=PromptCache()):
        if out is not None and first is None:
            first, n_first = time.process_time(), out.stats.generated_tokens
    end, st = time.process_time(), out.stats
    return (st.prefill_seconds, first - t0, st.generated_tokens / st.decode_seconds,
            1000 * (end - first) / max(1, st.generated_tokens - n_first))


def cache_cost_table(engines: dict, lengths: list[int], reps: int, max_tokens: int,
                     prompts) -> None:
    """Markdown rows: every engine on the same prompt, interleaved (the order rotates each
    repetition: ABBA... for two), medians; ratios against the first engine."""
    print("| prompt tokens | cache | prefill s | prefill CPU s | decode tok/s | "
          "decode CPU ms/token | prefill vs plain (wall / CPU) | decode vs plain (wall / CPU) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    labels = list(engines)
    for length in lengths:
        prompt = prompts(length)
        runs: dict[str, list] = {k: [] for k in labels}
        for rep in range(reps):
            order = labels[rep % len(labels):] + labels[: rep % len(labels)]
            for label in order:
                runs[label].append(_timed_run(engines[label], prompt, max_tokens))
        med = {k: [statistics.median(x[i] for x in v) for i in range(4)] for k, v in runs.items()}
        base = med[labels[0]]
        for label in labels:
            m = med[label]
            print(f"| {length} | {label} | {m[0]:.2f} | {m[1]:.2f} | {m[2]:.2f} | {m[3]:.0f} | "
                  f"{m[0] / base[0]:.2f}x / {m[1] / base[1]:.2f}x | "
                  f"{m[2] / base[2]:.2f}x / {base[3] / m[3]:.2f}x |", flush=True)


def decode_steps_table(model, caches: dict, lengths: list[int], steps: int, chunk: int,
                       prompts) -> None:
    """`caches`: label -> a function of a proposer (None) that makes a fresh cache (an
    engine's `prefill.new_cache`). Decode steps of the caches interleaved token by token (one step of each in turn, each
    greedy on its own logits, after a prefill in chunks as `prefill.prefill` does): median ms
    per step, wall and CPU, ratios against the first cache. Interleaving single steps keeps
    whatever else runs on the machine out of the comparison."""
    print("| prompt tokens | cache | ms / step | CPU ms / step | tok/s vs plain (wall / CPU) |")
    print("|---:|---|---:|---:|---:|")
    labels = list(caches)
    for length in lengths:
        prompt = prompts(length)
        state = {}
        for label, make in caches.items():
            cache = make(None)
            for i in range(0, len(prompt) - 1, chunk):
                model(mx.array(prompt[i : min(i + chunk, len(prompt) - 1)])[None], cache=cache)
                mx.eval([c.state for c in cache])
            state[label] = [cache, prompt[-1], [], []]
        for i in range(steps + 2):
            for label in labels[i % len(labels):] + labels[: i % len(labels)]:
                st = state[label]
                w, c = time.perf_counter(), time.process_time()
                st[1] = mx.argmax(model(mx.array([[st[1]]]), cache=st[0])[0, -1]).item()
                if i >= 2:  # warm-up steps not counted
                    st[2].append(time.perf_counter() - w)
                    st[3].append(time.process_time() - c)
        med = {k: (1000 * statistics.median(v[2]), 1000 * statistics.median(v[3]))
               for k, v in state.items()}
        base = med[labels[0]]
        for label in labels:
            m = med[label]
            print(f"| {length} | {label} | {m[0]:.1f} | {m[1]:.1f} | "
                  f"{base[0] / m[0]:.2f}x / {base[1] / m[1]:.2f}x |", flush=True)


def cache_engines(args) -> dict:
    """The plain-cache engine and the hierarchical-cache engine on the same weights."""
    longest = max(int(c) for c in args.cost_contexts.split(",") if c) + args.cost_tokens + 1
    plain = load(args.model, mode="none", no_draft=True, max_context=longest)
    hier = Engine(plain.model, plain.tokenizer, mode="none", config=plain.config,
                  name=plain.name, max_context=longest, kv="hierarchical",
                  kv_group_size=args.group_size)
    return {"plain": plain, "hierarchical": hier}


def cache_cost(args, engines: dict | None = None) -> None:
    """What the hierarchical cache costs a user who is not drafting: `none` on it against
    `none` on the plain cache (one process, shared weights, interleaved; medians, ratios)."""
    engines = engines or cache_engines(args)
    plain = next(iter(engines.values()))
    dtype = str(next(iter(plain.model.parameters()["model"]["embed_tokens"].values())).dtype)
    print(f"{plain.name}, {dtype.rsplit('.', 1)[-1]}, backend {backend.device_name()}, "
          f"prefill_step_size {plain.prefill_step_size}, G = {args.group_size}, "
          f"{args.cost_reps} repetitions interleaved, {args.cost_tokens} tokens decoded, "
          "medians\n")
    lengths = [int(c) for c in args.cost_contexts.split(",") if c]
    prompts = lambda n: context_prompts(plain, n, 1)[0]  # noqa: E731
    if args.cost_reps:
        cache_cost_table(engines, lengths, args.cost_reps, args.cost_tokens, prompts)
    if args.cost_steps:
        print(f"\nDecode steps interleaved token by token ({args.cost_steps} steps each, "
              "medians):\n")
        decode_steps_table(plain.model,
                           {k: e.target.new_cache for k, e in engines.items()},
                           lengths, args.cost_steps, plain.prefill_step_size, prompts)


def copied(pc: PromptCache, engine, proposer) -> PromptCache:
    """A copy of a prefilled hierarchical cache for `engine`: the reference and every draft
    variant use the same cache (the proposer binds it), so one prefill serves them all."""
    out = PromptCache()
    out.hold(copy.deepcopy(pc.cache), pc.tokens, engine.target.cache_kind(proposer))
    return out


def acceptance(args) -> None:
    """QuantSpec's acceptance on real source text at real lengths: per prompt the `none`
    reference on the hierarchical cache, then quantspec at every k of `--ks` on the same cache
    (one prefill per prompt), each asserted token-identical to it.
    Variants: the draft as shipped (4-bit weights over the 4-bit KV view) and with 8-bit
    weights (what the 4-bit KV view alone costs)."""
    G = args.group_size
    ks = [int(k) for k in args.ks.split(",") if k]
    lengths = [int(c) for c in args.contexts.split(",") if c]
    longest = max(lengths) + args.max_tokens + 1
    base = load(args.model, mode="none", no_draft=True, max_context=longest)
    if args.dtype:  # before the drafts are built: their weights and scales in that dtype
        base.model.set_dtype(getattr(mx, args.dtype))
    common = dict(config=base.config, name=base.name, max_context=longest)
    buffer = args.buffer_size  # None: 2 G
    ref = Engine(base.model, base.tokenizer, mode="none", kv="hierarchical", kv_group_size=G,
                 kv_buffer_size=buffer, **common)
    variants = {f"{bits}-bit weights + {4 if view == 'draft' else 8}-bit KV": Engine(
        base.model, base.tokenizer, mode="quantspec", num_draft=max(ks), group_size=G,
        buffer_size=buffer, weight_bits=bits, draft_kv=view, **common)
        for bits in [int(b) for b in args.weight_bits.split(",")]
        for view in args.draft_kv.split(",")}
    dtype = str(next(iter(base.model.parameters()["model"]["embed_tokens"].values())).dtype)
    print(f"{base.name}, {dtype.rsplit('.', 1)[-1]}, G = {G}, buffer {buffer or 2 * G}, "
          f"{args.prompts} prompts of held-out source per length, {args.max_tokens} tokens "
          "each, greedy\n")
    print("| context | draft | k | acceptance | by draft position (%) | tokens / target forward "
          "| identical |")
    print("|---:|---|---:|---:|---|---:|---|")
    for length in lengths:
        stats: dict = {}
        prompts = context_prompts(base, length, args.prompts)
        for n, prompt in enumerate(prompts[args.skip_prompts:], args.skip_prompts + 1):
            prefilled = PromptCache()
            prefill(ref.target, prompt, prefilled, None)
            want = ref.generate(prompt, max_tokens=args.max_tokens,
                                prompt_cache=copied(prefilled, ref, None))
            for label, eng in variants.items():
                for k in ks:
                    r = eng.generate(prompt, max_tokens=args.max_tokens, num_draft=k,
                                     prompt_cache=copied(prefilled, eng, eng.proposer))
                    assert r.stats.cached_tokens == len(prompt) - 1, "prefilled again"
                    stats.setdefault((label, k), []).append((r, r.tokens == want.tokens))
            # progress, what a run stopped early still measured, and what was generated
            # (acceptance means little on a degenerate continuation)
            went_on = base.tokenizer.decode(want.tokens)
            print(f"after {n} prompt(s) of {length} tokens (this one went on {went_on!r}):",
                  *_acceptance_rows(length, stats), sep="\n", file=sys.stderr, flush=True)
        print(*_acceptance_rows(length, stats), sep="\n", flush=True)


def verify_audit(args) -> None:
    """Exactness of the hierarchical cache's attention at length, in each dtype: a verify of
    k + 1 rows against k + 1 single-token steps at the same positions, over a cache of the
    model's attention shape filled to each context (random keys and values: the property is
    one of summation order, not of the numbers). Positions cover a whole group period, so
    verifies that straddle a flush (rows reading different quantized prefixes) are among them,
    and from 4,096 tokens up the codes span several tiles. Half precision must be bit for
    bit; float32 to its rounding (OpenBLAS rounds a product of few rows and of many
    differently, as for mlx-lm's own cache)."""
    from mlxspec.quant.hierarchical_cache import HierarchicalKVCache, hierarchical_attention

    cfg = load(args.model, mode="none", no_draft=True).config
    heads, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    G, ks = args.group_size, [int(k) for k in args.ks.split(",") if k]
    print(f"{args.model}: attention of {heads} query heads over {n_kv} KV heads x {d}, G = {G}; "
          f"verifies of k + 1 rows against single steps, k in {ks}\n")
    print("| context | dtype | verifies checked | straddling a flush | identical | max abs diff |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in [int(c) for c in args.contexts.split(",") if c]:
        for name in args.dtypes.split(","):
            dtype = getattr(mx, name)
            mx.random.seed(length)
            extra = max(ks) + 1 + G + 8
            k = (mx.random.normal((1, n_kv, length + extra, d)) * 2).astype(dtype)
            v = mx.random.normal((1, n_kv, length + extra, d)).astype(dtype)
            q = mx.random.normal((1, heads, length + extra, d)).astype(dtype)
            base = HierarchicalKVCache(G, auto_commit=True)
            for i in range(0, length, 2048):
                base.update_and_fetch(k[..., i : min(i + 2048, length), :],
                                      v[..., i : min(i + 2048, length), :])
                mx.eval(base.state)
            checked = straddled = same = 0
            worst = 0.0
            # the next position whose quantized prefix grows: verifies ending past it straddle
            flush = next(p for p in range(length + 1, length + G + 1)
                         if base.quantized_before(p) > base.quantized_before(p - 1))
            for kk in ks:
                shifts = sorted({*range(0, G + 1, max(1, G // 8)),
                                 *(flush - length - j for j in range(1, kk + 1) if flush - length >= j)})
                for shift in shifts:
                    start, outs, split = length + shift, [], False
                    for rows in ((kk + 1,), (1,) * (kk + 1)):
                        c = copy.deepcopy(base)
                        if start > length:
                            c.update_and_fetch(k[..., length:start, :], v[..., length:start, :])
                        out, done, before = [], start, c.split_forwards
                        for n in rows:
                            kv, _ = c.update_and_fetch(k[..., done : done + n, :],
                                                       v[..., done : done + n, :])
                            out.append(hierarchical_attention(
                                q[:, :, done : done + n], kv, d**-0.5, "causal" if n > 1 else None))
                            done += n
                        outs.append(mx.concatenate(out, axis=2))
                        split = split or (len(rows) == 1 and c.split_forwards > before)
                    checked += 1
                    straddled += split
                    same += mx.array_equal(outs[0], outs[1]).item()
                    worst = max(worst, mx.abs(outs[0].astype(mx.float32)
                                              - outs[1].astype(mx.float32)).max().item())
            print(f"| {length} | {name} | {checked} | {straddled} | {same}/{checked} | "
                  f"{worst:.2g} |", flush=True)
            if dtype != mx.float32 and same != checked:
                raise SystemExit(f"{name} at {length}: a verify differs from its single steps")


def _acceptance_rows(length: int, stats: dict) -> list[str]:
    rows = []
    for (label, k), runs in stats.items():
        rs = [r.stats for r, _ in runs]
        drafted, accepted = sum(s.drafted for s in rs), sum(s.accepted for s in rs)
        a = [sum(x) for x in zip(*(s.accepted_by_position for s in rs))]
        d = [sum(x) for x in zip(*(s.drafted_by_position for s in rs))]
        tpf = sum(s.generated_tokens for s in rs) / max(1, sum(s.target_forwards for s in rs))
        same = sum(ok for _, ok in runs)
        rows.append(f"| {length} | {label} | {k} | {100 * accepted / max(1, drafted):.1f}% | "
                    + " ".join(f"{100 * x / y:.0f}" for x, y in zip(a, d) if y)
                    + f" | {tpf:.2f} | {same}/{len(runs)} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="256,512,896",
                    help="prompt lengths within the trained positions (acceptance)")
    ap.add_argument("--long-contexts", default="4096,16384",
                    help="longer prompt lengths (step times and memory only)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--long-prompts", type=int, default=2)
    ap.add_argument("--skip-prompts", type=int, default=0,
                    help="--acceptance: run only the prompts after the first N of --prompts "
                         "(to finish a long run another session started)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--draft-kv", default="draft",
                    help="--acceptance: the KV views the draft reads, comma-separated: draft "
                         "(4-bit, shipped), target (8-bit: what the 4-bit weights alone cost)")
    ap.add_argument("--buffer-size", type=int, default=None,
                    help="--acceptance: the full-precision buffer (default 2 x --group-size)")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's quantized caches")
    ap.add_argument("--compare-weights", action="store_true",
                    help="only compare round-to-nearest and GPTQ draft weights (acceptance)")
    ap.add_argument("--cache-cost", action="store_true",
                    help="only measure the hierarchical cache's own cost under `none` "
                         "(prefill time and decode tok/s against the plain cache)")
    ap.add_argument("--acceptance", action="store_true",
                    help="only QuantSpec's acceptance at --contexts for each k of --ks")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--weight-bits", default="4,8",
                    help="draft weight bits compared by --acceptance (8: the KV view alone)")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="--acceptance: the model's dtype (default: as loaded, float32 on the CPU)")
    ap.add_argument("--verify-audit", action="store_true",
                    help="only the attention's exactness at --contexts: verifies of k + 1 rows "
                         "(k of --ks) against single steps, in each of --dtypes")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--memory", action="store_true",
                    help="only the KV memory table at --memory-contexts")
    ap.add_argument("--memory-contexts", default="4096,8192,16384")
    ap.add_argument("--cost-contexts", default="1024,2048,4096")
    ap.add_argument("--cost-reps", type=int, default=3,
                    help="repetitions of each whole generation (0: skip that table)")
    ap.add_argument("--cost-tokens", type=int, default=32)
    ap.add_argument("--cost-steps", type=int, default=64,
                    help="decode steps per cache interleaved token by token (0: skip)")
    args = ap.parse_args()
    if args.cache_cost:
        cache_cost(args)
        return
    if args.acceptance:
        acceptance(args)
        return
    if args.verify_audit:
        verify_audit(args)
        return
    if args.memory:
        model = load(args.model, mode="none", no_draft=True).model
        lengths = tuple(int(c) for c in args.memory_contexts.split(",") if c)
        print(f"KV bytes of every layer, fp16 keys/values, G = {args.group_size}:\n")
        print(format_memory_table(kv_memory_for_model(model, lengths,
                                                      group_size=args.group_size)))
        return
    contexts = [int(c) for c in args.contexts.split(",") if c]
    long_contexts = [int(c) for c in args.long_contexts.split(",") if c]
    G = args.group_size
    longest = max(contexts + long_contexts) + args.max_tokens + 1
    engine = load(args.model, mode="quantspec", num_draft=args.num_draft, max_context=longest,
                  group_size=G)
    # The reference shares the loaded weights (note: `load(..., kv="hierarchical")` with mode
    # "none" does not reach the Engine's kv option, so it is built directly).
    ref = Engine(engine.model, engine.tokenizer, mode="none", config=engine.config,
                 name=engine.name, max_context=longest, kv="hierarchical", kv_group_size=G)
    trained_positions = engine.config.get("max_position_embeddings") or 1024
    proposer = engine.proposer
    dtype = str(next(iter(engine.model.parameters()["model"]["embed_tokens"].values())).dtype)
    dtype = dtype.rsplit(".", 1)[-1]
    kv_dtype = getattr(mx, dtype)

    if args.compare_weights:
        compare_weights(engine, ref, contexts, args, G)
        return
    print(f"k = {args.num_draft} (tokens per target forward are capped at {args.num_draft + 1}), "
          f"G = {G}, model weights and KV in {dtype} on this machine, "
          f"trained positions {trained_positions}.\n")
    print("## Acceptance and step time\n")
    print("| context | mode | ms / target forward | tok/s | acceptance | acceptance by "
          "draft position (%) | tokens / target forward | peak GB |")
    print("|---:|---|---:|---:|---:|---|---:|---:|")
    for length in contexts + long_contexts:
        trained = length + args.max_tokens <= trained_positions
        for line in run_context(engine, ref, length, args, trained, not args.no_mlx_lm):
            print(line, flush=True)

    print("\n## Bytes read per step (weights + KV)\n")
    print("| context | draft step | verify step | plain step | draft / plain | assumes |")
    print("|---:|---:|---:|---:|---:|---|")
    for length in contexts + long_contexts:
        for label, w, kv in (("fp16 weights + fp16 KV (Apple silicon, computed)", mx.float16,
                              mx.float16),
                             (f"{dtype} weights + {dtype} KV (this CPU run)", None, kv_dtype)):
            b = step_bytes(engine.model, proposer.draft_model, length, G, kv_dtype=kv,
                           weight_dtype=w)
            print(f"| {length} | {b['draft_step'] / 1e6:.1f} MB | {b['verify_step'] / 1e6:.1f} MB"
                  f" | {b['plain_step'] / 1e6:.1f} MB | {b['draft_step'] / b['plain_step']:.2f} |"
                  f" {label} |")

    print("\n## KV memory (fp16, all layers)\n")
    try:
        print(format_memory_table(kv_memory_for_model(engine.model, (1024, 8192, 32768))))
    except ValueError as e:  # mlx-lm's QuantizedKVCache needs head_dim divisible by 32/64
        print(f"(not measurable for this model: {e})")

    print("\n## A hybrid model: Qwen3-Next-80B-A3B's shape (12 of 48 layers attend)\n")
    # 36 Gated DeltaNet layers: state 32 heads x 128 x 128 and a conv state of 3 x 8192, fp16.
    recurrent = 36 * (32 * 128 * 128 + 3 * 8192) * 2
    print("| context | fp16 KV | hierarchical KV | recurrent state | total fp16 | "
          "total quantspec | saved |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in hybrid_memory_table(12, 2, 256, recurrent):
        print(f"| {r['length']} | {r['fp16_kv'] / 2**20:.0f} MiB | "
              f"{r['hierarchical_kv'] / 2**20:.0f} MiB | {r['recurrent'] / 2**20:.0f} MiB | "
              f"{r['total_fp16'] / 2**20:.0f} MiB | {r['total_hierarchical'] / 2**20:.0f} MiB | "
              f"{100 * r['saved_fraction']:.0f}% |")

    print("\n## Quality within the trained positions (held-out text)\n")
    text = "".join(heldout_eval_texts(max_bytes=64_000))
    tokens = engine.encode(text)
    windows = [tokens[i : i + trained_positions]
               for i in range(0, len(tokens) - trained_positions, trained_positions)][:4]
    agg: dict[str, list[float]] = {}
    for w in windows:
        q = quality_report(engine.model, proposer.draft_model, w, G)
        for key, value in q.items():
            agg.setdefault(key, []).append(value)
    print(f"{len(windows)} windows of {trained_positions} tokens:\n")
    for key, values in agg.items():
        print(f"- {key}: {statistics.mean(values):.4f}")
    print(f"\npeak memory of the whole run: {backend.peak_memory_gb():.3f} GB")


if __name__ == "__main__":
    main()
