"""Two-plane (hierarchical INT4/INT8) affine quantization, computed and packed by hand.

QuantSpec stores every quantized value as two 4-bit codes:

* upper plane  U = clip(round((x - min) / s), 0, 15), s = (max - min) / 15, bias = min:
  x ~= min + s U, error <= s/2 (the draft's 4-bit view);
* lower plane  L = clip(round(16 r / s), -8, 7) with r = x - (min + s U), stored as L + 8:
  x ~= min + s U + s L / 16, error <= s/16 (s/32 except at the clamp; the target's ~8-bit view).

Both planes are plain affine 4-bit triples (packed codes, scales, biases) that MLX's packed
kernels (`mx.quantized_matmul`, `mx.dequantize`) accept: the upper plane with (s, min), the lower
plane with (s/16, -s/2), because (s/16)(L + 8) - s/2 = s L / 16. Together they are one affine
8-bit triple (`target_triple`: code 16 U + L + 8, step s/16, bias min - s/2), built on the fly
for the target's products. The codes are NOT taken from
`mx.quantize`: on MLX 0.32.4 it shifts its grid so that an edge is exact (scales can even come out
negative), its residual reaches ~|s| and a lower plane at step s/16 cannot cover it (see DESIGN.md
section 5). Packing is 8 codes per uint32, element i of each run of 8 at bits 4i, which is the
order `mx.quantize` packs in and `mx.quantized_matmul` reads.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

BITS = 4
PER_WORD = 32 // BITS
SUPPORTED_GROUP_SIZES = (32, 64, 128)
_SHIFTS = mx.arange(0, 32, BITS, dtype=mx.uint32)


class TwoPlane(NamedTuple):
    """Packed codes of both planes and the per-group scale s and minimum, along the last axis."""

    upper: mx.array  # uint32 (..., N / 8)
    lower: mx.array  # uint32 (..., N / 8)
    scales: mx.array  # (..., N / group_size), the upper plane's step s
    mins: mx.array  # (..., N / group_size), the upper plane's bias (the group minimum)

    def upper_triple(self) -> tuple[mx.array, mx.array, mx.array]:
        return self.upper, self.scales, self.mins

    def lower_triple(self) -> tuple[mx.array, mx.array, mx.array]:
        return lower_triple(self.lower, self.scales)

    def target_triple(self) -> tuple[mx.array, mx.array, mx.array]:
        return target_triple(self.upper, self.lower, self.scales, self.mins)


def lower_triple(lower: mx.array, scales: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(codes, scales, biases) of the lower plane: step s/16, bias -s/2 (codes stored as L + 8)."""
    return lower, scales * (1.0 / 16.0), scales * -0.5


