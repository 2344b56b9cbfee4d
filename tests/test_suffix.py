"""Suffix decoding: the store of earlier requests (eviction, longest match, frequencies, files),
the proposer (chains and trees, exact output), and the server's scopes."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
from conftest import build_model, make_engine
from server_helpers import post, start, stop

import mlxspec
from mlxspec.errors import MlxspecError
from mlxspec.proposers.suffix import SuffixProposer, best_chain, best_tree
from mlxspec.sampling import SamplingParams
from mlxspec.suffix_store import (
    MAX_MATCH,
    SuffixIndex,
    SuffixStores,
    load,
    save,
    scope_key,
)


def brute_longest(docs: list[list[int]], context: list[int]) -> int:
    """The longest suffix of `context` (<= MAX_MATCH) followed by a token in some document."""
    best = 0
    for d in docs:
        for p in range(1, len(d)):  # p: a continuation position
            n = 0
            while n < min(MAX_MATCH, p, len(context)) and d[p - 1 - n] == context[-1 - n]:
                n += 1
            best = max(best, n)
    return best


# ----------------------------------------------------------------------------- the store


@pytest.mark.parametrize("vocab", [6, 40])  # (40: most contexts miss at the shortest key)
def test_longest_match_is_found(vocab):
    rng = random.Random(vocab)
    for trial in range(60):
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 80))] for _ in range(4)]
        index = SuffixIndex(budget=150)  # (older documents evicted: their chains stay)
        for d in docs:
            index.add(d)
        stored = index.documents()
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.5:  # often a real match: a piece of a document
            d = rng.choice(docs)
            a = rng.randrange(len(d) - 1)
            context = context + d[: a + 1]
        length, positions = index.match(context)
        want = brute_longest(stored, context)
        # A match shorter than the shortest key is not looked for; among candidates the
        # chains hold (at most CHAIN per key), the longest one is found.
        assert length == (want if want >= 4 else 0), (trial, length, want)
        for p in positions.tolist():
            assert index.tokens[p - length : p].tolist() == context[len(context) - length :]


def test_frequency_orders_the_chain():
    index = SuffixIndex()
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 9], [5, 6, 4]):
        index.add([1, 2, 3, 4] + tail + [100 + len(index.docs)])
    length, positions = index.match([0, 1, 2, 3, 4])
    assert length == 4 and positions.size == 4
    conts = index.continuations(positions, 3)
    assert conts[(7, 8, 9)] == 3 and conts[(5, 6, 4)] == 1
    assert best_chain(conts, 3, 0.1) == [7, 8, 9]
    # A continuation too rare to pass min_prob ends the chain where the votes split.
    assert best_chain(Counter({(1, 2): 1, (1, 3): 1}), 2, 0.6) == [1]
    tokens, parents = best_tree(conts, 3, 0.1, budget=16)
    assert tokens[:3] == [7, 8, 9] and parents[:3] == [-1, 0, 1]  # the best path first
    assert (5, -1) in zip(tokens, parents)  # the rarer first token: a second branch


def test_lru_eviction_at_the_budget():
    index = SuffixIndex(budget=100)
    docs = [[1000 * i + j for j in range(30)] for i in range(5)]
    for d in docs[:3]:
        index.add(d)
    assert index.live == 90
    index.touch(index.match(docs[0][:10])[1])  # document 0 is used: document 1 is now oldest
    index.add(docs[3])
    assert index.live <= 100
    kept = index.documents()
    assert docs[1] not in kept and docs[0] in kept and docs[3] in kept
    assert index.match(docs[1][:10])[0] == 0  # evicted text never matches
    for i in range(50):  # many more: compaction keeps the array bounded
        index.add([7_000_000 + 100 * i + j for j in range(30)])
    assert index.live <= 100 and index.size < 8 * 100 + 4096


def test_repeated_and_extended_documents_are_stored_once():
    index = SuffixIndex()
    base = list(range(100, 160))
    index.add(base)
    index.add(base)  # the same request again: nothing new
    assert index.live == 60
    index.add(base + [1, 2, 3])  # the next chat turn: it replaces the shorter one
    assert index.live == 63 and len(index.docs) == 1
    index.add(base[:40] + [9] * 20)  # a shared prefix: the new part with MAX_MATCH overlap
    assert index.live == 63 + (60 - 40 + MAX_MATCH)
    assert index.match(base[:40] + [9, 9, 9, 9])[0] >= 4


def test_persistence_round_trip_and_bad_files(tmp_path):
    stores = SuffixStores(fingerprint="abc")
    stores.get("").add(list(range(50)))
    stores.get("addr:1.2.3.4").add([5] * 3 + list(range(200, 260)))
    path = tmp_path / "suffix.cache"
    save(stores, path)
    again = SuffixStores(fingerprint="abc")
    assert load(again, path) == 50 + 63
    assert again.get("").documents() == [list(range(50))]
    assert again.get("addr:1.2.3.4").documents() == [[5] * 3 + list(range(200, 260))]

    data = path.read_bytes()
    cases = {
        "not an mlxspec suffix cache": b"hello world\n",
        "format version 9": data.replace(b"cache 1\n", b"cache 9\n", 1),
        "damaged": data[:-4],
        "another model's tokenizer": data,
    }
    for words, content in cases.items():
        bad = tmp_path / "bad.cache"
        bad.write_bytes(content)
        fp = "other" if "tokenizer" in words else "abc"
        with pytest.raises(MlxspecError, match=words) as e:
            load(SuffixStores(fingerprint=fp), bad)
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
        assert bad.read_bytes() == content  # nothing lost
    assert load(SuffixStores(), tmp_path / "missing.cache") == 0


def test_scopes_share_one_budget():
    stores = SuffixStores(budget=100)
    stores.get("a").add(list(range(60)))
    stores.get("b").add(list(range(100, 160)))
    stores.evict_to_budget()
    assert stores.tokens() <= 100 and "b" in stores.scopes  # a was used least recently
    assert scope_key("request", "k", "1.2.3.4") is None
    assert scope_key("global", "k", "1.2.3.4") == ""
    assert scope_key("client", None, "1.2.3.4") == "addr:1.2.3.4"
    key = scope_key("client", "secret", "1.2.3.4")
    assert key.startswith("key:") and "secret" not in key


def test_lookup_and_proposal_cost():
    """Lookup + proposal well under a millisecond with 100 k stored tokens (the 1 M figure:
    bench/bench_suffix_store.py at c37452f)."""
    rng = random.Random(1)
    index = SuffixIndex()
    docs = [[rng.randrange(2000) for _ in range(500)] for _ in range(200)]
    for d in docs:
        index.add(d)
    proposer = SuffixProposer(store=index, local=False)
    proposer.reset([1, 2, 3], SamplingParams())
    contexts = [rng.choice(docs)[: rng.randrange(40, 400)] for _ in range(200)]
    start = time.perf_counter()
    for c in contexts:
        proposer.available(c, 8)
        proposer.propose(c, 8, None)
    per_step = (time.perf_counter() - start) / len(contexts)
    assert per_step < 2e-3  # generous for a loaded CI machine; ~0.05 ms here


# ----------------------------------------------------------------------------- the proposer


def test_proposer_offers_arms_by_match_length():
    index = SuffixIndex()
    text = list(range(10, 60))
    index.add(text)
    p = SuffixProposer(store=index, local=False)
    p.reset([1], SamplingParams())
    # The offer grows with the match: spec_factor (2) x its length, within the cap.
    assert p.available([1] + text[:5], 16) == {"suffix:4": 10}
    p.reset([1], SamplingParams())
    assert p.available([1] + text[:20], 16) == {"suffix:16": 16}
    assert p.available(text[:40], 8) == {"suffix:32": 8}
    assert p.propose(text[:40], 3, None).tokens.tolist() == text[40:43]
    assert p.peek(text[:40], 2, "suffix:32") == text[40:42]
    assert p.available([999, 998, 997, 996], 8) == {}


def test_auto_offers_the_store_only_where_it_adds_to_prompt_lookup():
    """`auto` offers the suffix arm where the store proposes other or more tokens than the
    prompt's own n-gram match, not where it would propose the same ones (a chat re-sending
    its earlier answer: one source's measurements would be split in two)."""
    from mlxspec.proposers.auto import AutoProposer

    text = list(range(10, 60))
    index = SuffixIndex()
    index.add(text)
    p = AutoProposer(None, store=index)
    p.reset(text[:30], SamplingParams())  # the prompt holds what the store holds
    assert list(p.available(text[:30] + text[:20], 8)) == ["ngram:4"]
    index = SuffixIndex()
    index.add(text[:20] + [7] * 30)  # the store continued otherwise: a second opinion
    p = AutoProposer(None, store=index)
    p.reset(text[:30], SamplingParams())
    offered = p.available(text[:30] + text[:20], 8)
    assert "ngram:4" in offered and any(a.startswith("suffix:") for a in offered)
    p.reset([1, 2, 3], SamplingParams())  # nothing in the prompt: the store alone
    assert list(p.available([1, 2, 3] + text[:20], 8)) == ["suffix:16"]


