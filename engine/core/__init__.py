"""The engine core: the step loop, the scheduler, the KV block manager, a sequence's state, parameter checks, the
sampler."""
