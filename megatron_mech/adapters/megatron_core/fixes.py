"""Fixes for megatron-core 0.16.1 bugs that hit any machine without Transformer Engine, GPUs included.

Unlike the CPU shims (:mod:`megatron_mech.adapters.megatron_core.cpu_shims`, applied only where CUDA is missing), these
run everywhere our entry point runs. Each fix binds only what is missing, so it is a no-op on a megatron-core that
does not have the bug.
"""
from __future__ import annotations

from typing import List

__all__ = ["apply_megatron_fixes", "bind_te_general_gemm"]


def bind_te_general_gemm() -> bool:
    """Bind ``moe_utils.te_general_gemm = None`` when it is missing; returns whether it bound it.

    ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only inside ``try: ... transformer_engine`` and
    never defines a fallback, yet ``RouterGatingLinearFunction.forward/backward`` test ``te_general_gemm is not
    None``: a NameError on every MoE forward without Transformer Engine (seen on CPU and on an H200 without TE).
    ``None`` selects the ``torch.mm`` path that is already there.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def apply_megatron_fixes() -> List[str]:
    """Apply every fix that is needed here; returns the names applied (``[]`` when none was needed). Safe to call
    any number of times, on any machine."""
    return ["te_general_gemm"] if bind_te_general_gemm() else []
