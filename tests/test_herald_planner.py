"""HeraldPlanner: the plan it returns (single process) and a 2-rank run of the driver with planner=herald.

Planning needs no process group: ``HeraldPlanner.plan`` on a W=2 ``Topology``, the default synthetic
config at scale 0.001 (the default model and batch size). The driver run is
``torchrec_herald.trainer.run_training`` with ``planner=herald`` and, for the comparison, the stock
``planner=table_wise``, 30 steps of 2 x 64 samples at the default data scale.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from torchrec_herald.dist_utils import run_multiprocess

W = 2
DRIVER = ["data.num_train_batches=30", "data.num_eval_batches=2", "batch_size=64"]


@functools.lru_cache(maxsize=None)
def _planned() -> Dict[str, Any]:
    from torchrec.distributed.planner import Topology

    from torchrec_herald.config import compose_config
    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import AccessStats, HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    cfg = compose_config(["planner=herald"])
    data = SyntheticCriteo(scale=0.001, seed=cfg.data.seed, zipf_alpha=cfg.data.zipf_alpha)
    tables = build_tables(data.feature_names, data.num_embeddings, cfg.model.embedding_dim, cfg.model.pooling)
    model = build_dlrm_train(tables, data.num_dense, cfg.model.dense_arch, cfg.model.over_arch, device="meta")
    B = cfg.batch_size
    sample = [b.sparse_features for _, b in zip(range(cfg.planner.stats_batches), data.train_batches(0, 1, W * B))]
    stats = AccessStats.from_batches(sample, tables)
    planner = HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=B, access_stats=stats,
                            hot_memory_budget_bytes=cfg.planner.hot_memory_budget_bytes)
    plan = planner.plan(model, [HeraldEmbeddingBagCollectionSharder()])
    return {"cfg": cfg, "tables": tables, "model": model, "stats": stats, "planner": planner, "plan": plan,
            "batch_size": B}


def test_planner_from_batches_counts_its_own_statistics_and_leaves_the_generator_alone() -> None:
    """``HeraldPlanner.from_batches`` (adoption without building AccessStats by hand) reads the first
    ``num_batches`` batches, takes the local batch size from them and plans the hot sets an explicit
    ``AccessStats`` of the same batches gives; a data loader drawing from the global generator while
    it is read leaves that generator as it was."""
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    p = _planned()
    n = p["cfg"].planner.stats_batches
    data = __import__("torchrec_herald.data", fromlist=["SyntheticCriteo"]).SyntheticCriteo(
        scale=0.001, seed=p["cfg"].data.seed, zipf_alpha=p["cfg"].data.zipf_alpha)
    read = []

    def loader() -> Any:
        for b in data.train_batches(0, 1, W * p["batch_size"]):
            torch.rand(1)  # a loader that draws from the global generator
            read.append(1)
            yield b

    torch.manual_seed(5)
    planner = HeraldPlanner.from_batches(loader(), num_batches=n, world_size=W, compute_device="cpu",
                                         batch_size=p["batch_size"],
                                         hot_memory_budget_bytes=p["cfg"].planner.hot_memory_budget_bytes)
    after = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(2)) and len(read) == n
    assert planner._topology.world_size == W and planner._topology.compute_device == "cpu"
    assert HeraldPlanner.from_batches(loader(), num_batches=1)._batch_size == W * p["batch_size"]  # the stride
    plan = _module_plan(planner.plan(p["model"], [HeraldEmbeddingBagCollectionSharder()]))
    for name, ps in _module_plan(p["plan"]).items():
        assert torch.equal(plan[name].hot.hot_ids, ps.hot.hot_ids), name
    assert planner.access_stats(p["tables"]).num_batches == n


def _module_plan(plan: Any) -> Dict[str, Any]:
    assert list(plan.plan) == ["model.sparse_arch.embedding_bag_collection"]
    return dict(plan.plan["model.sparse_arch.embedding_bag_collection"])


def test_plan_is_herald_with_stock_row_wise_layout() -> None:
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder, HeraldParameterSharding
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    p = _planned()
    herald = _module_plan(p["plan"])
    assert set(herald) == {t.name for t in p["tables"]}
    stock = _module_plan(stock_plan(p["model"], p["tables"], [CpuEmbeddingBagCollectionSharder()], "row_wise", W,
                                    p["batch_size"], torch.device("cpu")))
    for name, ps in herald.items():
        assert isinstance(ps, HeraldParameterSharding) and ps.sharding_type == HERALD_HOT_ROW_WISE, name
        assert stock[name].sharding_type == "row_wise"
        assert ps.ranks == stock[name].ranks == list(range(W)), name
        assert ps.sharding_spec == stock[name].sharding_spec, name


def test_hot_sets_are_the_cost_models() -> None:
    from torchrec_herald.planner import CostModelHotSetSelector

    p = _planned()
    herald = _module_plan(p["plan"])
    expected = CostModelHotSetSelector().select(p["stats"], p["tables"], W, p["batch_size"],
                                                p["cfg"].planner.hot_memory_budget_bytes)
    assert list(expected) == [t.name for t in p["tables"]]
    for name, choice in expected.items():
        assert torch.equal(herald[name].hot.hot_ids, choice.hot_ids), name
        assert herald[name].hot.sync == choice.sync, name
        assert herald[name].hot.expected == choice.expected.as_dict(), name
    assert sum(c.num_hot for c in expected.values()) > 0  # not vacuous: tables do get hot rows
    assert {c.sync for c in expected.values() if c.num_hot} <= {"dense", "sparse"}
    assert p["planner"].last_choices.keys() == expected.keys()


def test_describe_mentions_every_table() -> None:
    p = _planned()
    text = p["planner"].describe()
    lines = text.splitlines()
    for t in p["tables"]:
        assert any(line.split() and line.split()[0] == t.name for line in lines), t.name


def test_plan_survives_pickling() -> None:
    """collective_plan broadcasts the plan with broadcast_object_list (pickle): hot sets must survive."""
    from torchrec_herald.planner import herald_tables
    from torchrec_herald.sharding import HeraldParameterSharding

    plan = _planned()["plan"]
    back = pickle.loads(pickle.dumps(plan))
    before, after = herald_tables(plan), herald_tables(back)
    assert before.keys() == after.keys() and len(after) == 26
    for name in before:
        assert isinstance(_module_plan(back)[name], HeraldParameterSharding)
        assert after[name].hot_ids.dtype == torch.int64
        assert torch.equal(after[name].hot_ids, before[name].hot_ids), name
        assert after[name].sync == before[name].sync and after[name].expected == before[name].expected
        assert _module_plan(back)[name].sharding_spec == _module_plan(plan)[name].sharding_spec


# ---------------------------------------------------------------------- the driver, 2 ranks


def _drive(rank: int, world: int, runs: Dict[str, list], base: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return {name: run_training(compose_config(ov), Path(base) / name, show_progress=False)
            for name, ov in runs.items()}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> list:
    runs = {"herald": ["planner=herald", "planner.link_mbit=null"] + DRIVER, "table_wise": ["planner=table_wise"] + DRIVER}
    return run_multiprocess(_drive, W, runs, str(tmp_path_factory.mktemp("driver")), timeout_s=300)


def test_driver_herald_run(driver: list) -> None:
    m, tw = driver[0]["herald"], driver[0]["table_wise"]
    assert m["steps"] == 30 and m["world_size"] == W
    assert set(m["plan"].values()) == {"herald_hot_row_wise"}
    assert m["train_logloss"] < m["train_logloss_first"] - 0.05
    h = m["herald"]
    assert sum(h["hot_rows"].values()) > 0
    # the cost model's prediction vs what the sharded module counted
    assert h["measured_total"] == pytest.approx(h["predicted_total"], rel=0.15)
    # the module's per-table counters agree with TrafficMeter's herald tags (herald_meta is not per table)
    tags = m["traffic_per_step_by_tag"]
    metered = sum(s["bytes"] for k, s in tags.items() if k.startswith("herald_") and k != "herald_meta")
    assert {"herald_hot_sync", "herald_ids", "herald_pooled", "herald_pooled_grad"} <= set(tags)
    assert sum(h["measured_bytes_per_step"].values()) == pytest.approx(metered, rel=0.01)
    assert h["measured_total"] == pytest.approx(sum(h["measured_bytes_per_step"].values()))
    # fewer embedding vectors per step than stock TABLE_WISE on the same config
    assert set(tw["plan"].values()) == {"table_wise"} and tw["herald"] == {}
    assert 0 < m["traffic_per_step_total"]["embedding_vectors"] < tw["traffic_per_step_total"]["embedding_vectors"]
    # and it trains the same model (losses are means over ranks and steps)
    assert m["train_logloss"] == pytest.approx(tw["train_logloss"], rel=1e-5)
    assert m["train_logloss_first"] == pytest.approx(tw["train_logloss_first"], rel=1e-5)


def test_driver_ranks_agree_on_the_broadcast_plan(driver: list) -> None:
    """Rank 1 runs with the plan rank 0 planned and broadcast (collective_plan)."""
    a, b = driver[0]["herald"]["herald"], driver[1]["herald"]["herald"]
    assert a["hot_rows"] == b["hot_rows"] and a["sync"] == b["sync"]
    assert a["predicted_bytes_per_step"] == b["predicted_bytes_per_step"]
    assert driver[0]["herald"]["traffic_per_step_by_tag"] == driver[1]["herald"]["traffic_per_step_by_tag"]


def test_the_default_plans_data_parallel_tables_are_one_info_line_not_a_warning_each(
        caplog: pytest.LogCaptureFixture) -> None:
    """TorchRec's planner warns once per table without a sharding spec, which every DATA_PARALLEL table
    is by design; ``stock_plan`` folds those warnings into one info line naming the tables."""
    import logging

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner.stock import describe_plan, stock_plan
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder

    data = SyntheticCriteo(scale=0.001)
    tables = build_tables(data.feature_names, data.num_embeddings, 16)
    model = build_dlrm_train(tables, data.num_dense, [64, 16], [64, 1], device="meta")
    with caplog.at_level(logging.INFO):
        plan = stock_plan(model, tables, [CpuEmbeddingBagCollectionSharder()], "default", 2, 64, torch.device("cpu"))
    dp = [t for t, kind in describe_plan(plan).items() if kind == "data_parallel"]
    assert dp  # the default plan at W=2 replicates the small tables
    assert not [r for r in caplog.records if "Sharding spec not found" in r.getMessage()]
    [line] = [r.getMessage() for r in caplog.records if "DATA_PARALLEL table(s)" in r.getMessage()]
    assert line.startswith(f"TorchRec's default plan: {len(dp)} DATA_PARALLEL table(s) ({', '.join(dp)})")
    assert not logging.getLogger().filters  # the fold is scoped to the planning


def test_tables_constrained_to_stock_types_keep_them_beside_herald_tables() -> None:
    """``ParameterConstraints`` naming sharding types without ROW_WISE keep their tables stock, in the same
    EBC (they were overridden to herald's type silently); every other table is herald's."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    p = _planned()
    names = [t.name for t in p["tables"]]
    constraints = {names[0]: ParameterConstraints(sharding_types=["data_parallel", "column_wise"]),
                   names[1]: ParameterConstraints(sharding_types=["table_wise"]),
                   names[2]: ParameterConstraints(sharding_types=["row_wise", "table_wise"])}  # row-wise allowed
    planner = HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=p["batch_size"],
                            access_stats=p["stats"], constraints=constraints)
    types = {t: ps.sharding_type for t, ps in _module_plan(planner.plan(p["model"],
                                                                         [HeraldEmbeddingBagCollectionSharder()])).items()}
    assert (types[names[0]], types[names[1]]) == ("column_wise", "table_wise")  # (no DATA_PARALLEL beside herald)
    assert {types[n] for n in names[2:]} == {HERALD_HOT_ROW_WISE}
    assert set(planner.last_choices) == set(names[2:])  # hot sets chosen for herald's tables only
    alone = {names[0]: ParameterConstraints(sharding_types=["data_parallel"])}
    with pytest.raises(ValueError) as e:
        HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=p["batch_size"],
                      access_stats=p["stats"], constraints=alone).plan(p["model"], [HeraldEmbeddingBagCollectionSharder()])
    assert str(e.value) == (f"table {names[0]}: its ParameterConstraints allow ['data_parallel'], which cannot sit beside "
                            f"herald tables in one EBC (its own DDP would sync it outside herald's dense sync); allow "
                            f"one of ['table_wise', 'row_wise', 'column_wise', 'table_row_wise', 'table_column_wise'], "
                            f"or put it in an EBC of its own")


