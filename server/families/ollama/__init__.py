"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, ...): a translation layer over the chat,
completions and embeddings paths, answered as NDJSON streams with errors as `{"error": "..."}`."""

from server.families import ErrorShape, Family

FAMILY = Family("ollama", ErrorShape.OLLAMA)
API_VERSION = "0.12.0"  # the Ollama release whose API this family follows (/api/version)