def test_finish_keeps_the_request_in_its_store():
    a, b = SuffixIndex(), SuffixIndex()
    p = SuffixProposer(store=a)
    p.reset(list(range(20)), SamplingParams())
    context = list(range(20)) + [50, 51]
    p.update(context, 0)
    p.set_store(b)  # the next request's store: this one still goes into a
    p.finish()
    p.finish()  # once
    assert a.documents() == [context] and not b.docs
    p.reset([1, 2, 3, 4, 5], SamplingParams())
    p.set_store(None)
    p.reset([6, 7, 8, 9, 10], SamplingParams())  # the previous one went into b
    assert b.documents() == [[1, 2, 3, 4, 5]]



def test_a_fim_request_is_kept_and_matched_as_the_document_it_edits():
    """With the model's FIM tokens (`set_fim`), a FIM request goes into the store as its
    prefix then its answer (the text after the cursor left out) and is matched the same way:
    the editor's follow-up, whose prefix now ends with the first answer, is proposed what
    followed that answer, where the raw layout proposes the first answer again."""
    PRE, SUF, MID = 900, 901, 902
    prefix, after = list(range(10, 40)), list(range(60, 80))
    answer = list(range(100, 130))  # shown: the first 6 tokens; the rest decoded ahead
    first = [PRE] + prefix + [SUF] + after + [MID]
    follow = [PRE] + prefix + answer[:6] + [SUF] + after + [MID]
    proposed = {}
    for fim in (False, True):
        store = SuffixIndex()
        p = SuffixProposer(store=store, local=False)
        p.set_fim(SUF, MID) if fim else p.set_fim(None, None)
        p.reset(first, SamplingParams())
        p.update(first + answer, 0)
        p.finish()
        assert store.documents() == [[PRE] + prefix + answer if fim else first + answer]
        p.reset(follow, SamplingParams())
        proposed[fim] = p.propose(follow, 8, None).tokens.tolist()
    assert proposed == {True: answer[6:14], False: answer[:8]}
    # with them, a prompt without the markers is kept as it is
    p.reset(prefix, SamplingParams())
    p.update(prefix + answer, 0)
    p.finish()
    assert store.documents()[-1] == prefix + answer