def test_an_embedding_collection_beside_the_ebc_is_planned_by_torchrec() -> None:
    """A model with an ``EmbeddingCollection`` (sequence embeddings) beside its EBC: herald plans the EBC and
    leaves the EC's plan to TorchRec (it turned the EC's tables into herald's type, which TorchRec's EC sharder
    refused inside DMP)."""
    from torch import nn
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    class TwoKinds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=100,
                                                                  feature_names=["fb"])], device=torch.device("meta"))
            self.ec = EmbeddingCollection([EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=100,
                                                           feature_names=["fs"])], device=torch.device("meta"))

    kjt = KeyedJaggedTensor.from_lengths_sync(["fb"], torch.arange(16) % 100, torch.ones(16, dtype=torch.int32))
    planner = HeraldPlanner.from_batches([kjt] * 3, world_size=W, compute_device="cpu")
    plan = planner.plan(TwoKinds(), [HeraldEmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()])
    assert {t: ps.sharding_type for t, ps in plan.plan["ebc"].items()} == {"b": HERALD_HOT_ROW_WISE}
    assert plan.plan["ec"]["s"].sharding_type in ("row_wise", "table_wise", "column_wise", "data_parallel")


def test_two_towers_sharing_a_feature_are_planned_and_a_table_name_two_ebcs_use_is_named() -> None:
    """A two-tower model whose EBCs both read one KJT key: each tower's table gets the hot rows of its own
    counts (it was refused as a feature 'served by two tables'). Two EBCs naming a table alike are refused
    with one line naming both EBCs and the table (herald plans tables by name)."""
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    def tower(*tables: tuple) -> EmbeddingBagCollection:
        return EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=rows,
                                                          feature_names=[f]) for n, f, rows in tables],
                                      device=torch.device("meta"))

    class TwoTowers(nn.Module):
        def __init__(self, user_table: str) -> None:
            super().__init__()
            self.user = nn.Module()
            self.user.ebc = tower((user_table, "geo", 64), ("uid", "uid", 100))
            self.item = tower(("item_geo", "geo", 64), ("iid", "iid", 100))

    geo = torch.tensor([3, 3, 3, 3, 7, 7, 7, 1, 2, 5, 9, 11, 13, 17, 19, 23])  # (3 and 7 are hot)
    kjt = KeyedJaggedTensor.from_lengths_sync(["geo", "uid", "iid"], torch.cat([geo, torch.arange(16), torch.arange(16)]),
                                              torch.ones(48, dtype=torch.int32))
    planner = HeraldPlanner.from_batches([kjt] * 4, world_size=W, compute_device="cpu", hot_memory_budget_bytes=4096)
    plan = planner.plan(TwoTowers("user_geo"), [HeraldEmbeddingBagCollectionSharder()])
    assert {t: ps.sharding_type for m in ("user.ebc", "item") for t, ps in plan.plan[m].items()} == {
        t: HERALD_HOT_ROW_WISE for t in ("user_geo", "uid", "item_geo", "iid")}
    stats = planner.access_stats([c for m in (TwoTowers("user_geo").user.ebc, TwoTowers("user_geo").item)
                                  for c in m.embedding_bag_configs()])
    assert torch.equal(stats.counts["user_geo"], stats.counts["item_geo"])
    assert torch.equal(planner.last_choices["user_geo"].hot_ids, planner.last_choices["item_geo"].hot_ids)
    assert {3, 7} <= set(planner.last_choices["user_geo"].hot_ids.tolist())
    with pytest.raises(ValueError) as e:
        planner.plan(TwoTowers("item_geo"), [HeraldEmbeddingBagCollectionSharder()])
    assert str(e.value) == ("HeraldPlanner: EBCs 'user.ebc' and 'item' both have a table named 'item_geo'; herald plans "
                            "the tables of every EBC by name (hot sets, constraints): give each table a name of its own")

    class OneTowerTwoReaders(nn.Module):  # (TorchRec allows two tables of one EBC to read one key)
        def __init__(self) -> None:
            super().__init__()
            self.ebc = tower(("geo_a", "geo", 64), ("geo_b", "geo", 64), ("uid", "uid", 100))

    with pytest.raises(ValueError) as e:
        HeraldPlanner.from_batches([kjt] * 4, world_size=W, compute_device="cpu").plan(
            OneTowerTwoReaders(), [HeraldEmbeddingBagCollectionSharder()])
    assert str(e.value) == ("HeraldPlanner: EBC 'ebc': feature 'geo' is read by two of its tables, 'geo_a' and 'geo_b'; "
                            "herald's sharding maps a feature to one table: keep one of them stock "
                            "(ParameterConstraints(sharding_types=[...]) without row_wise), or put it in an EBC of its own")


