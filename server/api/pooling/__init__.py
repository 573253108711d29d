"""vLLM's pooling routes: /classify, /score, /rerank (Jina's /v1/rerank too), /pooling; inputs.py is what they
share before the engine."""
