"""torchrun worker: the real training entry point, then each rank's optimizer param groups saved.

Usage: ``torchrun ... mols_groups_worker.py OUT_DIR <pretrain_gpt flags>``. At the end of training (before the
final validation) each rank writes ``OUT_DIR/groups_rank{r}.json`` = [{"class", "lr", "max_lr", "min_lr",
"params"}, ...] for every non-empty param group, so a test can check the lr MoLS left in each group against
the multipliers the run recorded.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_mech.trainers.megatron_core import pretrain_gpt  # noqa: E402
from megatron_mech.adapters.megatron_core.mols.param_groups import TAG  # noqa: E402
from megatron_mech.optim import param_groups  # noqa: E402

out_dir = Path(sys.argv[1])
original_finish = pretrain_gpt.finish


def finish(args, t, runtime, run, output_dir):
    groups = [{"class": g.get(TAG), "lr": g["lr"], "max_lr": g.get("max_lr"), "min_lr": g.get("min_lr"),
               "params": sum(p.numel() for p in g["params"])} for g in param_groups(t.optimizer) if g["params"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"groups_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(groups))
    return original_finish(args, t, runtime, run, output_dir)


pretrain_gpt.finish = finish
pretrain_gpt.main(sys.argv[2:])