def _collective_plan_error(rank: int, world: int) -> str:
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    model = nn.Module()
    model.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=64,
                                                           feature_names=["geo"]) for n in ("geo_a", "geo_b")],
                                       device=torch.device("meta"))
    kjt = KeyedJaggedTensor.from_lengths_sync(["geo"], torch.arange(16) % 64, torch.ones(16, dtype=torch.int32))
    try:
        HeraldPlanner.from_batches([kjt] * 2, compute_device="cpu").collective_plan(
            model, [HeraldEmbeddingBagCollectionSharder()])
    except ValueError as e:
        return str(e)
    return "planned"


def _torchrec_runtime_error(rank: int, world: int) -> str:
    from torch import nn
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    model = nn.Module()
    model.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=64,
                                                           feature_names=[n]) for n in ("a", "b")],
                                       device=torch.device("meta"))
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.arange(16) % 64, torch.ones(16, dtype=torch.int32))
    # a stock type with a kernel no CPU sharder offers: TorchRec's enumerator raises a RuntimeError
    constraints = {"b": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["quant"])}
    try:
        HeraldPlanner.from_batches([kjt] * 2, compute_device="cpu", constraints=constraints).collective_plan(
            model, [HeraldEmbeddingBagCollectionSharder()])
    except RuntimeError as e:
        return str(e)
    return "planned"


