"""Shared harness: train stock TorchRec and herald on the same global batches, return losses and weights."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist

FEATURE_SCALE = 0.001  # Criteo cardinalities x 0.001: 26 tables, ~34k rows -> fast on 2 cores


def full_state(dmp: Any) -> Dict[str, torch.Tensor]:
    """DMP state dict with every ShardedTensor gathered into a full tensor (collective)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.zeros(v.size()) if dist.get_rank() == 0 else None
            v.gather(dst=0, out=full)
            full = full if full is not None else torch.zeros(v.size())
            dist.broadcast(full, 0)
            v = full
        out[k] = v.detach().clone()
    return out


def hot_specs_from_data(data: Any, tables: List[Any], min_count: int, sync: str, batches: int = 5,
                        global_batch: int = 64) -> Dict[str, Any]:
    """Deterministic hot sets for tests: ids seen >= min_count times in the first global batches."""
    from torchrec_herald.sharding.types import HotSpec

    counts = [torch.zeros(t.num_embeddings, dtype=torch.int64) for t in tables]
    for i, batch in enumerate(data.train_batches(0, 1, global_batch)):
        if i == batches:
            break
        kjt = batch.sparse_features
        for f, jt in enumerate(kjt.split([1] * len(tables))):
            counts[f] += torch.bincount(jt.values(), minlength=tables[f].num_embeddings)
    return {t.name: HotSpec((c >= min_count).nonzero().flatten(), sync=sync) for t, c in zip(tables, counts)}


def train(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """cfg: planner (table_wise|row_wise|herald), optimizer (sgd|rowwise_adagrad), via (apply|fused_params),
    pooling (SUM|MEAN), pipeline (plain|sparse_dist), steps, batch_size, hot_min_count, sync."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner.convert import herald_plan_from_row_wise
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder
    from torchrec_herald.traffic import TrafficMeter

    B = cfg.get("batch_size", 32)
    data = SyntheticCriteo(scale=FEATURE_SCALE, num_train_batches=cfg["steps"], seed=1)
    tables = build_tables(data.feature_names, data.num_embeddings, 8, cfg.get("pooling", "SUM"))
    model = build_dlrm_train(tables, data.num_dense, [16, 8], [16, 1], seed=0, device="cpu")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt, lr = cfg.get("optimizer", "sgd"), cfg.get("lr", 0.05)
    fused = None
    if cfg.get("via", "apply") == "apply":
        cls = torch.optim.SGD if opt == "sgd" else RowWiseAdagrad
        kw = {"lr": lr} if opt == "sgd" else {"lr": lr, "eps": 1e-8}
        apply_optimizer_in_backward(cls, model.model.sparse_arch.embedding_bag_collection.parameters(), kw)
    else:
        fused = {"optimizer": EmbOptimType.EXACT_SGD if opt == "sgd" else EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                 "learning_rate": lr, "eps": 1e-8}
    sharder = HeraldEmbeddingBagCollectionSharder(fused_params=fused)
    mode = "row_wise" if cfg["planner"] == "herald" else cfg["planner"]
    plan = stock_plan(model, tables, [sharder], mode, world, B, torch.device("cpu"), dist.group.WORLD)
    if cfg["planner"] == "herald":
        plan = herald_plan_from_row_wise(plan, hot_specs_from_data(data, tables, cfg.get("hot_min_count", 2),
                                                                   cfg.get("sync", "dense")))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dmp.load_state_dict(initial)
    dense_cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adagrad
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: dense_cls(ps, lr=lr))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    it = data.train_batches(rank, world, B)
    losses: List[float] = []
    with TrafficMeter(embedding_dim=8) as meter:
        if cfg.get("pipeline", "plain") == "plain":
            for batch in it:
                loss, _ = dmp(batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        else:
            pipe = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
            while True:
                try:
                    losses.append(pipe.progress(it)[0].item())
                except StopIteration:
                    break
            pipe.detach()
    return {"losses": losses, "state": full_state(dmp), "traffic": meter.summary(), "tags": meter.tag_summary(),
            "dense_names": sorted(dict(in_backward_optimizer_filter(dmp.named_parameters())))}
