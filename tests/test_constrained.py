"""Per-row work on the target's logits stays exact under speculation (`mlxspec/constrain.py`):
a grammar (JSON Schema, regex, GBNF) masks every verified position by the grammar's state
after the tokens before it, a proposal is cut at its first refused token, and the output is
token-identical to `none` with the same grammar (greedy, and with a seed at T = 1); a logit
bias changes the output as asked, the same in every mode; log-probabilities read from the
verify forward equal `none`'s."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest
from conftest import ByteTokenizer
from families import build, noisy_copy

from mlxspec import constrain
from mlxspec.engine import Engine
from mlxspec.errors import MlxspecError

VOCAB = 128  # ASCII: a byte tokenizer's ids are characters
EOS = 0

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer"}, "tag": {"enum": ["ab", "cd", "ef"]},
                         "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False}
# the prompt repeats the answer's keys, as a JSON answer about its input does: lookup finds them
PROMPT = 'rows: {"id": 17, "tag": "ab", "ok": true} {"id": 3, "tag": "ef", "ok": false} '
GBNF = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-e]+ | [0-9]{1,3}\n'
REGEX = r"[a-f]{2,6}(-[0-9]{1,2}){1,4}"
MODES = [("ngram", {}), ("ngram", {"tree": True}), ("draft", {}), ("draft", {"tree_width": 2}),
         ("suffix", {}), ("auto", {}), ("lookahead", {})]
GRAMMARS = [("json_schema", SCHEMA), ("regex", REGEX), ("grammar", GBNF)]


class Tok(ByteTokenizer):
    """Byte ids over ASCII, with an end-of-sequence token (a grammar ends with it)."""

    def __init__(self):
        super().__init__(VOCAB)
        self.eos_token_ids = {EOS}


@pytest.fixture(scope="module")
def pair():
    target = build("llama", seed=11, scale=3.0, vocab_size=VOCAB)
    draft = noisy_copy(target, "llama", noise=0.3, seed=12, vocab_size=VOCAB)
    return target, draft


def engine(model, mode="none", draft=None, **kw):
    return Engine(model, Tok(), mode=mode, draft_model=draft, num_draft=5, **kw)


def run(eng, prompt, **kw):
    """(tokens, per-token log-probabilities or None, stats) of one request; stats.finish is
    its finish reason (an end-of-sequence token is not among the tokens: "stop")."""
    batch, row = eng.open(prompt, **kw)
    from mlxspec.batch_step import follow

    outs = [o for o in follow(batch, row) if o is not None]
    tokens = [t for o in outs for t in o.tokens]
    lps = None
    if row.sampling.logprobs is not None:
        if all(o.logprobs is not None for o in outs):
            lps = [e for o in outs for e in o.logprobs]
        else:  # the output does not carry them: what the steps recorded, by position
            got = row.sampling.state.take(len(prompt) if isinstance(prompt, list) else
                                          len(eng.encode(prompt)), len(tokens))
            lps = got
    stats = outs[-1].stats
    stats.finish = outs[-1].finish_reason
    return tokens, lps, stats


def grammar_kw(kind, spec):
    return {kind: spec}


@pytest.mark.parametrize("mode,options", MODES, ids=lambda m: str(m))
def test_constrained_output_is_nones_in_every_mode(pair, mode, options):
    target, draft = pair
    ref = engine(target)
    eng = engine(target, mode, draft, **options)
    drafted = complete = 0
    for kind, spec in GRAMMARS:
        for settings in (dict(), dict(temperature=1.0, seed=5)):
            want, _, _ = run(ref, PROMPT, max_tokens=48, **grammar_kw(kind, spec), **settings)
            got, _, stats = run(eng, PROMPT, max_tokens=48, **grammar_kw(kind, spec), **settings)
            assert got == want, (kind, settings)
            drafted += stats.drafted
            if stats.finish == "stop":  # complete: it parses
                text = bytes(got).decode()
                complete += 1
                if kind == "json_schema":
                    jsonschema.validate(json.loads(text), spec)
                elif kind == "regex":
                    import re

                    assert re.fullmatch(REGEX, text)
    assert complete >= 2
    if mode not in ("lookahead",):
        assert drafted > 0  # speculation ran on constrained rows


def test_auto_speculates_on_a_long_constrained_answer(pair):
    """A grammar row's plain steps are synced, never the pipelined ones that `auto` stops to
    measure every 128 synced steps: after more than that many (a long constrained request on
    the engine), `auto` still proposes where the grammar makes copying pay, as `ngram` does,
    and gives `none`'s tokens."""
    target, _ = pair
    eng = engine(target)
    regex = "(abcdefgh ){30}"  # the answer repeats itself: lookup copies it
    want, _, plain = run(eng, "list: ", max_tokens=150, regex=regex)
    assert plain.target_forwards > 128  # all synced, on the engine's cost model
    for mode in ("ngram", "auto"):
        got, _, stats = run(eng, "list: ", max_tokens=150, regex=regex, mode=mode)
        assert got == want, mode
        assert stats.accepted > 100 and stats.target_forwards < 60, (mode, stats)


