"""LoRA adapters served per request over one base model (engine/lora/manager.py is the entry)."""
