"""Running a scheduled step: the model runner, the op set (norms, rotary, paged KV writes, attention), CPU attention,
pooling."""