def target_triple(upper: mx.array, lower: mx.array, scales: mx.array,
                  mins: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Both planes as ONE affine 8-bit triple: code 16 U + (L + 8) in [0, 255], step s/16,
    bias min - s/2, since min + s U + (s/16) L = (min - s/2) + (s/16)(16 U + L + 8).

    Built from the stored planes on the fly (nothing stored twice): byte i of the 8-bit codes is
    U_i << 4 | (L_i + 8), so the nibbles of the two planes are interleaved bytewise (uint8 views
    of the little-endian words: byte j of a 4-bit word holds elements 2j and 2j + 1). On MLX's
    CPU backend one 8-bit `quantized_matmul` costs a third of two 4-bit ones (measured: 0.61 vs
    1.82 ms for 7 query heads x 4032 keys x 64), so the conversion plus one product is ~half.
    The conversion is one compiled elementwise kernel (the two bytes of each uint16 are the
    pair), 0.04 ms there against 0.3 ms as separate ops and a stack: at 4k tokens a decode
    step converts every layer's keys and values."""
    pairs = _interleave(upper.view(mx.uint8), lower.view(mx.uint8))
    return pairs.view(mx.uint32), scales * (1.0 / 16.0), mins - scales * 0.5


def view_codes(planes: TwoPlane, two: bool) -> tuple[mx.array, mx.array, mx.array]:
    """A view's codes one per byte in element order (uint8 (..., N)), with its step and bias per
    group: the target's 8-bit codes 16 U + L + 8 (`target_triple`'s), or the draft's U alone.
    For products in floats (`hierarchical_cache._float_product`): one compiled elementwise
    kernel each, over contiguous bytes (a broadcasting unpack costs 5-7x as much on the CPU)."""
    if two:
        codes, step, bias = planes.target_triple()
        return codes.view(mx.uint8), step, bias
    return _spread(planes.upper.view(mx.uint8)).view(mx.uint8), planes.scales, planes.mins


def _spread_bytes(u8: mx.array) -> mx.array:
    # byte j holds elements 2j (low nibble) and 2j + 1 (high nibble): one per byte, in order
    return (u8 & 0xF).astype(mx.uint16) | mx.left_shift(mx.right_shift(u8, 4).astype(mx.uint16), 8)


_spread = mx.compile(_spread_bytes, shapeless=True)


def _interleave_bytes(u8: mx.array, l8: mx.array) -> mx.array:
    even = mx.left_shift(u8, 4) | (l8 & 0xF)  # elements 2j: low nibbles
    odd = (u8 & 0xF0) | mx.right_shift(l8, 4)  # elements 2j + 1: high nibbles
    # little-endian: the uint16's low byte (element 2j) comes first
    return even.astype(mx.uint16) | mx.left_shift(odd.astype(mx.uint16), 8)


_interleave = mx.compile(_interleave_bytes, shapeless=True)


def pack4(codes: mx.array) -> mx.array:
    """Pack 4-bit codes (any integer dtype, values 0..15) along the last axis: 8 per uint32."""
    *lead, n = codes.shape
    if n % PER_WORD:
        raise ValueError(f"last axis ({n}) must be a multiple of {PER_WORD}")
    words = codes.astype(mx.uint32).reshape(*lead, n // PER_WORD, PER_WORD)
    return mx.sum(mx.left_shift(words, _SHIFTS), axis=-1).astype(mx.uint32)


def unpack4(packed: mx.array) -> mx.array:
    """Inverse of `pack4` (uint32 codes 0..15)."""
    *lead, n = packed.shape
    codes = mx.bitwise_and(mx.right_shift(packed[..., None], _SHIFTS), 0xF)
    return codes.reshape(*lead, n * PER_WORD)


def quantize_two_plane(x: mx.array, group_size: int) -> TwoPlane:
    """Quantize along the last axis in groups of `group_size` into both 4-bit planes.

    Scales and minima are stored in x's dtype, and the codes are computed against those rounded
    values, so the bounds hold for what the kernels will actually reconstruct.
    """
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    *lead, n = x.shape
    if n % group_size:
        raise ValueError(f"last axis ({n}) must be a multiple of the group size {group_size}")
    dtype = x.dtype
    xg = x.astype(mx.float32).reshape(*lead, n // group_size, group_size)
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
    scales = ((hi - lo) / 15.0).astype(dtype)
    mins = lo.astype(dtype)
    s = scales.astype(mx.float32)
    m = mins.astype(mx.float32)
    s_safe = mx.where(s > 0, s, 1.0)  # a constant group: every code 0, reconstruction exact
    upper = mx.clip(mx.round((xg - m) / s_safe), 0, 15)
    resid = xg - (m + s * upper)
    lower = mx.clip(mx.round(resid * 16.0 / s_safe), -8, 7) + 8
    upper = upper.astype(mx.uint32).reshape(*lead, n)
    lower = lower.astype(mx.uint32).reshape(*lead, n)
    return TwoPlane(pack4(upper), pack4(lower), scales.squeeze(-1), mins.squeeze(-1))


def dequantize_two_plane(q: TwoPlane, group_size: int, planes: int = 2) -> mx.array:
    """Reconstruct through MLX's own `mx.dequantize` (which also checks the packing order).

    planes=1: the upper (draft) view; planes=2: upper + lower (target) view.
    """
    out = mx.dequantize(*q.upper_triple(), group_size=group_size, bits=BITS)
    if planes == 2:
        out = out + mx.dequantize(*q.lower_triple(), group_size=group_size, bits=BITS)
    return out


def concat_two_plane(a: TwoPlane | None, b: TwoPlane, axis: int) -> TwoPlane:
    """Concatenate two quantized blocks along `axis` (of the packed/scales arrays)."""
    if a is None:
        return b
    return TwoPlane(*(mx.concatenate([x, y], axis=axis) for x, y in zip(a, b)))
