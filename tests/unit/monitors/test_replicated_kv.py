"""Fewer query groups than tensor-parallel ranks (megatron-core replicates the K/V heads across ranks).

(a) Single process, pure math: the whole model's fused ``linear_qkv`` at TP=1 is split into TP row ranges as
megatron-core's ColumnParallel ``linear_qkv`` does; which query heads and which K head each rank attends with is
read off a transcription of megatron-core's ``get_query_key_value_tensors`` (all-gather the QKV activations,
take group ``r // (TP/G)``, then its query slice ``r % (TP/G)``) applied to the weight rows. The package's
route — :class:`ReplicatedKVShard` rows, the sends/receives of the monitor's all-to-all, summed shard Grams —
must give the dense TP=1 values: ΔW_q / ΔW_k spectra from an SVD of the whole matrices (each K row counted
once) and every head's Δ1/Δ2/Δ3 spectrum from :func:`qk_increment_spectra_dense` (its H×d_model² products).
(b) ``workers/replicated_kv_worker.py`` under torchrun (TP=2, gloo, one query group): the monitor and the
megatron-core discovery against TP=1.
"""
from __future__ import annotations


import pytest
import torch

from dist_utils import WORKERS, run_torchrun
from megatron_mech.core.layouts import ReplicatedKVShard, fuse_qkv
from megatron_mech.core.sharded import shard_gram, spectrum_from_shard_grams
from megatron_mech.core.spectral import QK_TERMS, matrix_spectrum, qk_increment_spectra, qk_increment_spectra_dense

WORKER = WORKERS / "replicated_kv_worker.py"
EPS64 = torch.finfo(torch.float64).eps

# (H, G, TP, d_head): shard boundaries on head boundaries, and (TP=8, d_head=4: 5 rows per rank) inside heads,
# where a rank stores parts of two heads and a K head is split over two ranks.
LAYOUTS = [(4, 1, 2, 3), (2, 1, 2, 4), (4, 2, 4, 2), (8, 1, 8, 4), (8, 2, 8, 2)]