def test_the_engine_gives_its_proposers_the_models_fim_tokens(model_dirs):
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="auto")
    vocab = engine.tokenizer.get_vocab()
    assert engine.proposer.suffix.fim == (vocab["<|fim_suffix|>"], vocab["<|fim_middle|>"])
    assert engine.clone().proposer.suffix.fim == engine.proposer.suffix.fim
    assert make_engine(build_model("llama", seed=1)[0], "suffix").proposer.fim is None

@pytest.fixture(scope="module")
def tiny():
    model, _ = build_model("llama", seed=1, scale=4.0)
    return model


PROMPTS = ["def foo(x):\n    return", "import os\nimport sys\n", "class A:\n    def __init__(self"]


@pytest.mark.parametrize("mode, options", [("suffix", {}), ("suffix", {"tree": True}),
                                           ("auto", {})])
def test_output_is_token_identical_to_none(tiny, mode, options):
    ref = make_engine(tiny, "none")
    engine = make_engine(tiny, mode, **options)
    want = {p: ref.generate(p, max_tokens=40).tokens for p in PROMPTS}
    replayed = 0
    for _ in range(2):  # the second round proposes from the first round's answers
        for p in PROMPTS:
            r = engine.generate(p, max_tokens=40)
            assert r.tokens == want[p], (mode, p)
            replayed += r.stats.accepted_by_source.get("suffix", 0)
    assert replayed >= 60  # the repeats were proposed from the store and accepted


@pytest.mark.slow
@pytest.mark.parametrize("tree", [False, True])
def test_sampled_output_is_exact(tree):
    """T > 0, against the exact distribution (test_exact_sampling's chi-square), with a store
    whose documents continue the prompt several ways and that every run adds its answer to."""
    from exact import (
        PROMPT,
        RUNS,
        VOCAB,
        exact_distribution,
        min_pvalue,
        sample_counts,
    )
    from families import build

    target = build("llama", seed=7, scale=1.5, vocab_size=VOCAB)
    store = SuffixIndex()
    for tail in ([1, 2, 3, 0, 1], [1, 2, 3, 0, 1], [0, 0, 1, 2, 3], [1, 2, 0, 0, 0]):
        store.add(PROMPT + tail)
    engine = make_engine(target, "suffix", vocab=VOCAB, num_draft=4, store=store, tree=tree)
    drafted: list[int] = []
    counts = sample_counts(engine, RUNS, drafted)
    assert min_pvalue(counts, exact_distribution(target, PROMPT)) > 1e-4
    assert sum(drafted) > 0


