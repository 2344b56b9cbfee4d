"""The step kernel, for B >= 1 rows and k >= 0 (a plain step is k = 0): one target forward over
each row's [last committed token] + proposal, exact verification, then one host sync and the
rollback of what was rejected. `start_step` builds everything lazily (a driver may start the
next step before reading this one: pipelining), `finish_step` syncs and commits. The cache is
rows (`caches.rows`): one request's cache of any kind, or ragged rows. See
docs/HOW_IT_WORKS.md, "The loop". Invariant: each row's cache holds every committed token but
the last.

The exact acceptance rules (a chain's; a tree's are `tree_verify.py`'s), shared by every mode:
at temperature 0, and for a keyed row, the host compares the target's draws with the draft
after the step's one sync (`greedy_accepted`); a sampled row without a seed takes the
rejection rule (`verify_sampled`: lazy (num_accepted, next_token), the same sync). The next
token is the target's correction at the first rejection, or the bonus token after the last
proposal when all were accepted: every step emits at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import mlx.core as mx
import mlx.nn as nn

from .caches import Checkpoint
from .caches.rows import Rows, as_rows
from .constrain import adjust_next, adjust_rows
from .proposal import Proposal
from .sampling import SamplingParams, keyed_draw, probs_from_logits, sample

GREEDY = SamplingParams()  # what an empty slot of a batch is "sampled" with

# A keyed row's (seed, absolute position of its next token): its draws are functions of these
# (`sampling.keyed_draw`), so it draws the same tokens in every mode and batch. None: a greedy
# row, or a sampled one drawing from MLX's global generator (exact in distribution only).
SeedAt = tuple[int, int] | None


@dataclass
class StepResult:
    tokens: list[int]  # committed by this step: the accepted draft tokens, then the target's
    accepted: int  # draft tokens accepted (len(tokens) - 1)
    drafted: int  # draft positions verified (a tree: its depth)
    source: str  # the proposal's source, "" for a plain step
    # per committed token its `constrain.TokenLogprob` (a row asking for log-probabilities)
    logprobs: list | None = None


@dataclass
class StartedStep:
    """A step whose forward and verification are built (lazily), not read back yet."""

    rows: object  # the cache's rows
    fed: list[int | None]  # each row's last token (None: sat out, its padding trimmed)
    sizes: list[int]  # draft tokens verified per row
    matched: list[bool]  # greedy or keyed: a draft token is accepted where it equals the draw
    sources: list[str]
    width: int
    # flat per fed row: matched rows their draws[:k+1] + draft; other sampled rows n, next,
    # draft (k = 0: next)
    out: mx.array
    ckpt: Checkpoint | None
    # rows with per-row work (`SamplingParams.adjusted`): their samplings, the position of the
    # token each was fed (committed tokens follow it), lazy log-probability arrays
    samplings: list[SamplingParams] | None = None
    positions: list[int] | None = None
    lps: list[tuple | None] | None = None


def _leading_true(flags: mx.array) -> mx.array:
    """Number of leading True values of a 1-D bool array."""
    if flags.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(flags.astype(mx.int32)).sum()


def greedy_accepted(target: list[int], draft: list[int]) -> int:
    """Temperature 0: the draft tokens accepted, while each equals the target's argmax
    (`target`: the argmax over [last token] + draft, read back; the next token is
    target[accepted])."""
    for i, d in enumerate(draft):
        if target[i] != d:
            return i
    return len(draft)


def verify_sampled(
    p: mx.array, draft: mx.array, q: mx.array | None, key: mx.array | None
) -> tuple[mx.array, mx.array]:
    """Temperature > 0, exact for any proposal.

    p: (k + 1, vocab) target probabilities; draft: (k,) proposed ids; q: (k, vocab) the draft's
    probabilities, or None for a deterministic proposal (q one-hot at the proposed token);
    key: None draws from MLX's global generator.

    With q (Leviathan et al. / Chen et al.): accept x with probability min(1, p(x)/q(x)); on
    rejection sample from normalize(max(0, p - q)). With q one-hot this becomes: accept x with
    probability p(x); on rejection sample from p with x removed. Bonus from p when all accepted.
    """
    k = draft.size
    # no key: MLX's global generator (a draw that need not be reproducible)
    accept_key, sample_key = mx.random.split(key) if key is not None else (None, None)
    if k == 0:
        return mx.array(0, dtype=mx.int32), sample(p[0], sample_key)
    p_draft = p[:k]
    p_x = mx.take_along_axis(p_draft, draft[:, None], axis=-1)[:, 0]
    if q is None:
        accept_prob = p_x
        residual = mx.where(mx.arange(p.shape[-1])[None, :] == draft[:, None], 0.0, p_draft)
    else:
        q_x = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
        accept_prob = mx.minimum(1.0, p_x / mx.maximum(q_x, 1e-30))
        residual = mx.maximum(p_draft - q, 0.0)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    num_accepted = _leading_true(u < accept_prob)
    rows = mx.concatenate([residual, p[k:]], axis=0)
    row = rows[num_accepted]
    mass = row.sum()
    # A residual of zero mass is only reachable with probability 0 (p == q); fall back to p.
    row = mx.where(mass > 0, row / mx.maximum(mass, 1e-30), p[num_accepted])
    return num_accepted, sample(row, sample_key)


def verify_chain(logits: mx.array, draft: mx.array, q: mx.array | None,
                 sampling: SamplingParams) -> tuple[mx.array, mx.array]:
    """The rejection rule for a sampled chain without a seed: logits (k + 1, vocab) over [last
    token] + draft (k,), q the draft's probabilities or None. Lazy (num_accepted, next)."""
    return verify_sampled(probs_from_logits(logits, sampling), draft, q, None)


