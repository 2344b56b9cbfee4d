"""The decode loop: prefill -> propose -> verify -> accept -> roll back, plus loading and the
public `Engine` API.

One step: the proposer suggests up to k tokens; the target runs one forward over
[last committed token] + proposal; `verify.py` decides how many are accepted and which token
follows; the target's KV cache is trimmed by the number rejected. The cache always holds every
committed token but the last, so the next step starts by feeding that one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from . import backend
from .errors import MlxspecError
from .policy import AdaptiveK, FixedK
from .proposers import MODES, make_proposer
from .proposers.base import Proposer
from .proposers.draft import common_prefix_len
from .sampling import SamplingParams, probs_from_logits, sample
from .stats import Stats
from .tree import tree_step
from .verify import verify_greedy, verify_sampled

MAX_NUM_DRAFT = 64


# ----------------------------------------------------------------------------- the loop


def plain_decode(model, cache, context: list[int], sampling: SamplingParams, max_tokens: int,
                 key: mx.array, stats: Stats) -> Iterator[list[int]]:
    """Non-speculative reference, pipelined as mlx_lm.generate is: the next step is queued
    (`mx.async_eval`) before the current token is read back."""

    def step(token: mx.array, step_key: mx.array) -> mx.array:
        logits = model(token.reshape(1, 1), cache=cache)[0, -1]
        if sampling.greedy:
            return mx.argmax(logits, axis=-1)
        return sample(probs_from_logits(logits, sampling), step_key)

    keys = mx.random.split(key, max_tokens + 1) if not sampling.greedy else [None] * (max_tokens + 1)
    y = step(mx.array([context[-1]], mx.uint32), keys[0])
    mx.async_eval(y)
    fed_last = False  # whether the cache already holds the last emitted token
    try:
        for n in range(1, max_tokens + 1):
            if n < max_tokens:
                next_y = step(y, keys[n])
                mx.async_eval(next_y)
            token = y.item()
            fed_last = n < max_tokens
            context.append(token)
            stats.record_step("none", 0, 0, 1)
            yield [token]
            y = next_y if n < max_tokens else None
    finally:
        if fed_last:  # restore the invariant: the cache holds all committed tokens but the last
            trim_prompt_cache(cache, 1)


def speculative_decode(model, cache, context: list[int], proposer: Proposer, policy,
                       sampling: SamplingParams, max_tokens: int, key: mx.array,
                       stats: Stats) -> Iterator[list[int]]:
    """Yield the tokens committed by each step (>= 1 per step); `context` grows in place."""
    generated = 0
    while generated < max_tokens:
        key, propose_key, verify_key = mx.random.split(key, 3)
        # Every step emits one token beyond the accepted ones, so k <= remaining - 1.
        k = min(policy.cap(proposer.name), max_tokens - generated - 1)
        start = time.perf_counter()
        proposal = proposer.propose(context, k, propose_key) if k > 0 else None
        if proposal is not None and proposal.parents is not None and len(proposal):
            # A tree (tree n-gram, lookahead): one forward with per-token positions and an
            # ancestor mask, exact verification of the best path, cache compaction.
            new_tokens, n = tree_step(model, cache, context[-1], proposal, sampling, verify_key,
                                      max_accept=k)
            context.extend(new_tokens)
            proposer.update(context, n)
            policy.observe(proposal.source, len(proposal), n, time.perf_counter() - start)
            stats.record_step(proposal.source, len(proposal), n, len(new_tokens))
            generated += len(new_tokens)
            yield new_tokens
            continue
        if proposal is not None and len(proposal):
            # The source's own estimate refines the cap (0: a plain step; switched-off sources
            # are probed now and then so that they can come back).
            k = min(k, policy.choose_or_probe(proposal.source))
        num_draft = min(len(proposal), k) if proposal is not None else 0
        if num_draft:
            draft = mx.array(proposal.tokens[:num_draft], mx.uint32) if isinstance(
                proposal.tokens, list) else proposal.tokens[:num_draft].astype(mx.uint32)
            q = proposal.draft_probs[:num_draft] if proposal.draft_probs is not None else None
        else:
            draft, q = mx.array([], mx.uint32), None
        inputs = mx.concatenate([mx.array([context[-1]], mx.uint32), draft])
        logits = model(inputs[None], cache=cache)[0]
        if sampling.greedy:
            num_accepted, next_token = verify_greedy(logits, draft)
        else:
            p = probs_from_logits(logits, sampling)
            num_accepted, next_token = verify_sampled(p, draft, q, verify_key)
        head = mx.stack([num_accepted.astype(mx.uint32), next_token.astype(mx.uint32)])
        result = mx.concatenate([head, draft]).tolist()  # the one host sync of the step
        n, drafted_tokens = result[0], result[2:]
        new_tokens = drafted_tokens[:n] + [result[1]]
        if num_draft > n:
            trim_prompt_cache(cache, num_draft - n)
        context.extend(new_tokens)
        proposer.update(context, n)
        source = proposal.source if num_draft else ""
        policy.observe(source, num_draft, n, time.perf_counter() - start)
        stats.record_step(source, num_draft, n, len(new_tokens))
        generated += len(new_tokens)
        yield new_tokens


# ----------------------------------------------------------------------------- results


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str = "length"  # "stop" (EOS or a stop string) or "length"

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


@dataclass
class StepOutput:
    """What `Engine.stream_steps` yields after each target forward."""

    text: str  # new text since the previous step (may be empty while a stop string is pending)
    tokens: list[int]  # tokens emitted by this step
    stats: Stats
    finish_reason: str | None = None  # set on the last output


@dataclass
class PromptCache:
    """A target KV cache and the tokens it holds; reused when a prompt extends `tokens`."""

    cache: list | None = None
    tokens: list[int] = field(default_factory=list)
    kind: str = ""

    def nbytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache or [])

    def reuse_prefix(self, tokens: list[int], kind: str) -> int:
        """Trim the cache to its longest common prefix with `tokens` and return that length;
        0 means nothing is reusable (no cache, another kind, or one that cannot trim so far)."""
        if self.cache is None or self.kind != kind:
            return 0
        keep = common_prefix_len(self.tokens, tokens)
        drop = len(self.tokens) - keep
        if keep == 0 or (drop and any(c.trim(drop) != drop for c in self.cache)):
            return 0
        self.tokens = self.tokens[:keep]
        return keep


# ----------------------------------------------------------------------------- loading


def _local_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except Exception:
        return None


def resolve_model_path(model: str | None) -> Path:
    """A local directory, a Hugging Face repo id (cache first, then download), or None for the
    bundled default model."""
    if model is None:
        from .models import bundled_model_path

        try:
            return bundled_model_path("target")
        except FileNotFoundError as e:
            raise MlxspecError(str(e)) from None
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise MlxspecError(f"{model}: not a model directory (no config.json in it)")
        return path
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise MlxspecError(f"{model}: no such model directory, and not a Hugging Face repo id") from None
    if model.startswith((".", "/", "~")):
        raise MlxspecError(f"{model}: no such model directory")
    cached = _local_snapshot(model)
    if cached is not None:
        return cached
    import os

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise MlxspecError(
            f"{model}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set. "
            f"Download it first (`hf download {model}`) or pass a local model directory.")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model",
                                   "*.tiktoken", "*.txt", "*.jinja"]))
    except Exception as e:
        raise MlxspecError(
            f"{model}: could not be downloaded ({type(e).__name__}) and is not in the local "
            f"Hugging Face cache. Download it on a machine with network access "
            f"(`hf download {model}`) or pass a local model directory.") from None


def load_model(model: str | None) -> tuple[nn.Module, Any, dict, str]:
    """(model, tokenizer, config, name) via mlx-lm; on the CPU backend computed in float32."""
    from mlx_lm.utils import load as mlx_lm_load

    path = resolve_model_path(model)
    try:
        net, tokenizer, config = mlx_lm_load(str(path), return_config=True)
    except (FileNotFoundError, ValueError) as e:
        raise MlxspecError(f"{model or path}: cannot load model: {e}") from None
    dtype = backend.compute_dtype()
    if dtype is not None:
        net.set_dtype(dtype)
    name = model if model is not None else f"bundled:{path.name}"
    return net, tokenizer, config, name


def vocab_size(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    return getattr(args, "vocab_size", None)


def check_draft_compatible(target_tok, draft_tok, target_model, draft_model,
                           target_name: str, draft_name: str) -> None:
    tv, dv = vocab_size(target_model), vocab_size(draft_model)
    if tv is not None and dv is not None and tv != dv:
        raise MlxspecError(
            f"draft model {draft_name} has vocabulary size {dv} but target {target_name} has {tv}: "
            "a draft must share the target's tokenizer")
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise MlxspecError(
            f"draft model {draft_name} does not share the tokenizer of target {target_name} "
            "(their token strings differ)")


def check_fits_in_memory(paths: list[Path], context_tokens: int = 0) -> None:
    """On Metal, refuse models that do not fit in the recommended working set."""
    if backend.device_name() != "metal":
        return
    need = sum(f.stat().st_size for p in paths for f in p.glob("*.safetensors"))
    limit = mx.device_info()["max_recommended_working_set_size"]
    if need > limit:
        raise MlxspecError(
            f"the model weights need {need / 1e9:.1f} GB but Metal's recommended working set is "
            f"{limit / 1e9:.1f} GB: use a smaller or more quantized model "
            f"(at most about {limit / 1e9:.1f} GB of weights plus KV cache)")


def load(model: str | None = None, *, mode: str = "none", draft: str | None = None,
         num_draft: int = 4, max_context: int | None = None, adaptive: bool = False,
         **mode_options) -> Engine:
    """Load a target (path, repo id, or None for the bundled model) and an optional draft."""
    _check_mode(mode)
    _check_num_draft(num_draft)
    target_path = resolve_model_path(model)
    draft_path = None
    if draft is None and mode == "draft":
        if model is not None:
            raise MlxspecError(f"mode '{mode}' needs a draft model (--draft-model)")
        from .models import bundled_model_path

        try:
            draft_path = bundled_model_path("draft")
        except FileNotFoundError as e:
            raise MlxspecError(str(e)) from None
    elif draft is not None:
        draft_path = resolve_model_path(draft)
    check_fits_in_memory([p for p in (target_path, draft_path) if p is not None])
    net, tokenizer, config, name = load_model(model)
    draft_model = None
    if draft_path is not None:
        draft_model, draft_tok, _, draft_name = load_model(draft if draft is not None else str(draft_path))
        check_draft_compatible(tokenizer, draft_tok, net, draft_model, name, draft_name)
    return Engine(net, tokenizer, mode=mode, draft_model=draft_model, num_draft=num_draft,
                  config=config, name=name, max_context=max_context, adaptive=adaptive,
                  **mode_options)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise MlxspecError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")


def _check_num_draft(num_draft: int) -> None:
    if not 1 <= num_draft <= MAX_NUM_DRAFT:
        raise MlxspecError(f"num_draft must be between 1 and {MAX_NUM_DRAFT}, got {num_draft}")


# ----------------------------------------------------------------------------- the engine


class Engine:
    """A loaded target (and draft) with a speculation mode; generates text or tokens."""

    def __init__(self, model: nn.Module, tokenizer, *, mode: str = "none",
                 draft_model: nn.Module | None = None, num_draft: int = 4,
                 config: dict | None = None, name: str = "model",
                 max_context: int | None = None, prefill_step_size: int = 2048,
                 adaptive: bool = False, kv: str = "fp", kv_group_size: int = 64,
                 kv_buffer_size: int | None = None, **mode_options):
        if kv not in ("fp", "hierarchical"):
            raise MlxspecError(f"kv must be 'fp' or 'hierarchical', got {kv!r}")
        # kv="hierarchical": plain decoding reads QuantSpec's 8-bit view of the hierarchical
        # cache, the reference `quantspec` is token-identical to.
        self.kv, self.kv_group_size, self.kv_buffer_size = kv, kv_group_size, kv_buffer_size
        self.model = model
        self.tokenizer = tokenizer
        self.draft_model = draft_model
        self.config = config or {}
        self.name = name
        self.max_context = max_context or self.config.get("max_position_embeddings")
        self.prefill_step_size = prefill_step_size
        self.adaptive = adaptive
        self.prompt_cache = PromptCache()
        self._proposers: dict = {}
        self.set_mode(mode, num_draft=num_draft, **mode_options)

    # -- configuration
    def set_mode(self, mode: str, num_draft: int | None = None, **mode_options) -> None:
        """Switch the speculation mode without reloading the target."""
        _check_mode(mode)
        if num_draft is not None:
            _check_num_draft(num_draft)
            self.num_draft = num_draft
        self.mode = mode
        self.mode_options = mode_options
        self.proposer = self._proposer_for(mode, **mode_options)
        # A proposer may bring its own policy (auto does); else k is fixed or adapted, with
        # num_draft as the cap.
        self.policy = getattr(self.proposer, "policy", None) or (
            AdaptiveK(max_k=self.num_draft) if self.adaptive else FixedK(self.num_draft))

    def _proposer_for(self, mode: str, **mode_options) -> Proposer | None:
        # One proposer per (mode, options), kept: a draft model's cache and QuantSpec's weight
        # copies survive switching modes back and forth.
        key = (mode, tuple(sorted(mode_options.items())))
        if key not in self._proposers:
            try:
                proposer = make_proposer(mode, self.model, self.draft_model, **mode_options)
            except MlxspecError:
                raise
            except (TypeError, ValueError) as e:  # a bad option of this mode
                raise MlxspecError(f"mode {mode!r}: {e}") from None
            self._proposers[key] = proposer
        return self._proposers[key]

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = bos is None or not prompt.startswith(bos)
            return self.tokenizer.encode(prompt, add_special_tokens=add_special)
        return [int(t) for t in prompt]

    # -- generation
    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Generate a whole completion. Keyword arguments as `stream_steps`."""
        text, tokens, out = [], [], None
        for out in self.stream_steps(prompt, **kwargs):
            text.append(out.text)
            tokens.extend(out.tokens)
        return GenerationResult("".join(text), tokens, out.stats, out.finish_reason or "length")

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as they are decoded."""
        for out in self.stream_steps(prompt, **kwargs):
            if out.text:
                yield out.text

    def stream_steps(self, prompt: str | list[int], *, max_tokens: int = 128,
                     temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     min_p: float = 0.0, seed: int | None = 0, stop: list[str] | str | None = None,
                     prediction: str | list[int] | None = None, num_draft: int | None = None,
                     prompt_cache: PromptCache | None = None, mode: str | None = None,
                     policy=None, progress=None) -> Iterator[StepOutput]:
        """Generate, yielding after every target forward. `prediction` (text or ids) is a
        predicted output the n-gram proposer copies from; `prompt_cache` (default: the
        engine's own) is reused when the prompt extends the tokens it holds; `mode` overrides
        the engine's mode for this call, `policy` its k policy (`FixedK`, `AdaptiveK`);
        `progress(done, total)` is called during prefill."""
        sampling = SamplingParams(temperature, top_p, top_k, min_p)
        try:
            sampling.validate()
        except ValueError as e:
            raise MlxspecError(str(e)) from None
        if max_tokens < 1:
            raise MlxspecError(f"max_tokens must be >= 1, got {max_tokens}")
        if num_draft is not None:
            _check_num_draft(num_draft)
        tokens = self.encode(prompt)
        if not tokens:
            raise MlxspecError("the prompt is empty")
        if self.max_context and len(tokens) >= self.max_context:
            raise MlxspecError(
                f"the prompt has {len(tokens)} tokens but the model's context is "
                f"{self.max_context} tokens")
        if self.max_context:
            max_tokens = min(max_tokens, self.max_context - len(tokens))
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if mode is not None:
            _check_mode(mode)
        mode = mode or self.mode
        proposer = self.proposer if mode == self.mode else self._proposer_for(mode)
        if hasattr(proposer, "set_prediction"):
            if isinstance(prediction, str):
                prediction = self.tokenizer.encode(prediction, add_special_tokens=False)
            proposer.set_prediction(prediction)
        if policy is not None:
            pass
        elif num_draft is not None:
            policy = FixedK(num_draft)
        elif proposer is self.proposer:
            policy = self.policy
        else:
            policy = getattr(proposer, "policy", None) or FixedK(self.num_draft)
        pc = prompt_cache if prompt_cache is not None else self.prompt_cache
        stats = Stats(mode=mode, prompt_tokens=len(tokens))
        key = mx.random.key(seed if seed is not None else time.time_ns() % 2**31)

        with wired_limit(self.model):
            backend.reset_peak_memory()
            start = time.perf_counter()
            self._prefill(pc, tokens, stats, proposer, progress)
            if proposer is not None:
                proposer.reset(tokens, sampling)  # a draft model prefills here: prefill time
            stats.prefill_seconds = time.perf_counter() - start
            context = list(tokens)
            if proposer is None:
                steps = plain_decode(self.model, pc.cache, context, sampling, max_tokens, key, stats)
            else:
                steps = speculative_decode(self.model, pc.cache, context, proposer, policy,
                                           sampling, max_tokens, key, stats)
            start = time.perf_counter()
            try:
                yield from self._detokenize(steps, stats, stops, start)
            finally:
                steps.close()
                pc.tokens = context[:-1]
                # An exception in the middle of a step (Ctrl-C, a failing callback) can leave
                # the cache holding other tokens than `context`: then it must not be reused.
                if any(getattr(c, "offset", len(pc.tokens)) != len(pc.tokens) for c in pc.cache):
                    pc.cache, pc.tokens = None, []

    def _prefill(self, pc: PromptCache, tokens: list[int], stats: Stats, proposer,
                 progress) -> None:
        """Bring `pc` to hold tokens[:-1], reusing the longest common prefix it already holds."""
        kind = getattr(proposer, "cache_kind", None) or (
            f"hierarchical-ref:{self.kv_group_size}:{self.kv_buffer_size}"
            if self.kv == "hierarchical" else "kv")
        keep = pc.reuse_prefix(tokens[:-1], kind)
        if keep == 0:
            maker = getattr(proposer, "make_target_cache", None)
            if maker is not None:
                pc.cache = maker(self.model)
            elif self.kv == "hierarchical":
                from .quant.hierarchical_cache import make_reference_cache

                pc.cache = make_reference_cache(self.model, self.kv_group_size, self.kv_buffer_size)
            else:
                pc.cache = make_prompt_cache(self.model)
            pc.kind = kind
        stats.cached_tokens = keep
        todo = tokens[keep:-1]
        done = 0
        pc.tokens = tokens[:keep]
        try:
            while done < len(todo):
                chunk = todo[done : done + self.prefill_step_size]
                self.model(mx.array(chunk, mx.uint32)[None], cache=pc.cache)
                mx.eval([c.state for c in pc.cache])
                done += len(chunk)
                pc.tokens = tokens[: keep + done]
                if progress is not None:
                    progress(done, len(todo))
        except BaseException:
            pc.cache, pc.tokens = None, []  # interrupted mid-chunk: the cache state is unknown
            raise
        if hasattr(proposer, "bind_cache"):  # a proposer that drafts on the target's own cache
            proposer.bind_cache(pc.cache)

    def _detokenize(self, steps: Iterator[list[int]], stats: Stats, stops: list[str],
                    start: float) -> Iterator[StepOutput]:
        eos = set(getattr(self.tokenizer, "eos_token_ids", None) or [])
        detok = self.tokenizer.detokenizer
        detok.reset()
        held = ""  # text withheld because it may be the start of a stop string
        hold = max((len(s) for s in stops), default=1) - 1
        for new_tokens in steps:
            finish = None
            emitted = []
            for t in new_tokens:
                if t in eos:
                    finish = "stop"
                    break
                emitted.append(t)
                detok.add_token(t)
            if finish:
                stats.generated_tokens -= len(new_tokens) - len(emitted)
                detok.finalize()
            text = held + detok.last_segment
            for s in stops:
                cut = text.find(s)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
            if finish is None and hold:
                cut = max(0, len(text) - hold)
                held, text = text[cut:], text[:cut]
            else:
                held = ""
            stats.decode_seconds = time.perf_counter() - start
            stats.peak_memory_gb = backend.peak_memory_gb()
            if finish:
                yield StepOutput(text, emitted, stats, finish)
                return
            yield StepOutput(text, emitted, stats)
        detok.finalize()
        stats.decode_seconds = time.perf_counter() - start
        yield StepOutput(held + detok.last_segment, [], stats, "length")
