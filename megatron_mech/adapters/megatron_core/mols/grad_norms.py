"""Gradient-norm accounting for MoLS in megatron-core: per-key squared gradient norms, each coordinate counted once
across tensor, expert, data and pipeline parallelism.

Gradient statistics with no extra samples (``--mech-mols-estimator two_batch``, default)
--------------------------------------------------------------------------------------
Per key (module classes, plus the fused QKV row blocks ``qkv_q/k/v``; the Q and K rows of ``linear_qkv`` count
under ``qk``, its V rows under ``vo``), per window iteration:

* **big batch** = the DP-reduced gradient, read just *after* the real ``finalize_model_grads``
  (``B_big`` = global batch). With the distributed optimizer the reduced gradient is reduce-scattered: each rank
  reads only the shard it owns (from the DDP grad buffers' bucket layout) and the shard norms are summed over DP.
* **small batch**, one of two routes (chosen once, ``route="auto"``):
  - ``"dp"`` (DP > 1 for every key's data-parallel group, ``overlap_grad_reduce=False``): each rank's *local*
    gradient just *before* the real finalize (the DP reduction), ``B_small = B/DP``. The squared norms of all DP
    replicas are averaged (the mean of n small-batch norms is still unbiased, and less noisy than any one of
    them). With gradient
    accumulation and DP > 1 this route is used and the micro-batch snapshot is not taken.
  - ``"microbatch"`` (DP = 1, or ``overlap_grad_reduce=True``; needs ≥ 2 micro-batches, ≥ PP + 1 under
    pipeline parallelism, no interleaved schedule): ``wrap_forward_step`` snapshots the grad buffer when the
    forward that follows micro-batch 1's backward starts — the 2nd forward of a step; under 1F1B the stage's
    (PP − stage − 1) warm-up forwards come first, so the forward after them plus one — it then holds exactly
    micro-batch 1's gradient (÷ num_microbatches, undone here) — ``B_small`` = micro-batch size; also averaged
    over DP replicas when DP > 1.
  With ``overlap_grad_reduce=True`` the DP reduction runs during the last backward, so the local gradient is not
  observable at finalize: the micro-batch route is used; without gradient accumulation that is impossible and
  ``MegatronMoLS`` raises, suggesting ``--mech-mols-estimator samples``.
* **Parallelism.** Each rank adds the squared norms of the gradient coordinates it owns uniquely and ONE world
  all-reduce of a ~50-float vector sums them (per step, window iterations only): TP-sharded parameters
  (``tensor_model_parallel``) count on every TP rank (disjoint shards); replicated ones (norms, router, RowParallel
  biases) count once (TP rank 0; expert-TP rank 0 for expert parameters); parameters whose local gradient is a
  *partial* sum over TP before finalize (sequence-parallel norms/router/biases, qk-layernorm; megatron-core's own
  ``_allreduce_non_tensor_model_parallel_grads`` rule) have their few gradient values all-reduced over TP first
  (a copy of those small tensors, pre-finalize only); expert parameters are summed over EP ranks (disjoint
  experts); pipeline stages hold disjoint layers and join the same world all-reduce (a stage without some
  class adds zeros). A tied embedding under pipeline parallelism has two copies, the first stage's input
  embedding and the last stage's output layer (``shared_embedding``): before finalize each holds its stage's
  part of the local gradient, so the two copies are summed over the embedding group first (like the TP
  partials); after finalize both hold the whole gradient and only the first stage's counts. All squared norms
  are accumulated in float64. Dense keys are then divided by DP and expert keys by expert-DP (mean over
  replicas / replicated reduced gradient). An expert rank's local gradient sums the mean-loss gradients of the
  EP/DP ranks whose tokens it received, so its small-batch value is rescaled by ``(expert_DP/DP)²`` and
  ``B_small = B/expert_DP``.
  The loss scale (fp16) is divided out. Context parallelism and per-token loss normalisation
  (``calculate_per_token_loss``) are rejected with a clear error.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_mech.adapters.megatron_core.mols.param_groups import class_by_id
from megatron_mech.core.layouts import ReplicatedKVShard
from megatron_mech.core.mols import MEASURED_KEYS
from megatron_mech.core.taxonomy import ModuleTaxonomy, fused_qkv_blocks, is_fused_qkv

__all__ = ["GradNormReader", "KEY_INDEX", "KEYS", "NUM_KEYS"]

KEYS = MEASURED_KEYS
KEY_INDEX = {k: i for i, k in enumerate(KEYS)}
NUM_KEYS = len(KEYS)
_BLOCK_KEYS = {0: ("qk", "qkv_q"), 1: ("qk", "qkv_k"), 2: ("vo", "qkv_v")}


class _Entry:
    __slots__ = ("param", "name", "key", "fused", "labels", "expert", "counted", "tp_reduce", "stage_reduce", "owned",
                 "rows", "cols")


def _squared_norms(views: List[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norms accumulated in float64: a float32 norm of an embedding-sized gradient on CPU is visibly
    off (measured: ``docs/results/calibration.md``). torch versions whose ``_foreach_norm`` takes no ``dtype``
    take one norm per tensor."""
    try:
        norms = torch._foreach_norm(views, 2, dtype=torch.float64)
    except TypeError:
        norms = [torch.linalg.vector_norm(v, dtype=torch.float64) for v in views]
    return torch.stack(norms) ** 2