def draw_next(logits: mx.array, samplings: list[SamplingParams], seeds: list[SeedAt],
              positions: list[int | None] | None = None) -> mx.array:
    """Each row's next token from its last logits (B, vocab), lazily: greedy rows one argmax,
    keyed rows their keyed draw, other sampled rows together per sampling setting from MLX's
    global generator. A row's bias and grammar apply, and its log-probabilities are kept on
    its state until the token is read (`constrain.adjust_next`)."""
    if not any(s.adjusted for s in samplings):
        return _draw(logits, samplings, seeds)
    logits, pending = adjust_next(logits, samplings, seeds, positions)
    tokens = _draw(logits, samplings, seeds)
    for state, b, pos, lp, post in pending:
        state.drawn(pos, tokens[b], lp, post)
    return tokens


def _draw(logits: mx.array, samplings: list[SamplingParams],
          seeds: list[SeedAt]) -> mx.array:
    tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
    groups: dict[SamplingParams, list[int]] = {}
    for b, (s, seed_at) in enumerate(zip(samplings, seeds)):
        if s.greedy:
            continue
        if seed_at is not None:
            tokens[b : b + 1] = keyed_draw(logits[b : b + 1], s, *seed_at)
        else:
            groups.setdefault(s, []).append(b)
    for group, members in groups.items():
        rows = mx.array(members, mx.int32)
        tokens[rows] = sample(probs_from_logits(logits[rows], group), None).astype(mx.uint32)
    return tokens


