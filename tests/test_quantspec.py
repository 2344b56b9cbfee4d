"""QuantSpec: the 4-bit weight draft, and speculative decoding over the hierarchical cache that is
token-identical (temperature 0) and distribution-exact (temperature > 0) to plain decoding with
the same cache."""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import build_model, make_engine
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.quant.hierarchical_cache import HierarchicalKVCache, make_reference_cache
from mlxspec.quant.memory import format_memory_table, kv_memory_table
from mlxspec.quant.weights import make_draft_model
from mlxspec.sampling import SamplingParams, probs_from_logits

G = 32  # small groups so that 60-140-token prompts flush several times mid-generation
SHAPE = dict(hidden=128, heads=4, kv_heads=2, vocab=128)  # head_dim 32, GQA


def _model(arch, seed=0, **kw):
    return build_model(arch, seed=seed, scale=4.0, **{**SHAPE, **kw})[0]


def _prompts(n, seed, lo=2 * G + 1, hi=4 * G + 10):
    rng = random.Random(seed)
    return [[rng.randrange(1, SHAPE["vocab"]) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


# ----------------------------------------------------------------------------- weights

def test_draft_model_shares_everything_but_the_quantized_linears():
    model = _model("llama")
    draft, info = make_draft_model(model, bits=4, group_size=64, quantize="mlp")
    assert not info["reused"] and info["quantized_layers"] == 3 * len(model.layers)
    assert draft is not model and draft.model is not model.model
    assert draft.model.embed_tokens is model.model.embed_tokens
    assert draft.lm_head is model.lm_head and draft.model.norm is model.model.norm
    for lt, ld in zip(model.model.layers, draft.model.layers):
        assert ld.self_attn is lt.self_attn and ld.input_layernorm is lt.input_layernorm
        assert isinstance(lt.mlp.gate_proj, nn.Linear)  # the target is untouched
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(ld.mlp, name)
            assert isinstance(q, nn.QuantizedLinear) and q.bits == 4 and q.group_size == 64
    quantized = sum(getattr(ld.mlp, n).weight.nbytes + getattr(ld.mlp, n).scales.nbytes
                    + getattr(ld.mlp, n).biases.nbytes
                    for ld in draft.model.layers for n in ("gate_proj", "up_proj", "down_proj"))
    assert info["extra_bytes"] == quantized
    x = mx.array([[1, 2, 3, 4, 5]])
    lt, ld = model(x), draft(x)
    assert not mx.array_equal(lt, ld).item()
    assert np.corrcoef(np.array(lt).ravel(), np.array(ld).ravel())[0, 1] > 0.9

    draft_all, info_all = make_draft_model(model, quantize="all")
    assert info_all["quantized_layers"] == 7 * len(model.layers)
    assert isinstance(draft_all.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert draft_all.lm_head is model.lm_head


def test_already_quantized_target_is_reused():
    model = _model("qwen2")
    q4 = copy.deepcopy(model)
    nn.quantize(q4, group_size=64, bits=4)
    draft, info = make_draft_model(q4)
    assert draft is q4 and info["reused"] and info["extra_bytes"] == 0
    assert "reuses" in info["note"]
    q8 = copy.deepcopy(model)
    nn.quantize(q8, group_size=64, bits=8)
    draft8, info8 = make_draft_model(q8)
    assert not info8["reused"] and draft8.model.layers[0].mlp.up_proj.bits == 4


# ----------------------------------------------------------------------------- greedy

def speculative_greedy(model, prompt, max_tokens, k, group_size=G, **kw):
    """Greedy quantspec through the engine with k fixed; (tokens, the proposer)."""
    engine = make_engine(model, "quantspec", vocab=SHAPE["vocab"], num_draft=k,
                         group_size=group_size, **kw)
    return engine.generate(prompt, max_tokens=max_tokens).tokens, engine.proposer


def reference_decode(model, prompt, max_tokens, group_size=G, buffer_size=None):
    """The lossless reference of quantspec: `none` reading the hierarchical cache's target view,
    through the engine (the same loop as every mode)."""
    engine = make_engine(model, "none", vocab=SHAPE["vocab"], kv="hierarchical",
                         kv_group_size=group_size, kv_buffer_size=buffer_size)
    return engine.generate(prompt, max_tokens=max_tokens).tokens


def manual_reference(model, prompt, max_tokens, group_size=G):
    """One token at a time with the reference cache, no engine: checks the engine's `none`."""
    cache = make_reference_cache(model, group_size)
    if len(prompt) > 1:
        model(mx.array(prompt[:-1], mx.uint32)[None], cache=cache)
    out, token = [], prompt[-1]
    for _ in range(max_tokens):
        logits = model(mx.array([[token]], mx.uint32), cache=cache)[0, -1]
        token = mx.argmax(logits).item()
        out.append(token)
    return out


def _logit_gap_to_fp(model, tokens):
    """Largest |logit| difference between the hierarchical-cache target and the fp-cache one."""
    fp = model(mx.array(tokens)[None], cache=make_prompt_cache(model))
    hier = model(mx.array(tokens)[None], cache=make_reference_cache(model, group_size=G))
    return mx.abs(fp - hier).max().item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_quantspec_is_token_identical_to_hierarchical_reference(arch):
    model = _model(arch, seed=11)
    differs_from_fp = 0
    drafted = accepted = 0
    for i, prompt in enumerate(_prompts(8, seed=len(arch))):
        want = reference_decode(model, prompt, 40, group_size=G)
        got, prop = speculative_greedy(model, prompt, 40, k=3 + i % 4,
                                       quantize="mlp" if i % 2 else "all")
        assert got == want, (arch, i)
        # the flush happened mid-generation
        assert prop.cache[0].q_len > len(prompt) - 2 * G
        drafted, accepted = drafted + prop.drafted, accepted + prop.accepted
        differs_from_fp = max(differs_from_fp, _logit_gap_to_fp(model, prompt + want))
    assert 0 < accepted < drafted
    assert differs_from_fp > 1e-3  # the quantized part really changes the target's logits


def test_dequantized_codes_path_stays_token_identical(monkeypatch):
    """MLX's CUDA backend has no transpose=False quantized matmul for the cache's shapes: there
    the codes are dequantized first. That path gives the kernel's products (to rounding), and
    quantspec stays token-identical to its reference on it."""
    from mlxspec.quant import hierarchical_cache as hc

    mx.random.seed(3)
    x, w = mx.random.normal((5, 64)), mx.random.normal((64, 4 * G))
    for bits in (4, 8):
        triple = mx.quantize(w, group_size=G, bits=bits)
        kernel = hc._qmm(x, triple, G)
        with monkeypatch.context() as m:
            m.setattr(hc, "dequantize_codes", lambda: True)
            fallback = hc._qmm(x, triple, G)
        assert mx.allclose(kernel, fallback, rtol=1e-4, atol=1e-4).item()
        assert not mx.allclose(kernel, x @ w, atol=1e-2).item()  # the codes were read
    model = _model("qwen2", seed=11)
    prompt = _prompts(1, seed=5)[0]
    monkeypatch.setattr(hc, "dequantize_codes", lambda: True)
    want = reference_decode(model, prompt, 24, group_size=G)
    got, prop = speculative_greedy(model, prompt, 24, k=4, quantize="all")
    assert got == want and 0 < prop.accepted


def test_a_draft_reading_the_target_view_is_exact_and_accepts_more():
    """The ablation `draft_kv="target"` (the draft's weights over the target's 8-bit KV view:
    what 4-bit weights alone cost) stays token-identical; with 8-bit weights too the draft is
    nearly the target, so it accepts at least what the shipped draft does."""
    model = _model("llama", seed=11)
    rates = {}
    for view in ("draft", "target"):
        drafted = accepted = 0
        for prompt in _prompts(3, seed=4):
            want = reference_decode(model, prompt, 24)
            got, prop = speculative_greedy(model, prompt, 24, k=4, weight_bits=8, draft_kv=view)
            assert got == want, view
            drafted, accepted = drafted + prop.drafted, accepted + prop.accepted
        rates[view] = accepted / drafted
    assert rates["target"] >= rates["draft"] and rates["target"] > 0.9, rates
    with pytest.raises(ValueError, match="draft_kv"):
        make_engine(model, "quantspec", vocab=SHAPE["vocab"], draft_kv="int8")


def test_reference_cache_is_the_target_view():
    model = _model("llama", seed=2)
    cache = make_reference_cache(model, group_size=G)
    assert all(isinstance(c, HierarchicalKVCache) and c.auto_commit for c in cache)
    prompt = _prompts(1, seed=3)[0]
    model(mx.array(prompt)[None], cache=cache)
    model(mx.array([[1]]), cache=cache)
    assert cache[0].q_len == G * ((len(prompt) - G) // G)  # flushed at the second forward


# ----------------------------------------------------------------------------- engine

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_quantspec_greedy_matches_reference(arch):
    model = _model(arch, seed=21)
    engine = make_engine(model, "quantspec", vocab=SHAPE["vocab"], num_draft=5, group_size=G)
    prompts = _prompts(6, seed=5)
    for prompt in prompts:
        assert engine.generate(prompt, max_tokens=30).tokens == reference_decode(
            model, prompt, 30, group_size=G)
    # prompt-cache reuse: a prompt that extends / shares a prefix with the last one
    last = prompts[-1] + engine.generate(prompts[-1], max_tokens=10).tokens
    for prompt in (last + [5, 6, 7], last[: 2 * G + 5] + [9, 9]):
        assert engine.generate(prompt, max_tokens=20).tokens == reference_decode(
            model, prompt, 20, group_size=G)


def test_engine_none_with_hierarchical_kv_is_the_reference():
    model = _model("qwen2", seed=23)
    plain = make_engine(model, "none", vocab=SHAPE["vocab"], kv="hierarchical", kv_group_size=G)
    spec = make_engine(model, "quantspec", vocab=SHAPE["vocab"], num_draft=4, group_size=G)
    for prompt in _prompts(4, seed=9):
        want = plain.generate(prompt, max_tokens=40).tokens
        assert want == manual_reference(model, prompt, 40, group_size=G)
        assert spec.generate(prompt, max_tokens=40).tokens == want


def _chi_square_pvalue(stats, counts, probs):
    """Pearson's test; cells expected < 5 times are pooled into one."""
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _joint_counts(engine, prompt, runs, keyed=True):
    """Counts of the first two tokens over `runs` runs: seeded (the keyed rule) or not (the
    rejection rule, MLX's generator seeded per run)."""
    counts = np.zeros((engine.tokenizer.vocab,) * 2)
    for seed in range(runs):
        mx.random.seed(seed)
        t = engine.generate(prompt, max_tokens=2, temperature=1.0,
                            seed=seed if keyed else None).tokens
        counts[t[0], t[1]] += 1
    return counts


def test_sampling_is_exact_chi_square():
    stats = pytest.importorskip("scipy.stats")
    vocab = 6
    model = build_model("llama", seed=4, hidden=64, heads=2, kv_heads=1, vocab=vocab,
                        scale=1.5)[0]
    prompt = _prompts(1, seed=9, lo=2 * G + 8, hi=2 * G + 8)[0]
    prompt = [t % vocab for t in prompt]
    sp = SamplingParams(temperature=1.0)
    # exact joint distribution of the first two tokens under the hierarchical-cache target
    cache = make_reference_cache(model, group_size=G)
    model(mx.array(prompt[:-1])[None], cache=cache)
    p1 = probs_from_logits(model(mx.array([[prompt[-1]]]), cache=cache)[0, -1], sp)
    exact = np.zeros((vocab, vocab))
    for x in range(vocab):
        c2 = make_reference_cache(model, group_size=G)
        model(mx.array(prompt + [x])[None, :-1], cache=c2)
        p2 = probs_from_logits(model(mx.array([[x]]), cache=c2)[0, -1], sp)
        exact[x] = np.array(p1, dtype=np.float64)[x] * np.array(p2, dtype=np.float64)
    # a crude draft (2-bit weights everywhere) so that rejections are frequent
    engine = make_engine(model, "quantspec", vocab=vocab, num_draft=1, group_size=G,
                         weight_bits=2, quantize="all")
    runs = 500
    for keyed in (True, False):
        counts = _joint_counts(engine, prompt, runs, keyed)
        drafted = engine.proposer.drafted
        assert 0.05 < engine.proposer.accepted / drafted < 0.98  # both paths taken
        pval = _chi_square_pvalue(stats, counts, exact)
        assert pval > 1e-3, (keyed, pval)

    # a deliberately wrong rejection rule: q reported as uniform, not the draft's distribution
    real_propose = engine.proposer.propose

    def wrong(context, k, seed, source=None):
        prop = real_propose(context, k, seed)
        prop.draft_probs = mx.ones_like(prop.draft_probs) / vocab
        return prop

    engine.proposer.propose = wrong
    bad = _joint_counts(engine, prompt, runs, keyed=False)
    pval_bad = _chi_square_pvalue(stats, bad, exact)
    assert pval_bad < 1e-3, pval_bad


# ----------------------------------------------------------------------------- memory

def test_memory_table():
    rows = kv_memory_table(n_kv_heads=2, head_dim=64, num_layers=2, lengths=(1024, 4096))
    by = {(r["cache"], r["length"]): r for r in rows}
    for n in (1024, 4096):
        fp16 = by[("fp16 KVCache", n)]["bytes"]
        q8 = by[("mlx-lm QuantizedKVCache 8-bit", n)]["bytes"]
        ours = by[("hierarchical G=64", n)]
        assert fp16 == n * 2 * 2 * 64 * 2 * 2  # layers * kv_heads * head_dim * (k, v) * fp16
        assert G <= ours["buffer_tokens"] * 2 <= 4 * 64
        # the target view is no bigger than mlx-lm's 8-bit cache plus the buffer
        assert ours["bytes"] <= q8 + ours["buffer"]
        assert ours["draft_view_bytes"] < ours["bytes"]
    assert "hierarchical" in format_memory_table(rows)


def test_quality_and_step_bytes_report():
    from mlxspec.quant.report import quality_report, step_bytes

    model = _model("llama", seed=6)
    draft, info = make_draft_model(model)
    tokens = _prompts(1, seed=4, lo=200, hi=200)[0]
    q = quality_report(model, draft, tokens, group_size=G, num_bytes=400)
    # the hierarchical target is close to the fp target, the draft further away
    assert abs(q["target_hierarchical"] - q["target_fp_cache"]) < 0.05 * q["target_fp_cache"]
    assert q["target_hierarchical_bits_per_byte"] == pytest.approx(
        q["target_hierarchical"] * 199 / 400)
    b = step_bytes(model, draft, 1024, group_size=64)
    assert b["draft_kv"] < b["verify_kv"] < b["plain_kv"]
    assert b["draft_weights"] < b["verify_weights"]
    assert b["verify_weights"] - b["draft_weights"] == info["replaced_bytes"] - info["extra_bytes"]


def test_engine_prefill_in_chunks_flushes():
    model = _model("qwen3", seed=8)
    engine = make_engine(model, "quantspec", vocab=SHAPE["vocab"], num_draft=3, group_size=G,
                         prefill_step_size=40)
    prompt = _prompts(1, seed=8, lo=150, hi=150)[0]
    got = engine.generate(prompt, max_tokens=12).tokens
    assert got == reference_decode(model, prompt, 12, group_size=G)
    c = engine.proposer.cache[0]
    assert c.buffer_len <= 2 * G + 1 and c.auto_commit  # draft_view restored it
    assert c.view == "target"


def test_long_drafts_cross_several_groups():
    """k > G: a draft and its verify span more than one group boundary."""
    model = _model("llama", seed=12)
    prompt = _prompts(1, seed=12, lo=3 * G - 3, hi=3 * G - 3)[0]
    got, prop = speculative_greedy(model, prompt, 2 * G + 10, k=G + 5, weight_bits=8)
    assert got == reference_decode(model, prompt, 2 * G + 10, group_size=G)
    assert prop.accepted > G  # 8-bit weights: long runs are accepted, crossing boundaries


# ----------------------------------------------------------------------------- half precision

@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("g,buffer", [(32, None), pytest.param(64, None, marks=pytest.mark.slow),
                                      (32, 96)])
def test_half_precision_token_identical(dtype, g, buffer):
    """The model kept in bf16 / fp16 (what Metal runs): greedy quantspec equals its reference
    token for token over many runs whose verifies straddle group flushes."""
    model = _model("llama", seed=31)
    model.set_dtype(dtype)
    lo = (buffer or 2 * g) + 1
    splits = drafted = 0
    for i, prompt in enumerate(_prompts(6, seed=g, lo=lo, hi=lo + 2 * g)):
        want = reference_decode(model, prompt, 40, group_size=g, buffer_size=buffer)
        engine = make_engine(model, "quantspec", vocab=SHAPE["vocab"], num_draft=3 + i % 4,
                             group_size=g, buffer_size=buffer)
        got = engine.generate(prompt, max_tokens=40)
        assert got.tokens == want, (dtype, g, buffer, i)
        splits += sum(c.split_forwards for c in engine.proposer.cache)
        drafted += got.stats.drafted
    assert splits > 10 and drafted > 0  # verifies (and drafts) across flushes happened


# ----------------------------------------------------------------------------- hybrid models

HYBRIDS = ["qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1"]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_quantspec_matches_reference(family):
    """Hybrid recurrent models: the attention layers get the hierarchical cache, the recurrent
    layers keep their state; drafting restores that state, so greedy quantspec equals `none`
    with the hierarchical cache, across flushes and with rejections."""
    from families import VOCAB, build

    from mlxspec import caches
    from mlxspec.quant.hierarchical_cache import hierarchical_layers

    model = build(family, seed=3)
    cache = make_reference_cache(model, group_size=G)
    kinds = {type(c).__name__ for c in caches.leaves(cache)}
    assert kinds == {"HierarchicalKVCache", "ArraysCache"}, kinds
    engine = make_engine(model, "quantspec", vocab=VOCAB, num_draft=4, group_size=G)
    ref = make_engine(model, "none", vocab=VOCAB, kv="hierarchical", kv_group_size=G)
    drafted = accepted = 0
    for prompt in _prompts(3, seed=7, lo=2 * G + 5, hi=3 * G):
        prompt = [t % VOCAB for t in prompt]
        got = engine.generate(prompt, max_tokens=48)
        assert got.tokens == ref.generate(prompt, max_tokens=48).tokens, family
        drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        layers = hierarchical_layers(engine.proposer.cache)
        assert layers and all(c.q_len > 0 for c in layers)  # flushed
    assert 0 < accepted < drafted, (family, accepted, drafted)  # rollback really happened


def test_propose_restores_recurrent_state():
    from families import build

    from mlxspec import caches
    from mlxspec.proposers.quantspec import QuantSpecProposer

    model = build("qwen3_5", seed=1)
    prop = QuantSpecProposer(model, group_size=G)
    cache = prop.make_target_cache(model)
    prompt = list(range(1, 90))
    model(mx.array(prompt[:-1])[None], cache=cache)
    mx.eval([c.state for c in caches.leaves(cache)])
    before = [list(c.cache) if caches.is_recurrent(c) else c.offset for c in caches.leaves(cache)]
    prop.reset(prompt, SamplingParams())
    proposal = prop.propose(prompt, 5, None)
    assert len(proposal) == 5
    after = [list(c.cache) if caches.is_recurrent(c) else c.offset for c in caches.leaves(cache)]
    for b, a in zip(before, after):
        if isinstance(b, list):
            assert all(x is y for x, y in zip(b, a))  # the very same state arrays
        else:
            assert a == b == len(prompt) - 1


@pytest.mark.parametrize("family,words", [("gemma3_text", ("sliding-window", "bounds")),
                                          ("gpt_oss", ("sliding-window",)),
                                          ("mamba2", ("no attention layers",))])
def test_quantspec_refusals_say_why(family, words):
    from families import build

    from mlxspec.errors import MlxspecError
    from mlxspec.proposers.quantspec import QuantSpecProposer

    model = build(family)
    for make in (lambda: QuantSpecProposer(model), lambda: make_reference_cache(model)):
        with pytest.raises(MlxspecError) as e:
            make()
        msg = str(e.value)
        assert family in msg and all(w in msg for w in words), msg
        assert "Modes that are exact on it" in msg


@pytest.mark.slow
def test_gptq_draft_weights():
    """method='gptq' (mlx-lm's GPTQ on calibration tokens): only the MLP layers are replaced,
    the target is untouched, and on the calibration distribution the GPTQ layers reproduce the
    full-precision layer outputs better than round-to-nearest."""
    model = _model("llama", seed=41)
    calib = [[(7 * i + 3 * j) % SHAPE["vocab"] for j in range(64)] for i in range(8)]
    rtn, info_r = make_draft_model(model, method="rtn")
    gptq, info_g = make_draft_model(model, method="gptq", calibration=calib)
    assert info_g["method"] == "gptq" and info_r["method"] == "rtn"
    assert info_g["quantized_layers"] == info_r["quantized_layers"] == 3 * len(model.layers)
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.Linear)  # target untouched
    assert gptq.model.layers[0].self_attn is model.model.layers[0].self_attn
    x = mx.array(calib)
    errs = {}
    for name, draft in (("rtn", rtn), ("gptq", gptq)):
        errs[name] = mx.mean((draft(x) - model(x)) ** 2).item()
    assert errs["gptq"] < errs["rtn"], errs
    with pytest.raises(ValueError):
        make_draft_model(model, method="gptq")
