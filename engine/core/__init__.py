"""The engine core: the step and the read/step loop that drives it, the scheduler, the KV block manager, parameter
checks."""
