"""The suffix store's cost: lookup + proposal per decoding step, and memory per stored token,
with about 1 M tokens of real text stored (the Python standard library's sources, tokenized by
the model's tokenizer).

    python bench/bench_suffix_store.py                 # the bundled model's tokenizer
    python bench/bench_suffix_store.py -m smollm2 --tokens 1000000

Steps are timed as decoding runs them: the context grows one token at a time, `available`
(the lookup and the chain) then `propose`, along documents that are in the store (a repeat:
long matches) and along text that is not (a fresh file: short matches or none).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sysconfig
import time
from pathlib import Path

import mlxspec  # noqa: F401  (OpenBLAS before mlx.core)
from mlxspec.proposers.suffix import SuffixProposer
from mlxspec.sampling import SamplingParams
from mlxspec.suffix_store import SuffixIndex


def stdlib_documents(tokenizer, want: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(stored, fresh): source files as token lists, about `want` tokens stored, a few more
    kept aside as text the store has never seen."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    random.Random(seed).shuffle(files)
    stored, fresh, total = [], [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")[:20000]
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < 200:
            continue
        if len(fresh) < 20:
            fresh.append(ids)
        elif total < want:
            stored.append(ids)
            total += len(ids)
        else:
            break
    return stored, fresh


def time_steps(proposer: SuffixProposer, docs: list[list[int]], steps: int, k: int,
               rng: random.Random) -> tuple[list[float], int]:
    """Seconds per step (available + propose), and how many steps had an offer."""
    times, offered = [], 0
    while len(times) < steps:
        doc = rng.choice(docs)
        start = rng.randrange(32, max(33, len(doc) - 200))
        for end in range(start, min(len(doc), start + 200)):
            context = doc[:end]
            t = time.perf_counter()
            offer = proposer.available(context, k)
            if offer:
                proposer.propose(context, k, None, next(iter(offer)))
            times.append(time.perf_counter() - t)
            offered += bool(offer)
    return times, offered


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="whose tokenizer (default: bundled)")
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from mlxspec.loading import load_model

    _, tokenizer, _, name = load_model(args.model)
    stored, fresh = stdlib_documents(tokenizer, args.tokens, args.seed)
    store = SuffixIndex(budget=max(args.tokens * 2, 1 << 20))
    t = time.perf_counter()
    for d in stored:
        store.add(d)
    add_s = time.perf_counter() - t
    print(f"tokenizer of {name}: {store.live:,} tokens stored in {len(store.docs)} documents "
          f"({add_s:.1f} s to add, {1e6 * add_s / store.live:.2f} us per token)")
    print(f"memory: {store.nbytes() / store.live:.1f} bytes per stored token "
          f"({store.nbytes() / 2**20:.1f} MiB of arrays for {store.live:,} tokens; the "
          f"array holds {len(store.tokens) - 1:,})")
    proposer = SuffixProposer(store=store, local=False)
    proposer.reset([0], SamplingParams())
    rng = random.Random(args.seed)
    for label, docs in (("repeat (text in the store)", stored), ("fresh (text not stored)", fresh)):
        times, offered = time_steps(proposer, docs, args.steps, args.k, rng)
        times.sort()
        print(f"{label}: lookup + proposal median {1e3 * statistics.median(times):.3f} ms, "
              f"p99 {1e3 * times[int(0.99 * len(times))]:.3f} ms, max {1e3 * times[-1]:.3f} "
              f"ms over {len(times)} steps; an offer at {100 * offered / len(times):.0f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
