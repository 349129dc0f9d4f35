"""Bad input fails fast and clearly: bad ids (on every rank, no hang), missing features, planner misuse;
a plan mixing herald and stock tables in one EBC is not bad input (it shards into a mixed EBC).

The 2-rank checks run in one process group; the worker catches each error and returns its message, so
both ranks' messages are asserted (``run_multiprocess``'s ``timeout_s`` turns a hang into a failure).
The planner checks need no process group.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List

import pytest
import torch

from herald_harness import error_of
from torchrec_herald.dist_utils import run_multiprocess

BAD_FEATURE = "cat_3"  # table t_cat_3: 2203 rows at scale 0.001
BAD_POS = 5  # the bad id replaces the id of sample 5
MISSING_FEATURE = "cat_7"


def _with_id(batch: Any, feature: str, pos: int, value: int) -> Any:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.sparse_features
    f = kjt.keys().index(feature)
    values = kjt.values().clone()
    values[sum(kjt.length_per_key()[:f]) + pos] = value
    return Batch(batch.dense_features, KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths()),
                 batch.labels)


def _without(batch: Any, feature: str) -> Any:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.sparse_features
    return Batch(batch.dense_features, KeyedJaggedTensor.from_jt_dict({k: kjt[k] for k in kjt.keys() if k != feature}),
                 batch.labels)


_error = error_of


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.distributed import DistributedModelParallel

    from herald_harness import build, full_state, make_data, run_steps
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder, HotSpec

    h = build(world, dict(planner="herald", steps=3))
    ref = build(world, dict(planner="herald", steps=3))  # the same model that sees no bad input, for comparison
    dmp, data = h["dmp"], h["data"]
    batch = next(iter(data.train_batches(rank, world, h["batch_size"])))
    n = dict(zip(data.feature_names, data.num_embeddings))[BAD_FEATURE]
    out: Dict[str, Any] = {"num_embeddings": n}
    # a bad id in rank 1's batch only: every rank must raise (rank 0's batch is fine)
    for name, bad in (("too_large", n), ("negative", -1)):
        b = _with_id(batch, BAD_FEATURE, BAD_POS, bad) if rank == 1 else batch
        out[name] = _error(lambda: dmp(b))
    # the same on the input dist's worker thread (a GPU's default): raised in the training thread, every rank
    from torchrec_herald.pipeline.context import find_herald_ebc

    ebc = find_herald_ebc(dmp)
    ebc.input_dist_in_thread = True
    out["too_large_in_thread"] = _error(lambda: dmp(_with_id(batch, BAD_FEATURE, BAD_POS, n) if rank == 1 else batch))
    out["thread_losses_after"] = run_steps(dmp, h["optimizer"], data.train_batches(rank, world, h["batch_size"]))
    out["ref_losses_1"] = run_steps(ref["dmp"], ref["optimizer"], ref["data"].train_batches(rank, world, ref["batch_size"]))
    ebc.input_dist_in_thread = None
    # a KJT without one of the EBC's features (every rank: a data pipeline bug)
    out["missing"] = _error(lambda: dmp(_without(batch, MISSING_FEATURE)))
    # per-sample weights are not supported by the herald sharding: a clear error, not silently ignored
    kjt = batch.sparse_features
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    weighted = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                 weights=torch.ones(kjt.values().numel()))
    out["weighted"] = _error(lambda: dmp(Batch(batch.dense_features, weighted, batch.labels)))
    # the module is still usable after those errors
    out["losses_after"] = run_steps(dmp, h["optimizer"], data.train_batches(rank, world, h["batch_size"]))
    out["ref_losses_2"] = run_steps(ref["dmp"], ref["optimizer"], ref["data"].train_batches(rank, world, ref["batch_size"]))
    mine, theirs = full_state(dmp), full_state(ref["dmp"])
    out["state_as_ref"] = sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)

    # one EBC whose plan mixes herald and stock tables: a mixed EBC (tests/test_mixed_sharding.py trains it)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    data = make_data({})
    tables = build_tables(data.feature_names, data.num_embeddings, 8)
    model = build_dlrm_train(tables, data.num_dense, [16, 8], [16, 1], seed=0, device="cpu")
    sharder = HeraldEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                "learning_rate": 0.1})
    row_wise = stock_plan(model, tables, [sharder], "row_wise", world, 32, torch.device("cpu"))
    plan = herald_plan_from_row_wise(row_wise, {t.name: HotSpec(torch.arange(2)) for t in tables})
    fqn = next(iter(plan.plan))
    plan.plan[fqn]["t_cat_4"] = row_wise.plan[fqn]["t_cat_4"]  # type: ignore[index]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    out["mixed"] = [(type(m).__name__, m.herald_tables, m.stock_tables) for m in dmp.modules()
                    if hasattr(m, "stock_tables")]
    # each rank its own hot set (a plan made on each rank from its own batches): refused on every rank
    model = build_dlrm_train(tables, data.num_dense, [16, 8], [16, 1], seed=0, device="cpu")
    apart = herald_plan_from_row_wise(row_wise, {t.name: HotSpec(torch.arange(2 + rank if t.name == "t_cat_7" else 2))
                                                 for t in tables})
    out["plans_apart"] = _error(lambda: DistributedModelParallel(model, device=torch.device("cpu"), plan=apart,
                                                                 sharders=[sharder]))
    return out


@functools.lru_cache(maxsize=None)
def results() -> List[Dict[str, Any]]:
    return run_multiprocess(_worker, 2, timeout_s=180)


@pytest.mark.parametrize("name", ["too_large", "negative", "too_large_in_thread"])
def test_bad_id_on_one_rank_raises_on_every_rank(name: str) -> None:
    res = results()
    bad = res[0]["num_embeddings"] if name.startswith("too_large") else -1
    for r in res:
        msg = r[name]
        assert msg.startswith("ValueError: "), msg
        assert f"id {bad} " in msg and f"'{BAD_FEATURE}'" in msg and f"'t_{BAD_FEATURE}'" in msg, msg
        assert f"[0, {res[0]['num_embeddings']})" in msg and "rank 1" in msg, msg


def _one_rank_worker(rank: int, world: int) -> Dict[str, Any]:
    """One rank with no hot rows, as the cost model plans one (its input dist sends nothing): a bad id, then
    the module trained on, by the compiled pass and by the torch ops (a GPU's path)."""
    from herald_harness import build, run_steps
    from torchrec_herald.pipeline.context import find_herald_ebc

    out: Dict[str, Any] = {}
    for path in ("compiled", "torch"):
        # (the trainer's cost model replicates no row at one rank; the harness's plan, given this minimum count)
        h = build(world, dict(planner="herald", steps=3, torch_ids=path == "torch", hot_min_count=10 ** 9))
        dmp, data = h["dmp"], h["data"]
        batch = next(iter(data.train_batches(rank, world, h["batch_size"])))
        n = dict(zip(data.feature_names, data.num_embeddings))[BAD_FEATURE]
        out["num_embeddings"], out[f"num_hot_{path}"] = n, find_herald_ebc(dmp)._num_hot
        for name, bad in (("too_large", n), ("negative", -1)):
            out[f"{name}_{path}"] = _error(lambda: dmp(_with_id(batch, BAD_FEATURE, BAD_POS, bad)))
        out[f"losses_after_{path}"] = run_steps(dmp, h["optimizer"], data.train_batches(rank, world, h["batch_size"]))
        ref = build(world, dict(planner="herald", steps=3, torch_ids=path == "torch", hot_min_count=10 ** 9))
        out[f"ref_losses_{path}"] = run_steps(ref["dmp"], ref["optimizer"],
                                              ref["data"].train_batches(rank, world, ref["batch_size"]))
    return out


@pytest.mark.parametrize("name", ["too_large", "negative"])
@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_bad_id_at_one_rank_without_hot_rows_is_the_same_clear_error(name: str, path: str) -> None:
    """One rank, no hot rows: the ids go to the lookup with no split or exchange, and an id outside its table is
    still one ValueError naming the id, the feature, the table and its range, raised before the forward."""
    r = run_multiprocess(_one_rank_worker, 1, timeout_s=180)[0]
    n = r["num_embeddings"]
    assert r[f"num_hot_{path}"] == 0
    msg = r[f"{name}_{path}"]
    bad = n if name == "too_large" else -1
    assert msg.startswith(f"ValueError: id {bad} of feature '{BAD_FEATURE}' is outside table 't_{BAD_FEATURE}' "
                          f"[0, {n}) (in rank 0's batch"), msg
    assert len(r[f"losses_after_{path}"]) == 3 and r[f"losses_after_{path}"] == r[f"ref_losses_{path}"]  # as if unseen


def test_missing_feature_is_a_clear_error() -> None:
    for r in results():
        assert r["missing"].startswith("ValueError: "), r["missing"]
        assert f"'{MISSING_FEATURE}'" in r["missing"] and "missing from the input KJT" in r["missing"]


#: a KJT with weights reaching herald's (unweighted) EBC: named, with the two ways out (it said "plan weighted tables
#: with a stock sharding type", which a user whose weighted EBC is already stock had done)
WEIGHTED = ("ValueError: the KJT this EBC reads carries per-sample weights; herald's tables t_cat_0, t_cat_1, t_cat_2, "
            "t_cat_3, … (26 in all) (features cat_0, cat_1, cat_2, cat_3, … (26 in all)) read it, and herald's sharding "
            "has no per-sample weights (TorchRec's sharded EBC applies a KJT's weights even where is_weighted=False): "
            "give their EBC a KJT without weights (a weighted EBC a KJT of its own), or keep these tables stock "
            "(ParameterConstraints without row_wise)")


def test_weighted_kjt_is_a_clear_error() -> None:
    for r in results():
        assert r["weighted"] == WEIGHTED, r["weighted"]


def test_module_still_trains_after_input_errors() -> None:
    """Refused batches leave nothing behind: the module then trains exactly as the same module that never saw them
    (the same losses, step for step, and the same weights)."""
    for r in results():
        assert len(r["thread_losses_after"]) == 3 and r["thread_losses_after"] == r["ref_losses_1"]
        assert len(r["losses_after"]) == 3 and r["losses_after"] == r["ref_losses_2"]
        assert r["state_as_ref"]


def test_herald_and_stock_tables_in_one_ebc_shard_into_a_mixed_ebc() -> None:
    for r in results():
        [(kind, herald, stock)] = r["mixed"]
        assert kind == "ShardedMixedEmbeddingBagCollection" and stock == ["t_cat_4"]
        assert len(herald) == 25 and "t_cat_4" not in herald


# ---------------------------------------------------------------------- planner (no process group)


@functools.lru_cache(maxsize=None)
def _model_and_stats() -> tuple:
    from herald_harness import make_data
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import AccessStats

    data = make_data({})
    tables = build_tables(data.feature_names, data.num_embeddings, 8)
    model = build_dlrm_train(tables, data.num_dense, [16, 8], [16, 1], device="meta")
    sample = [b.sparse_features for _, b in zip(range(4), data.train_batches(0, 1, 64))]
    return data, tables, model, AccessStats.from_batches(sample, tables)


def _planner(**kwargs: Any) -> Any:
    from torchrec.distributed.planner import Topology

    from torchrec_herald.planner import HeraldPlanner

    return HeraldPlanner(topology=Topology(world_size=2, compute_device="cpu"), batch_size=32, **kwargs)


def _herald_sharder() -> Any:
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    return HeraldEmbeddingBagCollectionSharder()


def test_budget_below_one_row_gives_a_herald_plan_without_hot_rows(caplog: pytest.LogCaptureFixture) -> None:
    """Never a stock plan labelled herald: every table is herald_hot_row_wise with no hot rows, and one
    warning names the key and the smallest budget that would replicate a row."""
    from torchrec_herald.planner import herald_tables
    from torchrec_herald.planner.stock import describe_plan
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    _, _, model, stats = _model_and_stats()
    row_bytes = 8 * 4 + 4  # dim 8 fp32 weights + the row-wise Adagrad state
    planner = _planner(access_stats=stats, hot_memory_budget_bytes=row_bytes - 1)
    with caplog.at_level(logging.WARNING, logger="torchrec_herald"):
        plan = planner.plan(model, [_herald_sharder()])
    specs = herald_tables(plan)
    assert set(describe_plan(plan).values()) == {HERALD_HOT_ROW_WISE} and len(specs) == len(describe_plan(plan))
    assert all(s.hot_ids.numel() == 0 and s.sync == "none" for s in specs.values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and r.name.startswith("torchrec_herald")]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"planner.hot_memory_budget_bytes: a budget of {row_bytes - 1} B per rank is "
                                  f"smaller than one hot row ({row_bytes} B, the smallest budget"), warnings[0]


