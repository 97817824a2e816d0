"""MoLS under DeepSpeed with HF models: fused-QKV attention (Phi-3, GPT-2), HF MoE experts (Qwen2-MoE),
DeepSpeed-MoE experts, the record's step convention and a window without signal. Real DeepSpeed engines (ZeRO 0,
and 3 for Phi-3) on one gloo rank under torchrun, one launch for all scenarios; each test reads its scenario's
errors (the checks and their references are in tests/workers/deepspeed_mols_worker.py)."""
from __future__ import annotations

import functools
import json

import pytest

from dist_utils import REPO_ROOT, run_torchrun
from optional_packages import requires

pytestmark = requires("deepspeed", "transformers")

WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_mols_worker.py"


@functools.lru_cache(maxsize=None)
def _results(tmp: str) -> dict:
    out = run_torchrun(WORKER, "--tmp", tmp, nproc=1, timeout=900).stdout
    assert "DEEPSPEED_MOLS_WORKER PASS" in out, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("@@RESULT "))
    return json.loads(line[len("@@RESULT "):])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return _results(str(tmp_path_factory.mktemp("deepspeed_mols")))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("scenario", ["fused_phi3", "fused_gpt2", "fused_phi3_zero3"])
def test_fused_qkv_is_measured_by_rows_and_scaled_by_the_rule(results, scenario):
    """Phi-3 qkv_proj (rule rows, ZeRO 0 and 3) and GPT-2 c_attn (rule qk): the measured Q/K and V parts equal
    the autograd reference sliced as the HF forward slices the projection; the fused group's lr after the ramp is
    base × the rule's multiplier, with α_qk ≠ 1."""
    assert results[scenario]["errors"] == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_hf_experts_get_their_multiplier_and_records_use_the_update_step(results):
    """Qwen2-MoE: the experts group's lr after the ramp = base · alpha/experts (≠ 1); at every step each group
    ran at the record's lr × its recorded multiplier (present for every group, window steps included)."""
    assert results["hf_experts"]["errors"] == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_deepspeed_moe_experts_stay_at_the_base_lr(results):
    assert results["ds_moe"]["errors"] == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1000)
def test_window_without_signal_is_reported_not_estimated_and_logged(results):
    assert results["no_signal"]["errors"] == []


def test_torch_mols_refuses_a_trainable_fused_qkv_by_name():
    """The plain-torch MoLS measures whole parameters, so a trainable fused QKV (GPT-2 c_attn) is refused by name
    rather than having its V rows measured as Q/K."""
    import transformers

    from megatron_mech.core.mols import MoLSConfig
    from megatron_mech.studies.torch_mols import TorchMoLS

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                                                 n_positions=16, bos_token_id=1, eos_token_id=1))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight is a fused Q/K/V"):
        TorchMoLS(model, MoLSConfig(window_steps=2), lr=1e-3)
    TorchMoLS(model, MoLSConfig(window_steps=2), lr=1e-3, enabled=False)  # the plain-AdamW arm needs no split


def test_fused_qkv_beside_separate_q_k_projections_is_refused_by_name():
    """One qk group multiplier cannot be both the fused rule's and α_qk: a model holding both kinds is refused,
    naming one parameter of each (checked before any engine exists)."""
    import torch
    import transformers

    from megatron_mech.adapters.deepspeed.mols_backend import MeasuredParameters

    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=1))
    assert MeasuredParameters(model).heads == (4, 2, 8)
    model.model.layers[1].self_attn.q_proj = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight.*layers\.1\.self_attn\.q_proj\.weight.*mech\.mols"):
        MeasuredParameters(model)
