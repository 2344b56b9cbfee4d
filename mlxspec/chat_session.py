"""A multi-turn conversation over an `Engine`, independent of the terminal.

Each turn renders the whole conversation with the tokenizer's chat template and hands it to
`Engine.stream_steps`. The engine keeps its KV cache between calls and reuses the longest
common token prefix, so a turn prefills only what is new: the end of the previous reply and
the new user message (`Stats.cached_tokens` shows the reuse). The output is exactly what a
fresh prefill of the whole conversation gives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import MlxspecError
from .stats import Stats

# Chat templates close a turn with one of these; the reply ends there even when the model's
# config lists only the document end as EOS.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def add_turn_end_tokens(tokenizer) -> list[str]:
    """Make the chat template's end-of-turn tokens stop generation; the ones added."""
    added = []
    add = getattr(tokenizer, "add_eos_token", None)
    if add is None:
        return added
    vocab = tokenizer.get_vocab()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for tok in TURN_END_TOKENS:
        if tok in vocab and vocab[tok] not in eos:
            add(tok)
            added.append(tok)
    return added


def check_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise MlxspecError("this model's tokenizer has no chat template: use `mlxspec generate`")


def render_chat(tokenizer, messages: list[dict], *, tools: list | None = None) -> str:
    """The conversation as the model's chat template renders it, ready for the reply (or, when
    it ends with an assistant message, continuing that message); `tools` goes to the template.
    The one place mlxspec renders a chat template: chat, edit, generate --chat, bench and the
    server's chat endpoints."""
    check_chat_template(tokenizer)
    cont = messages[-1]["role"] == "assistant"
    kwargs = dict(add_generation_prompt=not cont, tokenize=False,
                  **({"continue_final_message": True} if cont else {}),
                  **({"tools": tools} if tools is not None else {}))
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception:
        # Some templates reject a system role: fold it into the first user message.
        if messages[0]["role"] != "system" or len(messages) < 2:
            raise
        system, first, *rest = messages
        first = {**first, "content": system["content"] + "\n\n" + first["content"]}
        return tokenizer.apply_chat_template([first, *rest], **kwargs)


@dataclass
class Totals(Stats):
    """Statistics summed over a session's replies."""

    replies: int = 0
    interrupted: int = 0
    by_mode: dict[str, int] = field(default_factory=dict)  # replies per mode

    def add(self, s: Stats, interrupted: bool = False) -> None:
        super().add(s)
        self.replies += 1
        self.interrupted += int(interrupted)
        self.by_mode[s.mode] = self.by_mode.get(s.mode, 0) + 1

    def to_dict(self) -> dict:
        d = super().to_dict()
        del d["mode"]  # by_mode counts the replies of each
        return d

    def lines(self) -> list[str]:
        prefilled = self.prompt_tokens - self.cached_tokens
        modes = ", ".join(f"{m} {n}" for m, n in self.by_mode.items()) or "-"
        return [
            f"replies            {self.replies} ({self.interrupted} interrupted; by mode: {modes})",
            f"generated tokens   {self.generated_tokens} in {self.decode_seconds:.2f} s "
            f"({self.generation_tps:.1f} tok/s)",
            f"prompt tokens      {self.prompt_tokens}: {prefilled} prefilled in "
            f"{self.prefill_seconds:.2f} s, {self.cached_tokens} reused from the cache",
            f"target forwards    {self.target_forwards} "
            f"({self.mean_accepted_length:.2f} tokens per forward)",
            f"drafted/accepted   {self.drafted}/{self.accepted} "
            f"({100 * self.acceptance_rate:.0f}%)",
        ]


@dataclass
class Turn:
    """The outcome of one reply."""

    text: str
    tokens: list[int]
    stats: Stats | None
    finish_reason: str | None  # "stop", "length", or None when interrupted
    dropped_messages: int = 0  # old messages dropped to fit the context

    @property
    def interrupted(self) -> bool:
        return self.finish_reason is None


