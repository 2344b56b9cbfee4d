"""`stats.py`: what every mode reports, counted by its own methods."""

import pytest

from mlxspec.stats import Stats


def test_a_step_is_counted_by_position_and_by_source():
    s = Stats()
    s.record_step("ngram", drafted=3, accepted=2, emitted=3)
    s.record_step("", drafted=0, accepted=0, emitted=1, decode_seconds=0.5)
    s.record_step("draft", drafted=1, accepted=0, emitted=1, peak_memory_gb=1.5)
    assert (s.target_forwards, s.generated_tokens, s.drafted, s.accepted) == (3, 5, 4, 2)
    assert s.drafted_by_position == [2, 1, 1] and s.accepted_by_position == [1, 1, 0]
    assert s.drafted_by_source == {"ngram": 3, "draft": 1}
    assert s.accepted_by_source == {"ngram": 2, "draft": 0}
    assert s.decode_seconds == 0.5 and s.peak_memory_gb == 1.5
    assert s.acceptance_rate == 0.5 and s.mean_accepted_length == 5 / 3


def test_prefill_and_sums_over_generations():
    a, b = Stats(prompt_tokens=10), Stats(prompt_tokens=4)
    a.prefilled(0.5, cached=6)
    assert a.prompt_tps == 8.0
    b.record_step("ngram", 2, 1, 2)
    a.add(b)
    assert a.prompt_tokens == 14 and a.drafted_by_position == [1, 1]


def test_the_account_of_decoding_time_adds_up_by_kind_of_step():
    s = Stats()
    s.record_step("", 0, 0, 1, decode_seconds=0.1)
    s.record_step("ngram", 3, 2, 3, decode_seconds=0.25)
    s.record_step("ngram", 3, 0, 1, decode_seconds=0.35)
    s.record_step("draft", 2, 0, 1, decode_seconds=0.6, probe=True, setup_seconds=0.05)
    assert s.steps_by_kind == {"plain": 1, "accepted": 1, "rejected": 1, "probe": 1,
                               "catch-up": 1}
    assert s.tokens_by_step == {"plain": 1, "accepted": 3, "rejected": 1, "probe": 1,
                                "catch-up": 0}
    assert s.seconds_by_step["probe"] == pytest.approx(0.2)  # its catch-up apart
    assert sum(s.seconds_by_step.values()) == pytest.approx(s.decode_seconds)


@pytest.mark.parametrize("mode", ["none", "ngram", "draft", "auto"])
def test_a_generation_accounts_for_all_its_time_and_tokens(llama_pair, mode):
    """Every step lands in one kind: the kinds sum to the decoding time, the tokens and the
    forwards; plain decoding has plain steps only; `bench --explain` reads it against none."""
    from conftest import make_engine

    from mlxspec.bench.explain import account
    from mlxspec.bench.runners import Run

    target, draft = llama_pair
    engine = make_engine(target, mode, draft_model=draft, num_draft=3)
    s = engine.generate([5, 6, 7, 5, 6, 7, 5, 6], max_tokens=24).stats
    assert sum(s.seconds_by_step.values()) == pytest.approx(s.decode_seconds)
    assert sum(s.tokens_by_step.values()) == s.generated_tokens
    assert sum(n for k, n in s.steps_by_kind.items() if k != "catch-up") == s.target_forwards
    if mode == "none":
        assert set(s.steps_by_kind) == {"plain"}
        return
    assert s.steps_by_kind.keys() - {"plain"}  # it proposed
    base = make_engine(target, "none").generate([5, 6, 7, 5, 6, 7, 5, 6], max_tokens=24)
    runs = [Run(s_.tokens, s_.stats.decode_seconds, s_.stats.target_forwards,
                stats=s_.stats.to_dict()) for s_ in (base,)]
    mine = [Run(base.tokens, s.decode_seconds, s.target_forwards, stats=s.to_dict())]
    acc = account(mine, runs)
    gains = sum(k["gain"] for k in acc["kinds"].values())
    assert acc["time_vs_none"] == pytest.approx(1 - gains)  # complete by construction
