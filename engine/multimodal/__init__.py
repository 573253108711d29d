"""Images inside the engine: engine/multimodal/image_runner.py (per-request image state, M-RoPE positions, the
vision-encoder output cache) and processing.py (the Qwen2-VL image processor, shared with the API server)."""