def test_a_generation_enters_the_store_when_it_ends(tiny):
    """Through the Python API alone (no server, chat or edit around it), both single and
    batched: the prompt and answer are in the store when the generation ends, not at the next
    request's start."""
    from conftest import next_output

    from mlxspec.batch_step import BatchSpeculator

    store = SuffixIndex()
    engine = make_engine(tiny, "suffix", store=store)
    r = engine.generate(PROMPTS[0], max_tokens=12)
    assert len(r.tokens) == 12
    assert store.documents() == [engine.encode(PROMPTS[0]) + r.tokens]
    batch = BatchSpeculator(engine.model)
    rows = [engine.clone().join(batch, p, max_tokens=12) for p in PROMPTS[1:]]
    answers = [[] for _ in rows]
    live = list(zip(rows, answers))
    while live:
        for row, answer in list(live):
            try:
                answer.extend(next_output(batch, row).tokens)
            except StopIteration:
                live.remove((row, answer))
    for row in rows:
        batch.close(row)
    assert sorted(store.documents()) == sorted(
        [engine.encode(PROMPTS[0]) + r.tokens] +
        [engine.encode(p) + a for p, a in zip(PROMPTS[1:], answers)])


def test_chat_turns_share_the_store(tiny):
    from mlxspec.chat_session import ChatSession

    engine = make_engine(tiny, "auto")
    engine.tokenizer.chat_template = "x"
    engine.tokenizer.apply_chat_template = (
        lambda msgs, add_generation_prompt, tokenize: "".join(
            f"<{m['role']}>{m['content']}\n" for m in msgs) + "<assistant>")
    session = ChatSession(engine, max_tokens=24)
    session.reply("def foo(x):")
    assert session.suffix_store.live > 0  # the turn is in the session's store at once


# ----------------------------------------------------------------------------- the server


def test_server_scopes_keep_clients_apart(model_dirs, tmp_path):
    engine = mlxspec.load(str(model_dirs["llama"]), mode="auto")
    ref = mlxspec.load(str(model_dirs["llama"]), mode="none")
    prompt = "def alpha(beta, gamma):\n    return beta"
    want = ref.generate(prompt, max_tokens=32).text
    cache = tmp_path / "suffix.cache"
    srv = start(engine, suffix_scope="client", suffix_cache=str(cache))
    try:
        def ask(key=None, **spec):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"prompt": prompt, "max_tokens": 32, "temperature": 0}
            if spec:
                body["speculative"] = spec
            status, payload, _ = post(srv.url, "/v1/completions", body, headers=headers)
            assert status == 200, payload
            out = json.loads(payload)
            return out["choices"][0]["text"], out["usage"]["speculative"]

        text_a, _ = ask("alice")
        assert text_a == want
        keys = set(srv.suffix.scopes)
        assert len(keys) == 1 and next(iter(keys)).startswith("key:")
        text_b, _ = ask("bob", suffix=False)  # opted out: nothing kept
        assert text_b == want and len(srv.suffix.scopes) == 1
        text_b, spec_b = ask("bob")  # bob's store was empty: nothing of alice's proposed
        text_a, spec_a = ask("alice")
        assert text_a == text_b == want
        assert len(srv.suffix.scopes) == 2
        assert spec_a["target_forwards"] < spec_b["target_forwards"]
        text_c, _ = ask()  # no key: the client's address
        assert text_c == want and "addr:127.0.0.1" in srv.suffix.scopes
    finally:
        stop(srv)
    again = SuffixStores(fingerprint=srv.suffix.fingerprint)
    assert load(again, cache) > 0 and len(again.scopes) == 3


def test_a_request_decoded_plainly_feeds_the_store(model_dirs):
    """Over --spec-max-concurrency a request decodes plainly in the batch; its prompt and
    answer still enter its scope's store, so that a later request repeating it is proposed
    the answer (fewer forwards) and answers the same."""
    engine = mlxspec.load(str(model_dirs["llama"]), mode="auto")
    want = mlxspec.load(str(model_dirs["llama"]), mode="none").generate(
        "def alpha(beta, gamma):\n    return beta", max_tokens=32).text
    srv = start(engine, spec_max_concurrency=0)
    body = {"prompt": "def alpha(beta, gamma):\n    return beta", "max_tokens": 32,
            "temperature": 0}
    try:
        status, payload, _ = post(srv.url, "/v1/completions", body)
        plain = json.loads(payload)
        assert status == 200 and plain["usage"]["speculative"]["batched"] is True
        assert srv.suffix.tokens() > 0
        srv.worker.spec_max_concurrency = 32
        status, payload, _ = post(srv.url, "/v1/completions", body)
        again = json.loads(payload)
    finally:
        stop(srv)
    assert plain["choices"][0]["text"] == again["choices"][0]["text"] == want
    spec = again["usage"]["speculative"]
    assert spec["accepted_tokens"] > 0 and spec["target_forwards"] < 32

