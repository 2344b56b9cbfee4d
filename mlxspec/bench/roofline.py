"""A roofline for decoding: what a forward costs from the bytes it reads (weights, then the KV
cache of its context) and the arithmetic its further rows add (2 flops per weight per row,
attention per row and cached token), at a machine's measured rates. From what a run measured
(target forwards, their width, draft forwards, context) it projects the run's speed: checked
against this machine where both are measured (`mlxspec bench`), and bytes only at other
bandwidths (a memory-bound step, as decoding is on Apple silicon; `bench/gpu_check.py`).
Every figure from here is printed as a PROJECTION.

On a CPU the two add up: a one-row product is bound by the bytes it streams, and each further
row adds arithmetic at the rate a product of few rows reaches (measured; far below a large
product's). A GPU overlaps them, which is why other machines are projected from bytes only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

# sources whose proposed tokens each cost a forward of the proposer's own (draft) model
DRAFTING_SOURCES = ("draft", "draft-tree", "lookup+draft", "quantspec")


@dataclass
class Rates:
    """A machine's measured rates: bytes/s a one-row product streams from a weight matrix,
    and float ops/s of the rows a verify adds to it (a product of few rows is far from a
    large product's rate: 35-90 against 190 GFLOP/s on this project's 2-core CPU)."""

    bandwidth: float
    flops: float


@dataclass
class ForwardCost:
    """One model's forward: bytes read (the weights it multiplies, KV per cached token) and
    flops per row."""

    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_row: float  # 2 x the weights a row multiplies (the embedding table is a lookup)
    attention_flops_per_token: float  # per row and cached token: QK^T and PV

    def seconds(self, rates: Rates, rows: float, context: float, bytes_only: bool = False) -> float:
        """One row streams the weights and the KV (its arithmetic hides under that); each
        further row adds its arithmetic at the rate of a few-row product."""
        read = self.weight_bytes + self.kv_bytes_per_token * context
        if bytes_only:
            return read / rates.bandwidth
        flops = (rows - 1) * (self.flops_per_row + self.attention_flops_per_token * context)
        return read / rates.bandwidth + flops / rates.flops


def measure_rates(rows: int = 9) -> Rates:
    """From one-row and `rows`-row products with two 64 MB float32 matrices (2048 x 8192 and
    its transpose, as a model's MLP): the bytes over the one-row time, and the extra rows'
    flops over the extra time; best of 5."""
    shapes = [(2048, 8192), (8192, 2048)]
    weights = [mx.random.normal(s) for s in shapes]
    inputs = {r: [mx.random.normal((r, s[0])) for s in shapes] for r in (1, rows)}
    mx.eval(weights, inputs)

    def best(r: int) -> float:
        times = []
        for _ in range(6):
            start = time.perf_counter()
            mx.eval([x @ w for x, w in zip(inputs[r], weights)])
            times.append(time.perf_counter() - start)
        return min(times[1:])

    one, many = best(1), best(rows)
    flops = sum(2 * (rows - 1) * w.size for w in weights)
    return Rates(sum(w.nbytes for w in weights) / one, flops / max(many - one, 1e-9))


def forward_cost(model, weight_bytes_per_param: float | None = None,
                 kv_dtype=None) -> ForwardCost:
    """`model`'s forward; `weight_bytes_per_param` counts its floating weights as if stored at
    that size (2: float16 on Apple silicon; default: as they are), the KV in `kv_dtype`."""
    import mlx.nn as nn

    args = model.args
    tied = getattr(args, "tie_word_embeddings", False)
    # what a step reads: every weight but the embedding table (one row of it), unless the
    # table is the head too (a model converted from GGUF may hold both, untied)
    params = [v for k, v in tree_flatten(model.parameters())
              if tied or "embed_tokens" not in k]
    floats = [v for v in params if mx.issubdtype(v.dtype, mx.floating)]
    weight_bytes = sum(v.nbytes for v in params)
    if weight_bytes_per_param is not None:
        weight_bytes += sum(int(v.size * weight_bytes_per_param) - v.nbytes for v in floats)
    multiplied = 0  # weights each row multiplies (a quantized word packs 32 / bits of them)
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            multiplied += m.weight.size * 32 // m.bits
        elif isinstance(m, nn.Linear):
            multiplied += m.weight.size
    if tied:  # the embedding table is the head too
        embed = model.model.embed_tokens
        multiplied += embed.weight.size * (32 // embed.bits if hasattr(embed, "bits") else 1)
    layers, heads = args.num_hidden_layers, args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    dtype = kv_dtype or floats[0].dtype
    return ForwardCost(weight_bytes, 2 * layers * kv_heads * head_dim * dtype.size,
                       2.0 * multiplied, 4.0 * layers * heads * head_dim)


def project_run(stats: dict, tokens: int, target: ForwardCost, rates: Rates,
                draft: ForwardCost | None = None, bytes_only: bool = False) -> float:
    """Projected decode seconds of one measured run (its stats): its target forwards at their
    mean width over the mean context, and a draft forward per drafted token of a drafting
    source (with `draft`)."""
    forwards = stats.get("target_forwards", 0)
    if not forwards:
        return 0.0
    context = stats.get("prompt_tokens", 0) + tokens / 2
    width = 1 + stats.get("drafted", 0) / forwards
    seconds = forwards * target.seconds(rates, width, context, bytes_only)
    if draft is not None:
        by_source = stats.get("drafted_by_source", {})
        drafts = sum(n for s, n in by_source.items() if s in DRAFTING_SOURCES)
        seconds += drafts * draft.seconds(rates, 1, context, bytes_only)
    return seconds
