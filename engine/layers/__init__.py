"""Layer objects the models are built from: built once at load, called per step (linear, MoE)."""
