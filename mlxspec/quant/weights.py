"""The 4-bit weight draft: a second view of the target whose linear layers are 4-bit copies.

`make_draft_model(model)` returns a shallow copy of the model's module tree in which only the
chosen `nn.Linear` leaves are replaced by `nn.QuantizedLinear` copies (affine, group 64 by
default); every other module and array (embeddings, norms, the LM head, unquantized projections)
is the very same object as in the target, so only the quantized copies cost memory. The draft
forward is then just `draft_model(tokens, cache=shared_cache)`.

`quantize="mlp"` (the default, as in the QuantSpec authors' code) quantizes the MLP projections of
every transformer layer; `quantize="all"` also the attention projections. The LM head and the
embeddings are never quantized. If the target's chosen layers are already quantized to <= the
requested bits, the draft reuses them (no copy) and the info says so.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

QUANTIZE_CHOICES = ("mlp", "all")
WEIGHT_METHODS = ("rtn", "gptq")


class _NotForGPTQ(nn.Linear):
    """Marks a linear layer mlx-lm's GPTQ must leave alone (it selects by exact type)."""


def _gptq_copies(model: nn.Module, paths: list[str], bits: int, group_size: int,
                 calibration, batch_size: int = 4) -> dict[str, nn.Module]:
    """GPTQ-quantized copies of the linear layers at `paths`, through mlx-lm's
    `mlx_lm.quant.gptq.gptq_quantize` on a deep copy of the model (Hessians from a forward over
    `calibration`, token ids of shape (n, length)); the model itself is untouched."""
    from mlx_lm.quant.gptq import gptq_quantize

    work = copy.deepcopy(model)
    wanted = set(paths)
    for p, m in work.named_modules():
        if type(m) is nn.Linear and p not in wanted:
            m.__class__ = _NotForGPTQ
    data = mx.array(calibration, mx.uint32)
    if data.ndim != 2:
        raise ValueError("calibration must be token ids of shape (sequences, length)")
    gptq_quantize(work, data, bits, group_size, bits, group_size, batch_size=batch_size)
    mods = dict(work.named_modules())
    return {p: mods[p] for p in paths if isinstance(mods.get(p), nn.QuantizedLinear)}


_MLP_NAMES = ("mlp", "feed_forward", "ffn")


def _mlp_prefixes(model: nn.Module) -> set[str]:
    """Paths of modules that are MLP blocks by their class (e.g. Nemotron-H's `mixer` of an
    MLP layer is a `NemotronHMLP`)."""
    return {p for p, m in model.named_modules()
            if p and any(n in type(m).__name__.lower() for n in ("mlp", "feedforward"))}


def _selected(path: str, quantize: str, mlp_prefixes: frozenset[str] | set[str] = frozenset()
              ) -> bool:
    parts = path.split(".")
    if "layers" not in parts:
        return False  # embeddings, final norm, lm_head
    if quantize == "all":
        return True
    return any(p in _MLP_NAMES for p in parts) or any(
        path.startswith(prefix + ".") for prefix in mlp_prefixes)


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _quantized_copy(layer: nn.Module, bits: int, group_size: int) -> nn.Module | None:
    """A QuantizedLinear copy of a Linear (or of a QuantizedLinear with more bits); None when the
    input dimension does not split into groups."""
    if isinstance(layer, nn.QuantizedLinear):
        weight = mx.dequantize(layer.weight, layer.scales, layer.get("biases"),
                               group_size=layer.group_size, bits=layer.bits,
                               mode=getattr(layer, "mode", "affine"))
        dtype = layer.scales.dtype
    else:
        weight = layer.weight
        dtype = weight.dtype
    out_dims, in_dims = weight.shape
    gs = group_size
    if in_dims % gs:
        gs = next((g for g in (64, 32) if in_dims % g == 0), None)
        if gs is None:
            return None
    has_bias = "bias" in layer
    q = nn.QuantizedLinear(in_dims, out_dims, bias=has_bias, group_size=gs, bits=bits)
    q.weight, q.scales, q.biases = mx.quantize(weight.astype(dtype), group_size=gs, bits=bits)
    if has_bias:
        q.bias = layer.bias
    return q


