"""Request state, the scheduler and the paged KV block manager: what the engine knows
about requests, free of tensors."""
