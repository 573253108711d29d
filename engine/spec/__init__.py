"""Speculative decoding: the config, the n-gram proposer, the draft model, the per-sequence draft length,
verification."""
