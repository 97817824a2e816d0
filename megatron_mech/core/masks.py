"""The causal attention mask, in one place (framework-free)."""
from __future__ import annotations

import torch

__all__ = ["causal_mask"]


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """``[sq, sk]`` bool, True above the diagonal (masked), as megatron's default causal mask; for ``sq < sk`` the
    last ``sq`` queries of a ``sk``-long sequence (the diagonal is shifted by ``sk − sq``)."""
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1 + sk - sq)
