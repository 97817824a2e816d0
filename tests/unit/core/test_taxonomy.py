"""megatron_mech.core.taxonomy: parameter name -> module class.

The megatron-core checks build real tiny GPTModels (dense GQA + qkv bias + qk-layernorm, tied, MoE with shared
experts) in ONE subprocess (CPU shims are process-wide; the pytest process stays unpatched) and assert every
real parameter name against tables written from megatron-core's module structure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from megatron_mech.core import layouts
from megatron_mech.core.taxonomy import (
    FUSED_QKV_BLOCK_CLASS,
    MODULE_CLASSES,
    ModuleTaxonomy,
    UnknownParameterWarning,
    classify,
    classify_parameters,
    fused_qkv_blocks,
    fused_qkv_multiplier,
    is_fused_qkv,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# ------------------------------------------------------------------------------------ real megatron-core names
_BUILD = r"""
import json, socket, sys, warnings
warnings.filterwarnings("ignore")
import torch
from megatron_mech.adapters.megatron_core import cpu_shims as mcpu
mcpu.apply_cpu_shims()
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
ps.initialize_model_parallel()
mcpu.model_parallel_seed(1)
out = {}
for variant, moe, tie, ddp in (("dense", False, False, True), ("dense_tied", False, True, False),
                               ("moe", True, False, False)):
    extra = (dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_grouped_gemm=False,
                  add_bias_linear=False, moe_shared_expert_intermediate_size=16) if moe
             else dict(add_qkv_bias=True))
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=64, qk_layernorm=True, params_dtype=torch.float32,
                            **mcpu.CPU_CONFIG_KWARGS, **extra)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
                         num_experts=4 if moe else None, qk_layernorm=True),
                     vocab_size=64, max_sequence_length=16, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=tie)
    if ddp:
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    out[variant] = [[n, list(p.shape), id(p)] for n, p in model.named_parameters(remove_duplicate=False)]
print("@@PARAMS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def megatron_params():
    pytest.importorskip("megatron.core")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@PARAMS ")]
    assert proc.returncode == 0 and lines, f"model build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("@@PARAMS "):])


# Written from megatron-core 0.16.1's module structure (GPTModel -> LanguageModelEmbedding, TransformerBlock
# of TransformerLayer(input_layernorm, SelfAttention(linear_qkv, q/k_layernorm, linear_proj), pre_mlp_layernorm,
# MLP(linear_fc1, linear_fc2) | MoELayer(router, SequentialMLP.local_experts, SharedExpertMLP)), final_layernorm,
# output_layer), local (non-TE) layer spec, LayerNorm (weight + bias).
_EMB = {"embedding.word_embeddings.weight": "embedding", "embedding.position_embeddings.weight": "embedding"}
_ATTN = {
    "input_layernorm.weight": "norm", "input_layernorm.bias": "norm",
    "self_attention.linear_qkv.weight": "qk",
    "self_attention.q_layernorm.weight": "norm", "self_attention.q_layernorm.bias": "norm",
    "self_attention.k_layernorm.weight": "norm", "self_attention.k_layernorm.bias": "norm",
    "self_attention.linear_proj.weight": "vo",
    "pre_mlp_layernorm.weight": "norm", "pre_mlp_layernorm.bias": "norm",
}
_DENSE_LAYER = {**_ATTN, "self_attention.linear_qkv.bias": "qk", "self_attention.linear_proj.bias": "vo",
                "mlp.linear_fc1.weight": "mlp", "mlp.linear_fc1.bias": "mlp",
                "mlp.linear_fc2.weight": "mlp", "mlp.linear_fc2.bias": "mlp"}
_MOE_LAYER = {**_ATTN, "mlp.router.weight": "router",
              **{f"mlp.experts.local_experts.{e}.linear_fc{k}.weight": "experts" for e in range(4) for k in (1, 2)},
              "mlp.shared_experts.linear_fc1.weight": "mlp", "mlp.shared_experts.linear_fc2.weight": "mlp"}
_FINAL = {"decoder.final_layernorm.weight": "norm", "decoder.final_layernorm.bias": "norm"}
_HEAD = {"output_layer.weight": "head"}


def _table(layer: dict, head: bool, prefix: str = "") -> dict:
    t = dict(_EMB)
    for i in range(2):
        t.update({f"decoder.layers.{i}.{k}": v for k, v in layer.items()})
    t.update(_FINAL)
    if head:
        t.update(_HEAD)
    return {prefix + k: v for k, v in t.items()}


EXPECTED = {
    "dense": _table(_DENSE_LAYER, head=True, prefix="module."),  # built inside megatron's DDP wrapper
    "dense_tied": _table(_DENSE_LAYER, head=False),  # PP=1 tied: output_layer allocates no weight
    "moe": _table(_MOE_LAYER, head=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(EXPECTED))
def test_real_megatron_names(megatron_params, variant):
    params = megatron_params[variant]
    names = [n for n, _, _ in params]
    assert set(names) == set(EXPECTED[variant]) and len(names) == len(set(names))
    got = {n: classify(n) for n in names}
    assert got == EXPECTED[variant]
    # Float16Module inside DDP adds `module.module.`; the class does not depend on the wrapper prefix
    assert {n: classify("module.module." + n) for n in names} == EXPECTED[variant]
    tensors = {pid: torch.empty(0) for _, _, pid in params}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unknown names -> no warning
        tax = classify_parameters([(n, tensors[pid]) for n, _, pid in params])
    assert dict(tax) == EXPECTED[variant] and tax.unknown == () and "other" not in tax.classes_present()
    assert tax.fused_qkv == tuple(n for n in names if n.endswith(("linear_qkv.weight", "linear_qkv.bias")))
    assert tax.tied_embedding is False


@pytest.mark.slow
def test_real_megatron_fused_qkv_blocks(megatron_params):
    """The real linear_qkv shape (H=4, G=2, d_head=8) splits into Q/K/V rows as layouts says."""
    shapes = {n: s for n, s, _ in megatron_params["dense"]}
    w_name = "module.decoder.layers.0.self_attention.linear_qkv.weight"
    b_name = "module.decoder.layers.0.self_attention.linear_qkv.bias"
    assert shapes[w_name] == [(4 + 2 * 2) * 8, 32] and shapes[b_name] == [(4 + 2 * 2) * 8]
    w, b = torch.randn(shapes[w_name]), torch.randn(shapes[b_name])
    blocks = fused_qkv_blocks(w_name, w, 4, 2, 8)
    ref = layouts.qkv_row_blocks(w, 4, 2, 8)
    for key, r in zip("qkv", ref):
        assert torch.equal(blocks[key], r)
    bias_blocks = fused_qkv_blocks(b_name, b, 4, 2, 8)
    ref_b = layouts.qkv_row_blocks(b.unsqueeze(-1), 4, 2, 8)
    assert {k: v.shape for k, v in bias_blocks.items()} == {"q": (32,), "k": (16,), "v": (16,)}
    for key, r in zip("qkv", ref_b):
        assert torch.equal(bias_blocks[key], r.squeeze(-1))


# ------------------------------------------------------------------------------------------- literal name lists
MEGATRON_EXTRA = [  # names the CPU build above does not produce (TE spec, grouped GEMM, MLA, MTP, legacy)
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "norm"),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "norm"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "norm"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", "experts"),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight3", "experts"),
    ("decoder.layers.0.mlp.experts.weight1", "experts"),
    ("decoder.layers.0.mlp.experts.weight2", "experts"),
    ("decoder.layers.0.mlp.router.bias", "router"),
    ("decoder.layers.0.mlp.shared_experts.gate_weight", "mlp"),
    ("decoder.layers.0.self_attention.linear_q_proj.weight", "qk"),
    ("decoder.layers.0.self_attention.linear_q_down_proj.weight", "qk"),
    ("decoder.layers.0.self_attention.linear_kv_up_proj.weight", "qk"),
    ("decoder.layers.0.self_attention.kv_layernorm.weight", "norm"),
    ("mtp.layers.0.enorm.weight", "norm"),
    ("module.module.output_layer.weight", "head"),
    # legacy Megatron-LM / Megatron-DeepSpeed
    ("language_model.embedding.word_embeddings.weight", "embedding"),
    ("language_model.encoder.layers.0.self_attention.query_key_value.weight", "qk"),
    ("language_model.encoder.layers.0.self_attention.dense.weight", "vo"),
    ("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", "mlp"),
    ("language_model.encoder.layers.0.mlp.dense_4h_to_h.bias", "mlp"),
    ("language_model.encoder.final_layernorm.weight", "norm"),
    ("language_model.output_layer.weight", "head"),
]

