"""The text of earlier requests and answers, kept for suffix decoding (`proposers/suffix.py`):
a bounded store of token documents, the longest match of a context's suffix in them, and what
followed each match.

Layout (llama.cpp's ngram-cache idea, with zlib's hash chains): one int32 token array holding
every document, each followed by a -1 separator; per key length n in `KEYS`, a hash table
`head` (the most recent position whose preceding n tokens hash to a bucket) and a `prev` array
(the previous position in the same bucket). A lookup hashes the context's last 16, 8 and 4
tokens, walks at most `CHAIN` positions of the longest key that has any, and checks them
against the context in one numpy comparison (up to `MAX_MATCH` tokens back): a hash collision
or an evicted document fails that check, so neither can produce a wrong match. Adding a
document indexes it with a few vectorized passes. Memory: 4 bytes per token plus 4 per key
length (`prev`), plus the head tables (4 bytes per key length and bucket, about one bucket per
stored token): 28-40 bytes per stored token, twice that while the array has room to grow.

Documents are evicted least recently used first (used: added, or proposed from) once the live
tokens exceed the budget; evicted text is overwritten with -1 and the array is compacted when
the dead tokens outnumber the live ones. A document that starts like a stored one (the next
chat turn, the same file re-sent) stores only what is new, with `MAX_MATCH` tokens of overlap,
and a document that extends a stored one replaces it.

`SuffixStores` keeps one store per scope (the server: per API key or client address) under one
token budget; `save`/`load` write and read them as one versioned file.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from .errors import MlxspecError

KEYS = (4, 8, 16)  # hashed n-gram lengths: matches of >= 4 tokens are found
MAX_MATCH = 32  # a match is measured up to this many tokens back
CHAIN = 32  # most positions examined per key length and lookup
HEAD = 16  # documents sharing their first HEAD tokens are compared for a common prefix
DEFAULT_BUDGET = 1 << 20  # tokens

_MASK = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd multiplier of the polynomial hash
_MIX = 0xD6E8FEB86659FD93
_POW = [pow(_P, j, 1 << 64) for j in range(max(KEYS))]
_POW_NP = np.array(_POW, dtype=np.uint64)


def _tail_hashes(context: list[int]) -> dict[int, int]:
    """{n: hash of the last n tokens} for every key length the context is long enough for
    (right to left: the hash of the last 4 tokens is the start of the one of the last 8)."""
    out, h = {}, 0
    end = len(context)
    for j in range(min(max(KEYS), end)):
        h = (h + (context[end - 1 - j] + 1) * _POW[j]) & _MASK
        if j + 1 in KEYS:
            out[j + 1] = h
    return out


class SuffixIndex:
    """Documents of tokens, bounded by `budget` live tokens (see the module docstring)."""

    def __init__(self, budget: int = DEFAULT_BUDGET):
        if budget < 1:
            raise ValueError(f"the suffix budget must be >= 1 token, got {budget}")
        self.budget = budget
        self.docs: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end), LRU first
        self.live = 0  # tokens of the documents in `docs`
        self._next_id = 0
        self._heads: dict[int, list[int]] = {}  # hash of the first HEAD tokens -> doc ids
        self._starts: list[int] = []  # start of every document in the array, in order
        self._ids: list[int] = []
        self._open: int | None = None  # the document `extend` appends to
        self._reserve(1 << 12)

    # -- memory
    def _reserve(self, capacity: int) -> None:
        """Fresh arrays for `capacity` tokens (everything re-indexed by the caller)."""
        self.tokens = np.full(capacity + 1, -1, dtype=np.int32)  # a -1 always follows the end
        self.size = 1  # position 0 holds a -1: nothing matches across the array's start
        bits = max(12, int(capacity - 1).bit_length())
        self._shift = 64 - bits
        self.head = {n: np.full(1 << bits, -1, dtype=np.int32) for n in KEYS}
        self.prev = {n: np.full(capacity + 1, -1, dtype=np.int32) for n in KEYS}

    def nbytes(self) -> int:
        """Bytes of the arrays (what the store costs, beside small per-document records)."""
        return self.tokens.nbytes + sum(a.nbytes for a in self.head.values()) + sum(
            a.nbytes for a in self.prev.values())

    def _bucket(self, h: int) -> int:
        return ((h * _MIX) & _MASK) >> self._shift

    # -- adding
    def add(self, tokens: list[int]) -> None:
        """Store a finished document (a request's prompt and answer)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) <= KEYS[0]:
            return
        if len(tokens) > self.budget:
            tokens = tokens[-self.budget :]
        head, keep = self._shared_prefix(tokens)
        if keep == len(tokens):  # nothing new (the same request again)
            return
        if head is not None and keep == self.docs[head][1] - self.docs[head][0]:
            self._evict(head)  # the new document extends it: it replaces it
            head, keep = None, 0
        if head is not None:  # store the new part, with enough overlap to match across
            tokens = tokens[max(0, keep - MAX_MATCH) :]
        self._append(tokens, register=head is None)
        while self.live > self.budget and len(self.docs) > 1:
            self._evict(next(iter(self.docs)))
        if self.size - 1 > 2 * max(self.live, 1 << 12):
            self._compact()

    def _shared_prefix(self, tokens: list[int]) -> tuple[int | None, int]:
        """The stored document sharing the longest prefix (at least HEAD tokens) with
        `tokens`, touched, and that prefix's length; (None, 0) when none does."""
        if len(tokens) < HEAD:
            return None, 0
        ids = self._heads.get(hash(tuple(tokens[:HEAD])), [])
        ids[:] = [i for i in ids if i in self.docs]
        best, best_len = None, 0
        new = np.asarray(tokens, dtype=np.int32)
        for doc in ids[-8:]:
            start, end = self.docs[doc]
            n = min(end - start, len(new))
            diff = np.flatnonzero(self.tokens[start : start + n] != new[:n])
            common = int(diff[0]) if diff.size else n
            if common > best_len:
                best, best_len = doc, common
        if best is None or best_len < HEAD:
            return None, 0
        self.docs.move_to_end(best)
        return best, best_len

    def _append(self, tokens: list[int], register: bool) -> None:
        need = self.size + len(tokens) + 1
        if need > len(self.tokens) - 1:
            self._compact(extra=len(tokens) + 1)
        start = self.size
        end = start + len(tokens)
        self.tokens[start:end] = tokens
        self.tokens[end] = -1
        self.size = end + 1
        doc = self._next_id
        self._next_id += 1
        self.docs[doc] = (start, end)
        self._starts.append(start)
        self._ids.append(doc)
        self.live += end - start
        if register:
            self._heads.setdefault(hash(tuple(tokens[:HEAD])), []).append(doc)
        self._index(start, end)

    def _index(self, start: int, end: int, first: int | None = None) -> None:
        """Hash-chain the positions p of document [start, end) from `first` on (default: all)
        whose n preceding tokens lie in the document, for every key length n."""
        for n in KEYS:
            lo = max(start + n, first if first is not None else 0)
            if lo >= end:
                continue
            pos = np.arange(lo, end, dtype=np.int64)
            h = np.zeros(pos.size, dtype=np.uint64)
            for j in range(n):  # the same polynomial as _tail_hashes, right to left
                h += (self.tokens[pos - 1 - j].astype(np.uint64) + np.uint64(1)) * _POW_NP[j]
            b = ((h * np.uint64(_MIX)) >> np.uint64(self._shift)).astype(np.int64)
            self._link(n, b, pos)

    def _link(self, n: int, buckets: np.ndarray, pos: np.ndarray) -> None:
        """Chain increasing positions into their buckets (most recent at the head)."""
        head, prev = self.head[n], self.prev[n]
        order = np.argsort(buckets, kind="stable")
        b, p = buckets[order], pos[order]
        first = np.ones(b.size, dtype=bool)
        first[1:] = b[1:] != b[:-1]
        links = np.empty(p.size, dtype=np.int32)
        links[first] = head[b[first]]
        later = np.flatnonzero(~first)
        links[later] = p[later - 1]
        prev[p] = links
        last = np.ones(b.size, dtype=bool)
        last[:-1] = first[1:]
        head[b[last]] = p[last]

    # -- removing
    def _evict(self, doc: int) -> None:
        start, end = self.docs.pop(doc)
        self.tokens[start:end] = -1  # chains may still reach it: a -1 never matches
        self.live -= end - start

    def _compact(self, extra: int = 0) -> None:
        """Rewrite the live documents (least recently used first) into fresh arrays with
        room for `extra` more tokens, and re-index them."""
        docs = [(doc, self.tokens[s:e].copy()) for doc, (s, e) in self.docs.items()]
        capacity = max(1 << 12, 1 << int(2 * (self.live + len(docs) + extra) + 1).bit_length())
        self._reserve(capacity)
        self.docs.clear()
        self._starts, self._ids = [], []
        for doc, toks in docs:
            start = self.size
            end = start + toks.size
            self.tokens[start:end] = toks
            self.size = end + 1
            self.docs[doc] = (start, end)
            self._starts.append(start)
            self._ids.append(doc)
        self._index_all()

    def _index_all(self) -> None:
        """Index every live document in one vectorized pass per key length."""
        if not self.docs:
            return
        spans = np.array(list(self.docs.values()), dtype=np.int64)
        lengths = spans[:, 1] - spans[:, 0]
        pos = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in spans])
        doc_start = np.repeat(spans[:, 0], lengths)
        for n in KEYS:
            ok = pos - doc_start >= n
            p = pos[ok]
            if not p.size:
                continue
            h = np.zeros(p.size, dtype=np.uint64)
            for j in range(n):
                h += (self.tokens[p - 1 - j].astype(np.uint64) + np.uint64(1)) * _POW_NP[j]
            b = ((h * np.uint64(_MIX)) >> np.uint64(self._shift)).astype(np.int64)
            self._link(n, b, p)

    # -- looking up
    def match(self, context: list[int]) -> tuple[int, np.ndarray]:
        """(length, positions): the longest suffix of `context` (up to MAX_MATCH tokens, at
        least KEYS[0]) found among the positions examined, and the positions that follow
        each occurrence of it (most recent first); (0, empty) when none."""
        hashes = _tail_hashes(context)
        if not hashes or not self._has_shortest(context, hashes[KEYS[0]]):
            return 0, _EMPTY
        tail = None
        for n in reversed(KEYS):
            h = hashes.get(n)
            if h is None:
                continue
            prev = self.prev[n]
            p = int(self.head[n][self._bucket(h)])
            found = []
            while p >= 0 and len(found) < CHAIN:
                found.append(p)
                p = int(prev[p])
            if not found:
                continue
            if tail is None:
                tail = np.array(context[: -MAX_MATCH - 1 : -1], dtype=np.int32)
                back = np.arange(1, tail.size + 1, dtype=np.int64)
            cand = np.array(found, dtype=np.int64)
            idx = cand[:, None] - back
            np.maximum(idx, 0, out=idx)  # position 0 holds a -1
            lengths = np.logical_and.accumulate(self.tokens[idx] == tail, axis=1).sum(axis=1)
            best = int(lengths.max())
            if best >= n:
                return best, cand[lengths == best]
        return 0, _EMPTY

    def _has_shortest(self, context: list[int], h: int) -> bool:
        """Whether the context's last KEYS[0] tokens may occur (False: they do not, and so no
        longer suffix does): their bucket's chain, walked in Python. Most lookups in new text
        end here (~3 us, against ~40 for the numpy comparison of `match`)."""
        n, tokens = KEYS[0], self.tokens
        want = context[-n:]
        p, prev = int(self.head[n][self._bucket(h)]), self.prev[n]
        for _ in range(CHAIN):
            if p < 0:
                return False
            if tokens[p - n : p].tolist() == want:
                return True
            p = int(prev[p])
        return p >= 0  # (a chain longer than `match` walks: its longer keys may still match)

    def continuations(self, positions: np.ndarray, depth: int) -> Counter:
        """Counter of the distinct continuations (tuples of up to `depth` tokens, cut at
        their document's end) that start at `positions`."""
        idx = np.minimum(positions[:, None] + np.arange(depth), len(self.tokens) - 1)
        rows = self.tokens[idx]
        ends = np.where((rows < 0).any(axis=1), (rows < 0).argmax(axis=1), depth)
        return Counter(tuple(r[:e]) for r, e in zip(rows.tolist(), ends.tolist()) if e)

    def touch(self, positions: np.ndarray) -> None:
        """Mark the documents holding `positions` as used (least recently used go first)."""
        for p in set(positions.tolist()):
            i = bisect.bisect_right(self._starts, p) - 1
            doc = self._ids[i] if i >= 0 else None
            if doc in self.docs:
                self.docs.move_to_end(doc)

    # -- an open document (the request being generated)
    def open(self, tokens: list[int]) -> None:
        """Start a document that grows (`extend`); it must be the last one added."""
        self._append([int(t) for t in tokens], register=False)
        self._open = next(reversed(self.docs))

    def extend(self, tokens: list[int]) -> None:
        """Append tokens to the open document and index them."""
        doc = self._open
        start, end = self.docs[doc]
        if end + 1 != self.size or end + len(tokens) + 1 > len(self.tokens) - 1:
            self.docs.move_to_end(doc)  # compaction writes it last: room to grow after it
            self._compact(extra=len(tokens) + 1)
            start, end = self.docs[doc]
        self.tokens[end : end + len(tokens)] = tokens
        self.tokens[end + len(tokens)] = -1
        self.docs[doc] = (start, end + len(tokens))
        self.size = end + len(tokens) + 1
        self.live += len(tokens)
        self._index(start, end + len(tokens), first=end)

    def documents(self) -> list[list[int]]:
        """The live documents, least recently used first (what `save` writes)."""
        return [self.tokens[s:e].tolist() for s, e in self.docs.values()]


