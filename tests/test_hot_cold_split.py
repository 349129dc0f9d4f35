"""The hot/cold split with a spare bucket for hot ids (``ops/hot_cold.py``) against a reference written
with boolean masks, the way the split was computed before it stopped reading the host; the compiled
one-pass split (``native/id_split.cpp``) against those torch ops; the device error code of the first
invalid id; and where the herald EBC's input dist reads the host."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.ops.hot_cold import (bags_of_values, first_invalid_id, invalid_ids, row_block_sizes,
                                          split_hot_cold)


def _reference(values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
               table_offsets: torch.Tensor, hot_keys: torch.Tensor, block_sizes: torch.Tensor, W: int,
               B: int) -> Dict[str, torch.Tensor]:
    """Hot rows in bag order and per-bag hot counts by masks; cold ids bucketized by owner."""
    bag = bags_of_values(lengths, values.numel())
    keys = table_offsets[feature_table[bag // B]] + values
    hot_list: List[int] = hot_keys.tolist()
    is_hot = torch.tensor([int(k) in hot_list for k in keys.tolist()], dtype=torch.bool)
    hot_rows = torch.tensor([hot_list.index(int(k)) for k in keys[is_hot].tolist()], dtype=torch.int64)
    num_bags = lengths.numel()
    hot_counts = torch.bincount(bag[is_hot], minlength=num_bags)
    cold_lengths = torch.bincount(bag[~is_hot], minlength=num_bags)
    sub, cold_local = torch.ops.fbgemm.block_bucketize_sparse_features(
        cold_lengths, values[~is_hot], bucketize_pos=False, sequence=False, block_sizes=block_sizes,
        my_size=W, weights=None)[:2]
    return {"hot_rows": hot_rows, "hot_counts": hot_counts, "sub_lengths": sub.to(torch.int64),
            "cold_local_ids": cold_local.to(torch.int64)}


@pytest.mark.parametrize("W,hot_fraction,max_len", [(1, 0.3, 4), (2, 0.3, 4), (4, 0.5, 6), (3, 0.0, 3),
                                                    (2, 1.0, 3), (2, 0.3, 0)])
def test_the_spare_bucket_split_equals_the_masked_split(W: int, hot_fraction: float, max_len: int) -> None:
    g = torch.Generator().manual_seed(11 * W + max_len)
    rows = [37, 5, 120]  # per table
    feature_table = torch.tensor([0, 2, 1, 2], dtype=torch.int64)  # 4 features on 3 tables
    table_offsets = torch.tensor([0, 37, 42], dtype=torch.int64)
    B = 5
    F = feature_table.numel()
    lengths = torch.randint(0, max_len + 1, (F * B,), generator=g, dtype=torch.int64)
    bag = bags_of_values(lengths, int(lengths.sum()))
    n_rows = torch.tensor(rows)[feature_table[bag // B]]
    values = (torch.rand(bag.numel(), generator=g) * n_rows).to(torch.int64)
    all_keys = torch.cat([table_offsets[t] + torch.arange(n) for t, n in enumerate(rows)])
    pick = torch.rand(all_keys.numel(), generator=g) < hot_fraction
    hot_keys = all_keys[pick].sort().values
    blocks = torch.tensor(row_block_sizes(rows, W), dtype=torch.int64)[feature_table]

    split = split_hot_cold(values, lengths, feature_table, table_offsets, hot_keys, blocks, W, B)
    ref = _reference(values, lengths, feature_table, table_offsets, hot_keys, blocks, W, B)

    n_cold = int(split.sub_lengths.sum())
    assert torch.equal(split.sub_lengths, ref["sub_lengths"])
    assert torch.equal(split.bucketed_ids[:n_cold], ref["cold_local_ids"])
    assert torch.equal(split.bucketed_hot_rows[n_cold:], ref["hot_rows"])
    assert torch.equal(split.hot_offsets[1:] - split.hot_offsets[:-1], ref["hot_counts"])
    assert int(split.hot_offsets[0]) == 0 and split.bucketed_ids.numel() == values.numel()
    assert torch.equal(split.bag_lengths, lengths)
    # the spare row (past the hot buffer) in the cold ids' places
    assert bool((split.bucketed_hot_rows[:n_cold] == hot_keys.numel()).all())


def test_the_compiled_split_equals_the_torch_ops_output_for_output() -> None:
    """Random layouts (1-5 ranks, tables of 1-59 rows, none to all rows hot, empty and multi-id bags, ids
    outside their tables): the compiled pass gives the torch ops' split, per-(owner, feature) counts, hot
    rows read and bad-id flag, in dtype, shape and value."""
    from torchrec_herald.native import available, load
    from torchrec_herald.ops.hot_cold import out_of_table

    assert available(), "make setup builds the extension"
    native = load()
    g = torch.Generator().manual_seed(0)
    flagged = 0
    for trial in range(300):
        W, B, T, F = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 6), (1, 9), (1, 5), (1, 6)))
        rows_of_table = torch.randint(1, 60, (T,), generator=g)
        feature_table = torch.randint(0, T, (F,), generator=g)
        table_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), rows_of_table.cumsum(0)[:-1]])
        rows = rows_of_table[feature_table]
        blocks = (rows + W - 1) // W
        num_keys = int(rows_of_table.sum())
        num_hot = int(torch.randint(0, num_keys + 1, (1,), generator=g)) if trial % 5 else 0
        hot_keys = torch.randperm(num_keys, generator=g)[:num_hot].sort().values
        lengths = torch.randint(0, 4, (F * B,), generator=g)
        feature = bags_of_values(lengths, int(lengths.sum())) // B
        values = (torch.rand(feature.numel(), generator=g) * rows[feature].double()).long()
        if trial % 3 == 0 and values.numel():
            k = int(torch.randint(0, values.numel(), (1,), generator=g))
            values[k] = -1 if trial % 2 else int(rows[feature[k]]) + 3
        bad = out_of_table(values, rows, feature)
        ref = split_hot_cold(values.masked_fill(bad, 0), lengths, feature_table, table_offsets, hot_keys, blocks, W,
                             B, feature_of_value=feature)
        sub = ref.sub_lengths
        read = torch.zeros(num_hot + 1, dtype=torch.bool).index_fill_(0, ref.bucketed_hot_rows, True)[:num_hot]
        want = {"sub_lengths": sub, "hot_offsets": ref.hot_offsets, "bucketed_ids": ref.bucketed_ids,
                "bucketed_hot_rows": ref.bucketed_hot_rows,
                "per": torch.stack([sub, (sub > 0).to(sub.dtype)]).view(2, W, F, B).sum(3), "read": read,
                "any_bad": bad.any()}
        got = dict(zip(want, native.hot_cold_split(values, lengths, feature_table, table_offsets, hot_keys, blocks,
                                                   rows, W, B)))
        for name, w in want.items():
            assert got[name].dtype == w.dtype and torch.equal(got[name], w), (trial, name, got[name], w)
        flagged += int(bad.any())
    assert flagged == 98  # the cases with an id outside its table


def test_the_error_code_names_the_first_invalid_id_without_a_host_read() -> None:
    rows_per_feature = torch.tensor([10, 3], dtype=torch.int64)
    B = 2
    lengths = torch.tensor([1, 2, 2, 1], dtype=torch.int64)  # bags f0s0, f0s1, f1s0, f1s1
    values = torch.tensor([4, 9, 2, 1, 3, -1], dtype=torch.int64)  # 3 is outside feature 1's table, then -1
    bag = bags_of_values(lengths, values.numel())
    bad, code = invalid_ids(values, rows_per_feature, bag // B)
    assert bad.tolist() == [False, False, False, False, True, True]
    assert code.tolist() == [2, 3]  # (feature index + 1, id) of the first bad id
    assert first_invalid_id(values, lengths, rows_per_feature, B) == (1, 3)
    ok = values.clamp(0, 2)
    assert invalid_ids(ok, rows_per_feature, bag // B)[1].tolist() == [0, 0]
    assert first_invalid_id(ok, lengths, rows_per_feature, B) is None
    empty = torch.empty(0, dtype=torch.int64)
    assert invalid_ids(empty, rows_per_feature, empty)[1].tolist() == [0, 0]


def _host_reads_of_input_dist(rank: int, world: int) -> Dict[str, Any]:
    """Rank ``rank`` of a herald DLRM: the host reads (``tolist``/``item``/data-sized ops) of the input dist's
    start and of its first wait, counted on the ids' device."""
    from herald_harness import build
    from torchrec_herald.pipeline.context import find_herald_ebc

    # (one rank: no hot rows, the plan the cost model makes there)
    h = build(world, dict(planner="herald", steps=3, hot_min_count=2 if world > 1 else 10 ** 9))
    ebc = find_herald_ebc(h["dmp"])
    ebc._native_ids = None  # the torch ops: the path ids on a GPU take (the compiled pass is CPU only)
    kjt = next(iter(h["data"].train_batches(rank, world, h["batch_size"]))).sparse_features
    seen: List[str] = []
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        seen.append("tolist")
        return tolist(self, *a, **k)

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.__name__.split(".")[0]
            if name in {"_local_scalar_dense", "nonzero", "bincount", "_unique2", "masked_select"}:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        with Reads():
            ctx = ebc.create_context()
            first = ebc.input_dist(ctx, kjt)
            at_start = list(seen)
            second = first.wait()
            at_first_wait = seen[len(at_start):]
            second.wait()
            at_second_wait = seen[len(at_start) + len(at_first_wait):]
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    if ctx.split is None:  # one rank without hot rows: nothing split or sent
        return {"start": at_start, "first_wait": at_first_wait, "second_wait": at_second_wait,
                "rows": ctx.recv_rows.numel(), "ids": kjt.values().numel()}
    return {"start": at_start, "first_wait": at_first_wait, "second_wait": at_second_wait, "bags_to": ctx.bags_to,
            "sent": int(ctx.split.sub_lengths.gt(0).sum())}


