"""The API side of LoRA adapters: which names resolve to which adapter (registry.py)."""
