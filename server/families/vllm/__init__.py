"""vLLM's extra routes: /tokenize, /detokenize, the render endpoints and /inference/v1/generate."""

from server.families import ErrorShape, Family

FAMILY = Family("vllm", ErrorShape.OPENAI)
