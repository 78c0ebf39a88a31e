"""The fast path's model: its shapes (config), weights and their formats (bf16, FP8, INT4),
the compact Qwen3 forward with its reference math, and the KV cache layouts."""
