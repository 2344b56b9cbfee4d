"""Losslessness of the engine: every mode's greedy output equals plain decoding, which equals
mlx_lm.generate; the KV cache after any accept/reject sequence equals a fresh prefill."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from conftest import build_model, decode, make_engine
from helpers import prompts
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.policy import FixedK
from mlxspec.proposers.base import Proposal, Proposer
from mlxspec.sampling import SamplingParams
from mlxspec.stats import Stats


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    target, _ = build_model(request.param, seed=11, scale=4.0)
    draft, _ = build_model(request.param, seed=12, layers=1, scale=4.0)
    return request.param, target, draft


def test_none_matches_mlx_lm_generate(arch):
    _, target, _ = arch
    engine = make_engine(target, "none")
    for prompt in prompts(50, seed=1):
        ours = engine.generate(prompt, max_tokens=24).tokens
        ref = [t for t, _ in generate_step(mx.array(prompt), target, max_tokens=24)]
        assert ours == ref


@pytest.mark.parametrize("mode", ["ngram", "draft", "draft-self"])
def test_speculative_greedy_is_token_identical(arch, mode):
    _, target, draft = arch
    plain = make_engine(target, "none")
    if mode == "draft-self":  # the target drafting for itself: every proposal is accepted
        spec = make_engine(target, "draft", draft_model=target, num_draft=5)
    else:
        spec = make_engine(target, mode, draft_model=draft, num_draft=4)
    accepted = 0
    for prompt in prompts(50, seed=2):
        want = plain.generate(prompt, max_tokens=24).tokens
        got = spec.generate(prompt, max_tokens=24)
        assert got.tokens == want
        accepted += got.stats.accepted
        assert got.stats.generated_tokens == len(want)
    if mode != "draft":  # a random draft rarely agrees; the others must accept something
        assert accepted > 0
    if mode == "draft-self":
        assert spec.generate(prompts(1)[0], max_tokens=24).stats.acceptance_rate == 1.0


class ScriptedProposer(Proposer):
    """Proposes a random mix of right and wrong tokens, to drive every accept/reject pattern."""

    name = "scripted"

    def __init__(self, reference: list[int], prompt_len: int, seed: int):
        self.reference, self.prompt_len, self.rng = reference, prompt_len, random.Random(seed)

    def reset(self, prompt, sampling):
        pass

    def propose(self, context, num_draft, key, source=None):
        pos = len(context) - self.prompt_len
        right = self.reference[pos : pos + num_draft]
        tokens = [t if self.rng.random() < 0.7 else (t + 1) % 256 for t in right]
        return Proposal(tokens=tokens, source="scripted") if tokens else None

    def update(self, context, num_accepted):
        pass


def _cache_arrays(cache, length):
    return [(c.keys[..., :length, :], c.values[..., :length, :]) for c in cache]


@pytest.mark.parametrize("seed", range(6))
def test_rollback_leaves_cache_as_fresh_prefill(arch, seed):
    _, target, _ = arch
    prompt = prompts(1, seed=seed)[0]
    reference = make_engine(target, "none").generate(prompt, max_tokens=30).tokens
    cache = make_prompt_cache(target)
    target(mx.array(prompt[:-1])[None], cache=cache)
    context = list(prompt)
    stats = Stats()
    steps = decode(target, cache, context, ScriptedProposer(reference, len(prompt), seed),
                               FixedK(random.Random(seed).randint(1, 6)), SamplingParams(), 30,
                               0, stats)
    for _ in steps:
        # Invariant after every step: the cache holds every committed token but the last.
        assert cache[0].offset == len(context) - 1
    assert context[len(prompt):] == reference
    assert 0 < stats.accepted < stats.drafted  # both accepts and rejects happened
    fresh = make_prompt_cache(target)
    target(mx.array(context[:-1])[None], cache=fresh)
    for (k1, v1), (k2, v2) in zip(_cache_arrays(cache, len(context) - 1),
                                  _cache_arrays(fresh, len(context) - 1)):
        assert mx.allclose(k1, k2, atol=1e-4).item() and mx.allclose(v1, v2, atol=1e-4).item()


@pytest.mark.parametrize("mode", ["ngram", "none", "auto"])
def test_prompt_cache_reuse_is_exact(mode):
    """Also after a pipelined stretch ran to max_tokens (its last step is never queued)."""
    target, _ = build_model("llama", seed=3, scale=4.0)
    engine = make_engine(target, mode)
    first = prompts(1, seed=5)[0]
    out = engine.generate(first, max_tokens=20)
    follow = first + out.tokens + [7, 8, 9]
    reused = engine.generate(follow, max_tokens=20)
    assert reused.stats.cached_tokens >= len(first)
    fresh = make_engine(target, mode).generate(follow, max_tokens=20)
    assert fresh.stats.cached_tokens == 0
    assert reused.tokens == fresh.tokens


def test_stats_are_consistent(llama_pair):
    target, draft = llama_pair
    engine = make_engine(target, "draft", draft_model=target, num_draft=3)
    s = engine.generate([5, 6, 7], max_tokens=16).stats
    assert s.generated_tokens == 16
    assert sum(s.drafted_by_position) == s.drafted and sum(s.accepted_by_position) == s.accepted
    assert s.mean_accepted_length == pytest.approx(16 / s.target_forwards)
    assert s.target_forwards < 16  # self-drafting accepts everything: fewer forwards than tokens
    d = s.to_dict()
    for name in ("prompt_tokens", "generated_tokens", "target_forwards", "drafted", "accepted",
                 "acceptance_rate", "mean_accepted_length", "prompt_tps", "generation_tps",
                 "peak_memory_gb"):
        assert name in d


def test_eos_and_stop_strings(llama_pair):
    target, _ = llama_pair
    engine = make_engine(target, "none")
    base = engine.generate([1, 2, 3], max_tokens=20)
    eos = base.tokens[5]
    engine.tokenizer.eos_token_ids = {eos}
    cut = engine.generate([1, 2, 3], max_tokens=20)
    assert cut.finish_reason == "stop"
    assert cut.tokens == base.tokens[: base.tokens.index(eos)]
    engine.tokenizer.eos_token_ids = set()
    text = base.text
    stop = text[6:9]
    stopped = engine.generate([1, 2, 3], max_tokens=20, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.find(stop)]
    streamed = "".join(engine.stream([1, 2, 3], max_tokens=20, stop=stop))
    assert streamed == stopped.text


class FlakyModel:
    """Wraps a model; raises KeyboardInterrupt after its `fail_at`-th forward has run."""

    def __init__(self, model):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.calls, self.fail_at = 0, None

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt
        return out


@pytest.mark.parametrize("mode", ["none", "ngram"])
def test_interrupted_generation_never_poisons_the_prompt_cache(mode):
    target, _ = build_model("llama", seed=5, scale=4.0)
    flaky = FlakyModel(target)
    engine = make_engine(flaky, mode, num_draft=3)
    reference = make_engine(target, mode)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    for fail_at in (1, 3, 6):  # during prefill, and in the middle of decoding steps
        flaky.calls, flaky.fail_at = 0, fail_at
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompt, max_tokens=20)
        flaky.fail_at = None
        again = prompt + [6, 7]
        assert engine.generate(again, max_tokens=15).tokens == reference.generate(
            again, max_tokens=15).tokens


def test_failing_progress_callback_during_prefill():
    target, _ = build_model("llama", seed=6, scale=4.0)
    engine = make_engine(target, "none", prefill_step_size=4)
    prompt = list(range(1, 30))

    def progress(done, total):
        if done >= 8:
            raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError):
        engine.generate(prompt, max_tokens=5, progress=progress)
    want = make_engine(target, "none").generate(prompt, max_tokens=10).tokens
    assert engine.generate(prompt, max_tokens=10).tokens == want


# ----------------------------------------------------------------------------- plain stretches


class CountingModel:
    """Wraps a model; records len(context) at every one-token forward (when it is queued)."""

    def __init__(self, model, context: list[int]):
        self.model, self.layers, self.args = model, model.layers, model.args
        self.context, self.calls = context, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append((inputs.shape[1], len(self.context)))
        return self.model(inputs, *args, **kwargs)


class LateProposer(Proposer):
    """Offers nothing until the context holds `start` tokens, then the right continuation."""

    name = "late"

    def __init__(self, reference: list[int], prompt_len: int, start: int):
        self.reference, self.prompt_len, self.start = reference, prompt_len, start
        self.proposed_at: list[int] = []
        self.cache_offsets: list[int] = []
        self.cache = None

    def available(self, context, cap):
        return {"late": cap} if len(context) >= self.start else {}

    def propose(self, context, num_draft, key, source=None):
        self.proposed_at.append(len(context))
        self.cache_offsets.append(self.cache[0].offset)
        pos = len(context) - self.prompt_len
        return Proposal(tokens=self.reference[pos : pos + num_draft], source="late")


def test_plain_stretch_is_pipelined_and_hands_back_at_once(llama_pair):
    """While nothing is offered the loop runs pipelined (the next forward is queued before the
    current token is read); the token after which a source offers ends the stretch at once:
    the queued forward is read back as the next token, then the proposal is verified."""
    target, _ = llama_pair
    prompt = [7, 3, 9, 1]
    reference = make_engine(target, "none").generate(prompt, max_tokens=30).tokens
    start = len(prompt) + 10
    context = list(prompt)
    model = CountingModel(target, context)
    cache = make_prompt_cache(target)
    target(mx.array(prompt[:-1])[None], cache=cache)
    proposer = LateProposer(reference, len(prompt), start)
    proposer.cache = cache
    stats = Stats()
    for _ in decode(model, cache, context, proposer, FixedK(4), SamplingParams(), 30,
                                0, stats):
        pass
    assert context[len(prompt):] == reference  # nothing lost, nothing duplicated
    # The stretch saw `start` tokens, asked, stopped, and read back the queued token.
    assert proposer.proposed_at[0] == start + 1
    assert proposer.cache_offsets[0] == start  # the invariant holds when speculation resumes
    assert stats.accepted > 0
    # Pipelined: the forward for token i+1 was queued while the context still lacked token i.
    one_token = [n for width, n in model.calls if width == 1]
    assert one_token[:3] == [len(prompt), len(prompt), len(prompt) + 1]


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_stretches_hand_back_to_ngram_and_stay_exact(arch, mode, monkeypatch):
    """Greedy output equals `none` while plain stretches and n-gram steps alternate; n-gram
    drafts, and gets tokens accepted, right after stretches."""
    _, target, _ = arch
    plain = make_engine(target, "none")
    spec = make_engine(target, mode, num_draft=4, min_ngram=2)
    handed_back = accepted = 0
    for prompt in prompts(30, seed=7):
        want = plain.generate(prompt, max_tokens=40).tokens
        got, steps, before = [], [], (0, 0, 0)
        for out in spec.stream_steps(prompt, max_tokens=40):  # an output per step
            got += out.tokens
            s = out.stats  # (drafted in all, and by n-gram lookup: drafted, accepted)
            now = (s.drafted, s.drafted_by_source.get("ngram", 0),
                   s.accepted_by_source.get("ngram", 0))
            steps.append(tuple(n - b for n, b in zip(now, before)))
            before = now
        assert got == want
        for previous, step in zip(steps, steps[1:]):
            if previous[0] == 0 and step[1] > 0:  # a plain step, then an n-gram proposal
                handed_back += 1
                accepted += step[2]
    assert handed_back > 0 and accepted > 0


def test_overlapping_stop_strings_cut_at_the_earliest_match():
    """The engine cuts where the server's paths cut (mlxspec/stopstrings.py): at the earliest
    match in the text, whatever the order of the `stop` list."""
    target, _ = build_model("llama", seed=3, scale=4.0)
    engine = make_engine(target, "none")
    full = engine.generate([5, 6, 7], max_tokens=12).text
    a, b = full[2:4], full[3:5]  # two stop strings that overlap in the text
    for stops in ([b, a], [a, b]):
        out = engine.generate([5, 6, 7], max_tokens=12, stop=stops)
        assert out.text == full[: full.find(a)] and out.finish_reason == "stop"


def test_a_lazy_draft_catches_up_at_its_first_proposal(arch):
    """`auto`'s draft is not prefilled per prompt (most requests never probe it): its first
    proposal feeds the whole context and drafts what an eagerly prefilled draft drafts, at
    temperature 0 and, with the same seed, at temperature 1."""
    from mlxspec.proposers.draft import DraftModelProposer

    _, _, draft = arch
    prompt = prompts(2, seed=3)[1] + [7, 9, 11]
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        eager, lazy = DraftModelProposer(draft), DraftModelProposer(draft, prefill_at_reset=False)
        out = []
        for proposer in (eager, lazy):
            proposer.reset(prompt, sampling)
            out.append((len(proposer.cached), proposer.propose(prompt, 4, 5)))
        (eager_held, a), (lazy_held, b) = out
        assert eager_held == len(prompt) - 1 and lazy_held == 0  # nothing fed at reset
        assert a.tokens.tolist() == b.tokens.tolist()
        if a.draft_probs is not None:
            assert mx.allclose(a.draft_probs, b.draft_probs, atol=1e-5).item()
        assert eager.cached == lazy.cached == prompt


@pytest.mark.parametrize("mode", ["none", "ngram", "draft", "lookahead", "suffix", "auto",
                                  "quantspec"])
def test_a_prompt_prefilled_in_chunks_gives_the_tokens_of_one_prefill(arch, mode):
    """`prefill_chunk` shorter than the prompt: steps that only prefill yield nothing to
    `generate` and `stream`, whose answer is the one without chunks."""
    _, target, draft = arch
    engine = make_engine(target, mode, draft_model=draft, num_draft=3)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 256) for _ in range(300)]
    want = make_engine(target, "none").generate(prompt, max_tokens=12).tokens
    got = engine.generate(prompt, max_tokens=12, prefill_chunk=128)
    assert got.tokens == want and got.stats.prompt_tokens == 300
    assert "".join(engine.stream(prompt, max_tokens=12, prefill_chunk=128)) == got.text
