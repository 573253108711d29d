"""The request path every API family shares, between its routes and the engine: the POST route's front, input
checks and the engine request, admission, rendering the prompt, AsyncLLM, the output processor and detokenizer, the
collector, and `respond` (one JSON body or server-sent events through a family's Formatter)."""
