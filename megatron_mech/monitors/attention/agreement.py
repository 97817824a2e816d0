"""The attention monitor's cross-rank agreement protocol: the ranks check, with a few tiny collectives, that they
hold matching layouts, settings and loaded state, so a disagreement raises the same error on every rank (or drops
the snapshots everywhere) instead of hanging in a later collective.

Collectives (all-reduces of ±values with MAX give the minimum and maximum of every field at once):

* Construction over ``tp_group`` (global scope, TP > 1), :func:`agree_across_tensor_parallel`: an all-reduce of a
  fixed-length header (layer and extra counts, terms, interval, buckets, a local-validation flag) and, if every rank
  agrees, an all-gather of the per-layer layout (layer index, d_model, heads, groups, head_dim, head_offset, the whole
  model's heads and groups of a replicated-K/V layer; per extra: shard_dim and size), validated identically on
  every rank.
* Construction over ``dp_group`` (data-parallel split), :func:`agree_across_replicas`: one all-reduce of counts
  and a hash of layout and settings (the split plan is computed locally from them).
* ``load_state_dict``, :func:`agree_on_snapshot_step`: one all-reduce per group (TP, then DP) of the loaded
  snapshot step.
"""
from __future__ import annotations

import warnings
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_mech.core.sharded import collective_device, gram_size
from megatron_mech.monitors.attention.layer import AttentionLayer
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig

__all__ = ["agree_across_replicas", "agree_across_tensor_parallel", "agree_on_snapshot_step",
           "process_independent_hash"]


def process_independent_hash(values: Sequence[str]) -> int:
    """Hash of a list of strings, equal in every process (Python's hash() is salted per process)."""
    return zlib.crc32("\x1f".join(values).encode())


def _min_max(fields: list[int], group, fallback: torch.device) -> tuple[list[int], list[int]]:
    """One MAX all-reduce of ``fields`` and their negatives: the minimum and the maximum of each over ``group``."""
    device = collective_device(group, fallback=fallback)
    both = torch.tensor(fields + [-v for v in fields], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: len(fields)].tolist(), [-v for v in both[len(fields):].tolist()]
    return lo, hi


def agree_across_tensor_parallel(config: AttentionMonitorConfig, layers: list[AttentionLayer], extras: list,
                                 local_error: Optional[ValueError], tp_group, tp_size: int,
                                 fallback: torch.device) -> list[int]:
    """Two collectives: agree on a fixed-length header, then all-gather the layouts and validate them identically
    on every rank (so every rank raises the same ValueError, nobody hangs later). Returns each layer's total head
    count (the heads of the whole TP group)."""
    c = config
    fields = {
        "local validation failed": int(local_error is not None),
        "number of layers": len(layers),
        "number of extra linears": len(extras),
        "extra linear names": process_independent_hash([name for name, _, _ in extras]),
        "qk_terms": process_independent_hash(list(c.qk_terms)),
        "interval": c.interval,
        "bucket_mb (elements)": -1 if c.bucket_elements is None else c.bucket_elements,
        "checkpoint_snapshots": int(c.checkpoint_snapshots),
        "dw_route / gram_max_dim / krylov": process_independent_hash([c.dw_route, str(c.gram_max_dim),
                                                                      str(c.krylov_steps), str(c.krylov_block)]),
    }
    lo, hi = _min_max(list(fields.values()), tp_group, fallback)
    if local_error is not None:
        raise local_error
    if hi[0]:
        raise ValueError("AttentionEvaluator: construction failed on another tensor-parallel rank (see its error)")
    bad = [f"{name} (min {a}, max {b})" for name, a, b in zip(fields, lo, hi) if a != b]
    if bad:
        raise ValueError("AttentionEvaluator: tensor-parallel ranks disagree on " + "; ".join(bad))

    total_heads = [lay.head_offset + lay.num_heads for lay in layers]
    desc = []
    for lay in layers:
        kv = lay.replicated_kv
        desc += [lay.layer, lay.d_model, lay.num_heads, lay.num_query_groups, lay.head_dim, lay.head_offset,
                 0 if kv is None else kv.num_heads, 0 if kv is None else kv.num_query_groups]
    for _, w, sd in extras:
        desc += [sd, gram_size(w.shape, sd)]
    if not desc:
        return total_heads
    mine = torch.tensor(desc, dtype=torch.int64, device=collective_device(tp_group, fallback=fallback))
    gathered = [torch.empty_like(mine) for _ in range(tp_size)]
    dist.all_gather(gathered, mine, group=tp_group)
    table = torch.stack(gathered).cpu().tolist()            # [tp_size][len(desc)], same on every rank

    errors = []
    width = 8
    for i in range(len(layers)):
        rows = [r[width * i: width * i + width] for r in table]
        layer_ids = {r[0] for r in rows}
        if len(layer_ids) != 1:
            errors.append(f"layers[{i}] has different layer indices across ranks: {sorted(layer_ids)}")
            continue
        name = f"layer {rows[0][0]}"
        for col, what in ((1, "d_model"), (4, "head_dim"), (6, "replicated K/V heads' num_heads"),
                          (7, "replicated K/V heads' num_query_groups")):
            vals = {r[col] for r in rows}
            if len(vals) != 1:
                errors.append(f"{name}: {what} differs across ranks: {sorted(vals)}")
        ranges = sorted((r[5], r[5] + r[2]) for r in rows)
        expected = 0
        for start, stop in ranges:
            if start != expected:
                errors.append(f"{name}: head ranges [head_offset, head_offset + num_heads) of the ranks "
                              f"{ranges} do not tile [0, total heads) (set head_offset = tp_rank·num_heads)")
                break
            expected = stop
        total_heads[i] = expected
    base = width * len(layers)
    for j, (name, _, _) in enumerate(extras):
        rows = [r[base + 2 * j: base + 2 * j + 2] for r in table]
        if len({tuple(r) for r in rows}) != 1:
            errors.append(f"extra linear {name!r}: (shard_dim, unsplit size) differs across ranks: "
                          f"{sorted({tuple(r) for r in rows})}")
    if errors:
        raise ValueError("AttentionEvaluator: inconsistent layouts across tensor-parallel ranks: " + "; ".join(errors))
    return total_heads


