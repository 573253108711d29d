"""Cohere's v2 API on a pooling server: /v2/embed (embed.py) and /v2/rerank (rerank.py), as the official `cohere`
SDK's ClientV2 calls them; input_types.py and quantize.py are Cohere's prompt kinds and embedding types."""

from server.families import ErrorShape, Family

FAMILY = Family("cohere", ErrorShape.OPENAI)
