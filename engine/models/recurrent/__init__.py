"""Recurrent token mixers of hybrid models: each keeps a fixed-size state per sequence (engine/execution/
recurrent_state.py) instead of KV: LFM2's short gated convolution, Qwen3.5's Gated DeltaNet."""
