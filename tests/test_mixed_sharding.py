"""One EBC, herald tables beside stock-sharded ones (``ShardedMixedEmbeddingBagCollection``), trains exactly
the model stock TorchRec trains.

Every case trains, at 2 ranks on the same global batches for ``STEPS`` steps, a plan that gives every
k-th table a stock sharding (TABLE_WISE or ROW_WISE, from TorchRec's own planner) and the others
herald's hot/cold sharding, and compares with stock TABLE_WISE (plain loop):

* per step, the loss averaged over ranks (herald's pipeline moves samples between ranks):
  ``|h - s| / |s| <= 1e-5``;
* every final ``DMP.state_dict()`` tensor, the same 26 ``embedding_bags.<table>.weight`` keys as stock's:
  ``max|h - s| / max|s| <=`` :func:`herald_harness.weight_rtol`;
* both parts really ran: herald's tagged exchanges and stock's untagged all-to-alls both move embedding
  vectors.

Behaviour: a DATA_PARALLEL table beside herald tables, and the approximate pipeline modes with a mixed
EBC, are one ValueError naming the tables.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import pytest
import torch

from herald_harness import weight_rtol
from torchrec_herald.dist_utils import run_multiprocess

STEPS = 20
RTOL = 1e-5

SGD = dict(optimizer="sgd", via="apply", pooling="SUM")
ADAGRAD = dict(optimizer="rowwise_adagrad", via="fused_params", pooling="MEAN", multi_hot=True)
#: run -> harness cfg (reference runs: planner table_wise)
RUNS: Dict[str, Dict[str, Any]] = {
    "sgd_stock": dict(SGD, planner="table_wise"),
    "sgd_tw_plain": dict(SGD, planner="herald", stock_tables=("table_wise", 2)),
    "sgd_rw_sparse_dist": dict(SGD, planner="herald", stock_tables=("row_wise", 3), pipeline="sparse_dist"),
    "sgd_tw_herald_scheduling": dict(SGD, planner="herald", stock_tables=("table_wise", 2),
                                     pipeline=dict(allocator="greedy", scheduling="on")),
    "sgd_tw_herald_hot_only": dict(SGD, planner="herald", stock_tables=("table_wise", 4),
                                   pipeline=dict(scheduling="off")),
    "adagrad_stock": dict(ADAGRAD, planner="table_wise"),
    "adagrad_tw_plain": dict(ADAGRAD, planner="herald", stock_tables=("table_wise", 2)),
}
CASES = [(run, run.split("_")[0] + "_stock") for run in RUNS if not run.endswith("_stock")]


def _errors(rank: int, world: int) -> Dict[str, str]:
    """The messages of a DATA_PARALLEL table beside herald's and of approximate modes with a mixed EBC."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ParameterSharding, ShardingType

    from herald_harness import build, error_of, run_steps

    b = build(world, dict(SGD, planner="herald", stock_tables=("table_wise", 2)))
    out = {}
    for kw in (dict(skip="input"), dict(staleness=2)):
        it = b["data"].train_batches(rank, world, b["batch_size"])
        out[str(kw)] = error_of(lambda: run_steps(b["dmp"], b["optimizer"], it, pipeline=dict(kw)))
    plan = b["plan"]
    path = next(iter(plan.plan))
    name = b["tables"][1].name
    plan.plan[path][name] = ParameterSharding(sharding_type=ShardingType.DATA_PARALLEL.value,
                                              compute_kernel="dense", ranks=list(range(world)))
    from torchrec_herald.model import build_dlrm_train
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    model = build_dlrm_train(b["tables"], b["data"].num_dense, [16, 8], [16, 1], seed=0, device="cpu")
    out["data_parallel"] = error_of(lambda: DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[HeraldEmbeddingBagCollectionSharder()]))
    dist.barrier()
    return out


def _train_runs(rank: int, world: int, cfgs: List[Dict[str, Any]]) -> Dict[str, Any]:
    from herald_harness import train

    return {"runs": [train(rank, world, dict(cfg, steps=STEPS)) for cfg in cfgs], "errors": _errors(rank, world)}


@functools.lru_cache(maxsize=None)
def runs() -> Dict[str, Any]:
    names = list(RUNS)
    per_rank = run_multiprocess(_train_runs, 2, [RUNS[n] for n in names], timeout_s=600)
    return {"runs": {n: [per_rank[r]["runs"][i] for r in range(2)] for i, n in enumerate(names)},
            "errors": [per_rank[r]["errors"] for r in range(2)]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("run,reference", CASES, ids=[c[0] for c in CASES])
def test_mixed_ebc_trains_exactly_like_stock(run: str, reference: str) -> None:
    r = runs()["runs"]
    mixed, stock = r[run], r[reference]
    h_loss = torch.tensor([x["losses"] for x in mixed], dtype=torch.float64).mean(0)
    s_loss = torch.tensor([x["losses"] for x in stock], dtype=torch.float64).mean(0)
    assert h_loss.numel() == s_loss.numel() == STEPS
    assert float(((h_loss - s_loss).abs() / s_loss.abs()).max()) <= RTOL
    tol = weight_rtol(RUNS[run]["optimizer"])
    for rank in range(2):
        h, s = mixed[rank]["state"], stock[rank]["state"]
        assert set(h) == set(s) and sum(".embedding_bags." in k for k in s) == 26
        bad = {k: rel(h[k], s[k]) for k in s if not rel(h[k], s[k]) <= tol}
        assert not bad, (run, rank, bad)
    init = stock[0]["initial"]
    assert all(not torch.equal(stock[0]["state"][k], init[k]) for k in init)  # training moved every weight


@pytest.mark.parametrize("run", [c[0] for c in CASES])
def test_both_parts_of_a_mixed_ebc_move_their_own_embeddings(run: str) -> None:
    for res in runs()["runs"][run]:
        herald = sum(v["embedding_vectors"] for k, v in res["tags"].items() if k.startswith("herald_"))
        every = sum(v["embedding_vectors"] for v in res["traffic"].values())
        assert herald > 0, res["tags"]  # herald's own exchanges (tagged)
        assert every - herald > 0, res["traffic"]  # the stock part's pooled all-to-alls (untagged)


def test_data_parallel_beside_herald_tables_is_one_error_naming_the_table() -> None:
    for errors in runs()["errors"]:
        msg = errors["data_parallel"]
        assert msg.startswith("ValueError: tables ['t_cat_1'] have sharding types ['data_parallel']"), msg
        assert "every row hot" in msg


@pytest.mark.parametrize("mode", ["{'skip': 'input'}", "{'staleness': 2}"])
def test_approximate_modes_with_a_mixed_ebc_are_one_error_naming_the_stock_tables(mode: str) -> None:
    for errors in runs()["errors"]:
        msg = errors[mode]
        assert msg.startswith("ValueError: pipeline.skip and pipeline.staleness need every table of the EBC "
                              "herald-sharded; the plan keeps tables ['t_cat_1', 't_cat_3'"), msg


def test_the_planner_offers_only_the_stock_types_the_mixed_ebc_accepts() -> None:
    from torchrec_herald.planner.time_model import MIXABLE_STOCK
    from torchrec_herald.sharding.mixed import MIXABLE_STOCK_TYPES

    assert set(MIXABLE_STOCK) == set(MIXABLE_STOCK_TYPES)
