"""The diagnosis matrix's scoring (``benchmarks/diagnosis_matrix.py``): a real DeepSpeed fault run's records replayed
through today's detectors give the alerts, causes and first diagnosis the run recorded live; the matrix counts each
regime's diagnoses with their seeds; an incumbent that rings on the same seed's clean run is marked, not counted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import diagnosis_matrix as M
from dist_utils import REPO_ROOT, free_port
from megatron_mech.core.diagnosis import first_diagnosis
from megatron_mech.records.jsonl_file import read_jsonl, record_alerts
from optional_packages import requires


@pytest.mark.slow
@requires("deepspeed", "transformers")
def test_a_runs_records_replayed_give_the_alerts_and_diagnosis_it_recorded_live(tmp_path):
    # the study launcher's short attention-fault run (emulated FA2 backward, γ 0.3, in layer 1 from step 20, short
    # detector baselines): its alerts come from the live registry, with the causes stamped when they fired
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, "-m", "megatron_mech.studies.deepspeed_fault_train", "--fault-start", "20",
                          "--steps", "60", "--warmup", "5", "--mech-interval", "2", "--hidden", "16", "--layers", "2", "--heads", "2",
                          "--kv-heads", "1", "--seq-len", "16", "--micro-batch", "2", "--output-dir", str(out)],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    live = [a for record in read_jsonl(out / "mech.jsonl") for a in record_alerts(record)]
    assert live, "the fault run alerted nothing: nothing to compare"
    overrides = json.loads((out / "summary.json").read_text())["detectors"]["rule_overrides"]
    replayed = M.replayed_alerts(read_jsonl(out / "mech.jsonl"), overrides)

    def key(alerts):
        return [(a.step, a.metric, a.detail.get("cause"), a.detail.get("layer")) for a in alerts]

    assert key(replayed) == key(live)
    assert first_diagnosis(replayed).to_dict() == first_diagnosis(live).to_dict()


def _row(regime, seed, diagnosis, first_step=None, incumbents=None, **extra):
    return {"path": "deepspeed", "regime": regime, "seed": seed, "diagnosis": diagnosis, "onset": M.REGIMES[regime].onset,
            "expected": M.REGIMES[regime].expected or M.NO_ALERT, "live": {"diagnosis": diagnosis},
            "first_alert": None if first_step is None else {"step": first_step}, "incumbents": incumbents or {},
            **extra}


def test_the_matrix_counts_diagnoses_per_regime_with_their_seeds_and_marks_incumbents_that_ring_on_clean():
    rows = [_row("router", 21, "router", 270, {"OLMo grad-norm spike": 276, "ZClip grad-norm z-score": 265}),
            _row("router", 22, "data", 268, {"OLMo grad-norm spike": 268}),
            _row("router", 23, "router", 280, {}),
            _row("clean", 21, M.NO_ALERT, incumbents={"ZClip grad-norm z-score": 26},
                 incumbent_firings={"ZClip grad-norm z-score": [26, 300], "OLMo grad-norm spike": []})]
    assert M.confusion(rows) == {"router": {"router": [21, 23], "data": [22]}, "clean": {M.NO_ALERT: [21]}}
    # ZClip rang on seed 21's clean run after the router fault's onset (300 >= 260): marked, and not counted
    lead = M._lead(rows[0], rows[3])
    assert lead.startswith("first alert 270 (router), before every counted incumbent")
    assert "ZClip grad-norm z-score 265 (rings on the clean run)" in lead
    assert M._lead(rows[1], None).startswith("first alert 268 (data), tied with the first counted incumbent")
    text = M.report(rows, tuning=False, seeds_note="note")
    assert "| router (router) |" in text and "**2 (s21, s23)**" in text and "1 (s22)" in text
    assert "Diagonal: 3 of 4 runs." in text
