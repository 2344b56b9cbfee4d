"""One rank of a two-process test run (tests/test_distributed.py): loads the model sharded and,
on rank 0, generates with each mode given, printing one JSON line per generation; the other
rank follows. Usage: python dist_rank.py MODEL DRAFT STRATEGY PROMPT MAX_TOKENS TEMP MODE..."""

import json
import os
import sys

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec import distributed


def main() -> None:
    model, draft, strategy, prompt, max_tokens, temp, *modes = sys.argv[1:]
    group = distributed.init_group()
    coord = distributed.Coordinator(group)
    engine = distributed.load(model, mode=modes[0], draft=draft or None, strategy=strategy,
                              coordinator=coord)
    if not coord.leader:
        seen: dict[int, list[int]] = {}
        distributed.follow(engine, lambda gid, out: seen.setdefault(gid, []).extend(out.tokens))
        for gid in sorted(seen):
            print(json.dumps({"rank": 1, "tokens": seen[gid]}), flush=True)
        os._exit(0)
    extra_eos = os.environ.get("DIST_TEST_EOS")  # rank 0 only, as chat's turn-end tokens
    if extra_eos:
        engine.tokenizer.eos_token_ids = set(engine.tokenizer.eos_token_ids) | {int(extra_eos)}
    try:  # refused on rank 0 before any rank hears of it: the followers go on
        engine.generate(prompt, max_tokns=4)
    except TypeError:
        pass
    else:
        raise SystemExit("a misspelt keyword was accepted")
    for mode in modes:
        if os.environ.get("DIST_TEST_DIE") == mode:  # the failure test: rank 0 dies here
            os._exit(7)
        engine.set_mode(mode)
        result = engine.generate(prompt, max_tokens=int(max_tokens), temperature=float(temp),
                                 seed=3)
        print(json.dumps({"mode": mode, "tokens": result.tokens,
                          "accepted": result.stats.accepted,
                          "strategy": coord.strategy}), flush=True)
    distributed.finish(engine)
    os._exit(0)


if __name__ == "__main__":
    main()
