"""Speculative decoding pieces of the fast path (layer 2): the draft-free n-gram proposer
(:mod:`.ngram`), exact speculative acceptance (:mod:`.rejection`) and the EAGLE-3 draft model
with its loader (:mod:`.eagle3`). Each is self-contained and tested on CPU; the batched runner's
verify step puts them together (docs/fast-path.md, "Speculative decoding: the pieces")."""