def test_the_draft_model_drafts_within_the_grammar(pair, monkeypatch):
    """A constrained row's draft is masked by the grammar as it drafts: verification never
    has to cut it (but at an end-of-sequence token), and the matcher is left as it was."""
    target, draft = pair
    seen = []
    cut = constrain.Constraint.cut

    def watch(self, tokens):
        n = cut(self, tokens)
        seen.append((list(tokens), n))
        return n

    monkeypatch.setattr(constrain.Constraint, "cut", watch)
    eng = engine(target, "draft", draft)
    for settings in (dict(), dict(temperature=1.0, seed=3), dict(temperature=1.0)):
        run(eng, PROMPT, max_tokens=40, json_schema=SCHEMA, **settings)
    drafted = [(d, n) for d, n in seen if d]
    assert drafted and all(n == len(d) or EOS in d for d, n in drafted)


def test_quantspec_constrained_is_its_references():
    """QuantSpec's chains are cut like any other: the same tokens as `none` on the
    hierarchical cache, with a grammar, greedy and seeded."""
    target = build("qwen2", seed=5, scale=3.0, vocab_size=VOCAB)
    ref = engine(target, kv="hierarchical", kv_group_size=32)
    eng = engine(target, "quantspec", group_size=32)
    for kind, spec in GRAMMARS[:2]:
        for settings in (dict(), dict(temperature=1.0, seed=2)):
            want, _, _ = run(ref, PROMPT, max_tokens=40, **grammar_kw(kind, spec), **settings)
            got, _, stats = run(eng, PROMPT, max_tokens=40, **grammar_kw(kind, spec),
                                **settings)
            assert got == want, (kind, settings)