def test_budget_above_rank_memory_is_rejected_at_construction() -> None:
    from torchrec.distributed.planner import Topology

    _, _, _, stats = _model_and_stats()
    ddr = Topology(world_size=2, compute_device="cpu").devices[0].storage.ddr
    with pytest.raises(ValueError, match=rf"hot_memory_budget_bytes={ddr + 1} is more than a rank can hold"):
        _planner(access_stats=stats, hot_memory_budget_bytes=ddr + 1)
    _planner(access_stats=stats, hot_memory_budget_bytes=ddr)  # exactly a rank's DDR is allowed


def test_stats_of_other_tables_are_rejected_naming_the_table() -> None:
    from torchrec_herald.model import build_tables
    from torchrec_herald.planner import AccessStats

    data, tables, model, _ = _model_and_stats()
    sizes = list(data.num_embeddings)
    sizes[9] += 1  # t_cat_9 one row larger than the model's
    with pytest.raises(ValueError, match=r"table 't_cat_9': the access stats have \d+ rows but the model's table"):
        _planner(access_stats=AccessStats.empty(build_tables(data.feature_names, sizes, 8))).plan(model, [_herald_sharder()])
    with pytest.raises(ValueError, match=r"table 't_cat_25' of the model is not in the access stats"):
        _planner(access_stats=AccessStats.empty(tables[:-1])).plan(model, [_herald_sharder()])


