"""`admission.py`: a resolved request becomes a row, prefilled at once, with its round's other
joiners, or a chunk per step; what may not share a batch is refused before any work."""

import pytest
from conftest import build_model, make_engine

from mlxspec import caches
from mlxspec.admission import Admission
from mlxspec.caches.prompt import PromptCache
from mlxspec.cost import StepCost
from mlxspec.errors import MlxspecError
from mlxspec.row import DECODING, OPENING, PREFILLING


@pytest.fixture(scope="module")
def engine():
    target, _ = build_model("llama", seed=8)
    return make_engine(target)


def test_a_first_row_is_prefilled_at_open_and_ready_on_its_own_cache(engine):
    admission = Admission(engine.model, StepCost())
    row = admission.open(engine.request(list(range(1, 30))), engine.target, [])
    assert row.state == DECODING and admission.ready == [(row, True)]
    assert row.pc.tokens == list(range(1, 29)) and caches.offset(row.pc.cache) == 28
    assert row.stats.prefill_seconds > 0 and row.stats.cached_tokens == 0


def test_joiners_wait_for_the_next_round_and_then_are_ready_with_a_first_token(engine):
    admission = Admission(engine.model, StepCost())
    member = admission.open(engine.request([1, 2, 3]), engine.target, [])
    admission.ready = []
    want = engine.generate([7, 8, 9], max_tokens=1).tokens
    short = admission.open(engine.clone().request([7, 8, 9], max_tokens=5), engine.target,
                           [member])
    long = admission.open(engine.clone().request(list(range(40, 90)), max_tokens=5),
                          engine.target, [member], prefill_chunk=16)
    assert (short.state, long.state) == (OPENING, PREFILLING)
    ready = admission.run(empty=False)
    assert [r for r, _ in ready] == [short] and short.context[3:] == want
    assert long.pc.tokens == list(range(40, 56))  # one chunk
    assert short.pc.tokens == [7, 8, 9]  # the group's forward fed its whole prompt


def test_what_cannot_share_a_batch_is_refused_before_any_work(engine):
    admission = Admission(engine.model, StepCost())
    member = admission.open(engine.request([1, 2, 3]), engine.target, [])
    pc = member.pc
    with pytest.raises(MlxspecError, match="cannot share a prompt cache"):
        admission.open(engine.request([4, 5], prompt_cache=pc), engine.target, [member])
    lookahead = make_engine(engine.model, "lookahead")
    fresh = PromptCache()
    with pytest.raises(MlxspecError, match="cannot run in the batched step"):
        admission.open(lookahead.request([4, 5], prompt_cache=fresh), lookahead.target,
                       [member])
    assert fresh.cache is None  # nothing was prefilled
    other, _ = build_model("llama", seed=9)
    with pytest.raises(MlxspecError, match="another model"):
        admission.open(make_engine(other).request([4, 5]), make_engine(other).target, [])
