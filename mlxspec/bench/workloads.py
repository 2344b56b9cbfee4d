"""Benchmark workloads, drawn from the bundled model's held-out standard-library modules
(never from training files), in the formats the bundled model was trained on."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..recipe.corpus import edit_messages, format_chat, format_fim, make_edit_example
from ..recipe.heldout import heldout_files, heldout_functions, read_source

WORKLOADS = ("completion", "fim", "edit", "doc-qa", "chat", "free")


@dataclass
class Item:
    workload: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    prediction: str | None = None
    meta: dict = field(default_factory=dict)


def _completion(n: int, rng: random.Random, max_tokens: int) -> list[Item]:
    items = []
    texts = [t for t in (read_source(p) for p in heldout_files()) if t and t.count("\n") > 40]
    for i in range(n):
        lines = texts[i % len(texts)].splitlines(keepends=True)
        cut = rng.randint(20, min(len(lines) - 10, 60))
        start = max(0, cut - 40)
        items.append(Item("completion", "".join(lines[start:cut]), max_tokens))
    return items


def _fim(functions, rng, max_tokens) -> list[Item]:
    items = []
    for _, _, src in functions:
        lines = src.splitlines(keepends=True)
        a = rng.randint(1, max(1, len(lines) - 3))
        b = min(len(lines), a + rng.randint(1, 4))
        prompt = format_fim("".join(lines[:a]), "".join(lines[b:]))
        items.append(Item("fim", prompt, max_tokens, meta={"middle": "".join(lines[a:b])}))
    return items


def _edit(functions, rng, max_tokens) -> list[Item]:
    items = []
    for _, _, src in functions:
        instruction, edited = make_edit_example(src, rng)
        prompt = format_chat(edit_messages(src, instruction), add_generation_prompt=True)
        items.append(Item("edit", prompt, max_tokens, prediction=src.rstrip("\n"),
                          meta={"expected": edited}))
    return items


def _doc_qa(functions, rng, max_tokens) -> list[Item]:
    items = []
    for mod, name, src in functions:
        question = f"{src.rstrip()}\n\nShow me the source of `{mod}.{name}`."
        prompt = format_chat([{"role": "user", "content": question}], add_generation_prompt=True)
        items.append(Item("doc-qa", prompt, max_tokens))
    return items


def _chat(functions, rng, max_tokens) -> list[Item]:
    return [Item("chat", format_chat([{"role": "user", "content": f"What does `{mod}.{name}` do?"}],
                                     add_generation_prompt=True), max_tokens)
            for mod, name, _ in functions]


def _free(n, rng, max_tokens) -> list[Item]:
    starts = ["def ", "import ", "class ", "# ", "for ", "if __name__", "return ", "@"]
    return [Item("free", starts[i % len(starts)], max_tokens, temperature=1.0) for i in range(n)]


def build_workload(name: str, n: int = 20, max_tokens: int = 64, seed: int = 0) -> list[Item]:
    """`n` prompts of workload `name` (or 'mixed': every workload, shuffled)."""
    rng = random.Random(seed)
    if name == "mixed":
        per = -(-n // len(WORKLOADS))  # ceil: at least n items before the cut
        items = [it for w in WORKLOADS for it in build_workload(w, per, max_tokens, seed)]
        rng.shuffle(items)
        return items[:n]
    functions = heldout_functions(n, max_lines=30)
    if name == "completion":
        return _completion(n, rng, max_tokens)
    if name == "fim":
        return _fim(functions, rng, max_tokens)
    if name == "edit":
        # An edit answers with the whole function: give it room to finish.
        return _edit(functions, rng, max(max_tokens, 256))
    if name == "doc-qa":
        return _doc_qa(functions, rng, max(max_tokens, 128))
    if name == "chat":
        return _chat(functions, rng, max_tokens)
    if name == "free":
        return _free(n, rng, max_tokens)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + ('mixed',))}")