def test_a_json_answer_parses_and_the_unconstrained_one_does_not(pair):
    target, _ = pair
    eng = engine(target, "ngram")
    free, _, _ = run(eng, PROMPT, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(bytes(free).decode("latin-1"))
    got, _, stats = run(eng, PROMPT, max_tokens=120, json_schema=SCHEMA, temperature=1.0,
                        seed=2)
    assert stats.finish == "stop"
    jsonschema.validate(json.loads(bytes(got).decode()), SCHEMA)
    got, _, _ = run(eng, PROMPT, max_tokens=60, json_schema=True)  # any JSON object
    assert bytes(got).decode().startswith("{")


def test_a_proposal_is_cut_at_its_first_refused_token():
    c = constrain.Constraint(Tok(), "regex", "ab+c", 3)
    assert c.cut(list(b"abbbc")) == 5
    assert c.cut(list(b"abxc")) == 2
    assert c.cut(list(b"x")) == 0
    masks = constrain.allowed(c.bitmasks(list(b"ab")), VOCAB)
    allowed = [np.flatnonzero(np.array(m)).tolist() for m in masks]
    assert allowed == [[ord("a")], [ord("b")], [ord("b"), ord("c")]]
    assert c.pos == 3  # masks computed through a proposal leave the matcher where it was
    # kept in step by position: tokens known since are consumed, a step undone rolls back
    state = constrain.RequestState(constraint=c, start=3)
    state.known(3, ord("a"))
    state.align(4)
    assert c.pos == 4
    for i, t in enumerate(b"bb"):
        state.known(4 + i, t)
    state.align(6)
    assert c.pos == 6
    state.align(5)  # a step undone: back to after position 4
    assert c.pos == 5
    state.known(5, ord("x"))
    with pytest.raises(MlxspecError, match="refused"):
        state.align(6)


def test_malformed_grammars_and_biases_are_refused(pair):
    target, _ = pair
    eng = engine(target)
    with pytest.raises(MlxspecError, match="grammar"):
        eng.generate(PROMPT, max_tokens=4, grammar="root ::= (")
    with pytest.raises(MlxspecError, match="JSON Schema"):
        eng.generate(PROMPT, max_tokens=4, json_schema=[1])
    with pytest.raises(MlxspecError, match="one of"):
        eng.generate(PROMPT, max_tokens=4, json_schema=SCHEMA, regex="a+")
    with pytest.raises(MlxspecError, match="outside the vocabulary"):
        eng.generate(PROMPT, max_tokens=4, logit_bias={"999": 1})
    with pytest.raises(MlxspecError, match="number or false"):
        eng.generate(PROMPT, max_tokens=4, logit_bias={"5": "x"})
    with pytest.raises(MlxspecError, match="end-of-sequence"):
        Engine(target, ByteTokenizer(VOCAB)).generate(PROMPT, max_tokens=4, regex="a+")


def test_logit_bias_parses_every_form():
    enc = lambda t: list(t.encode())  # noqa: E731
    assert constrain.parse_logit_bias({"65": 2.5, 66: False}, VOCAB, enc) == (
        (65, 2.5), (66, -math.inf))
    assert constrain.parse_logit_bias([[65, 1], ["BC", -1]], VOCAB, enc) == (
        (65, 1.0), (66, -1.0), (67, -1.0))
    for bad in ([[1]], [[1, 2, 3]], {"a b": None}, "x", {"-1": 1}, {True: 1}):
        with pytest.raises(ValueError):
            constrain.parse_logit_bias(bad, VOCAB, None)


@pytest.mark.parametrize("mode,options", [("ngram", {}), ("draft", {}), ("draft", {"tree_width": 2}),
                                          ("suffix", {}), ("auto", {})], ids=lambda m: str(m))
def test_logit_bias_changes_the_output_as_asked_and_stays_exact(pair, mode, options):
    target, draft = pair
    ref, eng = engine(target), engine(target, mode, draft, **options)
    plain, _, _ = run(ref, PROMPT, max_tokens=24)
    banned = sorted(set(plain))[:3]
    bias = {str(t): False for t in banned}
    for settings in (dict(), dict(temperature=1.0, seed=3)):
        want, _, _ = run(ref, PROMPT, max_tokens=24, logit_bias=bias, **settings)
        assert not set(want) & set(banned)
        got, _, _ = run(eng, PROMPT, max_tokens=24, logit_bias=bias, **settings)
        assert got == want
    forced, _, _ = run(eng, PROMPT, max_tokens=12, logit_bias={ord("Q"): 100})
    assert forced == [ord("Q")] * 12


@pytest.mark.parametrize("mode,options", MODES, ids=lambda m: str(m))
def test_logprobs_equal_nones_in_every_mode(pair, mode, options):
    target, draft = pair
    ref, eng = engine(target), engine(target, mode, draft, **options)
    for extra in (dict(), dict(json_schema=SCHEMA), dict(temperature=1.0, seed=9),
                  dict(post_probs=True, temperature=0.8, top_k=5, seed=1)):
        want, want_lp, _ = run(ref, PROMPT, max_tokens=24, logprobs=3, **extra)
        got, got_lp, _ = run(eng, PROMPT, max_tokens=24, logprobs=3, **extra)
        assert got == want
        assert len(got_lp) == len(got) and all(e is not None for e in got_lp)
        for a, b in zip(got_lp, want_lp):
            assert a.token == b.token
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert np.allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)
    # what they are: the log-softmax of the model's logits, the chosen token's among them
    _, lps, _ = run(ref, PROMPT, max_tokens=6, logprobs=3)
    for e in lps:
        assert e.logprob <= 0 and len(e.top) == 3
        assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]
        assert e.top[0] == (e.token, pytest.approx(e.logprob))  # greedy: the top one
    _, post, _ = run(ref, PROMPT, max_tokens=6, logprobs=2, post_probs=True, top_k=1,
                     temperature=1.0)
    assert all(e.logprob == pytest.approx(1.0) for e in post)  # top_k 1: probability 1


def test_generate_returns_the_log_probabilities(pair):
    """`Engine.generate` hands them back per token (and in `to_dict`, as JSON), the same as
    the step outputs carry; a request that asked for none has None."""
    target, draft = pair
    eng = engine(target, "draft", draft)
    _, want, _ = run(engine(target), PROMPT, max_tokens=10, logprobs=2)
    result = eng.generate(PROMPT, max_tokens=10, logprobs=2)
    assert [(e.token, round(e.logprob, 4)) for e in result.logprobs] == [
        (e.token, round(e.logprob, 4)) for e in want]
    assert json.loads(json.dumps(result.to_dict()))["logprobs"][0]["token"] == want[0].token
    assert eng.generate(PROMPT, max_tokens=4).logprobs is None
