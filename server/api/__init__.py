"""HTTP routes only: decode the body, call the pipeline, format the answer. One package per API family
(openai/, vllm/ for vLLM's extra endpoints), plus the operational routes (health, metrics)."""