class ChatSession:
    """A conversation: system prompt, messages, generation settings and session totals."""

    def __init__(self, engine, *, system: str | None = None, max_tokens: int = 512,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, suffix_store=None, memory=None):
        from .suffix_store import SuffixIndex

        self.engine = engine
        # Each turn's prompt + max_tokens checked against it before its prefill
        # (`memory.check_prompt`; a ServingMemory, `memory.prompt_memory`): None, no check.
        self.memory = memory
        # Every turn's prompt and reply, for the suffix source of `auto` and `suffix` (the
        # session's one store whatever the mode; --suffix-cache gives a loaded one).
        self.suffix_store = suffix_store if suffix_store is not None else SuffixIndex()
        self.system = system or None
        self.messages: list[dict] = []  # user and assistant turns
        self.settings = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k)
        self.seed = seed
        self.totals = Totals()
        self.turn_stats: list[dict] = []
        self.last: Turn | None = None
        self.dropped = 0  # old messages dropped, over the session, to fit the context
        self.started = time.time()
        add_turn_end_tokens(engine.tokenizer)

    # -- the conversation
    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [dict(m) for m in self.messages]

    def render(self) -> str:
        return render_chat(self.engine.tokenizer, self.conversation())

    def reset(self) -> None:
        """A new conversation (the system prompt stays)."""
        self.messages = []

    def set_system(self, text: str | None) -> None:
        self.system = text or None

    def _fit(self) -> tuple[list[int], int]:
        """The prompt's tokens, dropping the oldest exchanges until it and some room for the
        reply fit in the model's context; and how many messages were dropped."""
        ctx = self.engine.max_context
        reserve = min(self.settings["max_tokens"], ctx // 4) if ctx else 0
        dropped = 0
        while True:
            tokens = self.engine.encode(self.render())
            if not ctx or len(tokens) + reserve <= ctx or len(self.messages) <= 1:
                break
            del self.messages[:2]  # the oldest user message and its reply
            dropped += 2
            self.dropped += 2
        if ctx and len(tokens) >= ctx:
            raise MlxspecError(f"the message needs {len(tokens)} tokens but the model's context "
                               f"is {ctx} tokens")
        return tokens, dropped

    # -- a turn
    def send(self, text: str) -> Iterator:
        """Add a user message and stream the reply as the engine's `StepOutput`s. Closing the
        iterator early (an interrupt) keeps the partial reply in the history. A message that
        does not fit (the context, the memory) is refused with the conversation as it was."""
        from .memory import check_prompt

        before, dropped_before = list(self.messages), self.dropped
        self.messages.append({"role": "user", "content": text})
        try:
            tokens, dropped = self._fit()
            check_prompt(self.memory, len(tokens), self.settings["max_tokens"],
                         context=self.engine.max_context, what="this message",
                         hint="/reset starts a new conversation, or send a shorter message")
        except BaseException:
            self.messages, self.dropped = before, dropped_before
            raise
        seed = None if self.seed is None else self.seed + len(self.turn_stats)
        proposer = getattr(self.engine, "proposer", None)
        if hasattr(proposer, "set_store"):
            proposer.set_store(self.suffix_store)
        steps = self.engine.stream_steps(tokens, seed=seed, **self.settings)
        pieces: list[str] = []
        out_tokens: list[int] = []
        last = None
        finish = None
        try:
            for out in steps:
                if out is None:  # a step that only prefilled a chunk of the prompt
                    continue
                last = out
                pieces.append(out.text)
                out_tokens.extend(out.tokens)
                if out.finish_reason is not None:
                    finish = out.finish_reason
                yield out
        finally:
            # the engine's cache bookkeeping runs now, not at garbage collection (and this
            # turn's text goes into the suffix store for the next one)
            steps.close()
            if last is None:  # nothing was generated (an error): the turn did not happen
                self.messages.pop()
            else:
                reply = "".join(pieces)
                self.messages.append({"role": "assistant", "content": reply})
                self.last = Turn(reply, out_tokens, last.stats, finish, dropped)
                self.totals.add(last.stats, interrupted=finish is None)
                entry = last.stats.to_dict()
                entry["finish_reason"] = finish
                self.turn_stats.append(entry)

    def reply(self, text: str) -> Turn:
        """Send a message and wait for the whole reply."""
        for _ in self.send(text):
            pass
        return self.last

    # -- saving
    def to_json(self) -> dict:
        return {
            "model": getattr(self.engine, "name", None),
            "mode": getattr(self.engine, "mode", None),
            "settings": dict(self.settings, seed=self.seed),
            "messages": self.conversation(),
            "turn_stats": self.turn_stats,
            "totals": self.totals.to_dict(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
        }