def test_planner_without_access_stats() -> None:
    needs = (r"HeraldPlanner needs access statistics: HeraldPlanner.from_batches\(sample_batches, ...\) or "
             r"access_stats=")
    with pytest.raises(ValueError, match=needs):
        _planner()
    with pytest.raises(ValueError, match=needs):
        _planner(stats=[])  # TorchRec planner Stats reporters are not access statistics
    with pytest.raises(TypeError, match="pass access statistics as access_stats="):
        from torchrec_herald.planner import AccessStats

        _planner(stats=AccessStats.empty([]))  # TorchRec's argument name is not reused for another type


def test_planner_from_batches_rejects_what_it_cannot_count() -> None:
    from torchrec_herald.planner import HeraldPlanner

    with pytest.raises(ValueError, match="HeraldPlanner.from_batches: num_batches must be an integer >= 1, got 0"):
        HeraldPlanner.from_batches([], num_batches=0)
    with pytest.raises(ValueError, match="^HeraldPlanner.from_batches: num_batches must be an integer >= 1, got 'x'$"):
        HeraldPlanner.from_batches([], num_batches="x")
    with pytest.raises(ValueError, match="^HeraldPlanner.from_batches: world_size must be an integer >= 1, got 0$"):
        HeraldPlanner.from_batches([], world_size=0)
    with pytest.raises(ValueError, match="^HeraldPlanner.from_batches: batch_size must be an integer >= 1, got 0$"):
        HeraldPlanner.from_batches([], batch_size=0)
    with pytest.raises(ValueError, match="^HeraldPlanner.from_batches: compute_device must be 'cpu' or 'cuda', got 'tpu'$"):
        HeraldPlanner.from_batches([], compute_device="tpu")
    with pytest.raises(ValueError, match="HeraldPlanner.from_batches: the batches iterable yielded no batch"):
        HeraldPlanner.from_batches(iter([]))
    with pytest.raises(ValueError, match="expected Batch or KeyedJaggedTensor items, got Tensor"):
        HeraldPlanner.from_batches([torch.zeros(3)])


