"""Quantization: 4-bit weight drafts and the hierarchical KV cache (QuantSpec)."""
