"""Small HF models for the DeepSpeed example and tests: Llama-style dense, Mixtral-style MoE, and Llama with
DeepSpeed MoE (``deepspeed.moe.layer.MoE``) feed-forward layers. Built from config objects: no weights are
downloaded; initialisation is seeded."""
from __future__ import annotations

import torch

__all__ = ["DeepSpeedMoEMLP", "dense_llama", "deepspeed_moe_llama", "mixtral"]


def _llama_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, seq_len: int):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "eager"  # plain matmuls: the same kernels on every CPU, and patchable
    return config


def dense_llama(vocab_size: int = 256, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                ffn: int = 64, seq_len: int = 64, seed: int = 0) -> torch.nn.Module:
    """A Llama-architecture causal LM (grouped-query attention with ``kv_heads`` < ``heads``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(vocab_size, hidden, layers, heads, kv_heads, ffn, seq_len))


def mixtral(vocab_size: int = 256, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
            ffn: int = 64, seq_len: int = 64, num_experts: int = 4, top_k: int = 2, seed: int = 0) -> torch.nn.Module:
    """A Mixtral-architecture causal LM (HF MoE blocks: ``block_sparse_moe.gate`` / ``mlp.gate``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq_len,
                           num_local_experts=num_experts, num_experts_per_tok=top_k, tie_word_embeddings=False,
                           use_cache=False)
    config._attn_implementation = "eager"
    return MixtralForCausalLM(config)


class DeepSpeedMoEMLP(torch.nn.Module):
    """A Llama MLP replaced by ``deepspeed.moe.layer.MoE`` over ``num_experts`` copies of it. The load-balancing
    loss of the last forward is kept in ``l_aux`` (the trainer adds it to the loss)."""

    def __init__(self, config, num_experts: int, ep_size: int, k: int):
        super().__init__()
        from deepspeed.moe.layer import MoE
        from transformers.models.llama.modeling_llama import LlamaMLP

        # drop_tokens=False: every token reaches its experts, so the step is the same whatever the capacity.
        self.moe = MoE(hidden_size=config.hidden_size, expert=LlamaMLP(config), num_experts=num_experts,
                       ep_size=ep_size, k=k, drop_tokens=False, use_rts=False)
        self.l_aux = torch.zeros(())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(hidden_states)
        self.l_aux = l_aux
        return out


def deepspeed_moe_llama(vocab_size: int = 256, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                        ffn: int = 64, seq_len: int = 64, num_experts: int = 4, ep_size: int = 2, k: int = 2,
                        seed: int = 0) -> torch.nn.Module:
    """Llama with every feed-forward layer a DeepSpeed MoE layer (needs ``deepspeed.init_distributed`` first).
    Expert weights differ per expert-parallel rank; everything else is identical on every rank (same seed)."""
    model = dense_llama(vocab_size, hidden, layers, heads, kv_heads, ffn, seq_len, seed)
    torch.manual_seed(seed + 1)
    for layer in model.model.layers:
        layer.mlp = DeepSpeedMoEMLP(model.config, num_experts, ep_size, k)
    return model


def moe_aux_loss(model: torch.nn.Module) -> torch.Tensor:
    """Sum of the DeepSpeed MoE load-balancing losses of the last forward (0 for other models)."""
    total = torch.zeros(())
    for m in model.modules():
        if isinstance(m, DeepSpeedMoEMLP):
            total = total + m.l_aux
    return total