_EMPTY = np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------- scopes


class SuffixStores:
    """One `SuffixIndex` per scope (a hashed API key, a client address, "" for everyone),
    together under `budget` live tokens: the least recently used scope gives up its least
    recently used document first."""

    def __init__(self, budget: int = DEFAULT_BUDGET, fingerprint: str = ""):
        self.budget, self.fingerprint = budget, fingerprint
        self.scopes: OrderedDict[str, SuffixIndex] = OrderedDict()

    def get(self, scope: str) -> SuffixIndex:
        store = self.scopes.get(scope)
        if store is None:
            store = self.scopes[scope] = SuffixIndex(self.budget)
        self.scopes.move_to_end(scope)
        return store

    def tokens(self) -> int:
        return sum(s.live for s in self.scopes.values())

    def evict_to_budget(self) -> None:
        """Evict until the scopes together hold at most `budget` tokens."""
        total = self.tokens()
        while total > self.budget and self.scopes:
            scope, store = next(iter(self.scopes.items()))
            if not store.docs:
                del self.scopes[scope]
                continue
            before = store.live
            store._evict(next(iter(store.docs)))
            total -= before - store.live


def scope_key(kind: str, api_key: str | None, address: str) -> str | None:
    """The scope of a request: None for `request` (nothing shared), "" for `global`, else the
    API key it presented (hashed: the key itself is never kept or written) or its address."""
    if kind == "request":
        return None
    if kind == "global":
        return ""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return "addr:" + address


