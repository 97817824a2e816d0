"""benchmarks/router_collapse.py's per-rule scoring on hand-written runs: every rule judged against the routing
collapse step on the fault run, and as a false alarm (or quiet) on the clean run."""
import json

from benchmarks import router_collapse
from run_summaries import write_summary_file

STEPS, START = 200, 100
BALANCED, STARVED = [256, 256, 256, 256], [500, 500, 16, 8]  # 16 and 8 of 1024: < 2%


def _write_run(run_dir, grad_norm, starved_from=None):
    run_dir.mkdir(parents=True)
    losses = [3.0] * STEPS
    write_summary_file(run_dir / "summary.json", first_step=1, final_step=STEPS, losses=losses)
    (run_dir / "mech.jsonl").write_text("".join(json.dumps({
        "step": s, "loss": 3.0, "metrics": {"symptom/max_attn_logit": 10.0, "symptom/grad_norm": grad_norm(s)},
        "alerts": []}) + "\n" for s in range(5, STEPS + 1, 5)))
    (run_dir / "routing.jsonl").write_text("".join(json.dumps({"step": s, "counts": {
        "0": BALANCED, "1": STARVED if starved_from and s >= starved_from else BALANCED}}) + "\n"
        for s in range(1, STEPS + 1)))


def test_every_rule_is_judged_against_the_collapse_and_on_the_clean_run(tmp_path):
    # Fault run: layer 1's experts 2 and 3 starve from step 120 to the end (the collapse step: 120); the grad norm
    # jumps from 1 to 30 at step 130 (over the level 20: 10 steps after the collapse). Clean run: balanced, grad
    # norm 1 but 25 at step 50 (a false alarm of the level 20). Loss and max logit flat: the other rules stay quiet.
    _write_run(tmp_path / "router", lambda s: 1.0 if s < 130 else 30.0, starved_from=120)
    _write_run(tmp_path / "clean", lambda s: 25.0 if s == 50 else 1.0)
    row = router_collapse.score(21, tmp_path, START)
    assert row["collapse"] == {"step": 120, "layer": 1, "expert": 2} and row["clean_collapse"] is None
    cells = {rule: router_collapse.rule_cell(j, START) for rule, j in row["judged"].items()}
    clean_cells = {rule: router_collapse.rule_cell(j, START) for rule, j in row["clean_judged"].items()}
    assert cells["grad norm > 20"] == "130 (-10)" and cells["max logit > 100 (QK-clip)"] == "miss"
    assert cells["router monitor"] == "miss" and cells["Megatron spiky loss"] == "miss"
    assert clean_cells["grad norm > 20"] == "FA@50" and clean_cells["router monitor"] == "·"
    table = router_collapse.rules_table([row])
    assert table[2].startswith("| 21 | router fault | 120 | ") and table[3].startswith("| 21 | clean | none | ")
    assert "| 130 (-10) |" in table[2] and "| FA@50 |" in table[3]


def test_a_first_firing_before_the_fault_is_shown_as_such():
    # A rule that first fired at step 55 of a run whose fault starts at 100 and that collapsed at 120.
    before = {"kind": "early", "lead": 65, "fraction": 65 / 120, "fired": 55}
    assert router_collapse.rule_cell(before, START) == "55 (before the fault)"
    assert router_collapse.rule_cell({**before, "lead": 10, "fired": 110}, START) == "110 (+10)"
