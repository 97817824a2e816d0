"""Studies outside the product API: fault injectors (including the emulated FA2 numerics) and lead time."""
