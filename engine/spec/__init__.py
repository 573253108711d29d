"""Speculative decoding: the config, the n-gram proposer, the per-sequence draft length, verification."""
