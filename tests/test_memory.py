"""The process's memory limit (--memory-limit, a control group's, the memory available) and
the server's per-request estimate (`ServingMemory`), on fake /proc and /sys files."""

from __future__ import annotations

import json
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


# ------------------------------------------- generate, chat, edit: a prompt that cannot fit


@pytest.fixture(scope="module")
def bundled_memory():
    """The bundled model's ServingMemory as `mlxspec generate/chat/edit --mode none` count it
    (its draft's KV too: the engine knows where its draft is)."""
    from mlxspec.loading import load

    engine = load(None, mode="none")
    return engine, memory.prompt_memory(engine, 1 << 40, "is the --memory-limit")


@pytest.fixture
def tight(bundled_memory, monkeypatch):
    """A --memory-limit (bytes) leaving room for a request of 300 tokens alone; the engine's
    stream_steps counted (a refused prompt never gets there: nothing prefilled)."""
    from mlxspec.engine import Engine

    monkeypatch.setattr(memory, "_limit_set", None)  # --memory-limit sets it for the process
    calls = []
    stream = Engine.stream_steps

    def counted(self, prompt, **kwargs):
        calls.append(len(self.encode(prompt)))
        return stream(self, prompt, **kwargs)

    monkeypatch.setattr(Engine, "stream_steps", counted)
    m = bundled_memory[1]
    return str(limit_for_room(m, m.alone(300, shared=False))), calls


def cli(*args, input=None):
    from click.testing import CliRunner

    from mlxspec.cli.main import main

    return CliRunner().invoke(main, list(args), input=input)


def test_generate_refuses_a_prompt_that_cannot_fit_before_its_prefill(tight, bundled_memory):
    limit, calls = tight
    engine = bundled_memory[0]
    long, short = "a b " * 300, "a b " * 50
    r = cli("generate", "-p", long, "--mode", "none", "--max-tokens", "8", "--memory-limit", limit)
    assert r.exit_code == 2 and calls == [], r.output
    [line] = r.stderr.strip().splitlines()[-1:]
    n = len(engine.encode(long))
    assert line.startswith("error: this prompt needs about ") and (
        f"({n} prompt tokens + --max-tokens 8: KV cache and prefill working set) but the "
        f"process leaves ") in line
    assert "GB limit, the --memory-limit, less" in line and "GB margin" in line
    assert line.endswith("its prompt alone does not fit")
    # A prompt that fits with fewer tokens to generate: the longest --max-tokens that fits.
    r = cli("generate", "-p", short, "--mode", "none", "--max-tokens", "600",
            "--memory-limit", limit)
    assert r.exit_code == 2 and calls == [], r.output
    longest = int(r.stderr.split("--max-tokens ")[-1].split()[0])
    assert r.stderr.strip().endswith(f"--max-tokens {longest} would fit") and 0 < longest < 600
    r = cli("generate", "-p", short, "--mode", "none", "--max-tokens", str(longest),
            "--memory-limit", limit)
    assert r.exit_code == 0 and calls == [len(engine.encode(short))], r.output


def test_a_chat_turn_that_cannot_fit_is_refused_and_the_session_goes_on(tight):
    limit, calls = tight
    r = cli("chat", "--mode", "none", "--max-tokens", "4", "--memory-limit", limit,
            input="a b " * 300 + "\nhello\n")
    assert r.exit_code == 0, r.output
    assert "error: this message needs about " in r.stderr
    assert "its prompt alone does not fit; /reset starts a new conversation" in r.stderr
    assert len(calls) == 1 and calls[0] < 300  # the second message was answered


def test_the_growing_conversation_is_refused_then_reset(bundled_memory):
    from mlxspec.chat_session import ChatSession
    from mlxspec.errors import MlxspecError

    engine, m = bundled_memory
    room = replace(m, limit=limit_for_room(m, m.alone(250, shared=False)))
    session = ChatSession(engine, max_tokens=4, memory=room)
    message = "a b " * 40  # a turn: about 95 tokens more
    session.reply(message)
    session.reply(message)  # (188 prompt tokens + 4)
    kept = list(session.messages)
    with pytest.raises(MlxspecError, match="this message needs about .* /reset starts"):
        session.reply(message)
    assert session.messages == kept and session.totals.replies == 2  # as it was
    session.reset()
    assert session.reply(message).stats.prompt_tokens < 300


def test_edit_refuses_a_file_that_cannot_fit_with_the_numbers(tight, tmp_path):
    limit, calls = tight
    path = tmp_path / "big.py"
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(15)))
    r = cli("edit", str(path), "-i", "rename x to y", "--mode", "none", "--memory-limit", limit)
    assert r.exit_code == 2 and calls == [], r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: this edit needs about ") and "prompt tokens + --max-tokens" in line
    assert "GB limit, the --memory-limit, less" in line
    assert line.endswith("; select fewer lines with --lines A:B")
    r = cli("edit", str(path), "-i", "rename x to y", "--mode", "none", "--memory-limit", limit,
            "--json")
    assert r.exit_code == 2 and calls == []
    assert json.loads(r.stdout)["error"].startswith("this edit needs about ")
    assert path.read_text().startswith("def f0(x):")
