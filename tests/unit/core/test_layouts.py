"""Megatron fused-QKV layout against a layout built row by row from its documented order."""
import pytest
import torch

from megatron_mech.core.layouts import fuse_qkv, qkv_block_rows, qkv_partition_sizes, qkv_row_blocks, split_fused_qkv


def build_by_hand(wq, wk, wv):
    """Rows per query group: its H/G query heads, then K, then V — each d_head rows of [out, in] weight."""
    num_heads, num_groups = wq.shape[0], wk.shape[0]
    per_group = num_heads // num_groups
    rows = []
    for g in range(num_groups):
        for j in range(per_group):
            rows.append(wq[g * per_group + j].T)  # paper [d_model, d_head] → Megatron rows [d_head, d_model]
        rows.append(wk[g].T)
        rows.append(wv[g].T)
    return torch.cat(rows, dim=0)


@pytest.mark.parametrize("num_heads,num_groups", [(4, 4), (8, 2), (6, 1), (1, 1)])
def test_split_matches_hand_layout_and_round_trips(num_heads, num_groups):
    d_model, d_head = 12, 3
    wq = torch.randn(num_heads, d_model, d_head)
    wk = torch.randn(num_groups, d_model, d_head)
    wv = torch.randn(num_groups, d_model, d_head)
    weight = build_by_hand(wq, wk, wv)
    q, k, v = split_fused_qkv(weight, num_heads, num_groups, d_head)
    assert torch.equal(q, wq) and torch.equal(k, wk) and torch.equal(v, wv)
    assert k._base is not None and k._base.data_ptr() == weight.data_ptr()  # K/V are views, no copy
    assert torch.equal(fuse_qkv(q, k, v), weight)
    q_rows, k_rows, v_rows = qkv_row_blocks(weight, num_heads, num_groups, d_head)
    assert torch.equal(q_rows, torch.cat([wq[h].T for h in range(num_heads)]))
    assert torch.equal(k_rows, torch.cat([wk[g].T for g in range(num_groups)]))
    assert torch.equal(v_rows, torch.cat([wv[g].T for g in range(num_groups)]))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_holds_whole_query_groups(tp):
    num_heads, num_groups, d_model, d_head = 8, 4, 10, 2
    wq = torch.randn(num_heads, d_model, d_head)
    wk = torch.randn(num_groups, d_model, d_head)
    wv = torch.randn(num_groups, d_model, d_head)
    full = build_by_hand(wq, wk, wv)
    heads_local, groups_local = qkv_partition_sizes(num_heads, num_groups, tp)
    rows_per_rank = full.shape[0] // tp
    for rank in range(tp):  # ColumnParallel: rank r holds rows [r·n/tp, (r+1)·n/tp)
        shard = full[rank * rows_per_rank:(rank + 1) * rows_per_rank]
        q, k, v = split_fused_qkv(shard, heads_local, groups_local, d_head)
        assert torch.equal(q, wq[rank * heads_local:(rank + 1) * heads_local])
        assert torch.equal(k, wk[rank * groups_local:(rank + 1) * groups_local])
        assert torch.equal(v, wv[rank * groups_local:(rank + 1) * groups_local])


def test_bad_layouts_raise_clear_errors():
    weight = torch.randn((8 + 2 * 2) * 4, 16)
    with pytest.raises(ValueError, match="rows"):
        split_fused_qkv(weight, 8, 4, 4)
    with pytest.raises(ValueError, match="not divisible by num_query_groups"):
        split_fused_qkv(weight, 6, 4, 4)
    with pytest.raises(ValueError, match="tensor-parallel"):
        qkv_partition_sizes(8, 2, 4)
    with pytest.raises(ValueError, match="2-D"):
        split_fused_qkv(weight[None], 8, 2, 4)
    with pytest.raises(ValueError, match="must both be"):
        fuse_qkv(torch.randn(4, 6, 2), torch.randn(2, 6, 2), torch.randn(2, 6, 3))


def test_float_counts_are_refused_by_name():
    """head_dim=4.0 used to reach view() and fail there with a TypeError."""
    from megatron_mech.core.layouts import split_fused_qkv

    weight = torch.zeros((4 + 2 * 2) * 4, 16)
    with pytest.raises(ValueError, match="head_dim must be an int, got 4.0"):
        split_fused_qkv(weight, 4, 2, 4.0)
    split_fused_qkv(weight, 4, 2, 4)


@pytest.mark.parametrize("num_heads,num_groups", [(8, 2), (4, 4), (6, 1), (8, 8)])
def test_block_rows_read_exactly_the_rows_of_the_blocks(num_heads, num_groups):
    """Every row range of Q, K and V equals the same range of the whole blocks (the reference), and a range inside
    one query group is a view of the weight (no copy), a range across groups a copy of just those rows."""
    head_dim = 3
    weight = torch.randn((num_heads + 2 * num_groups) * head_dim, 5)
    blocks = dict(zip("qkv", qkv_row_blocks(weight, num_heads, num_groups, head_dim)))
    for name, whole in blocks.items():
        for lo in range(whole.shape[0] + 1):
            for hi in range(lo, whole.shape[0] + 1):
                rows = qkv_block_rows(weight, num_heads, num_groups, head_dim, name, lo, hi)
                assert torch.equal(rows, whole[lo:hi]), (name, lo, hi)
                out = torch.full((hi - lo, 5), float("nan"))    # ``out``: every row written, in place
                assert qkv_block_rows(weight, num_heads, num_groups, head_dim, name, lo, hi, out=out) is out
                assert torch.equal(out, whole[lo:hi]), (name, lo, hi)
    one_head = qkv_block_rows(weight, num_heads, num_groups, head_dim, "q", head_dim, 2 * head_dim)
    assert one_head.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    if num_groups > 1:
        across = qkv_block_rows(weight, num_heads, num_groups, head_dim, "k", 0, 2 * head_dim)
        assert across.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    # a dtype: a copy across groups is made in it (bf16 → float32 is exact), a view keeps the weight's dtype
    low = weight.to(torch.bfloat16)
    whole_q = qkv_row_blocks(low, num_heads, num_groups, head_dim)[0]
    for lo, hi in ((0, whole_q.shape[0]), (1, whole_q.shape[0] - 1), (head_dim, 2 * head_dim)):
        rows = qkv_block_rows(low, num_heads, num_groups, head_dim, "q", lo, hi, torch.float32)
        assert torch.equal(rows.float(), whole_q[lo:hi].float())
        view = rows.untyped_storage().data_ptr() == low.untyped_storage().data_ptr()
        assert rows.dtype == (torch.bfloat16 if view else torch.float32)
    with pytest.raises(ValueError, match="block must be"):
        qkv_block_rows(weight, num_heads, num_groups, head_dim, "o", 0, 1)
    with pytest.raises(ValueError, match="outside"):
        qkv_block_rows(weight, num_heads, num_groups, head_dim, "k", 0, num_groups * head_dim + 1)
