"""KV-cache memory accounting, measured on real cache objects filled to given lengths.

Caches compared (per token, all layers): mlx-lm's `KVCache` in float16, mlx-lm's
`QuantizedKVCache` at 8 and 4 bits (group 64, per token along head_dim), and the hierarchical
cache (both 4-bit planes, scales and minima, and the full-precision buffer of the last G..2G
tokens, in the same float16). The numbers are `nbytes` of the caches after writing `length` random
keys/values in chunks (committing after each chunk for the hierarchical cache), so they include
mlx-lm's 256-token allocation steps and, for the hierarchical cache, the codes and live buffer
it holds (`allocated_bytes` adds the free room of its last block and buffer).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .hierarchical_cache import HierarchicalKVCache


def _fill(cache, length: int, n_kv_heads: int, head_dim: int, dtype, chunk: int) -> None:
    done = 0
    while done < length:
        n = min(chunk, length - done)
        k = mx.random.normal((1, n_kv_heads, n, head_dim)).astype(dtype)
        v = mx.random.normal((1, n_kv_heads, n, head_dim)).astype(dtype)
        cache.update_and_fetch(k, v)
        if isinstance(cache, HierarchicalKVCache):
            cache.commit()
        mx.eval(cache.state if not isinstance(cache, QuantizedKVCache) else
                [a for t in (cache.keys, cache.values) for a in t])
        done += n


def kv_memory_table(n_kv_heads: int, head_dim: int, num_layers: int,
                    lengths=(1024, 8192, 32768), dtype=mx.float16, group_size: int = 64,
                    buffer_size: int | None = None, chunk: int = 1024) -> list[dict]:
    """Rows {cache, length, bytes, bytes_per_token, ...}; one layer is measured, times layers."""
    rows = []
    for length in lengths:
        makers = [
            ("fp16 KVCache", lambda: KVCache()),
            ("mlx-lm QuantizedKVCache 8-bit", lambda: QuantizedKVCache(group_size=64, bits=8)),
            ("mlx-lm QuantizedKVCache 4-bit", lambda: QuantizedKVCache(group_size=64, bits=4)),
            (f"hierarchical G={group_size}",
             lambda: HierarchicalKVCache(group_size, buffer_size)),
        ]
        for name, make in makers:
            cache = make()
            _fill(cache, length, n_kv_heads, head_dim, dtype, chunk)
            held = (sum(cache.nbytes_by_part(used=True).values())
                    if isinstance(cache, HierarchicalKVCache) else cache.nbytes)
            total = held * num_layers
            row = dict(cache=name, length=length, bytes=total,
                       bytes_per_token=total / length)
            if isinstance(cache, HierarchicalKVCache):
                parts = {k: v * num_layers for k, v in cache.nbytes_by_part(used=True).items()}
                row["allocated_bytes"] = cache.nbytes * num_layers
                row.update(parts)
                row["draft_view_bytes"] = total - parts["lower_plane"]
                row["buffer_tokens"] = cache.buffer_len
            rows.append(row)
            del cache
    return rows


def model_kv_shape(model) -> tuple[int, int, int]:
    """(n_kv_heads, head_dim, num_layers) of an mlx-lm model."""
    args = model.args
    heads = args.num_attention_heads
    n_kv = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return n_kv, head_dim, len(model.layers)


def kv_memory_for_model(model, lengths=(1024, 8192, 32768), **kwargs) -> list[dict]:
    return kv_memory_table(*model_kv_shape(model), lengths=lengths, **kwargs)


def format_memory_table(rows: list[dict]) -> str:
    lines = ["| cache | tokens | KV bytes | bytes/token | vs fp16 |", "|---|---:|---:|---:|---:|"]
    fp16 = {r["length"]: r["bytes"] for r in rows if r["cache"].startswith("fp16")}
    for r in rows:
        ratio = r["bytes"] / fp16[r["length"]] if r["length"] in fp16 else float("nan")
        lines.append(f"| {r['cache']} | {r['length']} | {r['bytes']:,} | "
                     f"{r['bytes_per_token']:.1f} | {ratio:.3f} |")
    return "\n".join(lines)


def hybrid_memory_table(n_attention_layers: int, n_kv_heads: int, head_dim: int,
                        recurrent_bytes: int, lengths=(4096, 32768, 131072),
                        dtype=mx.float16, group_size: int = 64) -> list[dict]:
    """A hybrid model: only its attention layers hold a KV cache (measured per layer as in
    `kv_memory_table`); its recurrent layers hold a state of `recurrent_bytes` in all,
    whatever the context. Rows {length, fp16_kv, hierarchical_kv, recurrent, total_fp16,
    total_hierarchical, saved_fraction}."""
    rows = []
    for length in lengths:
        per = {r["cache"]: r["bytes"] for r in kv_memory_table(
            n_kv_heads, head_dim, 1, (length,), dtype, group_size, chunk=4096)}
        fp = per["fp16 KVCache"] * n_attention_layers
        hier = per[f"hierarchical G={group_size}"] * n_attention_layers
        rows.append(dict(length=length, fp16_kv=fp, hierarchical_kv=hier,
                         recurrent=recurrent_bytes, total_fp16=fp + recurrent_bytes,
                         total_hierarchical=hier + recurrent_bytes,
                         saved_fraction=(fp - hier) / (fp + recurrent_bytes)))
    return rows
