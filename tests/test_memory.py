"""The process's memory limit (--memory-limit, a control group's, the memory available) and
the server's per-request estimate (`ServingMemory`), on fake /proc and /sys files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxspec import memory
from mlxspec.caches.prompt import PromptCache, PromptCacheStore

V1_GROUP = "4:memory:/jobs/a\n3:cpu:/\n0::/\n"


@pytest.fixture
def fake_cgroups(tmp_path, monkeypatch):
    """write(the text of /proc/self/cgroup, {file under /sys/fs/cgroup: its text}), fakes."""
    proc, root = tmp_path / "cgroup", tmp_path / "sys"
    monkeypatch.setattr(memory, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)

    def write(groups: str, limits: dict[str, str]) -> None:
        proc.write_text(groups)
        for path, value in limits.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(value + "\n")

    return write


@pytest.mark.parametrize("groups, limits, found", [
    # v2: the group's memory.max
    ("0::/user.slice/job\n", {"user.slice/job/memory.max": "3500000000"},
     (3_500_000_000, "user.slice/job/memory.max")),
    # "max", and v1's number near 2**63: no limit
    ("0::/job\n", {"job/memory.max": "max"}, None),
    (V1_GROUP, {"memory/jobs/a/memory.limit_in_bytes": "9223372036854771712"}, None),
    # v1: the lowest of the group's and its ancestors'
    (V1_GROUP, {"memory/jobs/a/memory.limit_in_bytes": "8000000000"},
     (8_000_000_000, "memory/jobs/a/memory.limit_in_bytes")),
    (V1_GROUP, {"memory/jobs/a/memory.limit_in_bytes": "8000000000",
                "memory/jobs/memory.limit_in_bytes": "3000000000"},
     (3_000_000_000, "memory/jobs/memory.limit_in_bytes")),
    # a hybrid machine: v2 mounted beside v1 as "unified"
    ("4:memory:/\n0::/job\n", {"unified/job/memory.max": "2000000000"},
     (2_000_000_000, "unified/job/memory.max")),
])
def test_the_control_group_limit(fake_cgroups, groups, limits, found):
    fake_cgroups(groups, limits)
    got = memory.cgroup_limit()
    if found is None:
        assert got is None
    else:
        assert got[0] == found[0] and got[1].endswith(found[1]), got


def test_no_cgroup_file_means_no_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "absent")
    assert memory.cgroup_limit() is None


def test_the_budget_is_the_lower_of_the_group_and_available_and_the_flag_wins(
        fake_cgroups, monkeypatch):
    fake_cgroups("0::/job\n", {"job/memory.max": "3500000000"})
    monkeypatch.setattr(memory, "available_memory", lambda: 20_000_000_000)
    value, source = memory.budget()
    assert value == 3_500_000_000 and source.startswith("is the control group's limit (")
    monkeypatch.setattr(memory, "available_memory", lambda: 2_000_000_000)
    assert memory.budget() == (2_000_000_000, "of memory is available")
    memory.set_limit(1_000_000_000)
    try:
        assert memory.budget() == (1_000_000_000, "is the --memory-limit")
    finally:
        memory.set_limit(None)
    assert memory.budget()[0] == 2_000_000_000


@pytest.fixture(scope="module")
def serving(llama_pair):
    from conftest import make_engine

    return memory.serving_memory(make_engine(llama_pair[0]), 1 << 40, "is the --memory-limit",
                                 512)


def test_a_request_is_counted_from_the_model_shape(serving, llama_pair):
    args = llama_pair[0].args
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * (
        args.hidden_size // args.num_attention_heads) * 4  # float32 on the CPU
    assert serving.kv(1) == serving.kv(256) == 256 * per_token  # 256-token steps
    assert serving.kv(257) == 512 * per_token
    assert serving.weights == sum(p.nbytes for p in _params(llama_pair[0]))
    assert serving.source == "the --memory-limit" and "(the --memory-limit)" in serving.describe()


def test_the_longest_max_tokens_is_the_last_that_fits(serving):
    tight = replace(serving, limit=limit_for_room(serving, serving.alone(900)))
    longest = tight.longest_max_tokens(100)
    assert tight.alone(100 + longest) <= tight.room < tight.alone(100 + longest + 1)
    assert tight.longest_max_tokens(5000) == -1  # its prompt alone does not fit


def test_the_prompt_cache_store_shrinks_least_recently_used_first():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    def entry(tokens: list[int]) -> PromptCache:
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, len(tokens), 4)), mx.zeros((1, 1, len(tokens), 4)))
        return PromptCache([c], tokens)

    store = PromptCacheStore()
    old, new = entry([1, 2]), entry([3, 4])
    store.put(old)
    store.put(new)
    store.shrink(new.nbytes())
    assert store.entries == [new]


def limit_for_room(m: memory.ServingMemory, room: int) -> int:
    """A limit that leaves `room` bytes (or a few more) for requests."""
    limit = room + m.weights
    while (left := replace(m, limit=limit).room) < room:
        limit += room - left  # (the margin grows with the limit: a few rounds)
    return limit


def _params(model) -> list:
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(model.parameters())]


def test_shortfall_reads_the_resident_memory_and_what_the_system_has_left(tmp_path,
                                                                          monkeypatch):
    """`memory.shortfall`: resident memory over the limit less 2.5%, or available memory under
    that reserve (another process took it), whichever is worse; <= 0 while there is room."""
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    statm = tmp_path / "statm"
    monkeypatch.setattr(memory, "PROC_STATM", statm)
    monkeypatch.setattr(memory, "available_memory", lambda: 10_000_000_000)
    monkeypatch.setattr(memory, "cgroup_anon", lambda: None)
    limit = 4_000_000_000
    statm.write_text(f"999999 {3_000_000_000 // page} 0 0 0 0 0\n")
    assert memory.resident_bytes() == 3_000_000_000 // page * page
    assert memory.shortfall(limit) < -800_000_000  # room
    statm.write_text(f"999999 {3_950_000_000 // page} 0 0 0 0 0\n")
    assert 0 < memory.shortfall(limit) <= 50_000_000  # within the reserve of the limit
    statm.write_text(f"999999 {3_000_000_000 // page} 0 0 0 0 0\n")
    monkeypatch.setattr(memory, "available_memory", lambda: 60_000_000)
    assert memory.shortfall(limit) == limit // 40 - 60_000_000  # the system ran short
    # another process of its control group took it: the group's anonymous memory
    monkeypatch.setattr(memory, "available_memory", lambda: 10_000_000_000)
    monkeypatch.setattr(memory, "cgroup_anon", lambda: (3_950_000_000, limit))
    assert memory.shortfall(limit) == 3_950_000_000 + limit // 40 - limit


@pytest.mark.parametrize("groups, files, found", [
    (V1_GROUP, {"memory/jobs/a/memory.limit_in_bytes": "3000000000",
                "memory/jobs/a/memory.stat": "cache 5\nrss 7\ntotal_cache 9\ntotal_rss 2500"},
     (2500, 3_000_000_000)),
    ("0::/job\n", {"job/memory.max": "2000000000",
                   "job/memory.stat": "anon 1234\nfile 99999\nanon_thp 0"}, (1234, 2_000_000_000)),
    ("0::/job\n", {"job/memory.max": "max"}, None),
])
def test_the_control_groups_anonymous_memory(fake_cgroups, groups, files, found):
    fake_cgroups(groups, files)
    assert memory.cgroup_anon() == found
