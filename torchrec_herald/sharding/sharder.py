"""``HeraldEmbeddingBagCollectionSharder``: the sharder DMP needs for plans of the herald sharding type."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardedModule, ShardingEnv
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection
from torchrec_herald.sharding.mixed import ShardedMixedEmbeddingBagCollection
from torchrec_herald.sharding.stock import CpuEmbeddingBagCollectionSharder
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE


class HeraldEmbeddingBagCollectionSharder(CpuEmbeddingBagCollectionSharder):
    """Shards an EBC whose plan uses :data:`HERALD_HOT_ROW_WISE` into a
    :class:`ShardedHeraldEmbeddingBagCollection`; any other plan is sharded by stock TorchRec (also
    ROW_WISE on cpu); a plan that gives only some of the EBC's tables the herald type, the others a
    stock type, into a :class:`~torchrec_herald.sharding.mixed.ShardedMixedEmbeddingBagCollection`. The embedding optimizer comes from ``apply_optimizer_in_backward`` or
    ``fused_params`` exactly as for the stock sharder.

    Usage::

        plan = HeraldPlanner.from_batches(sample_batches).collective_plan(model, [sharder], pg)
        DistributedModelParallel(model, plan=plan, sharders=[HeraldEmbeddingBagCollectionSharder()])
    """

    def sharding_types(self, compute_device_type: str) -> List[str]:
        """TorchRec's EBC sharding types and herald's (hot rows replicated, cold rows row-wise)."""
        return super().sharding_types(compute_device_type) + [HERALD_HOT_ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """Herald's type runs fbgemm's fused TBE (its cold lookups); the stock types keep TorchRec's kernels."""
        if sharding_type == HERALD_HOT_ROW_WISE:
            return [EmbeddingComputeKernel.FUSED.value]
        return super().compute_kernels(sharding_type, compute_device_type)

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None) -> ShardedModule:
        """Herald's sharded EBC where the plan gives some of its tables herald's type (the rest sharded by
        TorchRec's types beside them in the same module), else TorchRec's own sharded EBC."""
        herald = [name for name, ps in params.items() if ps.sharding_type == HERALD_HOT_ROW_WISE]
        if not herald:
            return super().shard(module, params, env, device, module_fqn)
        if module.is_weighted():  # (its KJTs would carry weights that herald's sharding has no place for)
            raise ValueError(f"EBC {module_fqn or ''!r} is weighted (is_weighted=True), and the plan gives its tables "
                             f"{sorted(herald)} herald's sharding, which has no per-sample weights: plan them with "
                             f"a stock sharding type")
        low = [f"{c.name} ({c.data_type.name})" for c in module.embedding_bag_configs()
               if c.name in herald and c.data_type != DataType.FP32]
        if low:  # (herald's row store and update are FP32: it would train these rows in another precision than stock)
            raise ValueError(f"EBC {module_fqn or ''!r}: the plan gives herald's sharding tables {', '.join(low)}, whose "
                             f"rows herald would hold and update in FP32 where stock TorchRec keeps their data_type: "
                             f"plan them with a stock sharding type (HeraldPlanner does), or make them FP32")
        if len(herald) != len(params):  # per-table decisions: herald tables beside stock-sharded ones
            return ShardedMixedEmbeddingBagCollection(
                module, params, env, device,
                make_herald=lambda m, p, e, d: ShardedHeraldEmbeddingBagCollection(m, p, e, d, self.fused_params),
                make_stock=lambda m, p, e, d, fqn: super(HeraldEmbeddingBagCollectionSharder, self).shard(m, p, e, d, fqn),
                module_fqn=module_fqn)
        return ShardedHeraldEmbeddingBagCollection(module, params, env, device, self.fused_params)
