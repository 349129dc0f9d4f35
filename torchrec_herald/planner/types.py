"""The planner's typed results: what it decided for a model (:class:`PlanDecision`) and which tables of a
plan are herald's (:func:`herald_tables`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from torch import nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from torchrec_herald.planner.link_probe import LinkProbe
from torchrec_herald.planner.time_model import LinkDecision
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, HotSpec

__all__ = ["PlanDecision", "herald_tables"]


def herald_tables(plan: ShardingPlan) -> Dict[str, HotSpec]:
    """table -> HotSpec of every herald table in ``plan``."""
    out: Dict[str, HotSpec] = {}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if ps.sharding_type == HERALD_HOT_ROW_WISE:
                out[name] = ps.hot  # type: ignore[attr-defined]
    return out


@dataclass(frozen=True)
class PlanDecision:
    """The planner's decision for one model.

    Attributes:
        plan: the ``ShardingPlan`` for ``DistributedModelParallel``.
        sharders: the sharders that shard it (herald's, or TorchRec's EBC sharder on any device).
        dense_sync: ``ddp`` or ``forward_ordered`` (``sharding/dense_sync.py``).
        link: the model of time's choice among herald's plan and the stock candidates on the link, with
            every candidate's predicted time (None when the rate is unknown, or for a stock planner).
        probe: what the start-up link probe measured (None when nothing was measured).
    """

    plan: ShardingPlan
    sharders: List[ModuleSharder[nn.Module]]
    dense_sync: str
    link: Optional[LinkDecision] = None
    probe: Optional[LinkProbe] = None

    @property
    def herald(self) -> bool:
        """Some table is herald-sharded (False: stock TorchRec trains every table)."""
        return bool(herald_tables(self.plan))

    def link_report(self) -> Optional[Dict[str, Any]]:
        """``metrics.json`` ``link_decision``: the link decision's figures and its one-line reason."""
        if self.link is None and self.probe is None:
            return None
        out = {} if self.link is None else self.link.as_dict()
        if self.probe is not None:
            out["measured"] = self.probe.as_dict()
        return out
