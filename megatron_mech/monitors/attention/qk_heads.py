"""Per-head QK-increment entropies of the attention monitor, written into each layer's ``[terms × heads]`` block of
the reduce buffer.

With the Gram method the per-head cores of a bucket's layers wait and are solved together (grouped as ``qk_batch``
says; at most ~256 MiB of pending cores). QK spectra need no communication when each TP rank holds whole query
groups (heads with their K). With replicated K/V heads (fewer query groups than TP ranks,
:class:`~megatron_mech.core.layouts.ReplicatedKVShard`) a rank's query heads and their K head are stored on other
ranks: each evaluated layer adds ONE ``all_to_all`` over ``tp_group`` (before its bucket's all-reduce) that hands
each rank the current and snapshot rows of the heads it attends with and of their K head,
``(H/TP + 1)·d_head·2·d_model`` values received per rank.
"""
from __future__ import annotations

import torch

from megatron_mech.core.sharded import all_to_all_rows
from megatron_mech.core.spectral import (
    qk_increment_cores,
    qk_increment_spectra,
    spectra_from_qk_cores,
    spectral_entropy,
)
from megatron_mech.monitors.attention.layer import AttentionLayer
from megatron_mech.monitors.attention.settings import AttentionMonitorConfig

__all__ = ["HeadEntropies"]

# Pending QK cores (2·T·H·(2·d_head)² values per layer: 50 MiB in float32 for 32 heads and 3 terms) are solved
# as soon as they exceed this, so batching across layers never holds more than ~this much extra memory.
_QK_BATCH_BYTES = 256 * 2 ** 20


class HeadEntropies:
    """The per-head entropies of one bucket's layers: :meth:`start_bucket`, :meth:`fill` per layer, then
    :meth:`flush` before the bucket is reduced."""

    def __init__(self, config: AttentionMonitorConfig, tp_group, tp_size: int) -> None:
        self.config = config
        self.tp_group = tp_group
        self.tp_size = tp_size
        self._pending: list = []               # Gram-method cores of the bucket, solved together

    def start_bucket(self) -> None:
        self._pending = []                     # only this bucket's cores (never a failed one's)

    def fill(self, lay: AttentionLayer, q_cur, k_cur, q_prev, k_prev, target: torch.Tensor,
             dt: torch.dtype) -> None:
        """Layer ``lay``'s entropies of this rank's heads into ``target`` ``[terms × num_heads]``: from its current
        and snapshot Q/K rows (every row this rank stores, ``[rows, d_model]``, head order) on the evaluation
        device, in ``dt``."""
        d_model, dh = lay.d_model, lay.head_dim
        if lay.replicated_kv is not None:
            q_cur, k_cur, q_prev, k_prev = self._rows_attended_with(lay, q_cur, k_cur, q_prev, k_prev, dt)
            wq, wk = q_cur.view(lay.num_heads, dh, d_model).transpose(1, 2), k_cur.view(1, dh, d_model).transpose(1, 2)
        else:
            wq = q_cur.view(lay.num_heads, dh, d_model).transpose(1, 2)
            wk = k_cur.view(lay.num_query_groups, dh, d_model).transpose(1, 2)
        wq_prev = q_prev.view(lay.num_heads, dh, d_model).transpose(1, 2)
        wk_prev = k_prev.view(lay.num_query_groups, dh, d_model).transpose(1, 2)
        self._solve(wq_prev, wk_prev, wq, wk, target, dt)

    def fill_range(self, q_cur, k_cur, q_prev, k_prev, head_dim: int, target: torch.Tensor, dt: torch.dtype) -> None:
        """The entropies of a range of heads into ``target`` ``[terms × heads]``: their current and snapshot Q rows
        ``[heads·d_head, d_model]`` and the rows of the K heads they attend with (the heads of the range share
        those K heads evenly, as whole query groups or part of one do)."""
        d_model = q_cur.shape[1]
        views = [t.reshape(-1, head_dim, d_model).transpose(1, 2) for t in (q_prev, k_prev, q_cur, k_cur)]
        self._solve(*views, target, dt)

    def _solve(self, wq_prev, wk_prev, wq, wk, target: torch.Tensor, dt: torch.dtype) -> None:
        terms = self.config.qk_terms
        if self.config.qk_method == "gram":   # the cores wait for the rest of the bucket: one eigenproblem batch
            self._pending.append((qk_increment_cores(wq_prev, wk_prev, wq, wk, terms=terms, gram_dtype=dt), target))
            held = sum(c.grams_a.numel() * c.grams_a.element_size() * 2 for c, _ in self._pending)
            if held > _QK_BATCH_BYTES:
                self.flush()
            return
        spectra = qk_increment_spectra(wq_prev, wk_prev, wq, wk, terms=terms, method=self.config.qk_method)
        self._write(spectra, target)

    def flush(self) -> None:
        """Solve the pending cores, grouped as ``qk_batch`` says, into their blocks."""
        if not self._pending:
            return
        jobs, self._pending = self._pending, []
        for (_, target), spectra in zip(jobs, spectra_from_qk_cores([c for c, _ in jobs], batch=self.config.qk_batch)):
            self._write(spectra, target)

    def _write(self, spectra, target: torch.Tensor) -> None:
        ent = torch.stack([spectral_entropy(getattr(spectra, t), power=self.config.entropy_power)
                           for t in self.config.qk_terms])
        target.copy_(ent)

    def _rows_attended_with(self, lay: AttentionLayer, q_cur, k_cur, q_prev, k_prev, dt: torch.dtype):
        """Replicated K/V heads: the current and snapshot Q rows of the heads this rank attends with and the rows
        of their K head, gathered from the ranks that store them — ONE all-to-all over ``tp_group``, each row
        sent once to each rank that attends with it (``(H/TP + 1)·d_head`` rows of ``2·d_model`` values)."""
        kv = lay.replicated_kv
        q_both = torch.cat([q_cur.to(dt), q_prev.to(dt)], dim=1)
        k_both = torch.cat([k_cur.to(dt), k_prev.to(dt)], dim=1)
        sends, recv_rows = [], []
        for rank in range(self.tp_size):
            (q_lo, q_hi), (k_lo, k_hi) = kv.sends(rank)
            sends.append(torch.cat([q_both[q_lo:q_hi], k_both[k_lo:k_hi]]))
            (q_lo, q_hi), (k_lo, k_hi) = kv.receives(rank)
            recv_rows.append(q_hi - q_lo + k_hi - k_lo)
        q_used = torch.empty(kv.heads_per_rank * kv.head_dim, q_both.shape[1], dtype=q_both.dtype,
                             device=q_both.device)
        k_used = torch.empty(kv.head_dim, k_both.shape[1], dtype=k_both.dtype, device=k_both.device)
        for rank, block in enumerate(all_to_all_rows(sends, recv_rows, self.tp_group)):
            (q_lo, q_hi), (k_lo, k_hi) = kv.receives(rank)
            q_used[q_lo:q_hi] = block[:q_hi - q_lo]
            k_used[k_lo:k_hi] = block[q_hi - q_lo:]
        d_model = lay.d_model
        return q_used[:, :d_model], k_used[:, :d_model], q_used[:, d_model:], k_used[:, d_model:]
