"""The fast path's Triton kernels: attention (batch-1 and paged), GEMVs, small-batch GEMMs,
packed-weight (FP8 / INT4) kernels, and their shared PTX pieces. Each is self-checked against
the PyTorch reference before use."""
