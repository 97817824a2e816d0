"""Studies outside the product API: fault injectors (including the emulated FA2 numerics), lead time, the demo."""
