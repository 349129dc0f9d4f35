"""The ``planner`` config group as typed dataclasses: TorchRec's own planner (``planner=stock``,
``table_wise``, ``row_wise``) and :class:`~torchrec_herald.planner.HeraldPlanner` (``planner=herald``),
each validating itself with one error naming the bad key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from torchrec_herald.planner.pricing import LinkModel
from torchrec_herald.planner.planner import DEFAULT_HOT_MEMORY_BUDGET_BYTES
from torchrec_herald.planner.stock import STOCK_MODES

__all__ = ["DENSE_SYNCS", "HOT_SET_SELECTORS", "HeraldPlannerConfig", "StockPlannerConfig"]

#: ``planner.dense_sync`` values: how the dense layers' gradients are summed over ranks
DENSE_SYNCS = ("ddp", "forward_ordered")
#: ``planner.selector`` values
HOT_SET_SELECTORS = ("cost_model", "top_fraction")
_LINK_DEFAULTS: Dict[str, Any] = {"collective_latency_ms": LinkModel.__dataclass_fields__["collective_latency_ms"].default,
                                  "cpu_us_per_lookup": LinkModel.__dataclass_fields__["cpu_us_per_lookup"].default}


def _check_name(name: str, expected: str) -> None:
    if name != expected:
        raise ValueError(f"unknown planner.name {name!r}; expected 'stock' or 'herald'")


def _check_dense_sync(dense_sync: str) -> None:
    if dense_sync not in DENSE_SYNCS:
        raise ValueError(f"unknown planner.dense_sync {dense_sync!r}; expected one of {list(DENSE_SYNCS)}")


@dataclass
class StockPlannerConfig:
    """TorchRec's ``EmbeddingShardingPlanner``: as it plans by default (``mode=default``), or with one
    sharding type forced on every table (``table_wise``, ``row_wise``; the CPU sharder also offers
    ROW_WISE). The dense layers are DDP's (``dense_sync=ddp``)."""

    name: str = "stock"
    mode: str = "default"
    dense_sync: str = "ddp"

    def __post_init__(self) -> None:
        _check_name(self.name, "stock")
        if self.mode not in STOCK_MODES:
            raise ValueError(f"unknown planner.mode {self.mode!r}; expected one of {sorted(STOCK_MODES)}")
        _check_dense_sync(self.dense_sync)


@dataclass
class HeraldPlannerConfig:
    """HeraldPlanner: each table's hot rows replicated on every rank (chosen by the cost model from access
    statistics of the first ``stats_batches`` global batches), cold rows in stock ROW_WISE blocks.

    Args:
        hot_memory_budget_bytes: per rank, hot replica weights + row-wise Adagrad state; null: no limit.
        stats_batches: global batches sampled for the access statistics.
        selector: ``cost_model`` or ``top_fraction`` (the top ``top_fraction`` of each table, dense sync).
        mode: the cold layout, stock ROW_WISE blocks (kept for a common planner schema).
        dense_sync: ``forward_ordered`` (each dense layer's gradient sum waited for at its next forward,
            ``sharding/dense_sync.py``) or ``ddp``; DDP where the link model falls back to stock TABLE_WISE.
        link_mbit: each rank's link rate in Mbit/s; null: unknown (herald's plan is kept). With it the
            planner keeps herald's plan only where it is predicted faster than stock TABLE_WISE.
        collective_latency_ms: time a collective costs beyond its bytes (gloo on 2 shared cores: 1 ms).
        cpu_us_per_lookup: herald's extra CPU per lookup over stock's fused kernels (measured here).
    """

    name: str = "herald"
    hot_memory_budget_bytes: Optional[int] = DEFAULT_HOT_MEMORY_BUDGET_BYTES
    stats_batches: int = 20
    selector: str = "cost_model"
    top_fraction: float = 0.02
    mode: str = "row_wise"
    dense_sync: str = "forward_ordered"
    link_mbit: Optional[float] = None
    collective_latency_ms: float = _LINK_DEFAULTS["collective_latency_ms"]
    cpu_us_per_lookup: float = _LINK_DEFAULTS["cpu_us_per_lookup"]

    def __post_init__(self) -> None:
        _check_name(self.name, "herald")
        if self.selector not in HOT_SET_SELECTORS:
            raise ValueError(f"unknown planner.selector {self.selector!r}; expected one of {sorted(HOT_SET_SELECTORS)}")
        if self.hot_memory_budget_bytes is not None and int(self.hot_memory_budget_bytes) < 0:
            raise ValueError(f"planner.hot_memory_budget_bytes must be >= 0, got {self.hot_memory_budget_bytes}")
        if int(self.stats_batches) < 1:
            raise ValueError(f"planner.stats_batches must be >= 1, got {self.stats_batches}")
        if self.mode != "row_wise":
            raise ValueError(f"planner.mode of planner=herald is its cold layout, row_wise; got {self.mode!r}")
        _check_dense_sync(self.dense_sync)
        self.link_model()  # planner.link_mbit / collective_latency_ms / cpu_us_per_lookup: one error naming the key

    def hot_set_selector(self) -> Any:
        """The configured :class:`~torchrec_herald.planner.hot_set.HotSetSelector`; the cost model prices
        in time when the link is known (``link_mbit``), else in bytes."""
        from torchrec_herald.planner.hot_set import CostModelHotSetSelector, TopFractionHotSetSelector

        if self.selector == "top_fraction":
            return TopFractionHotSetSelector(self.top_fraction)
        return CostModelHotSetSelector(pricing=self.link_model())

    def link_model(self) -> Optional[LinkModel]:
        """The link the planner prices (None when ``link_mbit`` is not given)."""
        if self.link_mbit is None:
            return None
        return LinkModel(link_mbit=float(self.link_mbit), collective_latency_ms=float(self.collective_latency_ms),
                         cpu_us_per_lookup=float(self.cpu_us_per_lookup))
