"""vLLM's extra routes: /tokenize, /detokenize, the render endpoints and /inference/v1/generate."""
