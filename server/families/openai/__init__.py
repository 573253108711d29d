"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models. The OpenAI wire structs are
the shape every family translates to, so they live on the shared path (server/request/openai_protocol.py)."""

from server.families import ErrorShape, Family

FAMILY = Family("openai", ErrorShape.OPENAI)