def make_draft_model(model: nn.Module, bits: int = 4, group_size: int = 64,
                     quantize: str = "mlp", method: str = "rtn",
                     calibration=None) -> tuple[nn.Module, dict]:
    """(draft_model, info). info: reused (bool), extra_bytes, replaced_bytes, quantized_layers,
    skipped (paths left in full precision: input dim not a multiple of 32), weight_bits,
    weight_group_size, quantize, method, note.

    method="rtn" (default): round-to-nearest affine codes (`mx.quantize`). method="gptq":
    mlx-lm's GPTQ on `calibration` (token ids, (sequences, length)); layers it cannot do fall
    back to round-to-nearest."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES}, got {quantize!r}")
    if method not in WEIGHT_METHODS:
        raise ValueError(f"method must be one of {WEIGHT_METHODS}, got {method!r}")
    if method == "gptq" and calibration is None:
        raise ValueError("method='gptq' needs calibration token ids")
    mlps = _mlp_prefixes(model)
    targets = [(p, m) for p, m in model.named_modules()
               if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and _selected(p, quantize, mlps)]
    if not targets:
        raise ValueError("no linear layers to quantize for the draft")
    if all(isinstance(m, nn.QuantizedLinear) and m.bits <= bits for _, m in targets):
        have = sorted({m.bits for _, m in targets})
        info = dict(reused=True, extra_bytes=0, quantized_layers=0, skipped=[],
                    weight_bits=have[-1], weight_group_size=targets[0][1].group_size, quantize=quantize,
                    note=(f"the target is already quantized to {'/'.join(map(str, have))} bits: "
                          "the draft reuses its weights; only the KV cache is hierarchical"))
        return model, info

    replacements: dict[str, nn.Module] = {}
    skipped = []
    gptq = {}
    if method == "gptq":
        gptq = _gptq_copies(model, [p for p, m in targets if type(m) is nn.Linear
                                    and m.weight.shape[-1] % group_size == 0],
                            bits, group_size, calibration)
    for path, layer in targets:
        if isinstance(layer, nn.QuantizedLinear) and layer.bits <= bits:
            continue
        q = gptq.get(path) or _quantized_copy(layer, bits, group_size)
        if q is None:
            skipped.append(path)
        else:
            replacements[path] = q
    mx.eval([m.parameters() for m in replacements.values()])
    draft = _replace(model, "", replacements)
    extra = sum(_nbytes(m) for m in replacements.values())
    replaced = sum(_nbytes(m) for p, m in targets if p in replacements)
    info = dict(reused=False, extra_bytes=extra, replaced_bytes=replaced,
                quantized_layers=len(replacements), skipped=skipped, weight_bits=bits,
                weight_group_size=group_size, quantize=quantize,
                method="gptq" if gptq else "rtn",
                note=(f"{len(replacements)} {quantize} linears copied at {bits} bits "
                      f"({'GPTQ' if gptq else 'round-to-nearest'}) "
                      f"(+{extra / 2**20:.2f} MiB; they replace {replaced / 2**20:.2f} MiB "
                      "in the draft view only)"))
    return draft, info


def _replace(obj, path: str, replacements: dict[str, nn.Module]):
    """Copy-on-write rebuild: returns obj itself when nothing under it changes."""
    if path in replacements:
        return replacements[path]
    prefix = path + "." if path else ""
    if not any(p.startswith(prefix) for p in replacements):
        return obj
    if isinstance(obj, nn.Module):
        new = copy.copy(obj)  # shallow: shares every child and array
        for k, v in obj.items():
            nv = _replace(v, prefix + k, replacements)
            if nv is not v:
                new[k] = nv
        return new
    if isinstance(obj, (list, tuple)):
        items = [_replace(v, prefix + str(i), replacements) for i, v in enumerate(obj)]
        return type(obj)(items)
    if isinstance(obj, dict):
        return {k: _replace(v, prefix + k, replacements) for k, v in obj.items()}
    return obj