def _rank_own_batches_plan(rank: int, world: int) -> Dict[str, Any]:
    """Each rank's sample batches hot in other rows (rank 0: ids 0-7, rank 1: 32-39); a refused model on rank 0
    alone. What each rank plans alone, and what ``collective_plan`` gives it."""
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner, herald_tables
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    def model(features: List[str]) -> nn.Module:
        m = nn.Module()
        m.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=64,
                                                           feature_names=[f]) for i, f in enumerate(features)],
                                       device=torch.device("meta"))
        return m

    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(64) % 8 + 32 * rank, torch.ones(64, dtype=torch.int32))

    def planner() -> HeraldPlanner:
        return HeraldPlanner.from_batches([kjt] * 2, compute_device="cpu")

    sharders = [HeraldEmbeddingBagCollectionSharder()]
    out: Dict[str, Any] = {
        "own": herald_tables(planner().plan(model(["f"]), sharders))["t0"].hot_ids.tolist(),
        "shared": herald_tables(planner().collective_plan(model(["f"]), sharders))["t0"].hot_ids.tolist()}
    try:  # rank 0's model reads one feature with two tables (refused); rank 1's plans
        planner().collective_plan(model(["f", "f"] if rank == 0 else ["f"]), sharders)
        out["error"] = "planned"
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_every_rank_trains_rank_0s_plan_or_raises_rank_0s_planning_error() -> None:
    """``collective_plan``: rank 0 plans and every rank takes its plan, or its error, where its own sample batches
    would have planned other hot rows, or planned at all."""
    r = run_multiprocess(_rank_own_batches_plan, 2, timeout_s=120)
    assert r[0]["own"] == list(range(8)) and r[1]["own"] == list(range(32, 40))
    assert r[0]["shared"] == r[1]["shared"] == list(range(8))
    assert r[0]["error"] == r[1]["error"] and r[0]["error"].startswith("HeraldPlanner: EBC 'ebc': feature 'f' is read "
                                                                      "by two"), r


