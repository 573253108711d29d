"""vLLM's pooling routes: /classify, /score, /rerank (Jina's /v1/rerank too), /pooling; inputs.py is what they
share before the engine; finishing.py (normalization, activations, Matryoshka cuts) and scoring.py (pairs and scores)
are pure functions over the engine's pooled outputs."""

from server.families import ErrorShape, Family

FAMILY = Family("pooling", ErrorShape.OPENAI)