HF_LLAMA = [
    ("model.embed_tokens.weight", "embedding"),
    ("model.layers.0.self_attn.q_proj.weight", "qk"),
    ("model.layers.0.self_attn.k_proj.weight", "qk"),
    ("model.layers.0.self_attn.q_proj.bias", "qk"),  # Qwen2 attention biases
    ("model.layers.0.self_attn.v_proj.weight", "vo"),
    ("model.layers.0.self_attn.o_proj.weight", "vo"),
    ("model.layers.0.self_attn.q_norm.weight", "norm"),  # Qwen3
    ("model.layers.0.mlp.gate_proj.weight", "mlp"),
    ("model.layers.0.mlp.up_proj.weight", "mlp"),
    ("model.layers.0.mlp.down_proj.weight", "mlp"),
    ("model.layers.0.input_layernorm.weight", "norm"),
    ("model.layers.0.post_attention_layernorm.weight", "norm"),
    ("model.norm.weight", "norm"),
    ("lm_head.weight", "head"),
]

HF_MOE = [
    ("model.layers.1.block_sparse_moe.gate.weight", "router"),
    ("model.layers.1.block_sparse_moe.experts.0.w1.weight", "experts"),
    ("model.layers.1.block_sparse_moe.experts.7.w2.weight", "experts"),
    ("model.layers.1.block_sparse_moe.experts.7.w3.weight", "experts"),
    ("model.layers.1.mlp.gate.weight", "router"),  # Qwen-MoE / DeepSeek HF
    ("model.layers.1.mlp.experts.3.gate_proj.weight", "experts"),
    ("model.layers.1.mlp.shared_expert.up_proj.weight", "mlp"),
    ("model.layers.1.mlp.shared_expert_gate.weight", "mlp"),
]