def test_torchrecs_planning_runtime_error_is_raised_on_every_rank_alike() -> None:
    """TorchRec's planner raises a RuntimeError for a table whose constraints allow no sharding type and kernel:
    rank 0 alone raised it, and rank 1 saw its connection close (under NCCL: a wait until the timeout)."""
    errors = run_multiprocess(_torchrec_runtime_error, 2, timeout_s=120)
    assert errors[0] == errors[1] and "No available sharding type and compute kernel combination" in errors[0], errors


def test_a_planning_error_is_raised_on_every_rank_alike() -> None:
    """``collective_plan``: rank 0 plans; its ValueError reaches every rank (TorchRec's broadcast left the other
    ranks waiting for a plan, until rank 0's process ended)."""
    errors = run_multiprocess(_collective_plan_error, 2, timeout_s=120)
    assert errors[0] == errors[1] and errors[0].startswith("HeraldPlanner: EBC 'ebc': feature 'geo' is read by two")


_MIXABLE = "['table_wise', 'row_wise', 'column_wise', 'table_row_wise', 'table_column_wise']"


@pytest.mark.parametrize("tables, why, fix", [
    # an FP16 table beside FP32 ones: herald's sharding holds FP32 rows
    ([("t0", 8, "FP32"), ("t1", 8, "FP16")], "it is FP16, and herald's sharding holds FP32 rows", "make it FP32"),
    # a table of the EBC's other embedding dim: herald's sharding holds one dim an EBC
    ([("t0", 16, "FP32"), ("t2", 16, "FP32"), ("t1", 8, "FP32")],
     "it is of dim 8, and herald's sharding holds one dim an EBC (dim 16 there: its tables' sampled lookups move the "
     "most bytes)", "give it dim 16, or put it in an EBC of its own"),
])
def test_a_table_kept_stock_whose_constraints_allow_only_heralds_type_is_refused_naming_it(
        tables: List[Tuple[str, int, str]], why: str, fix: str) -> None:
    """A table herald cannot hold beside the EBC's herald tables (FP16, or of the other embedding dim) keeps a stock
    type there; one whose ``ParameterConstraints`` allow herald's type alone got a stock type silently (a user's
    explicit setting overridden): refused, naming the table and why it cannot be herald's."""
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_herald.planner import AccessStats, HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=20, feature_names=[f"f_{n}"],
                                  data_type=DataType[dt]) for n, d, dt in tables]
    model = torch.nn.Module()
    model.sparse = EmbeddingBagCollection(configs, device=torch.device("meta"))
    planner = HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=4,
                            access_stats=AccessStats.empty(configs),
                            constraints={"t1": ParameterConstraints(sharding_types=[HERALD_HOT_ROW_WISE])})
    with pytest.raises(ValueError) as e:
        planner.plan(model, [HeraldEmbeddingBagCollectionSharder()])
    assert str(e.value) == (f"table t1: its ParameterConstraints allow ['herald_hot_row_wise'], but {why}; allow a "
                            f"stock type that can sit beside herald's tables ({_MIXABLE}), or {fix}")


