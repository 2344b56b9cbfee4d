"""The public `Engine` API: a loaded model and its modes, requests checked and prefilled (with
the prompt cache). The decode loop is `batch_step.BatchSpeculator`: a request by itself is a batch
of one on its own cache (`Engine.open`), stepped by `batch_step.follow`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
from mlx_lm.generate import wired_limit

from . import backend, policy_store
from .batch_step import BatchSpeculator, follow
from .caches.prompt import PromptCache
from .cost import StepCost
from .errors import MlxspecError
from .fim import detect_fim
from .planning import BatchPolicy
from .policy import AUTO_MAX_K, DEFAULT_NUM_DRAFT, AdaptiveK, FixedK, Policy, check_num_draft
from .proposers import check_mode, make_proposer
from .proposers.auto import draft_policy
from .proposers.base import Proposer
from .request import Request, checked, resolved, signal_ids, workload_signal
from .row import BatchRow
from .stats import Stats
from .stopstrings import StepOutput  # noqa: F401  (public API, re-exported)
from .target import PrefillMeter, Target


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"
    # per token its `constrain.TokenLogprob` (the request asked for `logprobs`), else None
    logprobs: list | None = None

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [None if e is None else
                               {"token": e.token, "logprob": e.logprob, "top": e.top}
                               for e in self.logprobs]
        return out


class Engine:
    """A loaded target (and draft) with a speculation mode; generates text or tokens."""

    def __init__(self, model: nn.Module, tokenizer, *, mode: str = "none",
                 draft_model: nn.Module | None = None, num_draft: int | None = None,
                 config: dict | None = None, name: str = "model",
                 max_context: int | None = None, prefill_step_size: int = 2048,
                 adaptive: bool = False, kv: str = "fp", kv_group_size: int = 64,
                 kv_buffer_size: int | None = None, draft_source=None,
                 load_draft: Callable[[object, Engine], nn.Module] | None = None,
                 **mode_options):
        if kv not in ("fp", "hierarchical"):
            raise MlxspecError(f"kv must be 'fp' or 'hierarchical', got {kv!r}")
        # kv="hierarchical": plain decoding on QuantSpec's 8-bit view (what it verifies with)
        self.kv, self.kv_group_size, self.kv_buffer_size = kv, kv_group_size, kv_buffer_size
        self.model = model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        # loaded on first use when draft_model is None, by load_draft(draft_source, engine)
        # (`loading.load_draft`, which checks the pair: the loader knows the engine, not back)
        self.draft_source, self.load_draft = draft_source, load_draft
        self.config = config or {}
        self.name = name
        self.max_context = max_context or self.config.get("max_position_embeddings")
        self.prefill_step_size = prefill_step_size
        self.adaptive = adaptive
        self.prompt_cache = PromptCache()
        self.prefill_meter = PrefillMeter()  # its prefill's time per token (`prefill.prefill`)
        self._proposers: dict = {}
        # (id(proposer), workload signal) -> (the key its state is kept under, policy): kept
        # between processes by `policy_store`
        self.policies: dict[tuple[int, str], tuple[str, Policy]] = {}
        # what a step costs on this model and machine: one model for every request and batch
        self.cost = StepCost()
        self.signal_ids: dict[int, str] | None = None  # token id -> signal (`workload_signal`)
        self.fim_ids: tuple[int | None, int | None] | None = None  # (`fim_markers`, kept by clones)
        # where adaptive policies are kept between processes (`keep_policies`); None: priors
        self.policy_file: Path | None = None
        self.sync = None  # a sharded target: rank 0's tokens on every rank (distributed.py)
        self.num_draft_set = num_draft is not None
        self.num_draft = DEFAULT_NUM_DRAFT
        self.set_mode(mode, num_draft=num_draft, **mode_options)

    def clone(self, **extra) -> Engine:
        """Another engine on the same weights, with its own proposers, policies and prompt
        cache (a server slot); `extra`: a subclass's own constructor arguments."""
        other = type(self)(
            self.model, self.tokenizer, mode="none", draft_model=self.draft_model,
            num_draft=self.num_draft if self.num_draft_set else None, config=self.config,
            name=self.name, max_context=self.max_context, prefill_step_size=self.prefill_step_size,
            adaptive=self.adaptive, kv=self.kv, kv_group_size=self.kv_group_size,
            kv_buffer_size=self.kv_buffer_size, draft_source=self.draft_source,
            load_draft=self.load_draft, **extra)
        other.cost = self.cost  # the same weights on the same machine
        other.signal_ids, other.fim_ids = self.signal_ids, self.fim_ids
        other.set_mode(self.mode, **self.mode_options)
        return other

    # -- configuration
    def set_mode(self, mode: str, num_draft: int | None = None, **mode_options) -> None:
        """Switch the speculation mode without reloading the target."""
        check_mode(mode)
        if num_draft is not None:
            check_num_draft(num_draft)
            self.num_draft, self.num_draft_set = num_draft, True
            self.policies.clear()
        self.proposer = self.proposer_for(mode, **mode_options)
        self.mode, self.mode_options = mode, mode_options
        self.policy = self.policy_for(self.proposer)

    def proposer_for(self, mode: str, **mode_options) -> Proposer | None:
        """The proposer of `mode` (None for `none`), kept per (mode, options): a draft's cache
        and QuantSpec's weight copies survive switching modes."""
        check_mode(mode)
        key = (mode, tuple(sorted(mode_options.items())))
        if key not in self._proposers:
            # the pair's draft is loaded when a mode first uses it
            if (mode in ("draft", "auto") and self.draft_model is None
                    and self.draft_source is not None and self.load_draft is not None):
                self.draft_model = self.load_draft(self.draft_source, self)
            try:
                proposer = make_proposer(mode, self.model, self.draft_model, **mode_options)
            except MlxspecError:
                raise
            except (TypeError, ValueError) as e:  # a bad option of this mode
                raise MlxspecError(f"mode {mode!r}: {e}") from None
            if hasattr(proposer, "set_fim"):  # FIM requests read as the document they edit
                proposer.set_fim(*self.fim_markers())
            self._proposers[key] = proposer
        return self._proposers[key]

    def proposer_of(self, mode: str | None) -> Proposer | None:
        """The proposer a request in `mode` uses (None: the engine's mode, with its options)."""
        return self.proposer if mode in (None, self.mode) else self.proposer_for(mode)

    def policy_for(self, proposer: Proposer | None, signal: str = "") -> Policy:
        """The proposer's policy for one kind of request (`signal`, see `request.workload_signal`),
        kept so that it keeps learning: `AdaptiveK` for auto (k capped by num_draft when set)
        or with adaptive=True, else `FixedK(num_draft)`. Each kind learns apart: what a chat
        measured does not decide a completion's sources."""
        key = (id(proposer), signal)
        if key not in self.policies:
            if getattr(proposer, "adaptive", False):
                policy = draft_policy(self.model, getattr(proposer, "draft", None), self.cost,
                                      max_k=self.num_draft if self.num_draft_set else AUTO_MAX_K)
            elif self.adaptive:
                policy = AdaptiveK(max_k=self.num_draft, cost=self.cost)
            else:
                policy = FixedK(self.num_draft)
            mode = getattr(proposer, "name", "none")
            self.policies[key] = (f"{mode}/{signal}" if signal else mode, policy)
            policy_store.resume(self.policy_file, self.cost, self.policies.values())
        return self.policies[key][1]

    def keep_policies(self, path: Path | None) -> None:
        """Start the adaptive policies from what earlier processes kept at `path`, and keep
        this one's there (`save_policies`)."""
        self.policy_file = path
        policy_store.resume(path, self.cost, self.policies.values())

    def save_policies(self) -> None:
        """Keep what the adaptive policies measured at the policy file (`keep_policies`)."""
        policy_store.save(self.policy_file, self.cost, self.policies.values())

    @property
    def prefill_seconds_per_token(self) -> float:
        """The target's prefill time per token, as last measured (0: not yet)."""
        return self.prefill_meter.seconds_per_token

    @property
    def target(self) -> Target:
        """The target as the decode loop sees it: everything below the engine takes this."""
        return Target(self.model, self.tokenizer, self.kv, self.kv_group_size,
                      self.kv_buffer_size, self.prefill_step_size, self.sync, self.prefill_meter)

    def workload_signal(self, tokens: list[int], prediction) -> str:
        """The kind of request (`request.workload_signal`), for its policy."""
        if self.signal_ids is None:
            self.signal_ids = signal_ids(self.tokenizer)
        return workload_signal(self.signal_ids, tokens, prediction)

    def fim_markers(self) -> tuple[int | None, int | None]:
        """The model's FIM suffix and middle token ids ((None, None): it has none)."""
        if self.fim_ids is None:
            fim = detect_fim(getattr(self.tokenizer, "get_vocab", dict)())
            self.fim_ids = (fim.suffix, fim.middle) if fim else (None, None)
        return self.fim_ids

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = bos is None or not prompt.startswith(bos)
            return self.tokenizer.encode(prompt, add_special_tokens=add_special)
        return [int(t) for t in prompt]

    # -- generation
    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate a whole completion. Keyword arguments as `stream_steps`."""
        text, tokens, logprobs, out = [], [], [], None
        for step in self.stream_steps(prompt, **kwargs):
            if step is None:  # a step that only prefilled a chunk of the prompt
                continue
            out = step
            text.append(out.text)
            tokens.extend(out.tokens)
            if out.logprobs is not None:
                logprobs.extend(out.logprobs)
        return GenerationResult("".join(text), tokens, out.stats, out.finish_reason or "length",
                                logprobs if kwargs.get("logprobs") is not None else None)

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as they are decoded."""
        for out in self.stream_steps(prompt, **kwargs):
            if out is not None and out.text:  # (None: a step that only prefilled)
                yield out.text

    def stream_steps(self, prompt: str | list[int], **kwargs) -> Iterator[StepOutput | None]:
        """Generate, yielding after every target forward (None after a step that only
        prefilled a chunk). Keyword arguments as `request`, and `progress(done, total)`
        during prefill and `prefill_chunk` (a longer prompt prefilled that many tokens a step)."""
        with wired_limit(self.model):
            backend.reset_peak_memory()
            yield from follow(*self.open(prompt, **kwargs))

    def request(self, prompt: str | list[int], *, mode: str | None = None,
                prediction: str | list[int] | None = None, policy: Policy | None = None,
                prompt_cache: PromptCache | None = None, max_tokens: int = 128,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                min_p: float = 0.0, seed: int | None = None,
                stop: list[str] | str | None = None, num_draft: int | None = None,
                cache_reuse: int = 0, logit_bias=None, logprobs: int | None = None,
                post_probs: bool = False, grammar=None, json_schema=None,
                regex: str | None = None) -> Request:
        """A prompt and its options as a self-contained request (checked before any work, with
        clear errors): its tokens, sampling, the proposer of its `mode` (default: the
        engine's), its policy (`policy`, or the engine's for its mode and kind of request) and
        its prompt cache (`prompt_cache`, default the engine's: reused where the prompt
        shares a prefix with it). `prediction` (text or ids): a predicted output the n-gram
        proposer copies from; `num_draft`: a cap on k; `seed`: at T > 0 each token is drawn
        from noise keyed by (seed, its position), so every mode, batch and k draws the same
        tokens (None: MLX's global generator, exact in distribution only); `cache_reuse`
        N > 0: past the common prefix, runs of at least N cached tokens are reused where they
        moved (llama.cpp's `--cache-reuse`: not bit-identical to a fresh prefill,
        `caches/shift.py`).

        Per-row work on the target's logits, exact in every mode (`constrain.py`):
        `logit_bias` ({id: bias} or [[id or text, bias], ...], false bans), `logprobs` (None,
        or the number of top alternatives reported with each token's log-probability;
        `post_probs`: probabilities after bias, grammar and sampling transforms), and one
        grammar: `json_schema` (a JSON Schema, or True for any JSON object), `regex`, or
        `grammar` (GBNF or Lark text, or a (kind, spec) pair of `constrain.grammar_text`)."""
        target, tokens = self.target, self.encode(prompt)
        req = checked(target, tokens, self.max_context, max_tokens=max_tokens,
                      temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                      seed=seed, stop=stop, num_draft=num_draft, cache_reuse=cache_reuse,
                      logit_bias=logit_bias, logprobs=logprobs, post_probs=post_probs,
                      grammar=grammar, json_schema=json_schema, regex=regex)
        mode = mode or self.mode
        proposer = self.proposer_of(mode)
        if isinstance(prediction, str):
            prediction = self.tokenizer.encode(prediction, add_special_tokens=False)
        if policy is None:
            policy = self.policy_for(proposer, self.workload_signal(tokens, prediction))
        pc = prompt_cache if prompt_cache is not None else self.prompt_cache
        return resolved(req, target, mode, proposer, policy, pc, prediction)

    def join(self, batch: BatchSpeculator, prompt: str | list[int], *, progress=None,
             prefill_chunk: int | None = None, **options) -> BatchRow:
        """A request of this engine opened in `batch` (`BatchSpeculator.open`); `options`: as
        `request`."""
        return batch.open(self.request(prompt, **options), self.target, progress=progress,
                          prefill_chunk=prefill_chunk)

    def open(self, prompt: str | list[int], **kwargs) -> tuple[BatchSpeculator, BatchRow]:
        """A request by itself, opened: a batch of one on its own cache (of any kind), and its
        row. Whoever holds them steps the batch (`batch_step.follow`, the server's worker) and
        closes the row through it. Keyword arguments as `stream_steps`."""
        batch = BatchSpeculator(self.model, BatchPolicy(self.cost), sync=self.sync)
        return batch, self.join(batch, prompt, **kwargs)

    def accepts(self, mode: str | None = None) -> bool:
        """Whether a request in `mode` can share a batch with others (`Target.shareable`)."""
        try:
            proposer = self.proposer_of(mode)
        except MlxspecError:
            return False  # the request reports it
        return self.target.shareable(proposer)
