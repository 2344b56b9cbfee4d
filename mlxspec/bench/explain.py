"""Where a mode's decoding time goes against plain decoding's (`mlxspec bench --explain`).

Each generation's `Stats` splits its decoding time by kind of step (`stats.STEP_KINDS`): the
wall time of every step (from the commit before it) and the tokens it emitted. Against `none`
on the same prompts (the same tokens: every mode is exact), plain decoding costs `c` seconds a
token; a kind of step then gained or lost `seconds - tokens * c` (a plain step of `auto` that
is slower than `none`'s shows as a loss on "plain": the policy's own Python, an unpipelined
step; a rejected proposal's whole step is a loss; a catch-up is all loss). The kinds' gains and
losses add up to the mode's time less `none`'s, so the account is complete by construction.
"""

from __future__ import annotations

from ..stats import STEP_KINDS


def account(runs: list, base: list) -> dict | None:
    """Per kind of step: steps, tokens, seconds and the gain (+) or loss (-) against `base`'s
    (`none`'s) per-token time, as a share of `base`'s total time; None without a base or
    without the per-step figures (an earlier run's bench.json, a peer's runner)."""
    base_tokens = sum(len(r.tokens) for r in base)
    base_seconds = sum(r.decode_seconds for r in base)
    if not base_tokens or not base_seconds or not any(
            r.stats.get("seconds_by_step") for r in runs):
        return None
    per_token = base_seconds / base_tokens
    kinds = {}
    for kind in STEP_KINDS:
        steps = sum(r.stats.get("steps_by_kind", {}).get(kind, 0) for r in runs)
        if not steps:
            continue
        tokens = sum(r.stats.get("tokens_by_step", {}).get(kind, 0) for r in runs)
        seconds = sum(r.stats.get("seconds_by_step", {}).get(kind, 0.0) for r in runs)
        kinds[kind] = {"steps": steps, "tokens": tokens, "seconds": seconds,
                       "gain": (tokens * per_token - seconds) / base_seconds}
    seconds = sum(r.decode_seconds for r in runs)
    return {"none_seconds": base_seconds, "seconds": seconds,
            "time_vs_none": seconds / base_seconds, "kinds": kinds}


def _cell(kind: dict | None) -> str:
    if kind is None:
        return "—"
    return f"{100 * kind['gain']:+.1f} % ({kind['steps']} steps)"


def explain_table(results: dict) -> str:
    """A markdown table of every mode's account, per workload: its time against `none`'s and
    what each kind of step gained (+) or lost (-), as a share of `none`'s time."""
    lines = ["| workload | T | mode | time / none's | " + " | ".join(STEP_KINDS) + " |",
             "|---|---|---|---|" + "---|" * len(STEP_KINDS)]
    for r in results.values():
        for mode, m in r["modes"].items():
            acc = m.get("account")
            if mode == "none" or acc is None:
                continue
            cells = " | ".join(_cell(acc["kinds"].get(k)) for k in STEP_KINDS)
            lines.append(f"| {r['workload']} | {r['temperature']:g} | {mode} | "
                         f"{acc['time_vs_none']:.3f} | {cells} |")
    if len(lines) == 2:
        return "(no account: run `none` and another mode of mlxspec's)"
    return "\n".join(lines)
