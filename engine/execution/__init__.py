"""Running a scheduled step: the model runner, the sampler, pooling."""
