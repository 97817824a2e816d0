"""Run a patched Megatron-LM fork's ``pretrain_gpt.py`` (under torchrun) and write, per rank, what the call sites
handed the hook and what they cost::

    torchrun --nproc_per_node=2 tests/lm_loss_probe.py <fork>/pretrain_gpt.py <its flags>

Environment: ``MECH_PROBE_OUT`` (required) — the folder for ``rank<r>.json``; ``MECH_PROBE_NAN_STEP`` (optional) —
the step whose loss the last pipeline stage hands the call site as NaN (its micro-batches' loss sums), as a loss
that blew up there would; the training itself is unchanged.

Each ``rank<r>.json``: ``losses`` (the hook's loss of every step), ``loss_kinds`` (per step: ``tensor`` or
``float``, as :meth:`MechHook.after_optimizer_step` received it), ``callsite_all_reduces`` (per step: the
``torch.distributed.all_reduce`` calls made from ``megatron_mech.adapters.megatron_lm_fork.callsites``), ``actions`` (per
step: the :class:`~megatron_mech.hook.Action` the call site returned), ``first_alert_step`` and
``alert_steps`` (the steps of the alerts the hook raised).
"""
import json
import math
import os
import runpy
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
if (CHECKOUT / "megatron_mech" / "__init__.py").is_file():
    sys.path.insert(0, str(CHECKOUT))

import torch  # noqa: E402

from megatron_mech import hook as hook_module  # noqa: E402
from megatron_mech.adapters.megatron_lm_fork import callsites  # noqa: E402

OUT = Path(os.environ["MECH_PROBE_OUT"])
NAN_STEP = int(os.environ.get("MECH_PROBE_NAN_STEP", "0"))
PROBE = {"step": 0, "loss_kinds": {}, "callsite_all_reduces": {}, "actions": {}, "alert_steps": []}


def _wrap_before_step(before_step):
    def probed(iteration):
        PROBE["step"] = int(iteration) + 1
        return before_step(iteration)

    return probed


def _wrap_all_reduce(all_reduce):
    def probed(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == callsites.__name__:
            counts = PROBE["callsite_all_reduces"]
            counts[PROBE["step"]] = counts.get(PROBE["step"], 0) + 1
        return all_reduce(*args, **kwargs)

    return probed


def _wrap_hook_step(after_optimizer_step):
    def probed(self, step, *, loss, **kwargs):
        PROBE["loss_kinds"][int(step)] = "tensor" if isinstance(loss, torch.Tensor) else "float"
        return after_optimizer_step(self, step, loss=loss, **kwargs)

    return probed


def _wrap_callsite_step(after_optimizer_step):
    def probed(model, optimizer, iteration, losses_reduced, update_successful, grad_norm):
        if int(iteration) + 1 == NAN_STEP and losses_reduced:  # entries exist on the last stage only
            key = next(iter(losses_reduced[0]))
            blown = []
            for entry in losses_reduced:
                value = entry[key].detach().clone()
                value.view(-1)[0] = math.nan  # the loss (sum); the token count stays
                blown.append({**entry, key: value})
            losses_reduced = blown
        action = after_optimizer_step(model, optimizer, iteration, losses_reduced, update_successful, grad_norm)
        PROBE["actions"][int(iteration) + 1] = action.name
        return action

    return probed


def _write() -> None:
    hook = callsites.RUN.hook
    record = {"losses": list(hook.losses), "first_alert_step": hook.first_alert_step,
              "alert_steps": PROBE["alert_steps"],
              **{key: {str(k): v for k, v in PROBE[key].items()}
                 for key in ("loss_kinds", "callsite_all_reduces", "actions")}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    callsites.before_step = _wrap_before_step(callsites.before_step)
    callsites.after_optimizer_step = _wrap_callsite_step(callsites.after_optimizer_step)
    torch.distributed.all_reduce = _wrap_all_reduce(torch.distributed.all_reduce)
    hook_module.MechHook.after_optimizer_step = _wrap_hook_step(hook_module.MechHook.after_optimizer_step)
    original_get_hook = callsites.get_hook

    def get_hook():
        created = callsites.RUN.hook is None
        hook = original_get_hook()
        if created:
            hook.alert_callbacks.append(lambda step, alerts: PROBE["alert_steps"].append(int(step)))
        return hook

    callsites.get_hook = get_hook
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:  # also when the fork ends the run with sys.exit
        _write()


if __name__ == "__main__":
    main()