def start_step(model: nn.Module, cache, last_tokens: list[int | None],
               proposals: list[Proposal | None], samplings: list[SamplingParams],
               seeds: list[SeedAt], max_accepts: list[int | None] | None = None,
               sync=None) -> StartedStep:
    """Row b verifies proposals[b] (None or empty: plain) after last_tokens[b] (None: sits
    out), accepting at most max_accepts[b] draft tokens. `sync` (a sharded target) maps the
    result to rank 0's, so every rank commits the same tokens."""
    rows = as_rows(model, cache)
    if rows.alone and len(last_tokens) != 1:
        raise ValueError("several rows need ragged rows (`caches.rows.Rows`)")
    max_accepts = max_accepts or [None] * len(last_tokens)
    adjusted = False
    for s, last in zip(samplings, last_tokens):
        if last is not None and s.adjusted:
            adjusted = True
            break
    positions = rows.lengths if adjusted else None  # of the token each row is fed
    drafts, qs, sizes, masks = _drafts(proposals, max_accepts, samplings, last_tokens,
                                       positions)
    width = 1 + max(sizes)
    fed = []
    for last, d, k in zip(last_tokens, drafts, sizes):
        head = mx.array([0 if last is None else last], mx.uint32)
        fed.append(mx.concatenate([head, d, mx.repeat(head, width - 1 - k)]))  # pad: trimmed
    ckpt = rows.checkpoint()
    logits = model(mx.stack(fed), cache=rows.layers)
    if None in last_tokens:  # a row sitting out: everything it was fed goes at once
        rows.trim_rows([width if last is None else 0 for last in last_tokens])
    lps = None
    if adjusted:
        logits, lps = adjust_rows(logits, samplings, last_tokens, sizes, masks)
    if width == 1:  # plain: every row's next token in one draw, the fed rows' read back
        out = _draw(logits[:, 0], samplings, seeds)
        if None in last_tokens:
            out = out[mx.array([b for b, last in enumerate(last_tokens) if last is not None])]
    else:
        out = _verify_rows(logits, drafts, qs, sizes, samplings, seeds, last_tokens)
    if sync is not None:
        out = sync(out)
    sources, matched = [], []
    for prop, k, s, seed_at in zip(proposals, sizes, samplings, seeds):
        sources.append(prop.source if k else "")
        matched.append(s.greedy or seed_at is not None)
    return StartedStep(rows, list(last_tokens), sizes, matched, sources, width, out, ckpt,
                       list(samplings) if adjusted else None, positions, lps)


def _drafts(proposals, max_accepts, samplings, last_tokens, positions):
    """Each row's draft tokens (k of them, cut where its grammar refuses one), their q, k, and
    its grammar's masks over the positions verified (None: no grammar)."""
    drafts, qs, sizes, masks = [], [], [], []
    for b, (prop, cap) in enumerate(zip(proposals, max_accepts)):
        k = prop.tokens.size if prop is not None else 0
        if k and prop.parents is not None:
            raise ValueError("token trees run one row at a time, on its own cache")
        k = min(k, cap) if cap is not None else k
        constraint = getattr(samplings[b].state, "constraint", None)
        mask = None
        if constraint is not None and last_tokens[b] is not None:
            # the matcher after the token fed
            state = samplings[b].state
            state.known(positions[b], last_tokens[b])
            state.align(positions[b] + 1)
            draft = prop.tokens[:k].tolist() if k else []
            k = constraint.cut(draft)  # the first token the grammar refuses, and after: cut
            mask = constraint.bitmasks(draft[:k])  # llguidance's bits, one row per position
        masks.append(mask)
        sizes.append(k)
        drafts.append(prop.tokens[:k] if k else mx.array([], mx.uint32))
        qs.append(prop.draft_probs[:k] if k and prop.draft_probs is not None else None)
    return drafts, qs, sizes, masks


def _verify_rows(logits, drafts, qs, sizes, samplings, seeds, last_tokens) -> mx.array:
    """Flat per fed row: greedy and keyed rows their draws[:k+1] + draft (compared on the
    host), other sampled rows the rejection rule's (n, next) + draft (k = 0: next)."""
    argmax = (mx.argmax(logits, axis=-1).astype(mx.uint32)
              if any(map(attrgetter("greedy"), samplings)) else None)
    outs = []
    for b, (draft, q, k) in enumerate(zip(drafts, qs, sizes)):
        if last_tokens[b] is None:
            continue
        if samplings[b].greedy:
            outs.append(mx.concatenate([argmax[b, : k + 1], draft]))
        elif seeds[b] is not None:
            drawn = keyed_draw(logits[b, : k + 1], samplings[b], *seeds[b])
            outs.append(mx.concatenate([drawn, draft]))
        elif not k:
            outs.append(_draw(logits[b : b + 1, 0], samplings[b : b + 1], [None]))
        else:
            n, t = verify_chain(logits[b, : k + 1], draft, q, samplings[b])
            outs.append(mx.concatenate([mx.stack([n, t]).astype(mx.uint32), draft]))
    return mx.concatenate(outs)


