"""Subcommands of the ``qwen-trt`` CLI (one module each)."""
