"""Lookahead decoding: pool and window against a pure-Python reference, the proposal's tree
geometry, greedy token identity and sampled exactness."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, make_engine
from helpers import chi2_pvalue, generate_with, prompts

from mlxspec.proposers.lookahead import JacobiWindow, LookaheadProposer, NgramPool
from mlxspec.sampling import SamplingParams
from mlxspec.stats import Stats
from mlxspec.tree import depths

# ----------------------------------------------------------------------------- references


class RefPool:
    """One flat list of (key, continuation) in recency order."""

    def __init__(self, capacity):
        self.capacity, self.entries = capacity, []

    def add(self, key, cont):
        if (key, cont) in self.entries:
            self.entries.remove((key, cont))
        self.entries.append((key, cont))
        mine = [e for e in self.entries if e[0] == key]
        if len(mine) > self.capacity:
            self.entries.remove(mine[0])

    def get(self, key):
        return [c for k, c in reversed(self.entries) if k == key]


class RefWindow:
    """The window by absolute positions: level j holds guesses for positions
    root + 1 + j .. root + W + j; a new level's guess at position x is the target's output at
    position x - 1 of the previous top level."""

    def __init__(self, width, ngram, fill):
        self.w, self.n, self.fill = width, ngram, fill
        self.root = 0
        self.grid: list[dict[int, int]] = []

    def reset(self):
        self.grid = [dict(zip(range(1, self.w + 1), self.fill(self.w)))]
        self.root = 0

    def levels(self):
        return [[g[self.root + 1 + j + c] for c in range(self.w)] for j, g in enumerate(self.grid)]

    def advance(self, outputs, committed):
        grams = []
        top = len(self.grid) - 1
        if outputs is not None:
            new = {self.root + 1 + c + top + 1: outputs[c] for c in range(self.w)}
            if len(self.grid) == self.n - 1:
                for c in range(self.w):
                    first = self.grid[0][self.root + 1 + c]
                    rest = tuple(self.grid[j][self.root + 1 + c + j] for j in range(1, top + 1))
                    grams.append((first, rest + (outputs[c],)))
                self.grid = self.grid[1:] + [new]
            else:
                self.grid = self.grid + [new]
        self.root += committed
        for j, g in enumerate(self.grid):
            want = range(self.root + 1 + j, self.root + 1 + j + self.w)
            missing = [x for x in want if x not in g]
            filled = dict(zip(missing, self.fill(len(missing))))
            self.grid[j] = {x: g[x] if x in g else filled[x] for x in want}
        return grams


def _filler(seed):
    rng = random.Random(seed)
    return lambda n: [rng.randrange(50) for _ in range(n)]


def test_pool_matches_reference():
    rng = random.Random(0)
    for capacity in (1, 2, 5):
        pool, ref = NgramPool(capacity), RefPool(capacity)
        for _ in range(600):
            key, cont = rng.randrange(4), tuple(rng.randrange(3) for _ in range(2))
            pool.add(key, cont)
            ref.add(key, cont)
            k = rng.randrange(4)
            assert pool.get(k) == ref.get(k)
        stream = [rng.randrange(5) for _ in range(200)]
        nxt = 0
        for end in [*range(0, 200, 17), 200]:
            nxt = pool.add_stream(stream[:end], 3, nxt)
        for i in range(len(stream) - 2):
            ref.add(stream[i], tuple(stream[i + 1 : i + 3]))
        assert all(pool.get(k) == ref.get(k) for k in range(5))


@pytest.mark.parametrize("width,ngram", [(1, 2), (3, 2), (4, 3), (5, 5), (2, 4)])
def test_window_matches_reference(width, ngram):
    rng = random.Random(width * 10 + ngram)
    win, ref = JacobiWindow(width, ngram, _filler(1)), RefWindow(width, ngram, _filler(1))
    win.reset()
    ref.reset()
    for _ in range(300):
        assert win.levels == ref.levels()
        outputs = None if rng.random() < 0.2 else [rng.randrange(50) for _ in range(width)]
        committed = rng.randint(1, width + 3)
        assert win.advance(outputs, committed) == ref.advance(outputs, committed)
    assert win.full


def test_proposal_geometry():
    prop = LookaheadProposer(None, window=4, ngram=3, candidates=3, seed=1)
    prompt = [1, 2, 3, 1, 2, 4, 1, 5, 6, 1]
    prop.reset(prompt, SamplingParams())
    prop.window.levels = [[10, 11, 12, 13], [20, 21, 22, 23]]
    p = prop.propose(prompt, 4, None)
    d = depths(p.parents)
    tokens = p.tokens.tolist()

    def node_path(i):
        out = []
        while i >= 0:
            out.append(tokens[i])
            i = p.parents[i]
        return out[::-1]

    paths = {tuple(node_path(i)) for i in range(len(p))}
    for cont in [(5, 6), (2, 4), (2, 3)]:  # the pool's continuations of 1, newest first
        assert cont in paths
    cells = list(p.want_argmax)
    for c, i in enumerate(cells):  # top level, column c: position offset + 1 + c + 1
        assert d[i] == c + 2 and tokens[i] == 20 + c
        assert node_path(i) == [10, 11, 12, 13][: c + 1] + [20 + c]


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("model_type,wng", [("llama", (4, 4, 4)), ("qwen2", (6, 3, 8))])
def test_lookahead_greedy_is_token_identical(model_type, wng):
    target, _ = build_model(model_type, seed=11, scale=4.0)
    plain = make_engine(target, "none")
    stats = Stats()
    w, n, g = wng
    for prompt in prompts(50, seed=5):
        want = plain.generate(prompt, max_tokens=24).tokens
        got = generate_with(target, lambda: LookaheadProposer(target, w, n, g), prompt, 24,
                            SamplingParams(), stats=stats)
        assert got == want
    assert stats.accepted > 0


def test_lookahead_through_engine():
    target, _ = build_model("llama", seed=11, scale=4.0)
    plain = make_engine(target, "none")
    spec = make_engine(target, "lookahead")
    accepted = 0
    for prompt in prompts(50, seed=6):
        got = spec.generate(prompt, max_tokens=24)
        assert got.tokens == plain.generate(prompt, max_tokens=24).tokens
        accepted += got.stats.accepted
        assert got.stats.target_forwards < len(got.tokens) or got.stats.accepted == 0
    assert accepted > 0  # tree steps were taken and accepted, through the engine


def test_lookahead_sampled_is_exact():
    vocab = 6
    model, _ = build_model("llama", seed=21, vocab=vocab, scale=0.5)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1]
    sampling = SamplingParams(temperature=1.0)
    p1 = mx.softmax(model(mx.array(prompt)[None])[0, -1]).tolist()
    seconds = mx.softmax(model(mx.array([prompt + [a] for a in range(vocab)]))[:, -1], axis=-1)
    expected = np.outer(p1, np.ones(vocab)) * np.array(seconds.tolist())
    counts = np.zeros((vocab, vocab))
    stats = Stats()
    trials = 2000
    for t in range(trials):
        out = generate_with(model, lambda t=t: LookaheadProposer(model, 3, 3, 3, seed=t), prompt, 2,
                            sampling, seed=t, num_draft=2, stats=stats)
        counts[out[0], out[1]] += 1
    assert stats.accepted > trials // 10  # multi-token steps were exercised
    assert chi2_pvalue(counts.ravel(), expected.ravel()) > 1e-3


def test_bundled_model_greedy_is_token_identical():
    """Greedy lookahead and tree n-gram on the bundled model, 40 prompts."""
    from mlxspec.models import bundled_model_path

    path = bundled_model_path("target")  # shipped in models/: its absence is a failure
    from mlxspec.bench.workloads import build_workload
    from mlxspec.engine import Engine
    from mlxspec.loading import load_model
    from mlxspec.proposers.ngram_tree import TreeNgramProposer

    model, tok, _, _ = load_model(str(path))
    plain = Engine(model, tok, mode="none")
    items = build_workload("completion", 20, seed=1) + build_workload("chat", 20, seed=1)
    stats = Stats()
    for item in items:
        prompt = tok.encode(item.prompt)[-160:]
        want = plain.generate(prompt, max_tokens=16).tokens
        for factory in (lambda: LookaheadProposer(model), lambda: TreeNgramProposer()):
            got = generate_with(model, factory, prompt, 16, SamplingParams(), stats=stats)
            assert got[: len(want)] == want  # `want` stops at EOS; ours does not
    assert stats.accepted > 0
