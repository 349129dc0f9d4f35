"""Models other than TorchRec's DLRM, adopted with the README's edits (``HeraldPlanner.from_batches(...)
.collective_plan``, herald's sharder), train the model stock TorchRec trains (TABLE_WISE, the same batches, a plain
loop, 2 ranks): per-rank losses within 1e-5 and every final weight within :func:`herald_harness.weight_rtol`.

* one EBC whose tables have three embedding dims: herald takes the dim whose tables' lookups move the most bytes,
  the others keep a stock type in the same EBC (herald's sharding refused the plan herald's planner made);
* a two-tower model whose EBCs both read one KJT key (the planner refused the feature as 'served by two tables');
* a head with a batch norm, trained by herald's pipeline with scheduling on: the input allocator keeps each rank's
  samples (moving them changed what the batch norm computed, and the losses left stock's);
* one EBC with an FP16 table beside FP32 ones: the FP16 table keeps a stock type and its FP16 rows (herald held and
  updated it in FP32, silently: losses left stock's by 7e-5, weights by 1e-2).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest
import torch
from torch import nn

from herald_harness import weight_rtol
from torchrec_herald.dist_utils import run_multiprocess

STEPS, B = 6, 8
FEATURES = {"f0": 40, "f1": 56, "f2": 48}


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return loss, (loss.detach(), logits.detach(), labels)


class MixedDims(nn.Module):
    """One EBC of tables of dims 8, 16 and 4 (the second MEAN-pooled), a concatenation head."""

    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        specs = (("t0", 8, PoolingType.SUM), ("t1", 16, PoolingType.SUM), ("t2", 4, PoolingType.MEAN))
        self.sparse = EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=FEATURES[f],
                                                                 feature_names=[f], pooling=p)
                                              for (n, d, p), f in zip(specs, FEATURES)], device=torch.device("cpu"))
        self.head = nn.Sequential(nn.Linear(8 + 16 + 4 + 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: Any) -> Any:
        d = self.sparse(batch.sparse_features).to_dict()
        return _loss(self.head(torch.cat([d[f] for f in FEATURES] + [batch.dense_features], 1)).squeeze(1),
                     batch.labels)


class MixedPrecision(nn.Module):
    """One EBC of dim-8 tables, the second FP16 (``EmbeddingBagConfig.data_type``), a concatenation head."""

    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        types = (DataType.FP32, DataType.FP16, DataType.FP32)
        self.sparse = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n,
                                                                 feature_names=[f], data_type=dt)
                                              for i, ((f, n), dt) in enumerate(zip(FEATURES.items(), types))],
                                             device=torch.device("cpu"))
        self.head = nn.Sequential(nn.Linear(3 * 8 + 4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, batch: Any) -> Any:
        d = self.sparse(batch.sparse_features).to_dict()
        return _loss(self.head(torch.cat([d[f] for f in FEATURES] + [batch.dense_features], 1)).squeeze(1),
                     batch.labels)


class BatchNormHead(MixedPrecision):
    """Three FP32 tables of dim 8 and a ``BatchNorm1d`` in the head: its output depends on which samples share a
    rank's batch."""

    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.sparse = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n,
                                                                 feature_names=[f])
                                              for i, (f, n) in enumerate(FEATURES.items())], device=torch.device("cpu"))
        self.head = nn.Sequential(nn.Linear(3 * 8 + 4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


class TwoTowers(nn.Module):
    """A user and an item tower, each its own EBC; both read ``f1``."""

    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()

        def ebc(*tables: tuple) -> EmbeddingBagCollection:
            return EmbeddingBagCollection([EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=FEATURES[f],
                                                              feature_names=[f]) for n, f in tables],
                                          device=torch.device("cpu"))

        self.user, self.item = ebc(("u0", "f0"), ("u1", "f1")), ebc(("i0", "f2"), ("i1", "f1"))
        self.dense = nn.Linear(4, 1)

    def forward(self, batch: Any) -> Any:
        user, item = self.user(batch.sparse_features).to_dict(), self.item(batch.sparse_features).to_dict()
        u, i = torch.cat([user["f0"], user["f1"]], 1), torch.cat([item["f1"], item["f2"]], 1)  # (fx-traceable)
        logits = (u * i).sum(1) + self.dense(batch.dense_features).squeeze(1)
        return _loss(logits, batch.labels)


def _batch(step: int, rank: int) -> Any:
    """A deterministic skewed multi-hot local batch (empty bags included)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1009 * step + rank)
    lengths = [torch.randint(0, 4, (B,), generator=g) for _ in FEATURES]
    values = [(torch.rand(int(ln.sum()), generator=g) ** 2 * n).long() for ln, n in zip(lengths, FEATURES.values())]
    return Batch(dense_features=torch.randn(B, 4, generator=g),
                 sparse_features=KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values),
                                                   lengths=torch.cat(lengths).to(torch.int32)),
                 labels=torch.randint(0, 2, (B,), generator=g).float())


def _train(rank: int, world: int, model_name: str, herald: bool, for_model: bool = False,
           options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_herald import HeraldEmbeddingBagCollectionSharder, HeraldPlanner
    from torchrec_herald.planner.topology import default_storage_reservation, make_topology
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder

    torch.manual_seed(0)
    model = {"mixed_dims": MixedDims, "two_towers": TwoTowers, "mixed_precision": MixedPrecision,
             "batch_norm": BatchNormHead}[model_name]()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ebcs = [m for m in model.modules() if isinstance(m, EmbeddingBagCollection)]
    apply_optimizer_in_backward(RowWiseAdagrad, [p for m in ebcs for p in m.parameters()], {"lr": 0.1})
    if herald:
        sharder: Any = HeraldEmbeddingBagCollectionSharder()
        sample = [_batch(s, r) for s in range(4) for r in range(world)]
        plan = HeraldPlanner.from_batches(sample, num_batches=len(sample)).collective_plan(model, [sharder])
    else:
        sharder = CpuEmbeddingBagCollectionSharder()
        tables = [c.name for m in ebcs for c in m.embedding_bag_configs()]
        plan = EmbeddingShardingPlanner(topology=make_topology(world, "cpu"), batch_size=B,
                                        storage_reservation=default_storage_reservation(),
                                        constraints={t: ParameterConstraints(sharding_types=["table_wise"])
                                                     for t in tables}).collective_plan(model, [sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dmp.load_state_dict(initial)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    losses: List[float] = []
    pipeline = None
    if for_model:  # (the pipeline for whatever the plan is: TorchRec's where no one EBC is herald's)
        from torchrec_herald import HeraldTrainPipeline

        pipeline = HeraldTrainPipeline.for_model(dmp, optimizer, torch.device("cpu"), **(options or {}))
        it = iter([_batch(step, rank) for step in range(STEPS)])
        while True:
            try:
                losses.append(float(pipeline.progress(it)[0]))
            except StopIteration:
                break
    for step in range(STEPS if pipeline is None else 0):
        optimizer.zero_grad()
        loss, _ = dmp(_batch(step, rank))
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    state = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size(), dtype=v.metadata().tensor_properties.dtype)
            v.gather(dst=0, out=full if rank == 0 else None)
            dist.broadcast(full, 0)
            v = full
        state[k.replace("_dmp_wrapped_module.", "").replace("module.", "")] = v.detach().clone()
    types = {t: ps.sharding_type for mp in plan.plan.values() for t, ps in mp.items()}
    num_hot = sum(m._num_hot for m in dmp.modules() if type(m).__name__ == "ShardedHeraldEmbeddingBagCollection")
    start = {k.replace("module.", ""): v for k, v in initial.items()}  # (the model's own keys, as ``state`` names them)
    moved = any(not torch.equal(state[k], start[k]) for k in state if "embedding_bags" in k)
    return {"losses": losses, "state": state, "types": types, "pipeline": type(pipeline).__name__,
            "num_hot": num_hot, "moved": moved}


def _both(rank: int, world: int, model_name: str, for_model: bool = False,
          options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return {"herald": _train(rank, world, model_name, True, for_model, options),
            "stock": _train(rank, world, model_name, False)}


@pytest.mark.parametrize("model_name,herald_tables", [("mixed_dims", {"t1"}), ("two_towers", {"u0", "u1", "i0", "i1"}),
                                                      ("mixed_precision", {"t0", "t2"})])
def test_a_model_other_than_dlrm_trains_as_stock(model_name: str, herald_tables: set) -> None:
    for r in run_multiprocess(_both, 2, model_name, timeout_s=300):
        h, s = r["herald"], r["stock"]
        assert {t for t, kind in h["types"].items() if kind == "herald_hot_row_wise"} == herald_tables
        assert h["num_hot"] > 0 and h["moved"]  # (hot rows replicated, and the weights trained)
        assert h["losses"] == pytest.approx(s["losses"], rel=1e-5)
        assert set(h["state"]) == set(s["state"])
        for k, v in s["state"].items():
            assert h["state"][k].dtype == v.dtype, k
            err = float((h["state"][k] - v).abs().max().float() / v.abs().max().float().clamp(min=1e-12))
            assert err <= weight_rtol("rowwise_adagrad"), (k, err)


def test_the_pipeline_for_a_two_tower_model_is_torchrecs_and_trains_as_stock() -> None:
    """``HeraldTrainPipeline.for_model``: a model with two herald EBCs (or none: a stock plan) gets TorchRec's
    ``TrainPipelineSparseDist``, which trains herald's hot replication as stock trains (herald's scheduling drives
    one EBC); the per-rank losses and every weight as the plain loop's stock run."""
    for r in run_multiprocess(_both, 2, "two_towers", True, timeout_s=300):
        h, s = r["herald"], r["stock"]
        assert h["pipeline"] == "TrainPipelineSparseDist"
        assert h["losses"] == pytest.approx(s["losses"], rel=1e-5) and len(h["losses"]) == STEPS
        for k, v in s["state"].items():
            err = float((h["state"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
            assert err <= weight_rtol("rowwise_adagrad"), (k, err)


def test_a_batch_norm_keeps_each_ranks_samples_under_heralds_scheduling() -> None:
    """A batch norm normalises by its rank's batch, so the input allocator must not move samples between ranks:
    with scheduling on and the allocator at ``auto``, herald's pipeline keeps each rank's samples (one log line
    says why) and trains stock's model, per-rank losses and every weight (running statistics included)."""
    for r in run_multiprocess(_both, 2, "batch_norm", True, {"scheduling": "on", "window": 3}, timeout_s=300):
        h, s = r["herald"], r["stock"]
        assert h["pipeline"] == "HeraldTrainPipeline"
        assert h["num_hot"] > 0 and h["moved"]  # (hot rows replicated, and the weights trained)
        assert h["losses"] == pytest.approx(s["losses"], rel=1e-5) and len(h["losses"]) == STEPS
        assert any("running_mean" in k for k in s["state"])
        for k, v in s["state"].items():
            err = float((h["state"][k] - v).abs().max().float() / v.abs().max().float().clamp(min=1e-12))
            assert err <= weight_rtol("rowwise_adagrad"), (k, err)


def _greedy_with_batch_norm(rank: int, world: int) -> str:
    try:
        _train(rank, world, "batch_norm", True, True, {"allocator": "greedy"})
    except ValueError as e:
        return str(e)
    return "trained"


def test_the_greedy_allocator_with_a_batch_norm_is_refused_naming_the_layer() -> None:
    """``allocator=greedy`` set explicitly would move samples under the batch norm: refused as the pipeline is
    built, on every rank, naming the layer and the key."""
    assert run_multiprocess(_greedy_with_batch_norm, 2, timeout_s=300) == [
        "pipeline.allocator=greedy moves samples between ranks, and the model's head.1 (BatchNorm1d) normalise by "
        "each rank's own batch: it would train another model than stock TorchRec. Use pipeline.allocator=identity (or "
        "auto), or SyncBatchNorm (on GPUs)"] * 2


def test_batch_norms_are_found_inside_wrappers_torchscript_and_compiled_modules() -> None:
    """What the allocator check looks for: batch norms by their user-facing names (inside DMP's and DDP's wrappers:
    the 2-rank tests above), in a TorchScript-ed head (its class known by name alone) and under ``torch.compile``;
    ``SyncBatchNorm`` (global statistics) and per-sample norms are not flagged."""
    from torchrec_herald.pipeline.train_pipeline import batch_statistics_layers

    model = nn.Module()
    model.eager = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.GroupNorm(2, 4))
    model.scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    model.synced = nn.SyncBatchNorm(4)
    assert batch_statistics_layers(model) == ["eager.1 (BatchNorm1d)", "scripted.1 (BatchNorm1d)"]
    assert batch_statistics_layers(torch.compile(nn.Sequential(nn.BatchNorm2d(3)))) == ["_orig_mod.0 (BatchNorm2d)"]