def agree_across_replicas(config: AttentionMonitorConfig, layers: list[AttentionLayer], extras: list,
                          error: Optional[ValueError], dp_group, fallback: torch.device) -> None:
    """One all-reduce over ``dp_group``: the replicas must hold the same layer layout and settings (the split plan
    is computed locally from them), and a failure anywhere fails everywhere (``error``: this rank's)."""
    c = config
    desc = [str(c.interval), str(c.qk_terms), c.dw_scope, str(c.bucket_elements), str(c.checkpoint_snapshots),
            c.gram_dtype, c.qk_method, c.dw_route, str(c.gram_max_dim), str(c.krylov_steps), str(c.krylov_block),
            c.eval_device, c.qk_batch]
    for lay in layers:
        desc.append(f"{lay.layer},{lay.d_model},{lay.num_heads},{lay.num_query_groups},{lay.head_dim},"
                    f"{lay.head_offset},{lay.replicated_kv}")
    desc += [f"{name},{tuple(w.shape)},{sd}" for name, w, sd in extras]
    lo, hi = _min_max([int(error is not None), len(layers), len(extras), process_independent_hash(desc)], dp_group,
                      fallback)
    if error is not None:
        raise error
    if hi[0]:
        raise ValueError("AttentionEvaluator: construction failed on another rank (see its error)")
    if hi[1:] != lo[1:]:
        raise ValueError("AttentionEvaluator: data-parallel replicas disagree on the monitored layers, extra "
                         "linears or config (layer counts min/max "
                         f"{lo[1]}/{hi[1]}, extra counts {lo[2]}/{hi[2]}); every replica must build the "
                         "monitor from the same model and flags")


def agree_on_snapshot_step(step: Optional[int], rounds: Sequence[tuple], fallback: torch.device) -> bool:
    """Whether every rank loaded the same snapshot step (``None``: no snapshots). One all-reduce per round
    ``(group, what)`` — TP, then the DP replicas, in that order on every rank; each round carries the previous
    rounds' disagreement. A disagreement warns naming ``what``."""
    mine = -1 if step is None else step
    lo, hi = mine, mine
    for group, what in rounds:
        both = torch.tensor([hi, -lo], dtype=torch.int64, device=collective_device(group, fallback=fallback))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        lo, hi = -int(both[1]), int(both[0])
        if lo != hi:
            warnings.warn(f"AttentionEvaluator: {what} loaded different snapshot steps ({lo}..{hi}); "
                          f"dropping snapshots on every rank (the next interval is skipped)", stacklevel=2)
    return lo == hi
