"""torchrun worker (gloo, CPU): the per-layer maximum attention logit of a real megatron-core GPTModel.

``--tp N`` (nproc = N): builds a 2-layer GPTModel (4 query heads, 2 query groups, head dim 8, learned absolute
positions: the attention kernel's query and key are the split ``linear_qkv`` output), sets every parameter from a
full tensor drawn once per name and sharded as megatron-core shards it (so TP=1 and TP=2 hold the same model), with
the query rows of head 1 of layer 0 and of head 3 of layer 1 scaled ×4 (their logits dominate their layers: the
expected heads are known, one on each TP rank), installs
the max-logit family through the adapter's captures (:func:`megatron_model_view`) and runs one forward on an
evaluation step.

With ``--tp 1`` it also computes the reference: a forward hook on each layer's ``linear_qkv`` keeps its output,
split into query heads and key groups as megatron-core lays them out ([s, b, G, (H/G + 2)·d]), and every causal
(query, key) pair's ``q·k / sqrt(d)`` is formed densely in float64, per head.

Rank 0 prints ``@@RESULT {"metrics": ..., "details": ..., "reference": ...}``.
"""
from __future__ import annotations

import json
import sys
import warnings
import zlib

import torch

warnings.filterwarnings("ignore")

HEADS, GROUPS, HEAD_DIM, LAYERS, SEQ, BATCH, VOCAB = 4, 2, 8, 2, 12, 2, 64
BIG_HEADS = {0: 1, 1: 3}  # layer -> the head whose query rows are scaled


def _full_value(name: str, shape: tuple) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * 0.3


def set_parameters(model, tp: int, tp_rank: int) -> None:
    """Every parameter but the norms' from its full tensor, this rank's shard (megatron's partition_dim)."""
    per_group = (HEADS // GROUPS + 2) * HEAD_DIM
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            sharded = getattr(p, "tensor_model_parallel", False)
            dim = getattr(p, "partition_dim", 0)
            shape = list(p.shape)
            if sharded:
                shape[dim] *= tp
            full = _full_value(name, tuple(shape))
            for layer, head in BIG_HEADS.items():
                if name.endswith(f"layers.{layer}.self_attention.linear_qkv.weight"):
                    # rows grouped per query group: [the group's query heads, its key, its value]
                    group, within = divmod(head, HEADS // GROUPS)
                    start = group * per_group + within * HEAD_DIM
                    full[start:start + HEAD_DIM] *= 4.0
            p.copy_(full.chunk(tp, dim=dim)[tp_rank] if sharded else full)


def reference_maxima(qkv_outputs: dict) -> dict:
    """Per layer: (max logit, head) over every causal pair, from the kept ``linear_qkv`` outputs, in float64."""
    out = {}
    per_q = HEADS // GROUPS
    for layer, mixed in qkv_outputs.items():
        s, b, _ = mixed.shape
        mixed = mixed.double().view(s, b, GROUPS, (per_q + 2) * HEAD_DIM)
        q = mixed[..., :per_q * HEAD_DIM].reshape(s, b, HEADS, HEAD_DIM)
        k = mixed[..., per_q * HEAD_DIM:(per_q + 1) * HEAD_DIM]  # [s, b, G, d]
        future = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        per_head = []
        for head in range(HEADS):
            logits = torch.einsum("sbd,tbd->bst", q[:, :, head], k[:, :, head // per_q]) * HEAD_DIM ** -0.5
            per_head.append(float(logits.masked_fill(future, -torch.inf).max()))
        best = max(range(HEADS), key=lambda h: per_head[h])
        out[layer] = {"value": per_head[best], "head": best, "per_head": per_head}
    return out


def main() -> None:
    tp = int(sys.argv[sys.argv.index("--tp") + 1])
    from megatron_mech.adapters.megatron_core import cpu_shims as mcpu

    mcpu.apply_cpu_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_mech.adapters.megatron_core.discovery import megatron_model_view
    from megatron_mech.monitors.max_logit import MaxLogitMonitor
    from megatron_mech.monitors.protocol import MonitorContext

    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    mcpu.model_parallel_seed(5)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=64, tensor_model_parallel_size=tp,
                               hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
                               pipeline_dtype=torch.float32, **mcpu.CPU_CONFIG_KWARGS)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="learned_absolute")
    set_parameters(model, tp, ps.get_tensor_model_parallel_rank())
    mcpu.fast_forward_module(model)

    kept = {}
    for module_name, module in model.named_modules():
        if module_name.endswith("self_attention.linear_qkv"):
            layer = int(module_name.split("layers.")[1].split(".")[0])
            module.register_forward_hook(lambda mod, args, output, layer=layer: kept.__setitem__(
                layer, output[0].detach().clone()))

    family = MaxLogitMonitor()
    context = MonitorContext(settings=None, families=(), any_rank=bool)  # every rank has captures: the same answer
    assert family.setup(megatron_model_view([model]), context)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    family.before_step(1, True)
    with torch.no_grad():
        model(tokens, positions, None)
    metrics, details = family.observe(1)
    result = {"metrics": metrics, "details": details, "num_layers": family.recorder.num_layers,
              "reference": reference_maxima(kept) if tp == 1 else None}
    if torch.distributed.get_rank() == 0:
        print("@@RESULT " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
