"""`stats.py`: what every mode reports, counted by its own methods."""

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