def test_the_input_dist_reads_the_host_only_at_its_first_wait() -> None:
    # TrainPipelineSparseDist starts batch t+1's input dist before batch t's forward and waits for it after:
    # a host read at the start would hold the forward's launches until the id kernels finished on a GPU
    for r in run_multiprocess(_host_reads_of_input_dist, 2, timeout_s=180):
        assert r["start"] == [] and r["second_wait"] == []
        assert r["first_wait"] == ["tolist"]  # one read: the counts received and this rank's own sizes
        assert sum(r["bags_to"]) == r["sent"] > 0
    # one rank without hot rows: the ids go to the lookup as they are, and the one read is the bad-id flag
    r = run_multiprocess(_host_reads_of_input_dist, 1, timeout_s=180)[0]
    assert r["start"] == [] and r["second_wait"] == [] and r["first_wait"] == ["_local_scalar_dense"], r
    assert r["rows"] == r["ids"] > 0


def _input_dist_both_ways(rank: int, world: int) -> Dict[str, Any]:
    """Rank ``rank`` of a herald DLRM: the input dist of three batches through the compiled passes and through
    the torch ops, every field the forward reads afterwards."""
    from herald_harness import build
    from torchrec_herald.pipeline.context import find_herald_ebc

    h = build(world, dict(planner="herald", steps=3, hot_min_count=2, sync="mixed"))  # both hot-row sync modes
    ebc = find_herald_ebc(h["dmp"])
    native = ebc._native_ids
    assert native is not None, "make setup builds the extension"
    out: Dict[str, Any] = {"compiled": [], "torch": []}
    batches = list(h["data"].train_batches(rank, world, h["batch_size"]))[:3]
    for name, impl in (("compiled", native), ("torch", None)):
        ebc._native_ids = impl
        for batch in batches:
            ctx = ebc.create_context()
            ebc.input_dist(ctx, batch.sparse_features).wait().wait()
            assert ctx.split is not None
            out[name].append({f: getattr(ctx, f) for f in ("send_bag_index", "bags_to", "bags_from", "recv_lengths",
                                                           "recv_rows", "hot_unique", "hot_inverse", "sparse_idx",
                                                           "sparse_from", "bag_lengths")}
                             | {f: getattr(ctx.split, f) for f in ("hot_offsets", "sub_lengths", "bucketed_ids",
                                                                   "bucketed_hot_rows")})
    return out


def test_the_compiled_input_dist_sends_and_receives_what_the_torch_ops_do() -> None:
    """The input dist through the compiled passes (``hot_cold_split`` and, at the first wait,
    ``hot_cold_message``) gives every field the forward reads equal to the torch ops' (the path of ids on
    a GPU): the split, the hot rows read and each hot id's place among them, the sub-bags sent and the
    lengths and rows each owner received."""
    for r in run_multiprocess(_input_dist_both_ways, 2, timeout_s=180):
        for got, want in zip(r["compiled"], r["torch"]):
            for name, w in want.items():
                g = got[name]
                same = torch.equal(g, w) and g.dtype == w.dtype if isinstance(w, torch.Tensor) else g == w
                assert same, (name, g, w)
        assert all(any(b[f].numel() for b in r["torch"]) for f in ("recv_rows", "hot_inverse", "sparse_idx"))
