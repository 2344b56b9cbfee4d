"""Tiny random-weight models of the architecture families people run, from mlx-lm's own
configurations: plain attention, sliding windows (RotatingKVCache) and hybrid recurrent layers
(ArraysCache). Weights are scaled up so next-token distributions are peaked (greedy decoding is
then decided by clear margins), and a draft that agrees often but not always is the target's
own weights plus noise."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_unflatten

VOCAB = 128
WINDOW = 16  # sliding windows wrap several times within a test's generation

_BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
             max_position_embeddings=4096, tie_word_embeddings=False)

CONFIGS: dict[str, dict] = {
    "llama": dict(_BASE),
    "qwen2": dict(_BASE),
    "qwen3": dict(_BASE, head_dim=16),
    "qwen3_moe": dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=64,
                      norm_topk_prob=True),
    "gemma3_text": dict(_BASE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=WINDOW, sliding_window_pattern=3),
    "gpt_oss": dict(_BASE, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        _BASE, model_type="qwen3_5_text", num_hidden_layers=4, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        partial_rotary_factor=0.5)),
    "qwen3_next": dict(_BASE, num_hidden_layers=4, head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, shared_expert_intermediate_size=64,
                       mlp_only_layers=[], moe_intermediate_size=64, partial_rotary_factor=0.5,
                       full_attention_interval=2),
    "lfm2": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
                 conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=32,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
                 full_attn_idxs=[1, 3]),
    "nemotron_h": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=4096, num_attention_heads=4,
                       num_key_value_heads=2, attention_bias=False, mamba_num_heads=4,
                       mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                       conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern="M*-M",
                       num_hidden_layers=4, head_dim=16, time_step_limit=(0.0, float("inf"))),
    "falcon_h1": dict(hidden_size=64, head_dim=16, intermediate_size=128, mamba_d_conv=4,
                      mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_groups=1,
                      mamba_n_heads=4, mamba_chunk_size=16, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                      rope_theta=10000.0, max_position_embeddings=4096),
    "mamba2": dict(num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, state_size=16, num_hidden_layers=2,
                   layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                   use_conv_bias=True, tie_word_embeddings=True, time_step_limit=(0.0, 100.0),
                   time_step_rank="auto"),
}

SLIDING = ("gemma3_text", "gpt_oss")
RECURRENT = ("qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1", "mamba2")


# Families whose own output multipliers flatten the distribution need a larger scale.
SCALE = {"falcon_h1": 60.0}
# Tied-embedding families whose random layers are too weak against the input embedding (they
# would echo their input): shrink the embedding, scale the final norm back up.
EMBED_SHRINK = {"lfm2": ("model.embed_tokens.weight",), "falcon_h1": ("model.embed_tokens.weight",)}


def build(family: str, seed: int = 0, scale: float | None = None, dtype=mx.float32,
          **overrides):
    """A random-weight model of `family`, its output layer scaled by `scale`; `overrides`
    change its configuration (vocab_size, sliding_window, ...)."""
    scale = SCALE.get(family, 6.0) if scale is None else scale
    from mlx_lm.utils import _get_classes

    cfg = dict(CONFIGS[family])
    if "text_config" in cfg:
        cfg["text_config"] = {**cfg["text_config"], **overrides}
    else:
        cfg.update(overrides)
    cfg.setdefault("model_type", family)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    params = dict(tree_flatten(model.parameters()))
    # Peaked distributions: scale the output projection, or with tied embeddings the final
    # norm (scaling the embedding would scale the input too, and the model would just echo).
    heads = [n for n in params if n.endswith("lm_head.weight")] or [
        n for n in params if "layers" not in n and "norm" in n and n.endswith("weight")]
    for name in heads:
        params[name] = params[name] * scale
    for name in EMBED_SHRINK.get(family, ()):  # the residual stream must not be only the input
        params[name] = params[name] * 0.05
        for head in heads:
            params[head] = params[head] / 0.05
    model.update(tree_unflatten(list(params.items())))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


# Noise (relative to each tensor's mean magnitude) for a draft that agrees often, not always.
NOISE = {"falcon_h1": 0.1}


def noisy_copy(model, family: str, noise: float | None = None, seed: int = 1, **overrides):
    """The same family with the target's weights plus Gaussian noise: a draft that agrees
    often but not always."""
    noise = NOISE.get(family, 0.35) if noise is None else noise
    draft = build(family, seed=seed, dtype=mx.float32, **overrides)
    mx.random.seed(seed)
    params = tree_map(lambda w: w + noise * mx.random.normal(w.shape).astype(w.dtype) * (
        mx.abs(w).mean()) if mx.issubdtype(w.dtype, mx.floating) else w, model.parameters())
    draft.update(params)
    mx.eval(draft.parameters())
    return draft


def expected_refusal(family: str, mode: str) -> str | None:
    """The words the refusal must contain, or None where the mode must be exact."""
    if family in RECURRENT and mode in ("ngram-tree", "lookahead"):
        return "recurrent"
    if mode == "quantspec" and (family in SLIDING or family == "mamba2"):
        # Sliding windows already bound the KV cache; mamba2 has no attention layers at all.
        return "sliding-window" if family in SLIDING else "no attention layers"
    return None
