"""Turn a stock ROW_WISE plan into a herald plan: same row-wise layout for the cold rows, hot sets attached."""

from __future__ import annotations

import dataclasses
from typing import AbstractSet, Dict, Optional

from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan, ShardingType

from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, HeraldParameterSharding, HotSpec


def herald_plan_from_row_wise(plan: ShardingPlan, hot: Dict[str, HotSpec],
                              modules: Optional[AbstractSet[str]] = None,
                              keep: AbstractSet[str] = frozenset()) -> ShardingPlan:
    """Every ROW_WISE table of ``plan`` becomes :data:`HERALD_HOT_ROW_WISE` with ``hot[table]``
    (empty hot set when absent); the row-wise ``ranks`` / ``sharding_spec`` are kept, so herald
    tables have stock ROW_WISE's block layout. ``modules``: the EBCs' fqns herald shards (None: every module
    of the plan); the others' plans (an ``EmbeddingCollection``'s) stay as they are. ``keep``: tables that stay
    as ``plan`` shards them (a user's constraints gave them a stock type)."""
    out: Dict[str, EmbeddingModuleShardingPlan] = {}
    for fqn, module_plan in plan.plan.items():
        if modules is not None and fqn not in modules:
            out[fqn] = module_plan  # type: ignore[assignment]
            continue
        new = EmbeddingModuleShardingPlan()
        for table, ps in module_plan.items():  # type: ignore[union-attr]
            if table in keep:
                new[table] = ps
                continue
            if ps.sharding_type != ShardingType.ROW_WISE.value:
                raise ValueError(f"table {table}: expected a ROW_WISE stock plan, got {ps.sharding_type}")
            fields = {f.name: getattr(ps, f.name) for f in dataclasses.fields(ps)}
            fields.update(sharding_type=HERALD_HOT_ROW_WISE, compute_kernel="fused")
            new[table] = HeraldParameterSharding(**fields, hot=hot.get(table, HotSpec()))
        out[fqn] = new
    return ShardingPlan(out)