def tokenizer_fingerprint(tokenizer) -> str:
    """What a cache file is checked against: token ids only mean something to the tokenizer
    that made them."""
    try:
        vocab = tokenizer.get_vocab()
        text = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=True)
    except Exception:
        text = type(tokenizer).__name__
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- files

MAGIC = b"mlxspec-suffix-cache"
VERSION = 1


def save(stores: SuffixStores, path: str | os.PathLike) -> None:
    """Write every scope's documents to `path` atomically (a temporary file, then rename):
    a line `mlxspec-suffix-cache 1`, a JSON line (fingerprint, scopes and document lengths),
    then the tokens as little-endian int32."""
    scopes, chunks = [], []
    for scope, store in stores.scopes.items():
        docs = store.documents()
        scopes.append({"scope": scope, "docs": [len(d) for d in docs]})
        chunks.extend(docs)
    header = {"fingerprint": stores.fingerprint, "scopes": scopes}
    flat = np.array([t for d in chunks for t in d], dtype="<i4")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + b" %d\n" % VERSION)
        f.write(json.dumps(header).encode() + b"\n")
        f.write(flat.tobytes())
    os.replace(tmp, path)


def load(stores: SuffixStores, path: str | os.PathLike) -> int:
    """Read `path` into `stores` (a missing file: nothing to read); the tokens read. A file
    that is not a suffix cache, is damaged, or was written for another tokenizer raises one
    MlxspecError saying so; nothing is read from it and the file is left as it is."""
    path = Path(path)
    if not path.exists():
        return 0
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MlxspecError(f"--suffix-cache {path}: cannot read: {e.strerror or e}") from None
    where = f"--suffix-cache {path}"
    first, _, rest = data.partition(b"\n")
    if not first.startswith(MAGIC + b" "):
        raise MlxspecError(f"{where} is not an mlxspec suffix cache; move it away or name "
                           "another file")
    if first[len(MAGIC) + 1 :] != b"%d" % VERSION:
        raise MlxspecError(f"{where} has format version {first[len(MAGIC) + 1:].decode(errors='replace')}, "
                           f"this mlxspec reads version {VERSION}")
    line, _, body = rest.partition(b"\n")
    try:
        header = json.loads(line)
        scopes = [(str(s["scope"]), [int(n) for n in s["docs"]]) for s in header["scopes"]]
        fingerprint = str(header["fingerprint"])
    except (ValueError, KeyError, TypeError):
        raise MlxspecError(f"{where} is damaged (its header cannot be read)") from None
    total = sum(sum(d) for _, d in scopes)
    if len(body) != 4 * total or any(n < 0 for _, d in scopes for n in d):
        raise MlxspecError(f"{where} is damaged (it holds {len(body)} bytes of tokens, its "
                           f"header says {4 * total})")
    if stores.fingerprint and fingerprint != stores.fingerprint:
        raise MlxspecError(f"{where} was written for another model's tokenizer; use another "
                           "file for this model")
    flat = np.frombuffer(body, dtype="<i4")
    if flat.size and int(flat.min()) < 0:
        raise MlxspecError(f"{where} is damaged (negative token ids)")
    at = 0
    for scope, lengths in scopes:
        store = stores.get(scope)
        for n in lengths:
            store.add(flat[at : at + n].tolist())
            at += n
    stores.evict_to_budget()
    return total