def test_a_weighted_ebcs_tables_keep_a_stock_type_beside_a_herald_ebc(caplog: pytest.LogCaptureFixture) -> None:
    """Herald's sharding has no per-sample weights: HeraldPlanner gave a weighted EBC's tables herald's type, and
    herald's own sharder then refused the plan. They keep a stock type, said in one line; the other EBC is herald's."""
    import logging

    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_herald.planner import AccessStats, HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    def tables(*names: str) -> List[EmbeddingBagConfig]:
        return [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=20, feature_names=[f"f_{n}"]) for n in names]

    model = torch.nn.Module()
    model.weighted = EmbeddingBagCollection(tables("w0"), is_weighted=True, device=torch.device("meta"))
    model.plain = EmbeddingBagCollection(tables("u1", "u2"), device=torch.device("meta"))
    planner = HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=4,
                            access_stats=AccessStats.empty(tables("w0", "u1", "u2")))
    with caplog.at_level(logging.INFO, logger="torchrec_herald.planner.planner"):
        plan = planner.plan(model, [HeraldEmbeddingBagCollectionSharder()])
    types = {t: ps.sharding_type for fqn in ("weighted", "plain") for t, ps in plan.plan[fqn].items()}
    assert types["u1"] == types["u2"] == HERALD_HOT_ROW_WISE
    assert types["w0"] != HERALD_HOT_ROW_WISE
    assert ("HeraldPlanner: EBC 'weighted' is weighted (is_weighted=True), and herald's sharding has no per-sample "
            "weights: its tables w0 keep a stock type") in caplog.messages
    # one whose constraints allow herald's type alone: refused naming it (it reached TorchRec's planner, whose
    # RuntimeError named no reason)
    planner = HeraldPlanner(topology=Topology(world_size=W, compute_device="cpu"), batch_size=4,
                            access_stats=AccessStats.empty(tables("w0", "u1", "u2")),
                            constraints={"w0": ParameterConstraints(sharding_types=[HERALD_HOT_ROW_WISE])})
    with pytest.raises(ValueError) as e:
        planner.plan(model, [HeraldEmbeddingBagCollectionSharder()])
    assert str(e.value) == ("table w0: its ParameterConstraints allow ['herald_hot_row_wise'], but its EBC 'weighted' "
                            "is weighted (is_weighted=True), and herald's sharding has no per-sample weights; allow a "
                            "stock sharding type")


