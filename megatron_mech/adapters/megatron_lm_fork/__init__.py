"""Megatron-LM fork integration: the call-site functions the patch set adds to a fork, the fork's CPU
training-layer shims, and the patch tool (check / apply / revert)."""
