"""Herald trains exactly the model stock TorchRec trains: same global batches, same per-step losses, same
final weights.

Each case trains herald (hot rows replicated, cold rows row-wise with variable-size all-to-alls) and a
stock TorchRec reference (every table TABLE_WISE or ROW_WISE) from identical initial weights on the
same global batches (tests/herald_harness.py) for ``STEPS`` steps, and asserts, on every rank:

* per-step local loss: ``|h - s| / max(|s|, 1e-12) <= 1e-5``;
* final weights, for every key of ``DMP.state_dict()`` (the 26 embedding tables, gathered to full
  ``[n, dim]`` tensors, and every dense parameter): relative difference
  ``rel(h, s) = max|h - s| / max(max|s|, 1e-12)`` (per tensor; ``s`` the stock reference) ``<= 1e-5``;
* herald really used both of its paths: the TrafficMeter tags ``herald_hot_sync`` (hot-row gradient
  sync) and ``herald_pooled`` (cold partial pooled vectors) carry bytes, and herald sent fewer
  embedding vectors than the stock reference (every rank).

A covering matrix rather than the full cross product (each factor value appears at least once):

====  ===  =====================  ==============  =====  ================  ======  ==========  ======
case  W    embedding optimizer    set via         pool   loop              sync    reference   bags
====  ===  =====================  ==============  =====  ================  ======  ==========  ======
a     2    EXACT_SGD              apply_in_bwd    SUM    plain             dense   TABLE_WISE  1 id
b     2    EXACT_ROWWISE_ADAGRAD  fused_params    MEAN   SparseDist        sparse  ROW_WISE*   1 id
c     4    EXACT_ROWWISE_ADAGRAD  apply_in_bwd    SUM    SparseDist        dense   TABLE_WISE  1 id
d     4    EXACT_SGD              fused_params    MEAN   plain             sparse  ROW_WISE    0-3 ids
====  ===  =====================  ==============  =====  ================  ======  ==========  ======

``apply_in_bwd``: ``torchrec.optim.apply_optimizer_in_backward`` on the EBC's weights;
``fused_params``: the sharder's ``fused_params={"optimizer": EmbOptimType...}``; SparseDist:
``TrainPipelineSparseDist``; sync: how hot-row gradients are summed over ranks (per table; case a
also runs herald with ``mixed`` sync: even tables dense, odd ones sparse, in one module). Case d uses multi-id bags (``herald_harness.multi_hot``: 0 to 3 ids,
empty bags included), so MEAN divides by real bag lengths and bags are split over hot rows and
several cold owners. (Multi-id bags are not combined with row-wise Adagrad: there the stock
references themselves drift apart by up to ~1e-4 in weights after 50 steps (measured: ROW_WISE vs
TABLE_WISE 7e-6 at W=4 SUM, 3e-5 at W=2 MEAN), Adagrad's 1/sqrt(state) amplifying summation-order
rounding; herald stays within the same spread.)

\\* Stock ROW_WISE divides MEAN-pooled bags by ``length + 1e-6`` (TorchRec's
``_create_mean_pooling_divisor``), unlike TABLE_WISE, the unsharded EBC and herald; with row-wise
Adagrad that 1e-6 grows to ~6e-5 in the losses, so case b's reference is stock ROW_WISE with the exact
divisor (``herald_harness.exact_row_wise_mean``); :func:`test_stock_references_agree` shows that this
reference is bit-identical to TABLE_WISE and that TorchRec as shipped is not. Case d (SGD) uses
ROW_WISE as shipped: the 1e-6 stays within the tolerance there.

Stock runs are cached (``functools.lru_cache``) and every case's runs share one process group, so
the stock-reference test costs one extra stock run.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import pytest
import torch

from herald_harness import train, train_many, weight_rtol
from torchrec_herald.dist_utils import run_multiprocess

STEPS = 50
RTOL = 1e-5

#: case -> (world size, common cfg, reference run name, extra run names)
CASES: Dict[str, Tuple[int, Dict[str, Any], str, Tuple[str, ...]]] = {
    "a": (2, dict(optimizer="sgd", via="apply", pooling="SUM", pipeline="plain", sync="dense"),
          "table_wise", ("row_wise", "herald_mixed_sync")),
    "b": (2, dict(optimizer="rowwise_adagrad", via="fused_params", pooling="MEAN", pipeline="sparse_dist",
                  sync="sparse"),
          "row_wise_exact_mean", ("row_wise", "table_wise")),
    "c": (4, dict(optimizer="rowwise_adagrad", via="apply", pooling="SUM", pipeline="sparse_dist", sync="dense"),
          "table_wise", ()),
    "d": (4, dict(optimizer="sgd", via="fused_params", pooling="MEAN", pipeline="plain", sync="sparse",
                  multi_hot=True),
          "row_wise", ()),
}
#: run name -> harness cfg overrides
RUNS: Dict[str, Dict[str, Any]] = {
    "herald": dict(planner="herald"),
    "herald_mixed_sync": dict(planner="herald", sync="mixed"),
    "table_wise": dict(planner="table_wise"),
    "row_wise": dict(planner="row_wise"),
    "row_wise_exact_mean": dict(planner="row_wise", exact_rw_mean=True),
}


@functools.lru_cache(maxsize=None)
def runs(case: str) -> Dict[str, List[Dict[str, Any]]]:
    """run name -> per-rank harness results, for herald, the reference and the case's extra runs
    (all in one process group)."""
    world, cfg, ref, extra = CASES[case]
    names = ["herald", ref, *extra]
    per_rank = run_multiprocess(train_many, world, [dict(cfg, steps=STEPS, **RUNS[n]) for n in names],
                                timeout_s=300)
    return {n: [per_rank[r][i] for r in range(world)] for i, n in enumerate(names)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max(max|b|, 1e-12): relative difference of ``a`` to the reference ``b``."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def loss_rel(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def vectors(summary: Dict[str, Dict[str, float]]) -> float:
    return sum(s["embedding_vectors"] for s in summary.values())


@pytest.mark.parametrize("case,herald_run", [(c, "herald") for c in sorted(CASES)] + [("a", "herald_mixed_sync")])
def test_herald_matches_stock(case: str, herald_run: str) -> None:
    world, _, ref_name, _ = CASES[case]
    r = runs(case)
    herald, ref = r[herald_run], r[ref_name]
    for rank in range(world):
        h, s = herald[rank], ref[rank]
        assert loss_rel(h["losses"], s["losses"]) <= RTOL, (case, rank)
        assert set(h["state"]) == set(s["state"])
        assert sum(".embedding_bags." in k for k in s["state"]) == 26 and len(s["dense_names"]) > 0
        assert h["dense_names"] == s["dense_names"]
        worst = {k: rel(h["state"][k], s["state"][k]) for k in s["state"]}
        bad = {k: v for k, v in worst.items() if not v <= weight_rtol(CASES[case][1]["optimizer"])}
        assert not bad, (case, rank, bad)
        # herald's replicas agree: every rank presents the same tables, and its own hot replicas hold their rows
        for k, v in h["state"].items():
            assert torch.equal(v, herald[0]["state"][k]), (case, rank, k)
        assert h["hot_replica_gap"] == 0.0, (case, rank, h["hot_replica_gap"])
        # both paths carried traffic, and herald sent fewer embedding vectors than the stock reference
        assert h["tags"]["herald_hot_sync"]["bytes"] > 0, (case, rank)
        assert h["tags"]["herald_pooled"]["bytes"] > 0, (case, rank)
        assert 0 < vectors(h["traffic"]) < vectors(s["traffic"]), (case, rank)
        # the configured sync modes ran: dense = all_reduce (the only all_reduce in these runs), sparse =
        # one all-to-all of touched rows per step (its counts ride on input_dist's one meta exchange)
        sync = {**CASES[case][1], **RUNS[herald_run]}["sync"]
        assert (h["traffic"].get("all_reduce", {}).get("bytes", 0) > 0) == (sync in ("dense", "mixed")), sync
        assert h["tags"]["herald_meta"]["calls"] == STEPS, sync
        assert h["tags"]["herald_hot_sync"]["calls"] == STEPS * (2 if sync == "mixed" else 1), sync
        # the module's own per-table count of its hot-row sync (counted on the device, mapped to tables when
        # read) is the bytes TrafficMeter saw under that tag
        assert sum(t["hot_sync"] for t in h["table_traffic"].values()) == h["tags"]["herald_hot_sync"]["bytes"], sync
    # training moved the weights (the comparison is not of two untouched initialisations)
    init = ref[0]["initial"]
    assert set(init) == set(ref[0]["state"])
    assert all(not torch.equal(ref[0]["state"][k], init[k]) for k in init), case


def test_stock_references_agree() -> None:
    """The references: stock ROW_WISE and TABLE_WISE train bit-identical models (case a: SUM; case b:
    MEAN with ROW_WISE's exact divisor); TorchRec's ROW_WISE as shipped is not bit-identical under MEAN
    (its ``length + 1e-6`` divisor): if this last assertion fails TorchRec changed that and
    ``exact_row_wise_mean`` can go."""
    for case, rw_name in (("a", "row_wise"), ("b", "row_wise_exact_mean")):
        r = runs(case)
        for rank in range(CASES[case][0]):
            rw, tw = r[rw_name][rank], r["table_wise"][rank]
            assert rw["losses"] == tw["losses"], case
            for k in tw["state"]:
                assert torch.equal(rw["state"][k], tw["state"][k]), (case, k)
    b = runs("b")
    assert any(not torch.equal(b["row_wise"][0]["state"][k], b["table_wise"][0]["state"][k])
               for k in b["table_wise"][0]["state"])


def _no_hot_rows(rank: int, world: int) -> Dict[str, Any]:
    """A herald plan holding no hot rows (every id is cold: the minimum count is never reached), trained by
    both id paths, and stock ROW_WISE on the same batches."""
    cfg = dict(optimizer="rowwise_adagrad", via="fused_params", pooling="MEAN", pipeline="sparse_dist",
               sync="dense", hot_min_count=10 ** 9, steps=STEPS, dense_sync="forward_ordered")
    from unittest import mock

    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection as Sharded

    # which input dist ran: at one rank no split for an exchange (the ids go to the lookup as they are)
    split = mock.patch.object(Sharded, "_split_for_dist", autospec=True, side_effect=Sharded._split_for_dist)
    one_rank = mock.patch.object(Sharded, "_one_rank_input_dist", autospec=True,
                                 side_effect=Sharded._one_rank_input_dist)
    with split as splits, one_rank as direct:
        runs = {name: train(rank, world, dict(cfg, **extra)) for name, extra in (
            ("compiled", dict(planner="herald")), ("torch", dict(planner="herald", torch_ids=True)),
            ("row_wise", dict(planner="row_wise", exact_rw_mean=True)))}
    runs["input_dists"] = {"split": splits.call_count, "one_rank": direct.call_count}
    from torchrec_herald.pipeline.context import find_herald_ebc
    from herald_harness import build

    runs["num_hot"] = find_herald_ebc(build(world, dict(cfg, planner="herald"))["dmp"])._num_hot
    return runs


@pytest.mark.parametrize("world", [1, 2])
def test_a_plan_without_hot_rows_trains_as_stock_row_wise_by_both_id_paths(world: int) -> None:
    """Where a plan replicates no rows (one rank: nothing to save) the step skips the hot side (no lookup, no
    gradient hook, no hot-row counts), and at one rank the ids go to the lookup with no split or exchange; the
    model is stock ROW_WISE's, by the compiled pass and by the torch ops (the path of ids on a GPU), at one
    rank and at two."""
    for r in run_multiprocess(_no_hot_rows, world, timeout_s=300):
        assert r["num_hot"] == 0
        # one rank: every input dist took the direct path (none split ids for an exchange); two: none did
        calls = r["input_dists"]
        assert (calls["split"] == 0 and calls["one_rank"] > 0) if world == 1 else \
            (calls["split"] > 0 and calls["one_rank"] == 0), calls
        ref = r["row_wise"]
        for name in ("compiled", "torch"):
            h = r[name]
            assert loss_rel(h["losses"], ref["losses"]) <= RTOL, name
            worst = {k: rel(h["state"][k], ref["state"][k]) for k in ref["state"]}
            assert all(v <= weight_rtol("rowwise_adagrad") for v in worst.values()), (name, worst)
            assert "herald_hot_sync" not in h["tags"], name
        assert r["torch"]["losses"] == r["compiled"]["losses"]
        for k in ref["state"]:
            assert torch.equal(r["torch"]["state"][k], r["compiled"]["state"][k]), k
        assert any(not torch.equal(ref["state"][k], ref["initial"][k]) for k in ref["initial"])


#: the TrafficMeter tags of herald's own collectives: the input dist's counts and ids, the partial pooled
#: vectors and their gradients, the hot-row gradient sums, the forward-ordered dense sums
HERALD_COLLECTIVES = ("herald_meta", "herald_ids", "herald_pooled", "herald_pooled_grad", "herald_hot_sync",
                      "dense_allreduce")


def _one_rank(rank: int, world: int) -> Dict[str, Any]:
    """One rank: herald with hot rows (half the tables synced densely, half sparsely), the forward-ordered
    dense sync and the torch ops' id bookkeeping (a GPU's path), and stock TABLE_WISE, on the same batches."""
    cfg = dict(optimizer="rowwise_adagrad", via="fused_params", pooling="SUM", pipeline="sparse_dist",
               sync="mixed", steps=STEPS, dense_sync="forward_ordered")
    return {name: train(rank, world, dict(cfg, **extra)) for name, extra in (
        ("herald", dict(planner="herald", torch_ids=True)), ("table_wise", dict(planner="table_wise")))}


def test_one_rank_issues_no_collective_of_herald_and_trains_as_stock_table_wise() -> None:
    """At one rank nothing travels, so herald issues none of its collectives (as TorchRec's ``KJTAllToAll``
    returns its input when its group has one worker): no input-dist exchange, no pooled vectors' or gradients'
    all-to-all, no hot-row or dense sum. The model is still stock TABLE_WISE's, with hot rows replicated and
    synced both ways."""
    r = run_multiprocess(_one_rank, 1, timeout_s=300)[0]
    h, s = r["herald"], r["table_wise"]
    assert h["num_hot"] > 0
    assert not [t for t in HERALD_COLLECTIVES if t in h["tags"]], h["tags"]
    assert loss_rel(h["losses"], s["losses"]) <= RTOL
    worst = {k: rel(h["state"][k], s["state"][k]) for k in s["state"]}
    assert all(v <= weight_rtol("rowwise_adagrad") for v in worst.values()), worst
    assert any(not torch.equal(s["state"][k], s["initial"][k]) for k in s["initial"])


def _in_thread_or_not(rank: int, world: int) -> Dict[str, Any]:
    """Herald (hot rows, both sync modes, the torch ops' id bookkeeping as on a GPU) with its per-step input
    dist on the training thread and handed to the module's worker thread, on the same batches; and the
    threads that issued collectives."""
    import threading

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    issuers: set = set()
    # (TrafficMeter wraps c10d's functions, so they are the ones recorded)
    originals = {n: getattr(c10d, n) for n in ("all_to_all_single", "all_gather", "all_reduce", "broadcast")}

    def recorded(name: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            issuers.add(threading.current_thread().name)
            return originals[name](*a, **k)
        return call

    for n in originals:
        setattr(c10d, n, recorded(n))
        setattr(dist, n, getattr(c10d, n))
    try:
        cfg = dict(planner="herald", optimizer="rowwise_adagrad", via="fused_params", pooling="SUM",
                   pipeline="sparse_dist", sync="mixed", steps=STEPS, torch_ids=True)
        import functools
        import sys

        # the sparsely synced hot rows' sum: sized by the data (torch.unique, a host read on a GPU) on the CPU's
        # path only
        calls = [0]
        unique = torch.unique

        @functools.wraps(unique)
        def counted(*a: Any, **k: Any) -> Any:
            calls[0] += sys._getframe(1).f_code.co_name == "settle_hot_sync"
            return unique(*a, **k)

        torch.unique = counted  # type: ignore[assignment]
        try:
            out: Dict[str, Any] = {name: train(rank, world, dict(cfg, ids_in_thread=on))
                                   for name, on in (("main", False), ("worker", True))}
            on_torch_path = calls[0]
            out["compiled"] = train(rank, world, dict(cfg, torch_ids=False))  # the CPU's path, the reference
        finally:
            torch.unique = unique  # type: ignore[assignment]
        out["uniques"] = {"torch": on_torch_path, "compiled": calls[0] - on_torch_path}
    finally:
        for n, f in originals.items():
            setattr(c10d, n, f)
            setattr(dist, n, f)
    out["issuers"] = sorted(issuers)
    return out


def test_the_input_dist_on_a_worker_thread_trains_the_same_model() -> None:
    """On a GPU the per-step input dist's host work runs on a worker thread of the module's own: bit for bit
    the model of the input dist on the training thread, and both the model of the compiled id bookkeeping
    (a CPU's path), at two ranks, with hot rows synced densely and sparsely; the worker ran, only where asked, and issued no collective (every one stays on the training
    thread, in program order: NCCL's hazard of two threads' communicators cannot arise). The torch ops' path sums
    the sparsely synced hot rows into a buffer of all of them, rank by rank, where the CPU's path merges the
    received rows with ``torch.unique``: bit for bit the same model."""
    for r in run_multiprocess(_in_thread_or_not, 2, timeout_s=300):
        main, worker = r["main"], r["worker"]
        assert worker["worker_used"] and not main["worker_used"]
        assert r["issuers"] and not any(t.startswith("herald-input-dist") for t in r["issuers"]), r["issuers"]
        assert worker["losses"] == main["losses"] == r["compiled"]["losses"]
        for k in main["state"]:
            assert torch.equal(worker["state"][k], main["state"][k]), k
            assert torch.equal(main["state"][k], r["compiled"]["state"][k]), k
        assert worker["tags"]["herald_meta"]["calls"] == main["tags"]["herald_meta"]["calls"] == STEPS
        assert worker["tags"]["herald_hot_sync"]["bytes"] > 0
        # the torch ops' path (a GPU's) sums the sparsely synced rows with nothing sized by the data
        assert r["uniques"]["torch"] == 0 and r["uniques"]["compiled"] > 0, r["uniques"]
