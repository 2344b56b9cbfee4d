"""`row.py`: a request's life in the loop as one state, changed by the row's own methods; its
commits, outputs and failure."""

import mlx.core as mx
import pytest
from conftest import build_model, make_engine
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.batch_step import BatchSpeculator
from mlxspec.caches.prompt import PromptCache
from mlxspec.cost import StepCost
from mlxspec.policy import FixedK
from mlxspec.proposers.base import Proposer
from mlxspec.request import Request
from mlxspec.row import CLOSED, DECODING, FAILED, FINISHED, OPENING, PREFILLING, BatchRow
from mlxspec.sampling import SamplingParams
from mlxspec.stats import Stats


class Finishing(Proposer):
    """Proposes nothing; counts how often it is told its request ended."""

    name = "finishing"

    def __init__(self):
        self.finished = 0

    def propose(self, context, num_draft, seed, source=None):
        return None

    def finish(self):
        self.finished += 1


def raw_row(context, max_tokens, proposer=None) -> BatchRow:
    req = Request(list(context), SamplingParams(), max_tokens, [], None, None,
                  proposer=proposer, policy=FixedK(2), pc=PromptCache(), stats=Stats())
    return BatchRow(req, None, StepCost())


def test_a_row_decodes_until_max_tokens_then_is_finished():
    row = raw_row([1, 2, 3], max_tokens=3)
    assert row.state == DECODING and row.live
    row.commit([4, 5])
    assert row.state == DECODING and row.context == [1, 2, 3, 4, 5]
    row.commit([6])
    assert row.state == FINISHED and not row.live and not row.wants
    assert row.stats.generated_tokens == 3 and row.stats.target_forwards == 2


def test_its_outputs_are_taken_once_merged():
    row = raw_row([1], max_tokens=8)
    row.commit([2])
    row.commit([3, 4])
    out = row.take_output()
    assert out.tokens == [2, 3, 4] and row.take_output() is None


def test_a_failed_row_raises_its_error_and_leaving_tells_its_proposer_once():
    proposer = Finishing()
    row = raw_row([1, 2], max_tokens=4, proposer=proposer)
    row.fail(MemoryError("no memory"))
    assert row.state == FAILED and not row.live
    with pytest.raises(MemoryError, match="no memory"):
        row.output({})
    assert row.leave() and not row.leave()
    assert row.state == CLOSED and proposer.finished == 1
    with pytest.raises(MemoryError):  # still the reason it ended
        row.output({})


def test_a_joiner_is_opening_or_prefilling_until_a_step_prefills_it():
    """Beside a decoding row, a short request is `opening` (prefilled with the round's other
    joiners at the next step); one with `prefill_chunk` is `prefilling` a chunk per step,
    then decodes; its tokens are those of the request alone."""
    target, _ = build_model("llama", seed=3)
    engine = make_engine(target)
    prompt = [(7 * i) % 200 + 1 for i in range(40)]
    want = engine.generate(prompt, max_tokens=4).tokens
    batch = BatchSpeculator(target)
    first = engine.clone().join(batch, [5, 6, 7], max_tokens=30)
    row = engine.clone().join(batch, prompt, max_tokens=4, prefill_chunk=16)
    short = engine.clone().join(batch, [9, 8, 7], max_tokens=2)
    assert short.state == OPENING and short.waiting and not short.wants
    states = [row.state]
    got = []
    while row.live:
        out = row.output(batch.step())
        states.append(row.state)
        if out is not None:
            got += out.tokens
    assert states[:3] == [PREFILLING] * 3 and states[-1] == FINISHED and DECODING in states
    assert got == want
    for r in (row, first, short):
        batch.close(r)
    assert row.state == CLOSED and row.pc.tokens == prompt + want[:-1]


def test_the_first_draw_is_the_plain_steps():
    target, _ = build_model("llama", seed=4)
    cache = make_prompt_cache(target)
    logits = target(mx.array([[3, 4, 5]]), cache=cache)[0, -1]
    row = raw_row([3, 4, 5], max_tokens=2)
    assert row.first_draw(logits).tolist() == [int(mx.argmax(logits).item())]


def test_each_output_token_says_where_it_came_from(model_dirs):
    """A step's accepted proposal is the proposal's source's, the rest the target's own: as
    many proposed tokens in the outputs as the stats accepted."""
    import mlxspec

    engine = mlxspec.load(str(model_dirs["llama"]), mode="ngram", num_draft=4)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
    outs = [o for o in engine.stream_steps(prompt, max_tokens=40, temperature=0)
            if o is not None]
    sources = [s for o in outs for s in o.sources]
    assert len(sources) == sum(len(o.tokens) for o in outs)
    assert set(sources) <= {"ngram", "target"}
    assert sources.count("ngram") == outs[-1].stats.accepted > 0
