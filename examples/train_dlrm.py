#!/usr/bin/env python3
"""TorchRec's golden DLRM example (``examples/golden_training/train_dlrm.py`` in meta-pytorch/torchrec),
in its shape and shrunk to run on CPU with gloo, with torchrec_herald adopted in three edits. Each
edit is marked ``# herald edit N`` and is the only difference between ``--stock`` and the default:

1. the import;
2. herald's sharder, and a plan from ``HeraldPlanner.from_batches`` (it counts row accesses in a few
   sample batches itself) instead of TorchRec's planner;
3. ``HeraldTrainPipeline`` instead of ``TrainPipelineSparseDist``.

Run it on two ranks::

    torchrun --nproc_per_node 2 examples/train_dlrm.py            # herald
    torchrun --nproc_per_node 2 examples/train_dlrm.py --stock    # stock TorchRec, ROW_WISE plan

For the same ``--seed`` both start from bit-identical weights (the tables are built on ``meta`` and
each rank draws its rows as stock ROW_WISE does) and train to the same per-step losses
(``tests/test_adoption_example.py``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional

import torch
from torch import distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

from torchrec_herald import HeraldEmbeddingBagCollectionSharder, HeraldPlanner, HeraldTrainPipeline  # herald edit 1
from torchrec_herald.planner.topology import default_storage_reservation, make_topology
from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder


def _get_random_dataset(num_embeddings: int, batch_size: int = 32) -> RandomRecDataset:
    return RandomRecDataset(keys=DEFAULT_CAT_NAMES, batch_size=batch_size, hash_size=num_embeddings,
                            ids_per_feature=1, num_dense=len(DEFAULT_INT_NAMES))


def _stock_sharder() -> CpuEmbeddingBagCollectionSharder:
    """TorchRec's ``EmbeddingBagCollectionSharder``; it offers ROW_WISE on CUDA only, and this subclass
    lifts that one restriction on CPU."""
    return CpuEmbeddingBagCollectionSharder()


def _stock_plan(model: torch.nn.Module, sharding_type: str, batch_size: int) -> Any:
    tables = [c.name for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()]
    planner = EmbeddingShardingPlanner(
        topology=make_topology(dist.get_world_size(), "cpu"), batch_size=batch_size,
        storage_reservation=default_storage_reservation(),
        constraints={t: ParameterConstraints(sharding_types=[sharding_type]) for t in tables})
    return planner.collective_plan(model, [_stock_sharder()], dist.GroupMember.WORLD)


def train(herald: bool = True, num_embeddings: int = 4096, embedding_dim: int = 16, batch_size: int = 32,
          learning_rate: float = 0.1, num_iterations: int = 200, seed: int = 0, stock_sharding: str = "row_wise",
          initial_state: Optional[Dict[str, torch.Tensor]] = None, collect: bool = False,
          show_progress: bool = True) -> Dict[str, Any]:
    """Build and train the DLRM on this rank (every rank runs it, SPMD); returns the per-step losses and,
    with ``collect``, the model's full initial state (tables gathered) for comparison.

    ``stock_sharding`` picks the stock plan's sharding type; ``initial_state`` (full tensors) is loaded
    before training, to start a stock TABLE_WISE run from another run's weights."""
    device = torch.device("cpu")
    torch.manual_seed(seed)

    eb_configs = [
        EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=embedding_dim,
                           num_embeddings=num_embeddings, feature_names=[feature_name])
        for feature_name in DEFAULT_CAT_NAMES
    ]
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[64, embedding_dim],
        over_arch_layer_sizes=[64, 1],
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm_model)
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": learning_rate})
    # built before the model is sharded (the example builds it after): RandomRecDataset draws its batches
    # from the global generator when it is constructed, and here both variants draw them at the same point
    dataset = _get_random_dataset(num_embeddings, batch_size)

    if herald:  # herald edit 2: herald's sharder, and a plan from access counts of 20 sample batches
        sharder = HeraldEmbeddingBagCollectionSharder()
        plan = HeraldPlanner.from_batches(dataset, num_batches=20).collective_plan(train_model, [sharder])
    else:
        sharder = _stock_sharder()
        plan = _stock_plan(train_model, stock_sharding, batch_size)
    model = DistributedModelParallel(module=train_model, device=device, plan=plan, sharders=[sharder])

    out: Dict[str, Any] = {"initial_state": _full_state(model) if collect else None}
    if initial_state is not None:
        model.load_state_dict(dict(initial_state))

    non_fused_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    if herald:  # herald edit 3: herald's pipeline (look-ahead window, input allocator, caches)
        train_pipeline = HeraldTrainPipeline(model, non_fused_optimizer, device)
    else:
        train_pipeline = TrainPipelineSparseDist(model, non_fused_optimizer, device)

    train_iterator = iter(dataset)
    losses: List[float] = []
    for _ in tqdm(range(num_iterations), mininterval=5.0, disable=not show_progress or dist.get_rank() != 0):
        losses.append(float(train_pipeline.progress(train_iterator)[0]))
    out["losses"] = losses
    return out


def _full_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every tensor of ``model.state_dict()``, sharded tables gathered whole (collective)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            full = torch.zeros(value.size())
            value.gather(dst=0, out=full if dist.get_rank() == 0 else None)
            dist.broadcast(full, 0)
            value = full
        out[key] = value.detach().clone()
    return out


@record
def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock", action="store_true", help="stock TorchRec (ROW_WISE plan, TrainPipelineSparseDist)")
    parser.add_argument("--num_iterations", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dist.init_process_group(backend="gloo")
    losses = train(herald=not args.stock, num_iterations=args.num_iterations, seed=args.seed)["losses"]
    if dist.get_rank() == 0:
        print(f"{'stock' if args.stock else 'herald'}: first losses {[round(x, 4) for x in losses[:3]]}, "
              f"last {losses[-1]:.4f} (rank {dist.get_rank()} of {dist.get_world_size()}, LOCAL_RANK "
              f"{os.environ.get('LOCAL_RANK')})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