def test_cold_blocks_the_gpus_cannot_hold_are_a_planning_error_not_a_host_memory_kernel() -> None:
    """Planning for GPUs whose memory holds less than a table's row-wise block: TorchRec's planner picked
    ``fused_uvm_caching`` (rows in host memory) and herald's plan rewrote it to ``fused``, allocated whole on the
    device (an out-of-memory error as the model was built). Herald's blocks are fused only: the planner refuses."""
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    rows, dim = 4_000_000, 128  # 1 GiB of fp32 rows per rank, row-wise over 2
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=dim, num_embeddings=rows,
                                                            feature_names=["f0"])], device=torch.device("meta"))
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.randint(0, rows, (512,)), lengths=torch.ones(512, dtype=torch.int64))

    def plan(hbm: int) -> Any:
        topology = Topology(world_size=2, local_world_size=2, compute_device="cuda", hbm_cap=hbm, ddr_cap=64 << 30)
        return HeraldPlanner(topology=topology, batch_size=512, sample_batches=[kjt],
                             hot_memory_budget_bytes=1 << 20).plan(ebc, [HeraldEmbeddingBagCollectionSharder()])

    with pytest.raises(PlannerError, match="does not fit on any rank"):
        plan(600 << 20)
    roomy = plan(8 << 30).plan[""]["t0"]
    assert (roomy.sharding_type, roomy.compute_kernel) == ("herald_hot_row_wise", "fused")
