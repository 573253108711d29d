"""Prometheus metrics of the API server, and their copies under vLLM's names."""
