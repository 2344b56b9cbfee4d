"""Tree forward, cache compaction, tree verification (greedy and sampled) and tree n-gram."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, make_engine
from helpers import chi2_pvalue, generate_with, prefill, prompts
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxspec import tree_verify
from mlxspec.proposers.base import Proposal
from mlxspec.proposers.ngram_tree import MultiNgramIndex, TreeNgramProposer
from mlxspec.sampling import SamplingParams
from mlxspec.stats import Stats
from mlxspec.tree import (
    TrieBuilder,
    ancestor_mask,
    compact_cache,
    depths,
    tree_forward,
    tree_step,
)
from mlxspec.tree_verify import TreeSpec, walk_greedy


def random_tree(rng: random.Random, size: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, size)]
    return [rng.randrange(vocab) for _ in range(size)], parents


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


# ----------------------------------------------------------------------------- geometry


def test_depths_and_mask():
    parents = [-1, 0, 0, -1, 2]
    assert depths(parents) == [1, 2, 2, 1, 3]
    m = ancestor_mask(parents)
    assert m[5].tolist() == [True, True, False, True, False, True]  # node 4: root, 0, 2, itself
    with pytest.raises(ValueError):
        depths([-1, 1])


def test_trie_builder_shares_prefixes_and_respects_budget():
    trie = TrieBuilder()
    assert trie.add_path([1, 2, 3]) == [0, 1, 2]
    assert trie.add_path([1, 2, 4]) == [0, 1, 3]
    assert trie.tokens == [1, 2, 3, 4] and trie.parents == [-1, 0, 1, 1]
    assert trie.add_path([5, 6], budget=5) == [4]
    assert len(trie) == 5


# ----------------------------------------------------------------------------- forward


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_model(request):
    model, _ = build_model(request.param, seed=3, scale=4.0)
    return request.param, model


def test_tree_forward_matches_sequential_forward(arch_model):
    _, model = arch_model
    rng = random.Random(5)
    for _ in range(3):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        tokens, parents = random_tree(rng, rng.randint(2, 14), 256)
        cache = prefill(model, prompt[:-1])
        logits = tree_forward(model, cache, prompt[-1], tokens, parents)
        assert cache[0].offset == len(prompt) - 1 + len(tokens) + 1
        # Every root-to-leaf path, fed sequentially from scratch: logits at each node agree.
        leaves = set(range(len(tokens))) - set(parents)
        for leaf in sorted(leaves):
            path = path_to(parents, leaf)
            ref = model(mx.array(prompt + [tokens[i] for i in path], mx.uint32)[None])[0]
            ours = logits[mx.array([0] + [i + 1 for i in path])]
            np.testing.assert_allclose(np.array(ours), np.array(ref[len(prompt) - 1 :]),
                                       atol=2e-4, rtol=2e-4)


def test_tree_forward_leaves_model_untouched(arch_model):
    _, model = arch_model
    sites = [m for _, m in model.named_modules() if isinstance(m, dict) and "rope" in m]
    before = [type(s.rope) for s in sites]
    tree_forward(model, prefill(model, [1, 2]), 3, [4, 5, 6], [-1, -1, 0])
    assert [type(s.rope) for s in sites] == before


def test_compaction_equals_fresh_prefill(arch_model):
    _, model = arch_model
    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(10)]
    tokens, parents = random_tree(rng, 9, 256)
    for node in [None] + list(range(len(tokens))):
        path = path_to(parents, node) if node is not None else []
        cache = prefill(model, prompt[:-1])
        tree_forward(model, cache, prompt[-1], tokens, parents)
        compact_cache(cache, len(prompt) - 1, [0] + [i + 1 for i in path], len(tokens) + 1)
        committed = prompt + [tokens[i] for i in path]
        fresh = prefill(model, committed)
        for c, f in zip(cache, fresh):
            assert c.offset == f.offset == len(committed)
            k, v = c.state[0][..., : c.offset, :], c.state[1][..., : c.offset, :]
            np.testing.assert_allclose(np.array(k), np.array(f.keys[..., : f.offset, :]),
                                       atol=1e-4)
            np.testing.assert_allclose(np.array(v), np.array(f.values[..., : f.offset, :]),
                                       atol=1e-4)
        # ... and the compacted cache decodes like the fresh one.
        nxt = mx.array([[5]], mx.uint32)
        np.testing.assert_allclose(np.array(model(nxt, cache=cache)),
                                   np.array(model(nxt, cache=fresh)), atol=2e-4)


def test_compaction_quantized_kv_cache():
    model, _ = build_model("llama", seed=3, hidden=128)
    prompt, tokens, parents = list(range(1, 9)), [9, 10, 11, 12], [-1, -1, 1, 2]
    cache = [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    model(mx.array(prompt[:-1])[None], cache=cache)
    tree_forward(model, cache, prompt[-1], tokens, parents)
    compact_cache(cache, 7, [0, 2, 3, 4], 5)
    fresh = [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]
    model(mx.array(prompt + [10, 11, 12])[None], cache=fresh)
    for c, f in zip(cache, fresh):
        assert c.offset == f.offset
        for a, b in zip(c.keys, f.keys):
            np.testing.assert_allclose(np.array(a[..., : c.offset, :]),
                                       np.array(b[..., : f.offset, :]), atol=1e-3)
    assert isinstance(make_prompt_cache(model)[0], KVCache)


# ----------------------------------------------------------------------------- greedy


def test_walk_greedy_longest_path_among_duplicates():
    # root's children: 0 (tok 7) and 1 (tok 7, duplicate); only node 1 continues matching.
    spec = TreeSpec([7, 7, 8, 9], [-1, -1, 1, 2])
    argmax = [7, 0, 8, 9, 4]  # by row
    assert walk_greedy(spec, argmax) == ([1, 2, 3], 4)
    assert walk_greedy(TreeSpec([7, 7, 8, 9], [-1, -1, 1, 2], [True, False, True, True]),
                       argmax) == ([0], 0)
    assert walk_greedy(TreeSpec([], []), [3]) == ([], 3)


def test_tree_step_greedy_cap_and_sync_free_result():
    model, _ = build_model("llama", seed=3, scale=4.0)
    prompt = [5, 6, 7]
    ref = []
    cache = prefill(model, prompt)
    tok = mx.argmax(model(mx.array([[8]]), cache=cache)[0, -1]).item()
    for _ in range(4):
        ref.append(tok)
        tok = mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]).item()
    ref.append(tok)
    # The right path, plus a wrong sibling at every level.
    tokens, parents = [], []
    for depth in range(4):
        parent = -1 if depth == 0 else len(tokens) - 1
        tokens += [(ref[depth] + 1) % 256, ref[depth]]
        parents += [parent, parent]
    for cap, want in [(None, 4), (2, 2), (0, 0)]:
        cache = prefill(model, prompt)
        seen = []
        prop = Proposal(mx.array(tokens, mx.uint32), parents=parents, want_argmax=(1,),
                        on_result=lambda a, p, s=seen: s.append((a, p)))
        new, n = tree_step(model, cache, 8, prop, SamplingParams(), None, max_accept=cap)
        assert n == want and new == ref[: want + 1]
        assert cache[0].offset == len(prompt) + 1 + n
        assert seen == [([ref[1]], [1, 3, 5, 7][:want])]


# ----------------------------------------------------------------------------- sampled


def _dist(rng: np.random.Generator, vocab: int) -> np.ndarray:
    return rng.dirichlet(np.full(vocab, 1.5))


class ToyModel:
    """P(next | prefix) for a tiny vocabulary, a fixed random table."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng, self.table = vocab, np.random.default_rng(seed), {}

    def __call__(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.table:
            self.table[prefix] = _dist(self.rng, self.vocab)
        return self.table[prefix]


def _run_sampled(toy: ToyModel, make_tree, trials: int, walk, seed: int) -> np.ndarray:
    """Counts of the first two emitted tokens over `trials` tree verifications."""
    v = toy.vocab
    counts = np.zeros((v, v))
    host = np.random.default_rng(seed + 1)
    key = mx.random.key(seed)
    for _ in range(trials):
        key, sub, tree_key = mx.random.split(key, 3)
        tokens, parents, q = make_tree(np.random.default_rng(int(mx.random.randint(0, 2**30, key=tree_key))))
        rows = [()] + [tuple(tokens[j] for j in path_to(parents, i)) for i in range(len(tokens))]
        p = mx.array(np.stack([toy(r) for r in rows]).astype(np.float32))
        spec = TreeSpec(tokens, parents)
        if q is None:
            outs = tree_verify.device_sampled_deterministic(spec, p, sub)
        else:
            outs = tree_verify.device_sampled_q(spec, p, mx.array(q.astype(np.float32)), sub)
        mx.eval(*outs)
        path, nxt = walk(spec, *[o.tolist() for o in outs], deterministic=q is None)
        emitted = [tokens[i] for i in path] + [nxt]
        if len(emitted) == 1:
            emitted.append(host.choice(v, p=toy((emitted[0],))))
        counts[emitted[0], emitted[1]] += 1
    return counts


def _pvalue(toy: ToyModel, counts: np.ndarray) -> float:
    v = toy.vocab
    expected = np.array([[toy(())[a] * toy((a,))[b] for b in range(v)] for a in range(v)])
    return chi2_pvalue(counts.ravel(), expected.ravel())


def _fixed_tree(rng):
    # Duplicate siblings (token 2 twice), several children, two levels.
    return [2, 0, 2, 3, 1, 3, 0], [-1, -1, -1, -1, 0, 0, 1], None


def _wrong_walk(spec, node_values, u, residual_draws, deterministic=True):
    """Deliberately wrong: accepts child x with probability p(x), forgetting to renormalize
    by the mass of the children already rejected."""
    children = spec.children
    path, row = [], 0
    while True:
        for c in children[row]:
            if u[c] < node_values[c]:
                path.append(c)
                row = c + 1
                break
        else:
            return path, residual_draws[row]


def test_sampled_tree_verification_is_exact_deterministic():
    toy = ToyModel(4, seed=0)
    counts = _run_sampled(toy, _fixed_tree, 3000, tree_verify.walk_sampled, seed=1)
    assert _pvalue(toy, counts) > 1e-3
    wrong = _run_sampled(toy, _fixed_tree, 3000, _wrong_walk, seed=1)
    assert _pvalue(toy, wrong) < 1e-6


def test_sampled_tree_verification_is_exact_specinfer():
    toy = ToyModel(4, seed=2)
    qs = ToyModel(4, seed=3)  # the draft's distributions (differ from the target's)

    def iid_tree(rng):
        tokens, parents, q = [], [], []
        for _ in range(3):  # 3 i.i.d. draws under the root, 2 under each of them
            x = int(rng.choice(4, p=qs(())))
            tokens.append(x)
            parents.append(-1)
            q.append(qs(()))
            me = len(tokens) - 1
            for _ in range(2):
                tokens.append(int(rng.choice(4, p=qs((x,)))))
                parents.append(me)
                q.append(qs((x,)))
        return tokens, parents, np.stack(q)

    counts = _run_sampled(toy, iid_tree, 2000, tree_verify.walk_sampled, seed=4)
    assert _pvalue(toy, counts) > 1e-3


# ----------------------------------------------------------------------------- tree n-gram


def test_multi_ngram_index_keeps_several_positions():
    idx = MultiNgramIndex(1, 2, max_positions=2)
    idx.extend([1, 2, 3, 1, 2, 4, 1, 2, 5, 1])
    conts = [c for _, c in idx.continuations([9, 1], 2)]
    # "1" was followed at positions 1, 4, 7 (only the last 2 are kept); newest first.
    assert conts == [[2, 5], [2, 4]]
    assert list(idx.continuations([1, 2], 1)) == [(2, [5]), (2, [4]), (1, [5]), (1, [4])]


def test_tree_ngram_proposal_contains_the_chain_proposal():
    from mlxspec.proposers.ngram import NgramProposer

    rng = random.Random(0)
    for _ in range(20):
        stream = [rng.randrange(6) for _ in range(60)]
        chain, tree = NgramProposer(), TreeNgramProposer(budget=12)
        chain.reset(stream, SamplingParams())
        tree.reset(stream, SamplingParams())
        a, b = chain.propose(stream, 4, None), tree.propose(stream, 4, None)
        assert (a is None) == (b is None)
        if a is not None:
            assert b.tokens.tolist()[: len(a)] == a.tokens.tolist()  # first branch = chain
            assert b.parents[: len(a)] == list(range(-1, len(a) - 1))
            assert len(b) <= 12 and max(depths(b.parents)) <= 4


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tree_ngram_greedy_is_token_identical(model_type):
    target, _ = build_model(model_type, seed=11, scale=4.0)
    plain = make_engine(target, "none")
    stats = Stats()
    for prompt in prompts(50, seed=2):
        want = plain.generate(prompt, max_tokens=24).tokens
        got = generate_with(target, lambda: TreeNgramProposer(budget=16), prompt, 24,
                            SamplingParams(), stats=stats)
        assert got == want
    assert stats.accepted > 0


def test_tree_ngram_through_engine():
    target, _ = build_model("llama", seed=11, scale=4.0)
    plain = make_engine(target, "none")
    spec = make_engine(target, "ngram", tree=True)
    accepted = 0
    for prompt in prompts(50, seed=3):
        got = spec.generate(prompt, max_tokens=24)
        assert got.tokens == plain.generate(prompt, max_tokens=24).tokens
        accepted += got.stats.accepted_by_source.get("ngram-tree", 0)
    assert accepted > 0  # tree proposals were verified and accepted, through the engine