def test_an_embedding_optimizer_herald_cannot_reproduce_names_the_tables_and_the_way_out() -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_herald.sharding.hot_replicated import fused_params_of

    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=10, feature_names=[f])
                                  for n, f in (("ta", "fa"), ("tb", "fb"))], device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError) as e:
        fused_params_of(ebc, None)
    assert str(e.value) == (
        "herald_hot_row_wise reproduces ['EXACT_SGD', 'EXACT_ROWWISE_ADAGRAD'] exactly; the EBC of tables ta, tb uses "
        "exact_adagrad: use SGD or RowWiseAdagrad, or keep these tables stock (ParameterConstraints(sharding_types="
        "[...]) without row_wise, given to HeraldPlanner)")


def test_an_optimizer_setting_herald_would_ignore_is_refused_naming_the_tables() -> None:
    """Gradient clipping, max norm or weight decay with a decay mode change stock TorchRec's update (fbgemm's TBE);
    herald's would have trained without them, silently: refused at sharding, naming the setting and the tables.
    ``weight_decay`` without a mode (fbgemm's default NONE) changes nothing in stock's update either: accepted,
    through ``fused_params`` and through ``apply_optimizer_in_backward`` (torch's SGD takes it)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_herald.sharding.hot_replicated import fused_params_of

    def ebc() -> EmbeddingBagCollection:
        return EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=10,
                                                          feature_names=[f]) for n, f in (("ta", "fa"), ("tb", "fb"))],
                                      device=torch.device("meta"))

    sgd = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    for extra, named in ((dict(gradient_clipping=True, max_gradient=1e-3), "gradient_clipping=True"),
                         (dict(max_norm=1.0), "max_norm=1.0"),
                         (dict(weight_decay=0.01, weight_decay_mode=WeightDecayMode.L2),
                          "weight_decay=0.01 with weight_decay_mode=L2")):
        with pytest.raises(ValueError) as e:
            fused_params_of(ebc(), {**sgd, **extra})
        assert str(e.value) == (
            f"herald_hot_row_wise does not reproduce the embedding optimizer's {named} (the EBC of tables ta, tb): drop "
            f"it from fused_params / apply_optimizer_in_backward's arguments, or keep these tables stock "
            f"(ParameterConstraints(sharding_types=[...]) without row_wise, given to HeraldPlanner)")
    # (their defaults given explicitly, and a weight decay without a mode, change nothing: accepted)
    accepted = fused_params_of(ebc(), {**sgd, "gradient_clipping": False, "weight_decay": 0.01, "max_norm": 0.0,
                                       "weight_decay_mode": WeightDecayMode.NONE})
    assert accepted["optimizer"] == EmbOptimType.EXACT_SGD
    module = ebc()
    apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1, "weight_decay": 0.01})
    assert fused_params_of(module, None)["optimizer"] == EmbOptimType.EXACT_SGD


def test_a_table_of_another_precision_given_heralds_sharding_is_refused_naming_it() -> None:
    """Herald's rows are FP32: an FP16 table given herald's sharding would train in another precision than stock's
    (whose TBE keeps FP16 rows), silently. Herald's sharder refuses such a plan before building anything, naming
    the EBC and the table; HeraldPlanner keeps such tables stock (``tests/test_model_shapes.py``)."""
    from torchrec.distributed.types import ParameterSharding, ShardingEnv
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_herald import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE

    module = EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=10, feature_names=[f],
                                                        data_type=dt)
                                     for n, f, dt in (("ta", "fa", DataType.FP32), ("tb", "fb", DataType.FP16))],
                                    device=torch.device("meta"))
    params = {n: ParameterSharding(sharding_type=HERALD_HOT_ROW_WISE, compute_kernel="fused", ranks=[0])
              for n in ("ta", "tb")}
    with pytest.raises(ValueError) as e:
        HeraldEmbeddingBagCollectionSharder().shard(module, params, ShardingEnv(1, 0), torch.device("cpu"), "sparse")
    assert str(e.value) == (
        "EBC 'sparse': the plan gives herald's sharding tables tb (FP16), whose rows herald would hold and update in "
        "FP32 where stock TorchRec keeps their data_type: plan them with a stock sharding type (HeraldPlanner does), "
        "or make them FP32")


def test_ranks_sharding_with_different_hot_sets_are_refused_on_every_rank() -> None:
    """Plans made on each rank from its own batches can differ: the ranks' collectives would then not match (gloo
    aborted, NCCL would hang). Every rank names the table as the module is built."""
    line = ("ValueError: table t_cat_7: the ranks shard it with different hot sets ([2, 3] hot rows by rank, or other "
            "rows): every rank must use one plan. Plan with HeraldPlanner.collective_plan(model, sharders, pg) "
            "(rank 0 plans, every rank gets its plan), as TorchRec's planner")
    assert [r["plans_apart"] for r in results()] == [line, line]
