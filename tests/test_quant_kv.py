"""The hierarchical INT4/INT8 KV cache: error bounds, attention through each view against the
explicitly dequantized cache, rollback, and independence of how tokens are batched."""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import build_model
from mlx_lm.models.cache import make_prompt_cache

from mlxspec.quant.hierarchical_cache import (
    HierarchicalKVCache,
    hierarchical_attention,
    make_hierarchical_cache,
    quantize_keys,
    quantize_values,
)
from mlxspec.quant.kvquant import dequantize_two_plane, pack4, quantize_two_plane, unpack4

SLACK = 1e-5  # float32 rounding, relative to s


def _bounds(x, g):
    q = quantize_two_plane(x, g)
    s = mx.repeat(q.scales, g, axis=-1)
    tiny = SLACK * (mx.abs(x).max() + 1)
    e_up = mx.abs(dequantize_two_plane(q, g, planes=1) - x)
    e_two = mx.abs(dequantize_two_plane(q, g, planes=2) - x)
    assert mx.all(e_up <= s / 2 + tiny).item(), (e_up / s).max().item()
    assert mx.all(e_two <= s / 16 + tiny).item(), (e_two / s).max().item()
    return (e_up / mx.maximum(s, 1e-30)).max().item(), (e_two / mx.maximum(s, 1e-30)).max().item()


def attend_in_steps(cache, q, k, v, start: int, rows) -> mx.array:
    """The attention of positions start.. as steps of `rows` tokens each (a verify of n > 1
    causal), each step's keys and values added to `cache` first; the outputs concatenated."""
    out, done, scale = [], start, q.shape[-1] ** -0.5
    for n in rows:
        kv, _ = cache.update_and_fetch(k[..., done : done + n, :], v[..., done : done + n, :])
        out.append(hierarchical_attention(q[:, :, done : done + n], kv, scale,
                                          "causal" if n > 1 else None))
        done += n
    return mx.concatenate(out, axis=2)


def test_packing_order_matches_mlx():
    codes = mx.random.randint(0, 16, (3, 64)).astype(mx.uint32)
    packed = pack4(codes)
    assert mx.array_equal(unpack4(packed), codes).item()
    ones = mx.ones((3, 2))
    # MLX's own dequantize reads element i at bits 4i: scale 1, bias 0 gives the codes back
    assert mx.array_equal(mx.dequantize(packed, ones, 0 * ones, group_size=32, bits=4),
                          codes.astype(mx.float32)).item()
    # and mx.quantize packs in the same order
    w = mx.random.normal((2, 64))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    assert mx.allclose(mx.dequantize(wq, s, b, group_size=32, bits=4),
                       mx.repeat(s, 32, -1) * unpack4(wq).astype(mx.float32)
                       + mx.repeat(b, 32, -1), atol=1e-6).item()


@pytest.mark.parametrize("g", [32, 64, 128])
def test_error_bounds_random(g):
    mx.random.seed(g)
    for x in (mx.random.normal((4, 8, 256)) * 3, mx.random.uniform(-1, 1, (2, 512)),
              mx.random.normal((3, 256)) ** 3, mx.zeros((1, 128)) + 0.7):  # constant groups too
        up, two = _bounds(x, g)
        assert up <= 0.5 + 1e-4 and two <= 1 / 16 + 1e-4