def start_plain(model: nn.Module, rows: Rows, inputs: mx.array,
                samplings: list[SamplingParams] | None = None, seeds: list[SeedAt] | None = None,
                idle: list[int] | None = None, sync=None) -> tuple[mx.array, Checkpoint | None]:
    """A plain step (k = 0 for every row) fed `inputs` (B,) on the device: a pipelined step
    feeds the previous one's tokens unread. `samplings` and `seeds` per row (None: every row
    greedy with nothing to adjust: one argmax, as mlx-lm's loop); `idle`: 1 for a row sitting
    out (its input goes at once). Returns the lazy next tokens, started (`mx.async_eval`; a
    sharded target's ranks then run the forwards' collectives in the same order), and the
    checkpoint that undoes the step (`Rows.trim_rows`). Rows whose draw needs the last token
    read (a grammar) are not fed this way."""
    ckpt = rows.checkpoint() if rows.recurrent else None
    logits = model(inputs[:, None], cache=rows.layers)[:, -1]
    if idle is not None:
        rows.trim_rows(idle)
    if samplings is None:
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
    else:
        tokens = draw_next(logits, samplings, seeds)
    if sync is not None:
        tokens = sync(tokens)
    mx.async_eval(tokens)
    return tokens, ckpt


def _record(step: StartedStep, b: int, tokens: list[int]) -> list | None:
    """Row b committed `tokens`: its grammar and log-probabilities (`RequestState.committed`)."""
    s = step.samplings[b]
    if s.state is None:  # a bias only (log-probabilities and grammars have a state)
        return None
    return s.state.committed(step.positions[b] + 1, tokens, step.lps[b], s.post_probs)


def finish_step(step: StartedStep) -> list[StepResult | None]:
    """Read the step back (the one host sync) and roll back what was rejected; rows with
    per-row work advance their grammar and read their log-probabilities."""
    if step.lps is not None and any(lp is not None for lp in step.lps):
        mx.eval(step.out, *[a for lp in step.lps if lp is not None for a in lp if a is not None])
    flat = step.out.tolist()
    results, drop, fed_rows, at = [], [], [], 0
    for last, k, matched, source in zip(step.fed, step.sizes, step.matched, step.sources):
        if last is None:
            results.append(None)
            drop.append(0)  # (trimmed when the step started)
            fed_rows.append([])
            continue
        if not k and not matched:
            n, nxt, drafted = 0, flat[at], []
            at += 1
        elif matched:
            target, drafted = flat[at : at + k + 1], flat[at + k + 1 : at + 2 * k + 1]
            at += 2 * k + 1
            n = greedy_accepted(target, drafted)
            nxt = target[n]
        else:
            n, nxt, drafted = flat[at], flat[at + 1], flat[at + 2 : at + 2 + k]
            at += 2 + k
        drop.append(step.width - 1 - n)
        fed_rows.append([last] + drafted + [last] * (step.width - 1 - k))
        res = StepResult(drafted[:n] + [nxt], n, k, source)
        if step.samplings is not None and step.samplings[len(results)].adjusted:
            res.logprobs = _record(step, len(results), res.tokens)
        results.append(res)
    if any(drop):
        step.rows.trim_rows(drop, fed_rows, step.ckpt)
    return results


def decode_step(model: nn.Module, cache, last_tokens: list[int | None],
                proposals: list[Proposal | None], samplings: list[SamplingParams],
                seeds: list[SeedAt], max_accepts: list[int | None],
                sync=None) -> list[StepResult | None]:
    """One whole step (`start_step` then `finish_step`); a token tree on one row's own cache
    runs the tree step (`tree.py`)."""
    first = proposals[0]
    if (len(last_tokens) == 1 and first is not None and first.parents is not None
            and first.tokens.size > 0):
        from .tree import first_chain, tree_step

        if samplings[0].adjusted:  # a grammar, a bias or log-probabilities: its first chain
            proposals = [first_chain(first)]
        else:
            rows = as_rows(model, cache)
            if not rows.alone:
                raise ValueError("token trees run one row at a time, on its own cache")
            tokens, n = tree_step(model, rows.layers, last_tokens[0], first, samplings[0],
                                  seeds[0], max_accept=max_accepts[0], sync=sync)
            return [StepResult(tokens, n, first.depth(), first.source)]
    return finish_step(start_step(model, cache, last_tokens, proposals, samplings, seeds,
                                  max_accepts, sync))
