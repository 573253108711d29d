"""Layer objects the models are built from: built once at load, called per step (the op set with the attention
dispatcher and CPU attention, linear, LM heads, MoE)."""