def _row_sq(grad2d: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(grad2d, dim=1, dtype=torch.float64) ** 2


def _owned_row_sq(flat: torch.Tensor, lo: int, hi: int, cols: int) -> Tuple[int, torch.Tensor]:
    """Per-row squared sums of ``flat[lo:hi]`` for a [rows, cols] tensor: (first row, sums)."""
    r0, r1 = lo // cols, (hi - 1) // cols
    out = torch.zeros(r1 - r0 + 1, dtype=torch.float64, device=flat.device)
    a = -(-lo // cols) * cols  # first full-row start ≥ lo
    b = (hi // cols) * cols    # last full-row end ≤ hi
    if a >= b:  # no full row: the slice sits inside one or two rows
        mid = min(hi, (r0 + 1) * cols)
        out[0] += flat[lo:mid].double().pow(2).sum()
        if mid < hi:
            out[-1] += flat[mid:hi].double().pow(2).sum()
        return r0, out
    if lo < a:
        out[0] += flat[lo:a].double().pow(2).sum()
    full = flat[a:b].view(-1, cols)
    out[a // cols - r0: b // cols - r0] += _row_sq(full)
    if b < hi:
        out[-1] += flat[b:hi].double().pow(2).sum()
    return r0, out


class GradNormReader:
    """Per-key contributions of this rank to the squared gradient norms (see the module docstring)."""

    def __init__(self, model_chunks, taxonomy: ModuleTaxonomy, model_config):
        from megatron.core import parallel_state as ps

        self.tp_size = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        pipelined = ps.get_pipeline_model_parallel_world_size() > 1
        first_stage = ps.is_pipeline_first_stage()
        by_id = class_by_id(taxonomy)
        cfg = model_config
        heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
        head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        h_local, g_local = heads // self.tp_size, max(1, groups // self.tp_size)
        kv_layout = (ReplicatedKVShard(heads, groups, head_dim, self.tp_size, tp_rank) if groups < self.tp_size
                     else None)
        self.entries: List[_Entry] = []
        self.device = None
        self.dist_opt = bool(getattr(model_chunks[0].ddp_config, "use_distributed_optimizer", False))
        self.shards = {False: 1, True: 1}
        etp_rank = None
        for chunk in model_chunks:
            names = {id(p): n for n, p in chunk.named_parameters()}
            buffers = [(b, False) for b in getattr(chunk, "buffers", [])]
            buffers += [(b, True) for b in getattr(chunk, "expert_parallel_buffers", [])]
            for buf, expert_buf in buffers:
                self.device = buf.grad_data.device
                if self.dist_opt:
                    self.shards[expert_buf] = buf.data_parallel_world_size
                for param in buf.params:
                    if id(param) not in by_id:
                        raise ValueError(f"parameter {names.get(id(param))!r} is not in the taxonomy")
                    tax_name, cls = by_id[id(param)]
                    e = _Entry()
                    e.param, e.name = param, tax_name
                    e.expert = not getattr(param, "allreduce", True)
                    replicated = not getattr(param, "tensor_model_parallel", False)
                    if e.expert and replicated:
                        if etp_rank is None:
                            etp_rank = ps.get_expert_tensor_parallel_rank()
                        e.counted = etp_rank == 0
                    else:
                        e.counted = (not replicated) or tp_rank == 0
                    e.tp_reduce = None
                    # a tied embedding under PP: the first stage's input embedding and the last stage's output
                    # layer are two copies of one parameter; before finalize each holds its stage's part of the
                    # gradient (summed over the embedding group here), after finalize both hold the whole sum
                    e.stage_reduce = pipelined and bool(getattr(param, "shared_embedding", False))
                    if e.stage_reduce:
                        e.counted = e.counted and first_stage
                    if self.tp_size > 1 and not e.expert:
                        if getattr(param, "average_gradients_across_tp_domain", False):
                            e.tp_reduce = "avg"
                        elif (getattr(cfg, "sequence_parallel", False) and getattr(param, "sequence_parallel", False)) \
                                or (getattr(cfg, "qk_layernorm", False)
                                    and ("q_layernorm" in tax_name or "k_layernorm" in tax_name)):
                            e.tp_reduce = "sum"
                        if e.tp_reduce is not None:
                            e.counted = tp_rank == 0
                    if e.stage_reduce and e.tp_reduce is not None:
                        raise ValueError(f"parameter {tax_name!r} is both a tied pipeline embedding and a "
                                         "tensor-parallel partial sum: MoLS cannot count it")
                    e.fused = cls == "qk" and is_fused_qkv(tax_name)
                    e.key = KEY_INDEX[cls]
                    e.rows = param.shape[0]
                    e.cols = int(param.numel() // max(1, param.shape[0])) if param.dim() else 1
                    e.labels = None
                    if e.fused and groups < self.tp_size:
                        # a plain row range of the whole weight (megatron-core replicates K/V heads): Q rows,
                        # then K rows, then V rows, as ReplicatedKVShard says
                        n_q, n_k = (hi - lo for lo, hi in (kv_layout.q_rows_held(tp_rank),
                                                           kv_layout.k_rows_held(tp_rank)))
                        labels = torch.full((e.rows,), 2, dtype=torch.long)
                        labels[:n_q], labels[n_q:n_q + n_k] = 0, 1
                        e.labels = labels.to(buf.grad_data.device)
                    elif e.fused:
                        # the row layout of weight and bias alike: split the row indices as a 1-D "bias"
                        blocks = fused_qkv_blocks(tax_name, torch.arange(e.rows, dtype=torch.float64), h_local,
                                                  g_local, head_dim)
                        labels = torch.empty(e.rows, dtype=torch.long)
                        for lab, blk in enumerate(("q", "k", "v")):
                            labels[blocks[blk].reshape(-1).long()] = lab
                        e.labels = labels.to(buf.grad_data.device)
                    start, end, bucket_id = buf.param_index_map[param]
                    e.owned = (0, end - start)
                    if self.dist_opt:
                        bucket = buf.buckets[bucket_id]
                        shard = bucket.grad_data.numel() // buf.data_parallel_world_size
                        r = buf.data_parallel_group.rank()
                        lo_b = bucket.offset + r * shard
                        lo, hi = max(start, lo_b) - start, min(end, lo_b + shard) - start
                        e.owned = (lo, hi) if hi > lo else (0, 0)
                    self.entries.append(e)
        if self.device is None:
            raise ValueError("no DDP grad buffers found: wrap the model chunks in megatron-core's "
                             "DistributedDataParallel before building MegatronMoLS")
        self.sp_entries = [e for e in self.entries if e.tp_reduce is not None]
        self.stage_entries = [e for e in self.entries if e.stage_reduce]
        self.embedding_group = ps.get_embedding_group() if self.stage_entries else None

    # -- presence: param counts per class and per key, dense/expert (local; summed over the world by the caller)
    def presence(self) -> torch.Tensor:
        """[2 + 2, NK]: rows 0/1 = dense/expert entry counts per key; row 2 = fused-QKV count (col 0); row 3 =
        param counts per class of the taxonomy (first len(MODULE_CLASSES) columns)."""
        out = torch.zeros(4, NUM_KEYS, dtype=torch.float64)
        for e in self.entries:
            if e.fused:
                for lab in range(3):
                    for k in _BLOCK_KEYS[lab]:
                        out[int(e.expert), KEY_INDEX[k]] += 1
                out[2, 0] += 1
            else:
                out[int(e.expert), e.key] += 1
            out[3, e.key] += 1
        return out

    def _grad(self, e: _Entry) -> torch.Tensor:
        return e.param.main_grad

    def _add_fused(self, out: torch.Tensor, e: _Entry, grad: torch.Tensor, owned: bool) -> None:
        row = int(e.expert)
        if owned and self.dist_opt:
            lo, hi = e.owned
            if hi <= lo:
                return
            r0, sq = _owned_row_sq(grad.view(-1), lo, hi, e.cols)
            labels = e.labels[r0:r0 + sq.numel()]
        else:
            sq = _row_sq(grad.view(e.rows, -1))
            labels = e.labels
        blocks = torch.zeros(3, dtype=torch.float64, device=sq.device).index_add_(0, labels, sq)
        for lab in range(3):
            for k in _BLOCK_KEYS[lab]:
                out[row, KEY_INDEX[k]] += blocks[lab]

    def local(self, mode: str) -> Tuple[torch.Tensor, Optional[Tuple[Optional[torch.Tensor], ...]]]:
        """``mode="pre"``: the full local gradient (before the DP reduction); entries whose local gradient is a
        partial sum — SP-partial over TP, a tied embedding over the pipeline stages — are not counted but copied
        (``partial``, for :meth:`add_partials`); ``mode="post"``: the reduced gradient (the owned shard with the
        distributed optimizer; ``partial`` is ``None``). Returns ([2, NK] float64 contributions, partial)."""
        out = torch.zeros(2, NUM_KEYS, dtype=torch.float64, device=self.device)
        views, rows, keys = [], [], []
        for e in self.entries:
            if mode == "pre" and (e.tp_reduce is not None or e.stage_reduce):
                continue
            if not e.counted:
                continue
            grad = self._grad(e)
            if e.fused:
                self._add_fused(out, e, grad, owned=(mode == "post"))
                continue
            if mode == "post" and self.dist_opt:
                lo, hi = e.owned
                if hi <= lo:
                    continue
                views.append(grad.view(-1)[lo:hi])
            else:
                views.append(grad.view(-1))
            rows.append(int(e.expert))
            keys.append(e.key)
        if views:
            norms = _squared_norms(views)
            idx = torch.tensor(rows, device=self.device) * NUM_KEYS + torch.tensor(keys, device=self.device)
            out.view(-1).index_add_(0, idx, norms)
        if mode != "pre":
            return out, None
        return out, tuple(torch.cat([self._grad(e).detach().reshape(-1).double() for e in entries])
                          if entries else None for entries in (self.sp_entries, self.stage_entries))

    def zero_partials(self) -> Tuple[Optional[torch.Tensor], ...]:
        """Zero copies shaped like ``local("pre")``'s partials (a rank that joins the collectives without data)."""
        return tuple(torch.zeros(sum(e.param.numel() for e in entries), dtype=torch.float64, device=self.device)
                     if entries else None for entries in (self.sp_entries, self.stage_entries))

    def add_partials(self, out: torch.Tensor, partials: Tuple[Optional[torch.Tensor], ...]) -> torch.Tensor:
        """``out`` plus the contributions of the partial-sum copies, each summed over its group first (TP for
        SP-partial entries, then the embedding group for tied pipeline embeddings; the same calls on every rank
        of a group, which holds the same entries)."""
        sp, stage = partials
        out = out.clone()
        for entries, copy, group in ((self.sp_entries, sp, self.tp_group),
                                     (self.stage_entries, stage, self.embedding_group)):
            if copy is None:
                continue
            summed = copy.clone()
            torch.distributed.all_reduce(summed, group=group)
            off = 0
            for e in entries:
                n = e.param.numel()
                seg = summed[off:off + n]
                off += n
                if not e.counted:
                    continue
                if e.tp_reduce == "avg":
                    seg = seg / self.tp_size
                out[int(e.expert), e.key] += seg.pow(2).sum()
        return out

    def vectors(self) -> Dict[str, torch.Tensor]:
        """Per key: this rank's counted coordinates of the (fully reduced) gradient as one flat float64 copy
        (the sample estimator; fused QKV blocks split with taxonomy.fused_qkv_blocks row labels)."""
        parts: Dict[str, List[torch.Tensor]] = {}
        for e in self.entries:
            if not e.counted:
                continue
            grad = self._grad(e).detach().double()
            if e.fused:
                g2 = grad.view(e.rows, -1)
                for lab in range(3):
                    block = g2[e.labels == lab].reshape(-1)
                    for k in _BLOCK_KEYS[lab]:
                        parts.setdefault(k, []).append(block)
            else:
                parts.setdefault(KEYS[e.key], []).append(grad.reshape(-1))
        return {k: torch.cat(v) for k, v in parts.items()}
