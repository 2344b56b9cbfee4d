"""A small draft model with the target's tokenizer proposes k tokens autoregressively.

One implementation for one request and for many: `DraftRows` drafts for every member of a
batch of draft caches (`caches.rows.Rows`) in k forwards. A request by itself drafts in a
batch of one on its own draft cache of any kind; requests of a target batch that draft with
the same model share its ragged rows (one forward for all of them). Each member keeps
`cached`, the tokens its draft cache holds, so a step feeds only what the draft has not seen
(the target's last token, plus the last drafted one when all k were accepted), and a
rejection is a trim (a recurrent draft: its state restored and the accepted tokens fed again).
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from .. import caches
from ..caches.prompt import common_prefix_len
from ..caches.ragged import plain_attention
from ..caches.rows import Rows
from ..constrain import DraftGuide
from ..proposal import DRAFT_TREE, LOOKUP_DRAFT
from ..sampling import SamplingParams, draft_draw
from .base import Proposal, Proposer

# A draft behind by more tokens than this catches up in a forward of its own (timed apart).
CATCH_UP_APART = 8
# A draft tree's source, and its width where `auto` proposes one.
TREE, TREE_WIDTH, MAX_TREE_WIDTH = DRAFT_TREE, 2, 8
# Prompt lookup's chain continued by the draft (`propose_after`)
CONTINUED = LOOKUP_DRAFT
# The arms whose tokens the draft model proposes
DRAFT_ARMS = ("draft", TREE, CONTINUED)


class DraftModelProposer(Proposer):
    """`tree_width` > 1: `draft` proposes token trees (source TREE): at every depth the
    draft's top `tree_width` tokens, the best one continued (`DraftRows.propose`)."""

    name = "draft"
    cheap = False

    def __init__(self, draft_model: nn.Module, prefill_step_size: int = 512,
                 prefill_at_reset: bool = True, tree_width: int = 1):
        if not 1 <= tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be 1-{MAX_TREE_WIDTH}, got {tree_width}")
        self.model = draft_model
        self.tree_width = tree_width
        self.uses_trees = tree_width > 1
        self.prefill_step_size = prefill_step_size
        # True: the prompt is prefilled (and evaluated) in `reset`, as prefill time. False
        # (auto, which may not use the draft in a request): the first `propose` catches up.
        self.prefill_at_reset = prefill_at_reset
        self.cache: list | None = caches.make_cache(draft_model)  # None: in a batch's rows
        self.cached: list[int] = []  # the tokens its draft cache holds as context
        self.sampling = SamplingParams()
        # Drafted tokens its cache took beyond `cached` by the last proposal, settled by
        # `update` once the verify says how many were accepted (0: none pending)
        self.pending = 0
        self._checkpoint: caches.Checkpoint | None = None  # (a recurrent draft's, before them)
        self._pending_tokens: mx.array | None = None  # those tokens, where a tree may branch off
        # the rows it drafts in: a batch of one on its own draft cache, or a batch's shared
        # rows while it lends them its cache (`lend_cache`)
        self._rows = DraftRows(draft_model, Rows(draft_model, self.cache), [self])
        self._shared = False

    # -- its draft cache's state, changed by the rows it drafts in (`DraftRows`)
    def took(self, tokens: list[int]) -> None:
        """Its draft cache took `tokens` as context."""
        self.cached += tokens

    def forgot(self, n: int, fresh: list | None = None) -> None:
        """Its draft cache lost its last `n` tokens of context; `fresh`: it could not trim
        and starts again on this cache (its own, not a batch's rows)."""
        if fresh is not None:  # (its rows hold the fresh cache already)
            self.cached = []
            if not self._shared:
                self.cache = fresh
            return
        del self.cached[len(self.cached) - n :]

    def drafted(self, fed: int, checkpoint: caches.Checkpoint | None,
                tokens: mx.array | None = None) -> None:
        """A proposal fed its cache `fed` drafted tokens (a tree's first chain: `tokens`), after
        `checkpoint`; `update` keeps what the verify accepts."""
        self.pending, self._checkpoint, self._pending_tokens = fed, checkpoint, tokens

    def settle(self, num_accepted: int, context: list[int]) -> tuple[int, int, caches.Checkpoint | None]:
        """The verify accepted `num_accepted` tokens, `context` the committed ones: its pending
        tokens that the context holds (a tree's accepted path may leave the chain fed) kept as
        context; returns (kept, pending, the checkpoint before them)."""
        start, pending, ckpt = len(self.cached), self.pending, self._checkpoint
        kept = min(num_accepted, pending)
        if self._pending_tokens is not None:  # (verified: read back without a wait)
            kept = common_prefix_len(self._pending_tokens.tolist()[:kept],
                                     context[start : start + kept])
        self.cached += context[start : start + kept]
        self.pending, self._checkpoint, self._pending_tokens = 0, None, None
        return kept, pending, ckpt

    def lend_cache(self, rows: DraftRows) -> list:
        """Its draft cache, lent to a batch's shared `rows` (given back by `cache_back`)."""
        cache, self.cache, self._rows, self._shared = self.cache, None, rows, True
        return cache

    def cache_back(self, cache: list | None) -> None:
        """Its draft cache back from a batch's rows (None: its state is unknown after a failed
        step: a fresh one)."""
        self.pending, self._checkpoint, self._pending_tokens = 0, None, None
        if cache is None:
            self.cache, self.cached = caches.make_cache(self.model), []
        else:
            self.cache = cache
        self._rows = DraftRows(self.model, Rows(self.model, self.cache), [self])
        self._shared = False

    def reset(self, prompt: list[int], sampling: SamplingParams) -> None:
        self.sampling = sampling
        rows = self._rows
        if self.pending:  # an interrupted step left speculative tokens in the cache
            rows.update(self, self.cached, 0)
        keep = common_prefix_len(self.cached, prompt[:-1])
        rows.forget(0, len(self.cached) - keep)
        if self.prefill_at_reset:
            self.catch_up(prompt)

    def catch_up(self, prompt: list[int]) -> None:
        """Read the prompt now (prefill time), as the target's prefill did."""
        rows = self._rows
        rows.feed([prompt[len(self.cached) : -1]], self.prefill_step_size)
        mx.eval(rows.rows.evaluate())

    def available(self, context: list[int], cap: int) -> dict[str, int]:
        return {TREE if self.uses_trees else self.name: cap}

    def propose(self, context: list[int], num_draft: int, seed: int | None,
                source: str | None = None) -> Proposal | None:
        if num_draft < 1:
            return None
        width = (self.tree_width if self.uses_trees else TREE_WIDTH) if source == TREE else 1
        return self._rows.propose([(self, context, num_draft, seed)], [width])[0]

    def continues(self) -> bool:
        """Whether `propose_after` can run: a draft on its own cache that trims (a recurrent
        state could not go back past tokens it took as context)."""
        return self.cache is not None and not caches.has_recurrent(self.cache)

    def propose_after(self, context: list[int], chain: list[int], num_draft: int,
                      seed: int | None) -> Proposal:
        """`chain` (another source's tokens, e.g. prompt lookup's) continued by the draft to
        num_draft tokens in all: the draft reads the chain as context in one forward and
        drafts the rest. One proposal, the chain's tokens deterministic (q one-hot)."""
        n = len(chain)
        rest = self._rows.propose([(self, context + chain, num_draft - n, seed)])[0]
        # the chain went in as context; it is as speculative as the draft's own tokens
        del self.cached[len(self.cached) - n :]
        self.drafted(self.pending + n, self._checkpoint,
                     mx.concatenate([mx.array(chain, mx.uint32), rest.tokens[:-1]]))
        q = None
        if rest.draft_probs is not None:
            vocab = rest.draft_probs.shape[-1]
            one_hot = (mx.arange(vocab)[None] == mx.array(chain)[:, None]).astype(
                rest.draft_probs.dtype)
            q = mx.concatenate([one_hot, rest.draft_probs])
        return Proposal(tokens=mx.concatenate([mx.array(chain, mx.uint32), rest.tokens]),
                        draft_probs=q, source=CONTINUED, setup_seconds=rest.setup_seconds)

    def update(self, context: list[int], num_accepted: int) -> None:
        if self.pending:  # (nothing to do after a plain step)
            self._rows.update(self, context, num_accepted)


