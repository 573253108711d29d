"""GGUF files: reading llama.cpp's single-file checkpoints (metadata, tokenizer, quantized tensors)."""
