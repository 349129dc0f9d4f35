"""Planning: access statistics, hot-set selection (cost model) and HeraldPlanner; stock planning helpers."""

from torchrec_herald.planner.hot_set import (
    CostModelHotSetSelector,
    HotSetChoice,
    HotSetSelector,
    TableTraffic,
    TopFractionHotSetSelector,
)
from torchrec_herald.planner.link_probe import measured_link
from torchrec_herald.planner.planner import DEFAULT_HOT_MEMORY_BUDGET_BYTES, HeraldPlanner, herald_tables
from torchrec_herald.planner.pricing import LinkModel
from torchrec_herald.planner.stats import AccessStats

__all__ = [
    "AccessStats",
    "CostModelHotSetSelector",
    "DEFAULT_HOT_MEMORY_BUDGET_BYTES",
    "HeraldPlanner",
    "HotSetChoice",
    "HotSetSelector",
    "LinkModel",
    "TableTraffic",
    "TopFractionHotSetSelector",
    "herald_tables",
    "measured_link",
]
