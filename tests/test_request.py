"""`request.py`: a request checked before any work, with clear errors, and resolved once
(`Engine.request`) without changing the engine's proposer."""

import pytest
from conftest import build_model, make_engine

from mlxspec.batch_step import BatchSpeculator
from mlxspec.errors import MlxspecError
from mlxspec.request import workload_signal


@pytest.fixture(scope="module")
def engine():
    target, _ = build_model("llama", seed=5, max_pos=64)
    return make_engine(target, "ngram", max_context=64)


@pytest.mark.parametrize("options,message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"num_draft": 0}, "num_draft must be between 1"),
    ({"cache_reuse": -1}, "cache_reuse must be >= 0"),
    ({"regex": "a+", "json_schema": True}, "give one of grammar, json_schema and regex"),
])
def test_bad_options_are_refused_with_a_clear_error(engine, options, message):
    with pytest.raises(MlxspecError, match=message):
        engine.request([1, 2, 3], **options)


def test_the_prompt_must_fit_the_context_and_max_tokens_is_cut_to_it(engine):
    with pytest.raises(MlxspecError, match="the prompt is empty"):
        engine.request([])
    with pytest.raises(MlxspecError, match="the prompt has 64 tokens but the model's context"):
        engine.request([1] * 64)
    req = engine.request([1] * 60, max_tokens=10)
    assert req.max_tokens == 4 and req.end == 64


def test_a_refused_request_leaves_the_proposer_as_it_was(engine):
    """The prediction reaches the proposer when the request starts, not when it is
    resolved: a request the batch refuses changes nothing."""
    other, _ = build_model("llama", seed=6)
    batch = BatchSpeculator(other)
    before = engine.proposer.prediction
    with pytest.raises(MlxspecError, match="another model"):
        engine.join(batch, [1, 2, 3], prediction=[4, 5, 6, 7])
    assert engine.proposer.prediction is before
    req = engine.request([1, 2, 3], prediction="xyz")
    assert req.prediction == list(b"xyz") and req.stats.mode == "ngram" and req.shares


def test_the_kind_of_request():
    signals = {100: "fim", 101: "chat"}
    assert workload_signal(signals, [1, 2], [3]) == "edit"
    assert workload_signal(signals, [5, 101, 6], None) == "chat"
    assert workload_signal(signals, [5, 101, 100], None) == "fim"
    assert workload_signal({}, [100], None) == ""
