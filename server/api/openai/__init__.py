"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/models."""
