"""Images and audio inside the engine: engine/multimodal/image_runner.py (M-RoPE positions, the vision-encoder output
cache), audio_runner.py (Whisper's encoder cache and cross-attention inputs) and processing.py (the Qwen2-VL image
processor, shared with the API server)."""