DEEPSPEED = [
    ("module.language_model.encoder.layers.1.mlp.deepspeed_moe.gate.wg.weight", "router"),
    ("module.language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.0.dense_h_to_4h.weight",
     "experts"),
    ("module.language_model.encoder.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.dense_4h_to_h.bias",
     "experts"),
]

PEFT = [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "qk"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", "qk"),
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "qk"),
    ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight", "vo"),
    ("base_model.model.model.layers.0.self_attn.o_proj.lora_magnitude_vector.default.weight", "vo"),
    ("base_model.model.model.layers.0.mlp.down_proj.lora_B.my_adapter.weight", "mlp"),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", "embedding"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "head"),
    ("base_model.model.model.layers.1.block_sparse_moe.experts.0.w1.lora_A.default.weight", "experts"),
    ("module.decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", "qk"),
]


@pytest.mark.parametrize("name,expected", MEGATRON_EXTRA + HF_LLAMA + HF_MOE + DEEPSPEED + PEFT)
def test_literal_names(name, expected):
    assert classify(name) == expected
    assert classify("module." + name) == expected


def test_unknown_names_and_one_warning():
    names = ["model.layers.0.self_attn.rotary.freqs", "decoder.layers.0.mlp.coefficient", "weird_thing"]
    params = [(n, torch.nn.Parameter(torch.zeros(2))) for n in names]
    params.insert(1, ("model.layers.0.self_attn.q_proj.weight", torch.nn.Parameter(torch.zeros(2))))
    assert all(classify(n) == "other" for n in names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tax = classify_parameters(params)
    ours = [w for w in caught if issubclass(w.category, UnknownParameterWarning)]
    assert len(ours) == 1 and len(caught) == 1
    msg = str(ours[0].message)
    assert all(n in msg for n in names) and "q_proj" not in msg
    assert tax.unknown == tuple(names) and tax.params_of("other") == names
    assert tax.class_of("model.layers.0.self_attn.q_proj.weight") == "qk"


def test_extra_rules_precede_builtin():
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert classify(name) == "mlp"
    assert classify(name, extra_rules=[(r"layers\.0\.mlp", "experts")]) == "experts"
    assert classify(name, extra_rules=[(r"nomatch", "head"), (re.compile(r"fc1"), "vo"), (r"fc", "qk")]) == "vo"
    assert classify("my_fork.special_attn.wq", extra_rules=[(r"special_attn\.w[qk]$", "qk")]) == "qk"
    tax = classify_parameters([("custom.proj_q", torch.zeros(1))], extra_rules=[(r"proj_q$", "qk")])
    assert dict(tax) == {"custom.proj_q": "qk"} and tax.unknown == ()
    with pytest.raises(ValueError, match="unknown module class 'attn'"):
        classify(name, extra_rules=[(r"fc1", "attn")])
    with pytest.raises(ValueError, match="pair"):
        classify(name, extra_rules=["fc1"])


# ------------------------------------------------------------------------------------------------ tied embedding
class _TinyLM(torch.nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(10, 4)
        self.model.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


def test_tied_embeddings_classified_once():
    model = _TinyLM(tie=True)
    tax = classify_parameters(model)  # a module: named_parameters(remove_duplicate=False)
    assert dict(tax) == {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm",
                         "model.norm.bias": "norm"}
    assert tax.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tax.class_of("lm_head.weight") == "embedding" and tax.tied_embedding
    assert tax.params_of("head") == [] and "head" not in tax.classes_present()
    assert tax.tensors_of("embedding")[0] is model.lm_head.weight
    # the same through the pairs, with the head listed first: still one parameter, class embedding
    pairs = list(model.named_parameters(remove_duplicate=False))[::-1]
    tax2 = classify_parameters(pairs)
    assert dict(tax2) == {"lm_head.weight": "embedding", "model.norm.bias": "norm", "model.norm.weight": "norm"}
    assert tax2.aliases == {"model.embed_tokens.weight": "lm_head.weight"}
    # default named_parameters() drops the duplicate name: the tensor is still classified once, as embedding
    assert dict(classify_parameters(model.named_parameters())) == dict(tax)
    with pytest.raises(ValueError, match="tied_embedding=False"):
        classify_parameters(model, tied_embedding=False)


def test_untied_and_forced_tie():
    model = _TinyLM(tie=False)
    tax = classify_parameters(model)
    assert tax.class_of("lm_head.weight") == "head" and not tax.aliases and not tax.tied_embedding
    assert classify_parameters(model, tied_embedding=False).class_of("lm_head.weight") == "head"
    forced = classify_parameters(model, tied_embedding=True)
    assert forced.class_of("lm_head.weight") == "embedding" and forced.tied_embedding


def test_megatron_pipeline_tied_copy():
    """Last pipeline stage: a separate output_layer.weight copy marked shared_embedding=True -> embedding."""
    w = torch.nn.Parameter(torch.zeros(10, 4))
    w.shared_embedding = True
    last_stage = [("module.decoder.final_layernorm.weight", torch.nn.Parameter(torch.ones(4))),
                  ("module.output_layer.weight", w)]
    tax = classify_parameters(last_stage)
    assert tax.class_of("module.output_layer.weight") == "embedding" and tax.tied_embedding
    with pytest.raises(ValueError, match="shared_embedding"):
        classify_parameters(last_stage, tied_embedding=False)


# ------------------------------------------------------------------------------------------------ fused QKV
def test_is_fused_qkv():
    assert is_fused_qkv("module.decoder.layers.3.self_attention.linear_qkv.weight")
    assert is_fused_qkv("decoder.layers.3.self_attention.linear_qkv.bias")
    assert is_fused_qkv("language_model.encoder.layers.0.self_attention.query_key_value.weight")
    assert is_fused_qkv("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight")
    assert not is_fused_qkv("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    assert not is_fused_qkv("model.layers.0.self_attn.q_proj.weight")
    assert not is_fused_qkv("decoder.layers.0.self_attention.linear_proj.weight")
    assert FUSED_QKV_BLOCK_CLASS == {"q": "qk", "k": "qk", "v": "vo"}


@pytest.mark.parametrize("h,g,d,dm", [(4, 4, 3, 5), (8, 2, 4, 6), (6, 1, 2, 3)])
def test_fused_qkv_blocks_equal_layouts(h, g, d, dm):
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    w = torch.randn((h + 2 * g) * d, dm)
    blocks = fused_qkv_blocks(name, w, h, g, d)
    for key, ref in zip("qkv", layouts.qkv_row_blocks(w, h, g, d)):
        assert torch.equal(blocks[key], ref)
    # the three blocks partition the parameter's coordinates: squared norms add up
    total = sum(b.pow(2).sum() for b in blocks.values())
    assert torch.allclose(total, w.pow(2).sum())


def test_fused_qkv_blocks_errors():
    w = torch.randn(8 * 4, 6)
    with pytest.raises(ValueError, match="not a fused QKV"):
        fused_qkv_blocks("decoder.layers.0.mlp.linear_fc1.weight", w, 4, 2, 4)
    with pytest.raises(ValueError, match="rows"):
        fused_qkv_blocks("decoder.layers.0.self_attention.linear_qkv.weight", w, 4, 1, 4)
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        fused_qkv_blocks("decoder.layers.0.self_attention.linear_qkv.weight", w.view(2, 16, 6), 4, 2, 4)


def test_fused_qkv_multiplier():
    # MHA: Q and K rows are 2/3 of the parameter, V rows 1/3
    assert fused_qkv_multiplier(8.0, 1.0, 4, 4) == pytest.approx(8.0 ** (2 / 3))
    # GQA H=32, G=8: (H+G)/(H+2G) = 40/48
    assert fused_qkv_multiplier(2.0, 0.5, 32, 8) == pytest.approx(2.0 ** (40 / 48) * 0.5 ** (8 / 48))
    # only the H/G ratio matters (global or per-TP-partition counts agree)
    assert fused_qkv_multiplier(3.0, 1.5, 32, 8) == pytest.approx(fused_qkv_multiplier(3.0, 1.5, 8, 2))
    assert fused_qkv_multiplier(1.7, 1.7, 8, 2) == pytest.approx(1.7)
    assert fused_qkv_multiplier(3.0, 1.5, 8, 2, rule="qk") == 3.0
    assert fused_qkv_multiplier(3.0, 1.5, 8, 2, rule="vo") == 1.5
    # the row rule lies between the extremes
    assert 1.5 < fused_qkv_multiplier(3.0, 1.5, 8, 2) < 3.0
    with pytest.raises(ValueError, match="rule"):
        fused_qkv_multiplier(1.0, 1.0, 4, 4, rule="mean")
    with pytest.raises(ValueError, match="alpha_qk"):
        fused_qkv_multiplier(0.0, 1.0, 4, 4)
    with pytest.raises(ValueError, match="alpha_vo"):
        fused_qkv_multiplier(1.0, float("nan"), 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        fused_qkv_multiplier(1.0, 1.0, 4, 3)


# ------------------------------------------------------------------------------------------ ModuleTaxonomy API
def test_require_class_and_accessors():
    model = _TinyLM(tie=False)
    tax = classify_parameters(model)
    assert isinstance(tax, ModuleTaxonomy) and len(tax) == 4
    assert tax.classes_present() == ("embedding", "head", "norm")
    assert tax.counts() == {"embedding": 1, "head": 1, "norm": 2}
    assert tax.require_class("norm") == ["model.norm.weight", "model.norm.bias"]
    with pytest.raises(ValueError, match=r"unknown module class 'foo'; expected one of embedding, qk, vo"):
        tax.require_class("foo")
    with pytest.raises(ValueError, match=r"module class 'router' has no parameters in this model; present: "
                                         r"embedding, head, norm"):
        tax.require_class("router")
    with pytest.raises(ValueError, match="unknown module class"):
        tax.params_of("attention")
    with pytest.raises(KeyError, match="not in this taxonomy"):
        tax.class_of("nope")
    assert set(MODULE_CLASSES) >= set(tax.values())


def test_duplicate_name_rejected():
    p = torch.zeros(1)
    with pytest.raises(ValueError, match="appears twice"):
        classify_parameters([("model.norm.weight", p), ("model.norm.weight", torch.zeros(1))])


# ------------------------------------------------------------------------------------------------ HF fused QKV
def _tiny_hf_models() -> dict:
    """Tiny GPT-2 (Conv1D c_attn, [in, out]), Phi-3 (qkv_proj, GQA) and MPT (Wqkv) built from configs (no
    download): H = 4 query heads, G = 2 KV heads for Phi-3 (GPT-2 / MPT are MHA), d_head = 8."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                     n_positions=16, bos_token_id=1,
                                                                     eos_token_id=1)),
        "phi3": transformers.Phi3ForCausalLM(transformers.Phi3Config(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=1)),
        "mpt": transformers.MptForCausalLM(transformers.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                                                                  max_seq_len=16)),
    }


def test_hf_fused_qkv_models_are_classified_as_the_attention_discovery_finds_them():
    """GPT-2 c_attn, Phi-3 qkv_proj and MPT Wqkv are fused QKV (class qk) for MoLS, exactly the layers the
    attention monitors' discovery reads; GPT-2's attn.c_proj / MPT's attn.out_proj are V/O and GPT-2's mlp.c_fc /
    mlp.c_proj dense MLP: no parameter of these models is left 'other'."""
    from megatron_mech.adapters.deepspeed.attention import find_hf_attention

    for kind, model in _tiny_hf_models().items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnknownParameterWarning)
            tax = classify_parameters(model)
        assert not tax.unknown, kind
        discovered = {a.name for a in find_hf_attention(model)}
        fused_modules = {n.rsplit(".", 1)[0] for n in tax.fused_qkv}
        assert fused_modules == discovered and len(discovered) == 2, (kind, fused_modules, discovered)
        assert all(tax[n] == "qk" for n in tax.fused_qkv), kind
        assert not [n for n, c in tax.items() if c == "qk" and n not in tax.fused_qkv], kind
    assert classify("transformer.h.0.attn.c_proj.weight") == "vo"
    assert classify("transformer.blocks.0.attn.out_proj.weight") == "vo"
    assert classify("transformer.h.0.mlp.c_fc.bias") == classify("transformer.h.0.mlp.c_proj.weight") == "mlp"


def test_hf_fused_qkv_blocks_are_the_projections_the_forward_uses():
    """fused_qkv_blocks of the real GPT-2 / Phi-3 / MPT fused weights give the Q, K and V rows the models' own
    forward slices out of the fused projection (reference: the module's output split as HF does it)."""
    models = _tiny_hf_models()
    x = torch.randn(5, 32, dtype=torch.float64)
    cases = {"gpt2": ("transformer.h.1.attn.c_attn", 4, 4), "phi3": ("model.layers.1.self_attn.qkv_proj", 4, 2),
             "mpt": ("transformer.blocks.1.attn.Wqkv", 4, 4)}
    for kind, (module_name, h, g) in cases.items():
        module = models[kind].get_submodule(module_name).double()
        out = module(x).detach()
        # GPT-2: query, key, value = c_attn(x).split(embed_dim, dim=2); Phi-3 / MPT: [Q | K | V] by head counts
        q_ref, k_ref, v_ref = out.split([h * 8, g * 8, g * 8], dim=-1)
        blocks = fused_qkv_blocks(f"{module_name}.weight", module.weight.detach(), h, g, 8)
        bias = getattr(module, "bias", None)
        bias_blocks = fused_qkv_blocks(f"{module_name}.bias", bias.detach(), h, g, 8) if bias is not None else None
        for key, ref in zip("qkv", (q_ref, k_ref, v_ref)):
            got = x @ blocks[key].t() + (bias_blocks[key] if bias_blocks is not None else 0.0)
            assert torch.allclose(got, ref, rtol=0, atol=1e-12), (kind, key)  # float64 matmuls of 32 terms
    with pytest.raises(ValueError, match="c_attn.*stored \\[in, out\\]"):
        fused_qkv_blocks("transformer.h.0.attn.c_attn.weight", torch.zeros(96, 32), 4, 4, 8)
