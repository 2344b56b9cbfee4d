"""Draft trees (`proposers/draft.py`): at every depth the draft's top tokens, the first one
continued, verified in one target forward. Token-identical to `none` at T = 0, exact in
distribution at T > 0 (chi-square, and the same test rejects a broken rule), the draft cache
right after a path through a sibling, and `auto` choosing the tree by itself where it can.
Also prompt lookup's chain continued by the draft (`propose_after`), exact the same ways."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import build_model, make_engine

from mlxspec import caches
from mlxspec.caches.prompt import PromptCache
from mlxspec.policy import FixedK
from mlxspec.proposal import LOOKUP_DRAFT
from mlxspec.proposers.draft import TREE, DraftModelProposer
from mlxspec.sampling import SamplingParams

PROMPTS = [list(range(10, 40)) * 2, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8, 9], [5] * 20]


@pytest.fixture(scope="module")
def pair():
    target, _ = build_model("llama", seed=1, scale=4.0)
    # a draft right often but not always: the target with noise on its weights
    draft, _ = build_model("llama", seed=1, scale=4.0)
    from mlx.utils import tree_flatten, tree_unflatten

    rng = np.random.default_rng(0)
    noisy = [(k, v + mx.array(rng.normal(0, 0.02, v.shape), v.dtype))
             for k, v in tree_flatten(draft.parameters())]
    draft.update(tree_unflatten(noisy))
    return target, draft


@pytest.mark.parametrize("width", [2, 3])
def test_draft_trees_are_token_identical_to_plain_decoding(pair, width):
    target, draft = pair
    none = make_engine(target)
    tree = make_engine(target, "draft", draft_model=draft, tree_width=width)
    accepted = 0
    for prompt in PROMPTS:
        want = none.generate(prompt, max_tokens=40).tokens
        got = tree.generate(prompt, max_tokens=40)
        assert got.tokens == want
        assert got.stats.drafted_by_source.get(TREE, 0) > 0
        accepted += got.stats.accepted
    assert accepted  # trees were accepted into, not only rejected


def test_a_path_through_a_sibling_keeps_the_draft_cache_exact(pair):
    """A tree whose accepted path leaves the continued token at depth 2 (the sibling taken):
    the draft keeps exactly the committed tokens it was fed, and its cache equals a fresh
    prefill of them."""
    _, draft = pair
    prompt = list(range(10, 40))
    d = DraftModelProposer(draft, tree_width=2)
    d.reset(prompt, SamplingParams())
    prop = d.propose(prompt, 4, None, TREE)
    tokens = prop.tokens.tolist()
    assert prop.parents == [-1, -1, 0, 0, 2, 2, 4, 4] and prop.draft_probs is None
    # accepted: depth 1's first token, then depth 2's sibling, then the target's next
    context = prompt + [tokens[0], tokens[3], 99]
    d.update(context, 2)
    assert d.cached == prompt + [tokens[0]]
    fresh = caches.make_cache(draft)
    draft(mx.array(d.cached)[None], cache=fresh)
    assert caches.offset(d.cache) == len(d.cached)
    np.testing.assert_allclose(np.array(d.cache[0].keys[..., : len(d.cached), :]),
                               np.array(fresh[0].keys[..., : len(d.cached), :]), atol=1e-5)
    # the next proposal feeds the rest and proposes as a fresh proposer would
    again = DraftModelProposer(draft, tree_width=2)
    again.reset(context, SamplingParams())
    assert d.propose(context, 3, None, TREE).tokens.tolist() == \
        again.propose(context, 3, None, TREE).tokens.tolist()


def test_auto_tries_the_tree_and_keeps_choosing_by_measurement(pair):
    """`auto` with its draft's variants on (`draft_variants`, off by default) explores the
    draft's tree on a request by itself (its priors alone would never try it), stays identical
    to `none`, and offers no tree in a shared batch."""
    from mlxspec.batch_step import BatchSpeculator

    target, draft = pair
    default = make_engine(target, "auto", draft_model=draft).proposer  # variants off by default
    assert set(default.available(PROMPTS[0], 4)) & {TREE, LOOKUP_DRAFT} == set()
    none = make_engine(target)
    auto = make_engine(target, "auto", draft_model=draft, draft_variants=True)
    tree_drafted = 0
    for prompt in PROMPTS * 2:
        want = none.generate(prompt, max_tokens=40).tokens
        got = auto.generate(prompt, max_tokens=40, prompt_cache=PromptCache())
        assert got.tokens == want
        tree_drafted += got.stats.drafted_by_source.get(TREE, 0)
    assert tree_drafted > 0 and auto.policy.measured(TREE) > 0
    batch = BatchSpeculator(target)
    rows = [auto.clone().join(batch, p, max_tokens=8) for p in PROMPTS[:2]]
    batch.step()
    assert all(TREE not in (r.available() or {}) for r in rows)


@pytest.mark.slow
def test_draft_tree_sampling_is_exact_and_the_test_rejects_a_broken_rule(monkeypatch):
    """Chi-square of the first N tokens against the exact distribution, at T = 1 with top-k
    and top-p, on a sliding-window model; the same test rejects a tree rule that forgets the
    rejected siblings (a rejected token drawn again). Without a seed: the rejection rule's
    tree walk (with one, the keyed draws: `test_seeded.py`)."""
    import exact as ex

    import mlxspec.tree_verify as tv

    target, draft, exact, _ = ex.setup("gemma3_text", "draft")
    engine = make_engine(target, "draft", draft_model=draft, vocab=ex.VOCAB, num_draft=4,
                         tree_width=2)
    stats = engine.generate(ex.PROMPT, max_tokens=ex.N, seed=0, **ex.SAMPLING).stats
    assert stats.drafted >= 4
    assert ex.min_pvalue(ex.sample_counts(engine, ex.RUNS, keyed=False), exact) > 1e-4

    def forgetful(spec, p, key):  # residual draws from p itself: rejected tokens come back
        pc, u, _ = real(spec, p, key)
        return pc, u, mx.random.categorical(mx.log(p + 1e-30))

    real = tv.device_sampled_deterministic
    monkeypatch.setattr("mlxspec.tree.device_sampled_deterministic", forgetful)
    assert ex.min_pvalue(ex.sample_counts(engine, ex.RUNS, keyed=False), exact) < 1e-4


# ----------------------------------------------------------------------------- lookup + draft


class Prefer(FixedK):
    """A fixed-k policy that takes `source` whenever it is offered (else plain)."""

    def __init__(self, source: str, k: int = 4):
        super().__init__(k)
        self.source = source

    def plan(self, available):
        n = (available or {}).get(self.source, 0)
        return (self.source, min(n, self.max_k)) if n else ("", 0)


def test_lookup_continued_by_the_draft_is_the_chain_then_the_draft(pair):
    """`propose_after`: the chain's tokens, then what the draft drafts after them; a rejection
    inside the chain leaves the draft holding exactly the committed tokens (a fresh prefill)."""
    _, draft = pair
    context = list(range(10, 40))
    chain = [7, 8]
    d = DraftModelProposer(draft)
    d.reset(context, SamplingParams())
    prop = d.propose_after(context, chain, 5, None)
    fresh = DraftModelProposer(draft)
    fresh.reset(context + chain, SamplingParams())
    assert prop.source == LOOKUP_DRAFT
    assert prop.tokens.tolist() == chain + fresh.propose(context + chain, 3, None).tokens.tolist()
    d.update(context + [7, 99], 1)  # the chain's first token accepted, then the target's own
    assert d.cached == context + [7] and caches.offset(d.cache) == len(d.cached)
    ref = caches.make_cache(draft)
    draft(mx.array(d.cached)[None], cache=ref)
    np.testing.assert_allclose(np.array(d.cache[0].keys[..., : len(d.cached), :]),
                               np.array(ref[0].keys[..., : len(d.cached), :]), atol=1e-5)


def test_lookup_continued_by_the_draft_is_token_identical(pair):
    """Forced wherever offered (lookup's match shorter than k), through the engine: identical
    to `none`, and it ran."""
    target, draft = pair
    none = make_engine(target)
    auto = make_engine(target, "auto", draft_model=draft, draft_variants=True)
    ran = 0
    for prompt in ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2] * 3, PROMPTS[0], PROMPTS[3]):
        want = none.generate(prompt, max_tokens=30).tokens
        got = auto.generate(prompt, max_tokens=30, policy=Prefer(LOOKUP_DRAFT),
                            prompt_cache=PromptCache())
        assert got.tokens == want
        ran += got.stats.drafted_by_source.get(LOOKUP_DRAFT, 0)
    assert ran > 0


@pytest.mark.slow
def test_lookup_continued_by_the_draft_samples_exactly():
    """Chi-square at T = 1 (a predicted output gives lookup its chains, the draft continues
    them, q one-hot on the chain's tokens), on a sliding-window model."""
    import exact as ex

    target, draft, exact, _ = ex.setup("gemma3_text", "draft")
    engine = make_engine(target, "auto", draft_model=draft, vocab=ex.VOCAB,
                         draft_variants=True)
    # (the predicted output matches the prompt's last 4 tokens, then offers 2: shorter than k)
    kwargs = {"prediction": [0, 1, 2, 3, 2, 1], "policy": Prefer(LOOKUP_DRAFT)}
    stats = engine.generate(ex.PROMPT, max_tokens=ex.N, seed=0, **ex.SAMPLING, **kwargs).stats
    assert stats.drafted_by_source.get(LOOKUP_DRAFT, 0) > 0
    assert ex.min_pvalue(ex.sample_counts(engine, ex.RUNS, **kwargs), exact) > 1e-4
