"""Speculative decoding: proposers and the exact acceptance rule."""
