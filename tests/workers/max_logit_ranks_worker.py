"""torchrun worker (2 ranks, gloo): the per-layer maximum attention logit split over ranks as TP and PP split it.

Both ranks draw the same full query/key tensors (2 layers, 4 query heads, 2 key groups). Three layouts, each
against a reference :class:`MaxLogitRecorder` that records the full tensors on every rank (identical inputs, so its
reductions change nothing):

* TP: rank r records query heads 2r, 2r+1 (key group r) of both layers, head offset 2r;
* PP: rank r records layer r only (all heads);
* a tie and a NaN: head 1 (rank 0) and head 2 (rank 1) hold the same maximum of layer 0 — the lowest global head is
  named; a NaN in head 3 (rank 1) of layer 1 makes that layer NaN, named by head 3, on both ranks.

Rank 0 prints ``MAX_LOGIT_RANKS PASS`` when every rank's results equal the reference's.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_mech.monitors.max_logit import MaxLogitRecorder

HEADS, GROUPS, LAYERS = 4, 2, 2


def full_inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {layer: (torch.randn(2, HEADS, 7, 8, generator=gen), torch.randn(2, GROUPS, 7, 8, generator=gen))
            for layer in range(LAYERS)}


def observe(record_calls, offsets) -> tuple:
    recorder = MaxLogitRecorder(LAYERS, offsets)
    recorder.capturing = True
    for layer, q, k in record_calls:
        recorder(layer, q, k, 0.3, True)
    return recorder.observe(), recorder.observe_layers()


def check(name: str, got, want) -> None:
    (g_global, (g_metrics, g_details)), (w_global, (w_metrics, w_details)) = got, want
    same = (g_metrics.keys() == w_metrics.keys() and g_details == w_details
            and all((math.isnan(g_metrics[k]) and math.isnan(w_metrics[k])) or g_metrics[k] == w_metrics[k]
                    for k in g_metrics))
    if not same:
        raise AssertionError(f"{name}: {g_metrics} {g_details} != {w_metrics} {w_details}")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inputs = full_inputs(7)
    reference = observe([(layer, q, k) for layer, (q, k) in inputs.items()], {})

    tp = observe([(layer, q[:, 2 * rank:2 * rank + 2], k[:, rank:rank + 1]) for layer, (q, k) in inputs.items()],
                 {layer: 2 * rank for layer in inputs})
    check("TP", tp, reference)
    assert {d["head"] for d in tp[1][1].values()} <= set(range(HEADS))

    q, k = inputs[rank]
    check("PP", observe([(rank, q, k)], {rank: 0}), reference)

    tied = {layer: (q.clone(), k.clone()) for layer, (q, k) in inputs.items()}
    tied[0][0][:, 2] *= 10                    # head 2 (key group 1) dominates layer 0 ...
    tied[0][0][:, 1] = tied[0][0][:, 2]       # ... and head 1 (key group 0) gets the same queries
    tied[0][1][:, 0] = tied[0][1][:, 1]       # with equal key groups: q1·k0 == q2·k1 exactly, a tie
    tied[1][0][0, 3, 4, 0] = math.nan
    want = observe([(layer, q, k) for layer, (q, k) in tied.items()], {})
    got = observe([(layer, q[:, 2 * rank:2 * rank + 2], k[:, rank:rank + 1]) for layer, (q, k) in tied.items()],
                  {layer: 2 * rank for layer in tied})
    check("tie and NaN", got, want)
    details = got[1][1]
    assert details["symptom/max_attn_logit/layer0"]["head"] == 1, details
    assert details["symptom/max_attn_logit/layer1"]["head"] == 3 and math.isnan(
        got[1][0]["symptom/max_attn_logit/layer1"]), got
    dist.barrier()
    if rank == 0:
        print("MAX_LOGIT_RANKS PASS", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
