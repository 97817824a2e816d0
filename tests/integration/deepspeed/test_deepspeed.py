"""The DeepSpeed adapter: real DeepSpeed engines (ZeRO 0–3, MoE ep_size=2) on 2 gloo ranks under torchrun, each
check against an independent reference (see tests/workers/deepspeed_worker.py), plus single-process checks of
the config section, the HF discovery and the layout conversions."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from dist_utils import REPO_ROOT, run_torchrun
from optional_packages import requires
from run_summaries import assert_summary_schema

pytestmark = requires("deepspeed", "transformers")

WORKER = REPO_ROOT / "tests" / "workers" / "deepspeed_worker.py"


def run_worker(scenario: str, stages: str, *extra: str, timeout: float = 400) -> dict:
    out = run_torchrun(WORKER, "--scenario", scenario, "--stages", stages, *extra, timeout=timeout).stdout
    assert "DEEPSPEED_WORKER PASS" in out, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("@@RESULT "))
    return json.loads(line[len("@@RESULT "):])


# ------------------------------------------------------------------------------------------------ torchrun
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_attention_metrics_equal_full_weight_reference_zero_1_2_3():
    """ZeRO 1 and 2 read the replicated weights, ZeRO 3 gathers them: all equal the dense computation from
    safe_get_full_fp32_param; an unknown mech key fails before training, naming it."""
    result = run_worker("attention", "1,2,3")
    assert all(result[s]["checked"] > 0 for s in ("1", "2", "3"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_router_stats_equal_single_process_moe_ep2_zero_1_2_and_mixtral_zero_3():
    result = run_worker("router", "1,2,3")
    assert all(result[s]["checked"] > 0 for s in ("1", "2", "3"))


@functools.lru_cache(maxsize=None)
def _mols(stages: str) -> dict:
    return run_worker("mols", stages, timeout=600)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(700)
def test_mols_lr_is_base_times_multiplier_every_scheduler_zero_0_to_3():
    """Every group's lr = the scheduler's own lr × multiplier at every step (checked in the worker), for none,
    WarmupLR, WarmupDecayLR, WarmupCosineLR and a client scheduler at ZeRO 0-3; the measured α do not depend on
    the ZeRO stage (ZeRO 0 is plain data parallelism: the reference)."""
    result = _mols("0,1,2,3")
    reference = result["0"]["alphas"]
    for stage in ("1", "2", "3"):
        for kind, alphas in result[stage]["alphas"].items():
            for cls, alpha in alphas.items():
                assert math.isclose(alpha, reference[kind][cls], rel_tol=1e-5), (stage, kind, cls, alpha,
                                                                                 reference[kind][cls])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_mols_gradient_statistics_equal_autograd_reference_with_accumulation():
    """Gradient accumulation 2 at ZeRO 0, 2 and 3: MoLS's small-batch (micro-batch) and big-batch (reduced)
    squared norms per module class equal plain-autograd references on an untouched copy of the model."""
    result = run_worker("mols_stats", "0,2,3")
    assert all(result[s]["classes"] >= 5 for s in ("0", "2", "3"))
    # bf16 training (the reference stays fp32: bf16 rounding of weights and activations, hence 5 %)
    assert run_worker("mols_stats", "2", "--precision", "bf16", "--rtol", "0.05")["2"]["classes"] >= 5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_save_and_load_continue_identically_zero_2_3(tmp_path):
    run_worker("resume", "2,3", "--tmp", str(tmp_path))
    lines = (tmp_path / "zero2" / "b" / "mech.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [4, 6]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_attention_fault_in_hf_model_raises_attention_alert():
    result = run_worker("fault", "1")
    assert result["1"]["fault"] is not None


# ------------------------------------------------------------------------------------------------ single process
def test_config_rejects_unknown_keys_by_name():
    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section

    for section, where, key in (({"intervall": 3}, "mech", "intervall"),
                                ({"mols": {"windw": 2}}, "mech.mols", "windw"),
                                ({"monitors": {"intervall": 2}}, "mech.monitors", "intervall"),
                                ({"deepspeed": {"layot": "auto"}}, "mech.deepspeed", "layot")):
        with pytest.raises(ValueError, match=where.replace(".", r"\.")) as info:
            parse_section(section)
        assert key in str(info.value)


@pytest.mark.parametrize("section, field", [({"monitors": {"interval": 0}}, "interval"),
                                            ({"monitors": {"qk_terms": ["delta4"]}}, "delta4"),
                                            ({"mols": {"clamp": [3.0, 2.0]}}, "clamp"),
                                            ({"detector": {"baseline": 1}}, "baseline"),
                                            ({"deepspeed": {"engine_monitor": "yes"}}, "mech.deepspeed.engine_monitor"),
                                            ({"monitors": {"all_linears": True}}, "mech.monitors.all_linears")])
def test_config_rejects_bad_values_naming_the_field(section, field):
    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_section(section)


def test_config_is_the_hook_config_plus_deepspeed_options():
    from megatron_mech.config import MechConfig
    from megatron_mech.adapters.deepspeed.ds_config_section import parse_section, read_section

    config, options = parse_section({"monitors": {"interval": 5}, "mols": {"enabled": True, "window": 3},
                                     "deepspeed": {"engine_monitor": False}})
    assert isinstance(config, MechConfig) and config.monitors.interval == 5 and config.mols.window == 3
    assert options.engine_monitor is False and options.attention_layout == "auto"
    assert parse_section(None)[0] == MechConfig()
    assert read_section({"train_batch_size": 4, "mech": {"on_alert": "stop"}}) == {"on_alert": "stop"}


def test_grouped_and_concatenated_layouts_round_trip():
    from megatron_mech.core.layouts import concatenated_qkv_blocks, grouped_qkv_from_blocks, qkv_row_blocks

    H, G, dh, d = 6, 2, 3, 5
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * dh, d, generator=gen, dtype=torch.float64) for n in (H, G, G))
    grouped = grouped_qkv_from_blocks(q, k, v, H, G, dh)
    # independent reference: build the Megatron grouping row by row
    rows, per = [], H // G
    for g in range(G):
        rows += [q[(g * per + j) * dh:(g * per + j + 1) * dh] for j in range(per)]
        rows += [k[g * dh:(g + 1) * dh], v[g * dh:(g + 1) * dh]]
    assert torch.equal(grouped, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(qkv_row_blocks(grouped, H, G, dh), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(concatenated_qkv_blocks(torch.cat([q, k, v]), H, G, dh), (q, k, v)))
    assert not qkv_row_blocks(grouped_qkv_from_blocks(q, k, None, H, G, dh), H, G, dh)[2].any()
    with pytest.raises(ValueError, match="k_rows"):
        grouped_qkv_from_blocks(q, k[:-1], v, H, G, dh)


def test_hf_discovery_llama_mixtral_qwen2_and_phi3():
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from megatron_mech.core.layouts import qkv_row_blocks
    from megatron_mech.adapters.deepspeed.attention import find_hf_attention
    from megatron_mech.adapters.deepspeed.models import dense_llama, mixtral
    from megatron_mech.adapters.deepspeed.router_capture import find_gates

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    models = {"llama": dense_llama(vocab_size=64), "mixtral": mixtral(vocab_size=64),
              "qwen2": Qwen2ForCausalLM(Qwen2Config(**small)), "phi3": Phi3ForCausalLM(Phi3Config(**small))}
    for name, model in models.items():
        found = find_hf_attention(model)
        assert [a.layer for a in found] == [0, 1], name
        for a in found:
            a.refresh()
            H, G, dh = a.geometry.num_heads, a.geometry.num_kv_heads, a.geometry.head_dim
            assert (H, G, dh) == (4, 2, 8), name
            q_rows, k_rows, v_rows = qkv_row_blocks(a.buffer, H, G, dh)
            attn = model.get_submodule(a.name.rsplit(".qkv_proj", 1)[0])
            if a.layout == "separate":
                want_q, want_k = attn.q_proj.weight, attn.k_proj.weight
            else:  # Phi-3: [Q | K | V] rows, as its forward slices them
                assert name == "phi3" and a.layout == "concatenated"
                w = attn.qkv_proj.weight
                want_q, want_k = w[:H * dh], w[H * dh:(H + G) * dh]
            assert torch.equal(q_rows, want_q.detach()) and torch.equal(k_rows, want_k.detach()), name
            assert not v_rows.any()
    gates = find_gates(models["mixtral"])
    assert [(g.layer, g.kind, g.topk, g.num_experts) for g in gates] == [(0, "hf", 2, 4), (1, "hf", 2, 4)]
    assert find_gates(models["llama"]) == []


def test_hf_router_capture_equals_the_logits_mixtral_uses():
    """The forward hook hands the router monitor exactly the logits HF Mixtral computes (single process)."""
    from megatron_mech.core.router_statistics import RoutingStats
    from megatron_mech.adapters.deepspeed.models import mixtral
    from megatron_mech.adapters.deepspeed.router_capture import find_gates, gate_capture
    from megatron_mech.monitors.router import RouterLayer, RouterEvaluator

    model = mixtral(vocab_size=64)
    gates = find_gates(model)
    monitor = RouterEvaluator([RouterLayer(g.layer, g.weight, g.topk) for g in gates])
    for g in gates:
        gate_capture(g)(lambda logits, layer=g.layer: monitor.record(layer, logits))
        gate_capture(g)(lambda logits: pytest.fail("a second capture must not install a second hook"))
    seen = {}
    for g in gates:  # the independent reference: recompute from the gate's own input
        g.module.register_forward_pre_hook(lambda m, a, layer=g.layer: seen.setdefault(layer, []).append(
            torch.nn.functional.linear(a[0].reshape(-1, m.weight.shape[1]), m.weight).detach()))
    monitor.capturing = True
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids)
    metrics, _ = monitor.observe(1)
    for g in gates:
        ref = RoutingStats(4, 20)
        ref.update(torch.cat(seen[g.layer]), 2)
        for key, value in ref.summary().items():
            assert math.isclose(metrics[f"router/layer{g.layer}/{key}"], value, rel_tol=1e-12, abs_tol=1e-15), key
        g.handle.remove()


# ------------------------------------------------------------------------------------------------ the guide
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_guide_deepspeed_script_runs_as_written(tmp_path):
    """The DeepSpeed guide's own-script example (docs/guides/deepspeed.md) is complete: extracted verbatim and run as ``python train.py`` (one CPU
    process), it trains with MoLS, writes every evaluation to mech.jsonl and saves a checkpoint; ``mech.close()``
    gives the script the run's summary and writes it beside mech.jsonl in the one schema (MoLS's time apart from the
    monitors', the script's steps untimed)."""
    import os
    import subprocess
    import sys

    from dist_utils import free_port

    (tmp_path / "train.py").write_text(_guide_script())
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=360)
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "ds" / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    assert any(r.get("mols") for r in records)  # MoLS measured (gradient accumulation 2 on one rank)
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step20"
    _, summary = assert_summary_schema(tmp_path / "runs" / "ds" / "summary.json", trainer_keys=())
    assert summary.final_step == 20 and summary.first_step == 1 and len(summary.losses) == 20
    assert summary.losses[-1] == pytest.approx(records[-1]["loss"], rel=1e-6)
    assert summary.mols_seconds > 0 and summary.final_mols and summary.step_seconds is None
    assert summary.verdict in run.stdout  # what close() returned to the script is what it wrote


def _guide_script() -> str:
    guide = (REPO_ROOT / "docs" / "guides" / "deepspeed.md").read_text()
    start = guide.index("```python\n", guide.index("## Training with DeepSpeed")) + len("```python\n")
    return guide[start:guide.index("```", start)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_guide_deepspeed_script_exits_cleanly_on_two_ranks_every_time(tmp_path):
    """The guide's example, verbatim under ``torchrun --nproc_per_node=2`` (gloo), three times: every run exits 0.
    A gloo process group still alive when Python exits can abort the process (its worker thread releases the last
    collective's tensors while the interpreter is shutting down: ``terminate called without an active
    exception``), so ``mech.close()`` destroys the groups it created and the example ends by destroying its own."""
    import os
    import subprocess
    import sys

    from dist_utils import free_port

    script = _guide_script()
    for attempt in range(3):
        work = tmp_path / f"run{attempt}"
        work.mkdir()
        (work / "train.py").write_text(script)
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              f"--master_port={free_port()}", "train.py"], cwd=work, env=env, text=True,
                             capture_output=True, timeout=170)
        assert run.returncode == 0 and "terminate called" not in run.stderr, (attempt, run.stderr[-4000:])
        assert (work / "ckpt" / "latest").read_text().strip() == "global_step20"
        steps = [json.loads(line)["step"] for line in (work / "runs" / "ds" / "mech.jsonl").read_text().splitlines()]
        assert steps == [5, 10, 15, 20], steps


# ------------------------------------------------------------------------------------------------ a user's console
USER_SCRIPT = '''
import logging
import sys

import deepspeed
import torch

from megatron_mech.adapters.deepspeed.cpu import single_process_env, skip_shm_comm_build
from megatron_mech.adapters.deepspeed.engine import DeepSpeedMech
from megatron_mech.adapters.deepspeed.models import dense_llama

if len(sys.argv) > 1:  # a script that sets up its own logging
    logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
T, NAN_AT = 6, 3
ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
             "zero_optimization": {"stage": 0},
             "mech": {"monitors": {"interval": 2}, "output": {"dir": "runs/ds"}}}
single_process_env()
skip_shm_comm_build()
deepspeed.init_distributed(dist_backend="gloo")
model = dense_llama(vocab_size=256, hidden=16, layers=2, heads=2, kv_heads=1, ffn=32, seq_len=17)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
mech = DeepSpeedMech.from_engine(engine, train_steps=T)
for step in range(T):
    mech.before_step()
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    mech.after_step(torch.full_like(loss, float("nan")) if engine.global_steps == NAN_AT else loss)
mech.close()
'''
# the layer trend on the per-head Δ2 entropies: the rule's warm-up 30 + a window of 10 evaluations, every 2 steps
LAYER_TREND = "attn/*/head*/delta2_entropy: a layer's median fall >= 1.5 log units over 10 evaluations"
# the max-logit level armed from the first evaluation (step 2); the update-ratio jump after the trend's warm-up and
# window, at the next evaluation (step 82)
START_LINE = ("[mech] monitors on: 2 attention layers, max attention logit, every 2 steps, reading the model's float32 "
              "weights (the optimizer's own); detectors armed from step 106 (warm-up 30 + baseline 20 + persistence 3 "
              "evaluations); level rules armed from the first evaluation (step 2): symptom/max_attn_logit/layer* > 100; "
              f"layer trend armed from step 80: {LAYER_TREND}; "
              "update-ratio jump armed from step 82: every layer's update ratio, in median, >= 0.693 log units above "
              "its own last 10 evaluations")


def _run_user_script(tmp_path, *args):
    import os
    import subprocess
    import sys

    from dist_utils import free_port

    (tmp_path / "train.py").write_text(USER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "train.py", *args], cwd=tmp_path, env=env, text=True, capture_output=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "ds" / "mech.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["alerts"]] == [3]  # the NaN loss, recorded at its own step
    return run


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_without_logging_set_up_shows_the_start_line_and_alerts(tmp_path):
    """A user's own DeepSpeed script that sets up no logging: the start line (once, with the model's attention
    layers, the interval and the armed-from step) and the NaN loss's alert reach the console (stderr)."""
    run = _run_user_script(tmp_path)
    lines = (run.stdout + run.stderr).splitlines()
    assert [line for line in lines if line.startswith("[mech] monitors on:")] == [START_LINE], run.stderr[-4000:]
    assert [line for line in lines if line.startswith("[mech] ALERT step 3:")], run.stderr[-4000:]
    assert not [line for line in lines if line.startswith("[mech] ALERT") and "step 3:" not in line]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_script_with_its_own_logging_gets_the_lines_there_and_nothing_added(tmp_path):
    """A script that configured logging itself (``logging.basicConfig`` to a file) gets the start line and the
    alert in its file, and nothing of megatron-mech's on the console: no handler is added next to its own."""
    log = tmp_path / "train.log"
    run = _run_user_script(tmp_path, str(log))
    assert "[mech]" not in run.stdout + run.stderr, run.stderr[-4000:]
    lines = log.read_text().splitlines()
    assert [line for line in lines if "[mech] monitors on:" in line] == [f"INFO:megatron_mech:{START_LINE}"]
    assert [line for line in lines if "[mech] ALERT step 3:" in line], lines


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_summary_and_end_of_run_line_state_the_armed_from_step_of_a_short_run(tmp_path):
    """A run that ends before the detectors are armed says so: summary.json holds the armed-from step
    ((30 warm-up + 20 baseline + 3 persistence) evaluations × interval 2 = 106) and that only non-finite values
    could alert, and the hook's end-of-run line on the console says the same."""
    import os
    import subprocess
    import sys

    from dist_utils import free_port

    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-m", "megatron_mech.trainers.deepspeed.train", "--steps", "4",
                          "--mech-interval", "2", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                          "--seq-len", "16", "--micro-batch", "2", "--warmup", "0", "--output-dir", str(tmp_path)],
                         env=env, cwd=REPO_ROOT, text=True, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    note = ("run ended at step 4, before the detectors were armed (step 106): only non-finite values and the level "
            "rules could alert; level rules (symptom/max_attn_logit/layer* > 100) armed from step 2")
    summary = json.loads((tmp_path / "summary.json").read_text())
    # no --mech-detector-* setting: the default rules, nothing to override (the report rebuilds the rules from it)
    assert summary["detectors"] == {"armed_from_step": 106, "last_step": 4, "armed": False, "note": note,
                                    "rule_overrides": {},
                                    "level_rules": {"armed_from_step": 2,
                                                    "rules": ["symptom/max_attn_logit/layer* > 100"]},
                                    "layer_trends": [{"rule": LAYER_TREND, "armed_from_step": 80}],
                                    "update_ratio_jump": {"armed_from_step": 82, "level": math.log(2)}}
    # not "No alerts fired." alone: the run never reached its baseline-relative rules
    assert summary["diagnosis"] is None and summary["verdict"].startswith(
        "No alerts fired, and the detectors never armed: the run ended at step 4, the first baseline-relative rule "
        "arms at step 106")
    assert [line for line in run.stderr.splitlines() if line.endswith(f"[mech] {note}")], run.stderr[-4000:]
    # the one summary schema, the launcher's own fields under "trainer"
    raw, read = assert_summary_schema(tmp_path / "summary.json",
                                      trainer_keys={"model", "zero_stage", "world", "steps", "stopped_by_signal"})
    assert read.trainer == {"model": "llama", "zero_stage": 2, "world": 1, "steps": 4, "stopped_by_signal": None}
    assert read.final_step == 4 and len(read.step_seconds) == 4 and len(read.losses) == 4