def draft_proposer(proposer) -> DraftModelProposer | None:
    """The draft-model proposer behind a row's proposer (`draft` itself, or `auto`'s)."""
    if isinstance(proposer, DraftModelProposer):
        return proposer
    inner = getattr(proposer, "draft", None)
    return inner if isinstance(inner, DraftModelProposer) else None


class DraftRows:
    """The draft caches of `members` (row b: members[b]) drafting with one draft model."""

    def __init__(self, model, rows=None, members: list[DraftModelProposer] | None = None):
        self.model = model
        self.rows = rows  # the members' draft caches (`Rows`); None: no member yet
        self.members = members or []

    # -- membership (ragged rows: requests of a target batch)
    @staticmethod
    def joins(proposer: DraftModelProposer) -> bool:
        """Only drafts with plain `KVCache` layers share rows; others draft on their own."""
        return (proposer.cache is not None and plain_attention(proposer.cache)
                and not proposer.pending)

    def join(self, proposer: DraftModelProposer) -> None:
        if self.rows is None:
            self.rows = Rows(self.model)
        self.rows.put_row(len(self.members), proposer.lend_cache(self))  # back by `leave`
        # Started, not waited for: a queued step may still be running; the copy joins it.
        mx.async_eval(self.rows.evaluate())
        self.members.append(proposer)

    def leave(self, proposer: DraftModelProposer, failed: bool = False) -> None:
        """Give the member's draft cache back (a fresh one after a failed step: state unknown)."""
        b = self.members.index(proposer)
        self.members.pop(b)
        layers = self.rows.take_row(b)
        self.rows.keep_rows([i for i in range(len(self.members) + 1) if i != b])
        proposer.cache_back(None if failed else layers)
        if not self.members:
            self.rows = None

    # -- drafting
    def forget(self, b: int, n: int) -> None:
        """Member b's draft cache without its last `n` tokens (one that cannot trim: anew)."""
        if n <= 0:
            return
        p = self.members[b]
        if not self.rows.alone:
            self.rows.trim_rows([n if i == b else 0 for i in range(len(self.members))])
        elif not caches.trim_exact(self.rows.layers, n):
            fresh = caches.make_cache(self.model)
            self.rows = Rows(self.model, fresh)
            p.forgot(n, fresh)
            return
        p.forgot(n)

    def _forward(self, tokens: list[mx.array | None]) -> mx.array:
        """Logits (B, width, vocab) of one forward feeding row b tokens[b] (None: sits out);
        the padding is trimmed again at once."""
        if len(tokens) == 1:  # one row (a request by itself): nothing to pad
            return self.model(tokens[0].reshape(1, -1).astype(mx.uint32), cache=self.rows.layers)
        sizes = [0 if t is None else t.size for t in tokens]
        width = max(sizes)
        empty = mx.array([], mx.uint32)
        rows = [mx.concatenate([empty if t is None else t.reshape(-1).astype(mx.uint32),
                                mx.zeros((width - n,), mx.uint32)]) for t, n in zip(tokens, sizes)]
        logits = self.model(mx.stack(rows), cache=self.rows.layers)
        if any(width - s for s in sizes):
            self.rows.trim_rows([width - s for s in sizes])
        return logits

    def feed(self, pending: list[list[int]], chunk: int) -> dict[int, mx.array]:
        """Row b's `pending[b]` tokens into its draft cache, `chunk` a forward; the logits
        after each row's last one."""
        logits = {}
        longest = max(map(len, pending), default=0)
        for start in range(0, longest, chunk):
            part = pending if longest <= chunk else [t[start : start + chunk] for t in pending]
            fed = []  # (a loop, not a comprehension: a call less per step)
            for t in part:
                fed.append(mx.array(t, mx.uint32) if t else None)
            out = self._forward(fed)
            for b, t in enumerate(part):
                if t and start + len(t) == len(pending[b]):
                    logits[b] = out[b, len(t) - 1]
            if start + chunk < longest:
                mx.eval(self.rows.evaluate())
        for p, t in zip(self.members, pending):
            p.took(t)
        return logits

    def _read_context(self, requests) -> tuple[list[int], dict[int, mx.array], float]:
        """Each request's row, the logits after what its draft had not seen yet (at least one
        token: the target's last), and the seconds of a catch-up on skipped context."""
        rows, pending, longest = [], [[]] * len(self.members), 0
        for p, context, _, _ in requests:
            b = self.members.index(p) if len(self.members) > 1 else 0
            rows.append(b)
            if len(p.cached) >= len(context):
                self.forget(b, len(p.cached) - len(context) + 1)
            pending[b] = context[len(p.cached) :]
            longest = max(longest, len(pending[b]))
        # Usually one or two tokens; more where `auto` kept a row off the draft a while: that
        # catch-up is a prefill, timed apart so that the step is not charged with it.
        setup = 0.0
        if longest > CATCH_UP_APART:
            start = time.perf_counter()
            self.feed([t[:-1] for t in pending], self.members[0].prefill_step_size)
            mx.eval(self.rows.evaluate())
            setup = time.perf_counter() - start
            pending = [t[-1:] for t in pending]
        return rows, self.feed(pending, self.members[0].prefill_step_size), setup

    def propose(self, requests: list[tuple[DraftModelProposer, list[int], int, int | None]],
                widths: list[int] | None = None) -> list[Proposal]:
        """Per (member, context, k >= 1, seed), k drafted tokens: a keyed row (a seed, T > 0)
        draws each with the target's keyed noise at its position, over the draft's q (a
        deterministic proposal, `sampling.keyed_draw`); other sampled rows from MLX's global
        generator, with q for the rejection rule.
        widths[j] > 1: a tree instead, k deep (`_tree`)."""
        widths = widths or [1] * len(requests)
        rows, logits, setup = self._read_context(requests)
        ckpt = self.rows.checkpoint()  # (ragged rows: None, a trim undoes anything)
        # the drafted tokens, k_max - 1 more forwards; a row with a grammar drafts within it
        # per request: (j, its row, k, seed, position of its first drafted token, greedy)
        tokens, probs, guides, drafting, deepest = [], [], {}, [], 0
        for j, ((p, context, k, seed), b) in enumerate(zip(requests, rows)):
            tokens.append([])
            probs.append([])
            if getattr(p.sampling.state, "constraint", None) is not None:
                guides[j] = DraftGuide(p.sampling.state, len(context))
            drafting.append((j, b, k, seed, len(context),
                             p.sampling.greedy and widths[j] == 1 and j not in guides))
            deepest = max(deepest, k)
        try:
            for i in range(deepest):
                feed = [None] * len(self.members)
                drawn, feeding = [], False
                for j, b, k, seed, position, greedy in drafting:
                    if i >= k:
                        continue
                    if greedy:
                        token, q = mx.argmax(logits[b], axis=-1), None
                    else:
                        row_logits = guides[j].mask(logits[b]) if j in guides else logits[b]
                        if widths[j] > 1:  # the top tokens; the first one is continued
                            q = _top(row_logits, widths[j])
                            token = q[0]
                        else:
                            token, q = draft_draw(row_logits, requests[j][0].sampling, seed,
                                                  position + i)
                        if j in guides:
                            guides[j].take(token)
                    tokens[j].append(token)
                    probs[j].append(q)
                    drawn.append(token)
                    if i + 1 < k:
                        feed[b], feeding = token, True
                if feeding:
                    out = self._forward(feed)
                    for b, t in enumerate(feed):
                        if t is not None:
                            logits[b] = out[b, 0]
                mx.async_eval(drawn)
        finally:
            for guide in guides.values():
                guide.close()
        proposals = []
        for (p, _, k, _), toks, qs, width in zip(requests, tokens, probs, widths):
            # the draft cache now also holds toks[:-1]; their fate is known after verify
            p.drafted(k - 1, ckpt, mx.stack(toks[:-1]) if width > 1 and k > 1 else None)
            if width > 1:
                prop = _tree(qs, width)
            else:
                q = None if qs[0] is None else mx.stack(qs)
                prop = Proposal(tokens=mx.stack(toks), draft_probs=q, source="draft")
            prop.setup_seconds = setup
            proposals.append(prop)
            setup = 0.0  # (counted once)
        return proposals

    def update(self, proposer: DraftModelProposer, context: list[int], num_accepted: int) -> None:
        """After verification (`DraftModelProposer.update`, the one path): the member's
        accepted drafted tokens kept, the rest dropped from its draft cache."""
        if not proposer.pending:
            return
        b = self.members.index(proposer)
        start = len(proposer.cached)
        kept, pending, ckpt = proposer.settle(num_accepted, context)
        drop = pending - kept
        if drop:
            # (a recurrent draft's state is restored and the accepted tokens fed again)
            fed = context[start : start + kept] + [0] * drop
            drops = [0] * len(self.members)
            drops[b] = drop
            self.rows.trim_rows(drops, [fed], ckpt)


def _top(logits: mx.array, width: int) -> mx.array:
    """The `width` likeliest tokens, likeliest first (lazy)."""
    top = mx.argpartition(-logits, kth=width - 1)[:width]
    return top[mx.argsort(-logits[top])].astype(mx.uint32)


def _tree(tops: list[mx.array], width: int) -> Proposal:
    """A draft tree from each depth's top tokens: the likeliest continued, the others leaves
    beside it. Deterministic (no q): exact at any temperature by the deterministic tree rule,
    which at a rejection tries the next sibling under the residual (`tree_verify.py`)."""
    parents = []
    for d in range(len(tops)):
        parents += [(d - 1) * width if d else -1] * width
    return Proposal(tokens=mx.concatenate(tops), source=TREE, parents=parents)

