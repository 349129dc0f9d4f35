"""What the planner decides for a model, typed: the plan, the sharders that shard it, how the dense layers
sync, and, when a link rate is known, the candidates the model of time weighed (herald's plan, stock TABLE_WISE,
TorchRec's default plan, herald's tables beside stock ones) with their predicted times.

:func:`plan_model` is the one entry point from a ``planner`` config (``planner/config.py``): TorchRec's
own planner for ``planner=stock|table_wise|row_wise``, :class:`~torchrec_herald.planner.HeraldPlanner`
for ``planner=herald`` (which prices the link and trains the fastest candidate itself, TorchRec's default
plan only where it beats TABLE_WISE by more than one collective's latency).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_herald.planner.config import HeraldPlannerConfig, StockPlannerConfig
from torchrec_herald.planner.pricing import LinkModel
from torchrec_herald.planner.types import PlanDecision

__all__ = ["PlanDecision", "plan_model"]

logger = logging.getLogger(__name__)


def plan_model(config: Union[StockPlannerConfig, HeraldPlannerConfig], module: nn.Module,
               tables: Sequence[EmbeddingBagConfig], sample_batches: Sequence[Any], world_size: int,
               local_batch_size: int, device: torch.device, pg: Optional[dist.ProcessGroup] = None,
               earlier: Optional[PlanDecision] = None) -> PlanDecision:
    """Plan ``module`` as ``config`` says (collectively when ``pg`` is given: rank 0 plans).

    Args:
        sample_batches: KJTs or Batches whose accesses herald's hot sets are chosen from (unused by the
            stock planner).
        earlier: this job's decision for the same planner settings, already logged (an approximate run plans
            before its exact reference and again for itself): its link probe's outcome is reused, not measured
            again, so the three plan on one measured link, and the plan's table is not logged again.
    """
    from torchrec_herald.planner.planner import HeraldPlanner
    from torchrec_herald.planner.stock import stock_plan
    from torchrec_herald.planner.topology import make_topology
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder, HeraldEmbeddingBagCollectionSharder

    if isinstance(config, StockPlannerConfig):
        sharders: List[ModuleSharder[nn.Module]] = [CpuEmbeddingBagCollectionSharder()]
        plan = stock_plan(module, list(tables), sharders, config.mode, world_size, local_batch_size, device, pg)
        return PlanDecision(plan=plan, sharders=sharders, dense_sync=config.dense_sync)
    probe = None
    if earlier is not None:
        probe = earlier.probe
    elif config.wants_probe and pg is not None and world_size > 1:
        from torchrec_herald.planner.link_probe import probe_on_every_rank

        probe = probe_on_every_rank(pg)  # (on every rank, or on none)
    one_rank = config.prices_one_rank_locally(world_size)
    config = config.with_measured(probe)
    link = LinkModel.local(config.cpu_us_per_lookup) if one_rank else config.link_model()
    planner = HeraldPlanner(topology=make_topology(world_size, device.type), batch_size=local_batch_size,
                            sample_batches=list(sample_batches), hot_memory_budget_bytes=config.hot_memory_budget_bytes,
                            hot_set_selector=config.hot_set_selector(), link=link, dense_sync=config.dense_sync)
    planner.log_plan_table = earlier is None
    decision = planner.decide(module, [HeraldEmbeddingBagCollectionSharder()], pg)
    return dataclasses.replace(decision, probe=probe)