def megatron_rows_attended(full: torch.Tensor, H: int, G: int, TP: int, d: int, rank: int):
    """Rows of the whole fused weight that rank ``rank``'s query heads and K head come from, following
    megatron-core 0.16.1 ``Attention.get_query_key_value_tensors`` for ``num_query_groups < world_size`` (the
    activation columns of ``X Wᵀ`` are the weight's rows)."""
    idx = rank // (TP // G)
    size = full.shape[0] // G
    block = full[idx * size:(idx + 1) * size]                         # "q1 q2 k1 v1" of group idx
    per_group = H // G
    query = block[:per_group * d].view(per_group, d, -1)
    key = block[per_group * d:(per_group + 1) * d]
    j = rank % (TP // G)
    heads = (H // G) // (TP // G)                                     # num_attention_heads_per_partition // (TP/G)
    return query[j * heads:(j + 1) * heads].reshape(-1, full.shape[1]), key


def exchange(shards: list[torch.Tensor], H: int, G: int, TP: int, d: int):
    """The monitor's all-to-all in one process: per rank, the rows it stores go where ``sends`` says, and land
    where the receiver's ``receives`` says."""
    layouts = [ReplicatedKVShard(H, G, d, TP, r) for r in range(TP)]
    held = [lay.local_qk_rows(s) for lay, s in zip(layouts, shards)]
    out = []
    for dest in range(TP):
        q_used = torch.full((H // TP * d, shards[0].shape[1]), float("nan"), dtype=shards[0].dtype)
        k_used = torch.full((d, shards[0].shape[1]), float("nan"), dtype=shards[0].dtype)
        for src in range(TP):
            (sq_lo, sq_hi), (sk_lo, sk_hi) = layouts[src].sends(dest)
            (rq_lo, rq_hi), (rk_lo, rk_hi) = layouts[dest].receives(src)
            assert (sq_hi - sq_lo, sk_hi - sk_lo) == (rq_hi - rq_lo, rk_hi - rk_lo)
            q_used[rq_lo:rq_hi] = held[src][0][sq_lo:sq_hi]
            k_used[rk_lo:rk_hi] = held[src][1][sk_lo:sk_hi]
        out.append((q_used, k_used))
    return out


def random_model(H: int, G: int, d: int, d_model: int, gen: torch.Generator):
    return (torch.randn(H, d_model, d, generator=gen, dtype=torch.float64),
            torch.randn(G, d_model, d, generator=gen, dtype=torch.float64),
            torch.randn(G, d_model, d, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("H,G,TP,d", LAYOUTS)
def test_each_rank_pairs_its_query_heads_with_megatrons_k_head(H, G, TP, d):
    full = fuse_qkv(*random_model(H, G, d, 6, torch.Generator().manual_seed(H * TP + d)))
    shards = full.chunk(TP, dim=0)                                    # ColumnParallel: TP equal row ranges
    for rank, (q_used, k_used) in enumerate(exchange(list(shards), H, G, TP, d)):
        want_q, want_k = megatron_rows_attended(full, H, G, TP, d, rank)
        assert torch.equal(q_used, want_q) and torch.equal(k_used, want_k), f"rank {rank}"


@pytest.mark.parametrize("H,G,TP,d", LAYOUTS)
def test_every_q_and_k_row_is_stored_once(H, G, TP, d):
    counts = {"q": torch.zeros(H * d, dtype=torch.int64), "k": torch.zeros(G * d, dtype=torch.int64)}
    for rank in range(TP):
        lay = ReplicatedKVShard(H, G, d, TP, rank)
        for key, (lo, hi) in (("q", lay.q_rows_held(rank)), ("k", lay.k_rows_held(rank))):
            counts[key][lo:hi] += 1
    assert bool((counts["q"] == 1).all()) and bool((counts["k"] == 1).all())


@pytest.mark.parametrize("H,G,TP,d", LAYOUTS)
def test_sharded_spectra_equal_dense_tp1(H, G, TP, d):
    d_model = 7
    gen = torch.Generator().manual_seed(100 + H * TP + d)
    prev = random_model(H, G, d, d_model, gen)
    cur = tuple(w + 1e-2 * torch.randn(w.shape, generator=gen, dtype=torch.float64) for w in prev)
    full_prev, full_cur = fuse_qkv(*prev), fuse_qkv(*cur)

    # ΔW_q, ΔW_k: sum of the ranks' shard Grams (rows split, Gram over d_model) vs the SVD of the whole ΔW
    grams = {"q": 0, "k": 0}
    for rank, (s_prev, s_cur) in enumerate(zip(full_prev.chunk(TP), full_cur.chunk(TP))):
        lay = ReplicatedKVShard(H, G, d, TP, rank)
        for key, now, before in zip("qk", lay.local_qk_rows(s_cur), lay.local_qk_rows(s_prev)):
            grams[key] = grams[key] + shard_gram(now - before, 0)
    dense = {"q": (cur[0] - prev[0]).transpose(1, 2).reshape(-1, d_model),
             "k": (cur[1] - prev[1]).transpose(1, 2).reshape(-1, d_model)}
    for key in "qk":
        got, want = spectrum_from_shard_grams(grams[key], d_model), matrix_spectrum(dense[key])
        # σ² through the Gram: absolute error ≤ 10·(m + n)·eps64·σ_max² (Gram formation, eigvalsh and the
        # reference SVD; see test_sharded)
        bound = 10 * (dense[key].shape[0] + d_model) * EPS64 * float(want[0]) ** 2
        assert got.shape == want.shape and float((got.square() - want.square()).abs().max()) <= bound, key

    # per head: the ranks' exchanged rows vs the dense d_model × d_model products of the TP=1 model
    reference = qk_increment_spectra_dense(*prev[:2], *cur[:2], terms=QK_TERMS)
    got_prev = exchange(list(full_prev.chunk(TP)), H, G, TP, d)
    got_cur = exchange(list(full_cur.chunk(TP)), H, G, TP, d)
    heads = H // TP
    for rank in range(TP):
        (q_prev, k_prev), (q_cur, k_cur) = got_prev[rank], got_cur[rank]
        as_heads = lambda rows, n: rows.view(n, d, d_model).transpose(1, 2)  # noqa: E731
        spectra = qk_increment_spectra(as_heads(q_prev, heads), as_heads(k_prev, 1), as_heads(q_cur, heads),
                                       as_heads(k_cur, 1), terms=QK_TERMS)
        for term in QK_TERMS:
            want = getattr(reference, term)[rank * heads:(rank + 1) * heads]
            # float64 Gram route vs float64 SVD of the formed product: σ to ~sqrt(eps64)·σ_max (the Gram route
            # squares the condition number); 1e-6·σ_max leaves a wide margin over that 1.5e-8
            scale = float(want.max())
            assert torch.allclose(getattr(spectra, term), want, rtol=0, atol=1e-6 * scale), (rank, term)


@pytest.mark.parametrize("H,G,TP,d,message", [
    (4, 2, 2, 3, "num_query_groups < TP"),          # whole groups per rank: the ordinary layout
    (4, 2, 3, 3, "num_query_groups < TP"),          # TP not a multiple of G (megatron-core refuses it too)
    (6, 1, 4, 2, "num_heads=6 is not divisible"),
    (8, 1, 8, 1, "not divisible by the tensor-parallel size 8"),  # (8 + 2)·1 rows over 8 ranks
])
def test_bad_replicated_layouts_raise_clear_errors(H, G, TP, d, message):
    with pytest.raises(ValueError, match=message):
        ReplicatedKVShard(H, G, d, TP, 0)


def test_replicated_layer_and_monitor_refuse_inconsistent_input_by_name():
    from megatron_mech.monitors import AttentionLayer, AttentionEvaluator

    kv = ReplicatedKVShard(4, 1, 3, 2, 1)
    shard = torch.zeros(kv.rows_per_rank, 6)
    with pytest.raises(ValueError, match=r"head_offset=0 \(expected 2\)"):
        AttentionLayer(0, shard, 2, 1, 3, head_offset=0, replicated_kv=kv)
    with pytest.raises(ValueError, match=r"expected \[\(H \+ 2G\)·d_head / TP = 9, d_model\]"):
        AttentionLayer(0, torch.zeros(12, 6), 2, 1, 3, head_offset=2, replicated_kv=kv)
    layer = AttentionLayer(0, shard, 2, 1, 3, head_offset=2, replicated_kv=kv)
    with pytest.raises(ValueError, match="rank 1 of 2, but this is rank 0 of a tensor-parallel group of 1"):
        AttentionEvaluator([layer])


@pytest.mark.slow
@pytest.mark.distributed
def test_monitor_under_torchrun_tp2_one_query_group_equals_tp1():
    result = run_torchrun(WORKER, nproc=2, timeout=240)
    assert "REPLICATED_KV PASS" in result.stdout, result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.distributed
def test_training_tp2_one_query_group_matches_tp1(tmp_path):
    """The whole stack (flags, megatron-core model, discovery, hook, monitor) on a real CPU training run: the
    attention metrics of TP=2 with one query group follow the TP=1 run of the same model."""
    from test_megatron_training import TRAINING_TOL, assert_same_series, train

    one_group = ("--num-query-groups", "1", "--mech-monitors", "attention")
    tp1 = train(tmp_path, "tp1", 1, *one_group, steps=10)
    tp2 = train(tmp_path, "tp2", 2, *one_group, "--tensor-model-parallel-size", "2", steps=10)
    assert len([k for k in tp2["records"][-1]["metrics"] if "/head" in k and k.endswith("delta2_entropy")]) == 2 * 4
    for pattern in ("dwq_entropy", "dwk_entropy", "delta2_entropy"):
        # TRAINING_TOL: float32 reordering in the TP reductions, measured and justified in test_megatron_training
        assert_same_series(tp1, tp2, pattern, TRAINING_TOL)


@pytest.mark.slow
@pytest.mark.distributed
def test_mols_per_class_norms_tp2_one_query_group_equal_tp1():
    """MoLS splits the fused linear_qkv gradient into its Q, K and V rows; with one query group at TP=2 a rank's
    rows are a plain range of the whole weight, and the per-class norms must still equal TP=1's."""
    from dist_utils import REPO_ROOT, job_ranks, run_worker_jobs
    from test_megatron_mols import _max_rel

    norms = dict(kind="train", groups=1, steps=4, window_steps=4, warmup=8)
    results = run_worker_jobs(REPO_ROOT / "tests" / "workers" / "mols_worker.py",
                              [dict(norms, id="tp1"), dict(norms, id="tp2", tp=2, nproc=2)], 300)
    tp1, tp2 = job_ranks(results, "tp1")[0], job_ranks(results, "tp2")
    assert {"qkv_q", "qkv_k", "qkv_v"} <= set(tp1["obs"][0]["small"])
    assert _max_rel(tp1["obs"], tp2[0]["obs"]) < 1e-5  # float32 reordering over TP, as for the TP=2 GQA job
    assert _max_rel(tp2[0]["obs"], tp2[1]["obs"]) == 0.0  # all-reduced: identical on both ranks
