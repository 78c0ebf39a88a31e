"""The fast path's step: a plan in (rows of any number of tokens per sequence), logits and
picked tokens out. The batched model over a paged KV cache, its CUDA graphs, the executor
that runs a plan on it, the batch-1 decoder, the sampler and grammar masks."""