def test_error_bounds_real_activations():
    model, _ = build_model("llama", seed=3, hidden=128, heads=4, kv_heads=2, vocab=128)
    cache = make_prompt_cache(model)
    model(mx.random.randint(0, 128, (1, 128)), cache=cache)
    for c in cache:
        k, v = c.keys[..., :128, :], c.values[..., :128, :]
        for g in (32, 64):
            _bounds(k.swapaxes(-1, -2), g)  # keys per channel along tokens
            _bounds(v, 32)  # values per token along head_dim
        # the cache's own quantizers agree with the generic one
        kq = quantize_keys(k, 32)
        assert mx.allclose(dequantize_two_plane(kq, 32).swapaxes(-1, -2), k,
                           atol=float(kq.scales.max()) / 16 + 1e-5).item()
        vq = quantize_values(v, 32)
        assert vq.scales.shape == (*v.shape[:-1], v.shape[-1] // 32)


def test_two_plane_attention_scores_tighter_than_upper():
    mx.random.seed(1)
    k = mx.random.normal((1, 2, 256, 64))
    q = mx.random.normal((1, 2, 4, 64))
    kq = quantize_keys(k, 64)
    exact = q @ k.swapaxes(-1, -2)
    up = q @ dequantize_two_plane(kq, 64, 1)
    two = q @ dequantize_two_plane(kq, 64, 2)
    e_up, e_two = mx.abs(up - exact).max().item(), mx.abs(two - exact).max().item()
    assert e_two < e_up / 4


# ----------------------------------------------------------------------------- attention

def _reference(queries, k_all, v_all, start, view, g, gv, scale):
    """Attention computed from the explicitly dequantized cache, row by row: a query at position
    p reads keys/values [0, Q(p)) through the view's planes and [Q(p), p] in full precision."""
    planes = 1 if view == "draft" else 2
    helper = HierarchicalKVCache(g)
    B, H, L, D = queries.shape
    n_kv = k_all.shape[1]
    outs = []
    for r in range(L):
        p = start + r
        qn = helper.quantized_before(p)
        ks, vs = [k_all[..., qn : p + 1, :]], [v_all[..., qn : p + 1, :]]
        if qn:
            ks.insert(0, dequantize_two_plane(quantize_keys(k_all[..., :qn, :], g), g,
                                              planes).swapaxes(-1, -2))
            vs.insert(0, dequantize_two_plane(quantize_values(v_all[..., :qn, :], gv), gv,
                                              planes)[..., :D])
        k, v = mx.concatenate(ks, axis=-2), mx.concatenate(vs, axis=-2)
        k = mx.repeat(k, H // n_kv, axis=1)
        v = mx.repeat(v, H // n_kv, axis=1)
        w = mx.softmax((queries[:, :, r : r + 1] * scale) @ k.swapaxes(-1, -2), axis=-1)
        outs.append(w @ v)
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("head_dim,block", [(32, 4096), (64, 4096), (16, 4096), (32, 256)])
def test_attention_matches_dequantized_cache(head_dim, block):
    """block=256: the codes span several blocks and the attention runs over several tiles."""
    g = 32
    mx.random.seed(head_dim)
    n_heads, n_kv = 4, 2  # GQA
    scale = head_dim**-0.5
    caches = {v: HierarchicalKVCache(g, block_size=block) for v in ("target", "draft")}
    for v, c in caches.items():
        c.view = v
    k_all = mx.zeros((1, n_kv, 0, head_dim))
    v_all = mx.zeros((1, n_kv, 0, head_dim))
    # a many-token prefill (rows need groups quantized on the fly), one-token decodes, verifies
    steps = [150, 1, 1, 5, 7, 1, 33, 3] + ([300, 2, 1, 5] if block == 256 else [])
    for i, n in enumerate(steps):
        k = mx.random.normal((1, n_kv, n, head_dim)) * 2
        val = mx.random.normal((1, n_kv, n, head_dim))
        q = mx.random.normal((1, n_heads, n, head_dim))
        start = k_all.shape[2]
        k_all = mx.concatenate([k_all, k], axis=2)
        v_all = mx.concatenate([v_all, val], axis=2)
        for view, c in caches.items():
            if i % 2:
                c.commit()  # flushing or not must not change any result
            kv, _ = c.update_and_fetch(k, val)
            got = hierarchical_attention(q, kv, scale, "causal" if n > 1 else None)
            want = _reference(q, k_all, v_all, start, view, g, c.value_group_size, scale)
            assert got.shape == want.shape
            err = mx.abs(got - want).max().item()
            assert err < 2e-4, (view, i, err)
    # the two views differ (the lower plane matters) and the target is closer to exact
    c = caches["target"]
    c.commit()
    assert c.q_len > 0


def test_views_differ_and_target_is_closer():
    mx.random.seed(7)
    c_t, c_d = HierarchicalKVCache(32), HierarchicalKVCache(32)
    c_d.view = "draft"
    k = mx.random.normal((1, 2, 200, 32)) * 3
    v = mx.random.normal((1, 2, 200, 32))
    q = mx.random.normal((1, 4, 1, 32))
    for c in (c_t, c_d):
        c.update_and_fetch(k, v)
        c.commit()
    kvt, _ = c_t.update_and_fetch(k[..., :1, :], v[..., :1, :])
    kvd, _ = c_d.update_and_fetch(k[..., :1, :], v[..., :1, :])
    exact = mx.fast.scaled_dot_product_attention(
        q, mx.concatenate([k, k[..., :1, :]], 2), mx.concatenate([v, v[..., :1, :]], 2),
        scale=32**-0.5)
    e_t = mx.abs(hierarchical_attention(q, kvt, 32**-0.5) - exact).max().item()
    e_d = mx.abs(hierarchical_attention(q, kvd, 32**-0.5) - exact).max().item()
    assert e_t < e_d / 3


# ----------------------------------------------------------------------------- rollback

def _state(c):
    return c.offset, c.q_len, [a.tolist() for a in c.state]


@pytest.mark.parametrize("prefix", [40, 63, 64, 90, 95, 127])
def test_rollback_is_exact(prefix):
    g = 32
    mx.random.seed(prefix)
    k = mx.random.normal((1, 2, prefix + 40, 32))
    v = mx.random.normal((1, 2, prefix + 40, 32))
    fresh = HierarchicalKVCache(g)
    fresh.update_and_fetch(k[..., :prefix, :], v[..., :prefix, :])
    fresh.commit()
    for spec in (1, 3, 6, 33):
        for chunked in (False, True):
            c = HierarchicalKVCache(g)
            c.update_and_fetch(k[..., :prefix, :], v[..., :prefix, :])
            c.commit()
            ks, vs = k[..., prefix : prefix + spec, :], v[..., prefix : prefix + spec, :]
            if chunked:  # draft-style: one token at a time, in the draft view
                c.view = "draft"
                for j in range(spec):
                    kv, _ = c.update_and_fetch(ks[..., j : j + 1, :], vs[..., j : j + 1, :])
                    hierarchical_attention(mx.random.normal((1, 4, 1, 32)), kv, 0.1)
                c.view = "target"
            else:  # verify-style: all at once
                kv, _ = c.update_and_fetch(ks, vs)
                hierarchical_attention(mx.random.normal((1, 4, spec, 32)), kv, 0.1, "causal")
            assert c.trim(spec) == spec
            assert _state(c) == _state(fresh)
            # and both continue identically, across the next flush
            for cc in (c, fresh):
                cc.commit()
            out = []
            for cc in (c, HierarchicalKVCache(g)):
                if cc is not c:
                    cc.update_and_fetch(k[..., :prefix, :], v[..., :prefix, :])
                    cc.commit()
                kv, _ = cc.update_and_fetch(k[..., prefix:, :], v[..., prefix:, :])
                out.append(hierarchical_attention(mx.ones((1, 4, 40, 32)), kv, 0.1, "causal"))
                cc.commit()
            assert mx.array_equal(out[0], out[1]).item()


def test_trim_never_cuts_into_flushed_groups():
    c = HierarchicalKVCache(32)
    c.update_and_fetch(mx.zeros((1, 1, 100, 32)), mx.zeros((1, 1, 100, 32)))
    assert c.commit() == 64  # Q(100) = 32 * floor((100 - 32) / 32)
    assert c.buffer_len == 36
    assert c.trimmable() == 4  # offset may not go below q_len + (buffer_size - G) = 96
    assert c.trim(10) == 4 and c.offset == 96


def test_batching_does_not_change_results():
    """Prefill in one chunk, in several, or token by token: the same outputs (position rule)."""
    model, _ = build_model("qwen2", seed=5, hidden=128, heads=4, kv_heads=2, vocab=128,
                           scale=4.0)
    tokens = mx.random.randint(0, 128, (1, 150))
    outs = []
    for chunks in ([150], [70, 80], [40, 1, 1, 1, 60, 47]):
        cache = make_hierarchical_cache(model, group_size=32)
        done, logits = 0, []
        for n in chunks:
            logits.append(model(tokens[:, done : done + n], cache=cache))
            for c in cache:
                c.commit()
            done += n
        outs.append(mx.concatenate(logits, axis=1))
    for o in outs[1:]:
        # float32 sums in another order (and past 128 tokens a 4-bit code flipped by that: seen
        # 6e-4 on an AMD EPYC); a wrong position rule moves logits by O(1)
        assert mx.allclose(o, outs[0], atol=2e-3).item()


# ----------------------------------------------------------------------------- exactness, growth

@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("g,block", [(32, 4096), (32, 256), (64, 4096)])
def test_verify_equals_single_steps_bit_for_bit(dtype, g, block):
    """A forward over several rows gives every row exactly the bits a single-token step at that
    position gives, also when the rows straddle a flush (different quantized prefixes) and in
    half precision: one summation order for both. (float32 goes through OpenBLAS, whose
    matrix-vector and matrix-matrix kernels round differently - as for mlx-lm's own cache - so
    there it is equal to float32 rounding.)"""
    mx.random.seed(3)
    n_kv, heads, d = 2, 4, 32
    total = 700 if block == 256 else 420
    k = (mx.random.normal((1, n_kv, total, d)) * 2).astype(dtype)
    v = mx.random.normal((1, n_kv, total, d)).astype(dtype)
    q = mx.random.normal((1, heads, total, d)).astype(dtype)
    splits = 0
    for start in range(2 * g - 3, total - 8, 23):
        outs = []
        for rows in ((6,), (1,) * 6):
            c = HierarchicalKVCache(g, block_size=block, auto_commit=True)
            c.update_and_fetch(k[..., :start, :], v[..., :start, :])
            outs.append(attend_in_steps(c, q, k, v, start, rows))
            splits += c.split_forwards
        if dtype == mx.float32:
            assert mx.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5).item(), start
        else:
            assert mx.array_equal(outs[0], outs[1]).item(), (dtype, start)
    assert splits >= 5  # verifies that straddle a flush were among them


def test_appends_grow_linearly():
    """Token-by-token appends: reallocations and bytes copied grow linearly with the context
    (not with its square), and allocated memory stays within one block of what is held."""
    g, block = 32, 512
    d, n_kv = 32, 2
    stats = {}
    for total in (1024, 4096):
        c = HierarchicalKVCache(g, block_size=block, auto_commit=True)
        mx.random.seed(0)
        k = mx.random.normal((1, n_kv, total, d))
        for t in range(total):
            c.update_and_fetch(k[..., t : t + 1, :], k[..., t : t + 1, :])
            if t % 256 == 0:
                mx.eval(c.state)
        c.commit()
        mx.eval(c.state)
        used, alloc = c.nbytes_by_part(used=True), c.nbytes_by_part()
        codes_used = sum(v for key, v in used.items() if key != "buffer")
        codes_alloc = sum(v for key, v in alloc.items() if key != "buffer")
        per_block = codes_used * block // c.q_len
        assert codes_alloc - codes_used <= per_block, (codes_alloc, codes_used)
        assert alloc["buffer"] <= 2 * (c.buffer_len + c.buffer_size + 64) * n_kv * d * 4
        stats[total] = (c.allocations, c.bytes_copied, codes_used)
        k_all, _ = c.dequantized()
        assert k_all.shape[2] == total
    (a1, b1, _), (a4, b4, u4) = stats[1024], stats[4096]
    assert a4 <= 4.5 * a1 and b4 <= 4.5 * b1, stats  # linear, a quadratic would be ~16x
    assert b4 <= 2 * u4 + 4096 * n_kv * d * 4 * 4, stats  # O(1) copies per token


def test_attention_tiles_are_bounded(monkeypatch):
    """No score matrix wider than one block: every packed product (a step) and every tile of
    reconstructed codes (a prefill chunk's shared tiles) covers <= block_size keys."""
    # (spies on the module's kernels: a tile's width bounds memory, the outputs cannot show it)
    from mlxspec.quant import hierarchical_cache as hc

    products, tiles = [], []
    real_product, real_tile = hc._planes_product, hc._dequantized

    def product(x, planes, group_size, two):
        out = real_product(x, planes, group_size, two)
        products.append(out.shape[-1])
        return out

    def tile(planes, group_size, two):
        out = real_tile(planes, group_size, two)
        tiles.append(max(out.shape[-2:]))  # keys (.., D, tokens), values (.., tokens, D)
        return out

    monkeypatch.setattr(hc, "_planes_product", product)
    monkeypatch.setattr(hc, "_dequantized", tile)
    c = HierarchicalKVCache(32, block_size=256, auto_commit=True)
    k = mx.random.normal((1, 2, 1100, 32))
    kv, _ = c.update_and_fetch(k, k)
    hierarchical_attention(mx.random.normal((1, 4, 1100, 32)), kv, 0.1, "causal")
    kv, _ = c.update_and_fetch(k[..., :1, :], k[..., :1, :])
    hierarchical_attention(mx.random.normal((1, 4, 1, 32)), kv, 0.1)
    assert products and max(products) <= 256
    assert tiles and max(tiles) <= 256
    assert len(c.blocks) == 5 and c.blocks[-1].cap <= 256


def test_state_round_trip():
    c = HierarchicalKVCache(32, block_size=256, auto_commit=True)
    k = mx.random.normal((1, 2, 600, 32))
    c.update_and_fetch(k, k)
    c.commit()
    other = HierarchicalKVCache.from_state(c.state)
    other.meta_state = c.meta_state
    assert [a.tolist() for a in other.state] == [a.tolist() for a in c.state]
    q = mx.random.normal((1, 4, 1, 32))
    kv1, _ = c.update_and_fetch(k[..., :1, :], k[..., :1, :])
    kv2, _ = other.update_and_fetch(k[..., :1, :], k[..., :1, :])
    assert mx.array_equal(hierarchical_attention(q, kv1, 0.1),
                          hierarchical_attention(q, kv2, 0.1)).item()


# ----------------------------------------------------------------------------- prefill chunks

def _attend_chunks(chunks, g, block, buffer, view, dtype=mx.float32, seed=1):
    n_kv, heads, d = 2, 4, 32
    mx.random.seed(seed)
    total = sum(chunks)
    k = (mx.random.normal((1, n_kv, total, d)) * 2).astype(dtype)
    v = mx.random.normal((1, n_kv, total, d)).astype(dtype)
    q = mx.random.normal((1, heads, total, d)).astype(dtype)
    c = HierarchicalKVCache(g, buffer_size=buffer, block_size=block, auto_commit=True)
    c.view = view
    done, out = 0, []
    for n in chunks:
        kv, _ = c.update_and_fetch(k[..., done : done + n, :], v[..., done : done + n, :])
        out.append(hierarchical_attention(q[:, :, done : done + n], kv, d**-0.5, "causal"))
        done += n
    return mx.concatenate(out, axis=2)


@pytest.mark.parametrize("g,block,buffer,view,chunks", [
    (32, 4096, None, "target", [700]),
    (32, 256, None, "target", [700, 300, 150]),  # several tiles, several row blocks
    (64, 4096, None, "target", [1100, 600]),
    (32, 256, 100, "draft", [333, 400, 129]),  # a buffer that is not a multiple of G
    (32, 256, None, "target", [5, 300, 3, 200]),  # chunks starting inside a group
    (128, 512, 300, "target", [900, 200]),
])
def test_shared_tile_prefill_equals_per_row(monkeypatch, g, block, buffer, view, chunks):
    """A chunk of many rows (one product per tile of codes for all its rows, the buffer as
    per-group windows) gives what the per-row computation gives, to float32 rounding."""
    from mlxspec.quant import hierarchical_cache as hc

    # (a spy: both paths give the same output, so only the call shows the shared one ran)
    calls = []
    real = hc._shared_tile_attention
    monkeypatch.setattr(hc, "_shared_tile_attention", lambda q, kv: calls.append(1) or real(q, kv))
    shared = _attend_chunks(chunks, g, block, buffer, view)
    assert len(calls) == sum(n > hc.SHARED_TILE_ROWS for n in chunks) > 0
    monkeypatch.setattr(hc, "SHARED_TILE_ROWS", 10**9)
    per_row = _attend_chunks(chunks, g, block, buffer, view)
    assert mx.allclose(shared, per_row, atol=2e-5, rtol=1e-5).item(), \
        mx.abs(shared - per_row).max().item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_shared_tile_prefill_half_precision(monkeypatch, dtype):
    """In half precision the shared path is at least as close to the float32 computation as
    the per-row one (whose packed products accumulate in half precision)."""
    from mlxspec.quant import hierarchical_cache as hc

    args = ([333, 400, 129], 32, 256, None, "target")
    exact = _attend_chunks(*args).astype(mx.float32)
    shared = _attend_chunks(*args, dtype=dtype).astype(mx.float32)
    monkeypatch.setattr(hc, "SHARED_TILE_ROWS", 10**9)
    per_row = _attend_chunks(*args, dtype=dtype).astype(mx.float32)
    err_shared = mx.abs(shared - exact).mean().item()
    err_rows = mx.abs(per_row - exact).mean().item()
    assert err_shared <= 1.1 * err_rows, (err_shared, err_rows)


def test_the_longest_verify_after_a_long_prefill_equals_single_steps():
    """After a prefill chunk long enough to share tiles of codes (over SHARED_TILE_ROWS rows),
    the longest verify (MAX_NUM_DRAFT + 1 rows) still gives every row exactly the bits that
    single-token steps give: only prefill chunks share tiles, verifies compute per row."""
    from mlxspec.policy import MAX_NUM_DRAFT
    from mlxspec.quant.hierarchical_cache import SHARED_TILE_ROWS

    width, prefix = MAX_NUM_DRAFT + 1, 1100
    assert prefix > SHARED_TILE_ROWS >= width
    mx.random.seed(5)
    n_kv, heads, d = 2, 4, 32
    k = (mx.random.normal((1, n_kv, prefix + width, d)) * 2).astype(mx.bfloat16)
    v = mx.random.normal((1, n_kv, prefix + width, d)).astype(mx.bfloat16)
    q = mx.random.normal((1, heads, prefix + width, d)).astype(mx.bfloat16)
    outs = []
    for rows in ((width,), (1,) * width):
        c = HierarchicalKVCache(32, block_size=256, auto_commit=True)
        kv, _ = c.update_and_fetch(k[..., :prefix, :], v[..., :prefix, :])
        hierarchical_attention(q[:, :, :prefix], kv, d**-0.5, "causal")
        outs.append(attend_in_steps(c, q, k, v, prefix, rows))
    assert mx.array_equal(outs[0], outs[1]).item()


def test_state_is_per_block_and_reads_the_old_layout():
    """`state` holds each block's codes as views (no copy of the whole store after every
    prefill chunk); a state saved as one group of all the codes restores the same cache."""
    c = HierarchicalKVCache(32, block_size=256, auto_commit=True)
    k = mx.random.normal((1, 2, 700, 32))
    c.update_and_fetch(k, k)
    c.commit()
    state = c.state
    assert len(state) == 2 + 8 * len(c.blocks) and len(c.blocks) == 3
    kq, vq = c.keys_q, c.values_q  # the whole store, concatenated
    old = HierarchicalKVCache.from_state([c.buf_k, c.buf_v, *kq, *vq])
    old.meta_state = c.meta_state
    assert [a.tolist() for a in old.state] == [a.tolist() for a in state]


@pytest.mark.parametrize("g", [32, 64, 128])
def test_target_triple_is_both_planes(g):
    """The target's 8-bit triple (codes 16 U + L + 8, step s/16, bias min - s/2), built from the
    two stored planes, reconstructs what the two planes do and multiplies like their sum."""
    from mlxspec.quant.kvquant import target_triple

    mx.random.seed(g)
    x = mx.random.normal((2, 3, 16, 4 * g)) * 3
    q = quantize_two_plane(x, g)
    codes, scales, biases = q.target_triple()
    assert codes.dtype == mx.uint32 and codes.shape[-1] == x.shape[-1] // 4
    assert all(mx.array_equal(a, b).item() for a, b in zip(
        (codes, scales, biases), target_triple(q.upper, q.lower, q.scales, q.mins)))
    c8 = mx.bitwise_and(mx.right_shift(codes[..., None], mx.arange(0, 32, 8, dtype=mx.uint32)),
                        0xFF).reshape(x.shape)
    assert mx.array_equal(c8, 16 * unpack4(q.upper) + unpack4(q.lower)).item()
    eight = mx.dequantize(codes, scales, biases, group_size=g, bits=8)
    assert mx.allclose(eight, dequantize_two_plane(q, g, planes=2), atol=1e-5).item()
    w = mx.random.normal((5, 16))
    two = (mx.quantized_matmul(w, *q.upper_triple(), transpose=False, group_size=g, bits=4)
           + mx.quantized_matmul(w, *q.lower_triple(), transpose=False, group_size=g, bits=4))
    one = mx.quantized_matmul(w, codes, scales, biases, transpose=False, group_size=g, bits=8)
    assert mx.allclose(one, two, atol=1e-4, rtol=1e-5).item()


def test_two_product_target_route(monkeypatch):
    """Off the CPU the target reads its planes as two 4-bit products (the fewest bytes): that
    route too matches the dequantized cache and keeps verifies equal to single steps."""
    from mlxspec.quant import hierarchical_cache as hc

    monkeypatch.setattr(hc, "_route", lambda dtype: "planes")
    test_attention_matches_dequantized_cache(32, 256)
    test_verify_equals_single_steps_bit_for_bit(mx.bfloat16, 32, 256)


@pytest.mark.parametrize("two", [True, False])
@pytest.mark.parametrize("k,n,g", [(32, 256, 64), (300, 64, 32), (64, 4096, 64)])
def test_float_product_matches_packed_kernels(two, k, n, g):
    """The CPU's float32 route (scales factored out of float products over the codes) computes
    what MLX's packed kernels compute from the same planes, keys-like (many groups along N) and
    values-like (groups along head_dim), in the target's 8-bit view and the draft's 4-bit one."""
    # (the module's kernels compared directly: closer than attention outputs could show)
    from mlxspec.quant import hierarchical_cache as hc

    mx.random.seed(7)
    w = mx.random.normal((1, 2, k, n)) * 3
    planes = quantize_two_plane(w, g)
    x = mx.random.normal((1, 2, 7, k))
    packed = hc._qmm(x, planes.target_triple() if two else planes.upper_triple(), g)
    floats = hc._float_product(x, planes, g, two)
    assert floats.dtype == mx.float32 and floats.shape == packed.shape
    assert mx.allclose(floats, packed, rtol=1e-4, atol=1e-3 * k**0.5).item()
    assert not mx.allclose(floats, x @ w, atol=0.05).item()  # the codes were read, not w
    assert hc._route(mx.float32) == "floats" and hc._route(mx.bfloat16) == "eight"


def test_softmax_exponential_matches_mx_exp():
    """The CPU's compiled exp(a - b) of the attention's softmax: within 2e-7 relative of
    `mx.exp` over the range a softmax reaches, broadcasting like a subtraction, exactly 1 at
    the row maximum and exactly 0 for masked scores (so the masked columns of a verify row add
    nothing, as a single step's absent columns)."""
    # (the module's compiled exponential directly: its precision is below what outputs show)
    from mlxspec.quant import hierarchical_cache as hc

    xs = mx.linspace(-87.0, 0.0, 100_001)
    got, want = hc._exp_difference(xs, mx.array(0.0)), mx.exp(xs)
    assert (mx.abs(got - want) / want).max().item() < 2e-7
    s = mx.array([[1.0, 3.0, hc._NEG], [-200.0, 0.5, 0.25]])
    m = s.max(axis=-1, keepdims=True)
    out = hc._exp_difference(s, m).tolist()
    assert out[0][1] == 1.0 and out[0][2] == 0.0 and out[1][0] == 0.0 and out[1][1] == 1.0
    assert abs(out[1][2] - mx.exp(mx.array(-0.25)).item()) < 1e-7
    with mx.stream(mx.cpu):
        assert hc._exp_difference(mx.array([float("-inf")]), mx.array([0.0])).item() == 0.0
