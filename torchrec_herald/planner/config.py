"""The ``planner`` config group as typed dataclasses: TorchRec's own planner (``planner=stock``,
``table_wise``, ``row_wise``) and :class:`~torchrec_herald.planner.HeraldPlanner` (``planner=herald``),
each validating itself with one error naming the bad key."""

from __future__ import annotations

import math

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from torchrec_herald.planner.pricing import LinkModel, is_number
from torchrec_herald.planner.planner import DEFAULT_HOT_MEMORY_BUDGET_BYTES
from torchrec_herald.planner.stock import STOCK_MODES

if TYPE_CHECKING:
    from torchrec_herald.planner.link_probe import LinkProbe

__all__ = ["DENSE_SYNCS", "HOT_SET_SELECTORS", "HeraldPlannerConfig", "StockPlannerConfig"]

#: ``planner.dense_sync`` values: how the dense layers' gradients are summed over ranks
DENSE_SYNCS = ("ddp", "forward_ordered")
#: ``planner.selector`` values
HOT_SET_SELECTORS = ("cost_model", "top_fraction")
_LINK_DEFAULTS: Dict[str, Any] = {"collective_latency_ms": LinkModel.__dataclass_fields__["collective_latency_ms"].default,
                                  "cpu_us_per_lookup": LinkModel.__dataclass_fields__["cpu_us_per_lookup"].default}


def _check_name(name: str, expected: str) -> None:
    if name != expected:  # (planner.name=herald under planner=table_wise: the option, not the key, picks the group)
        known = name in ("stock", "herald")
        raise ValueError(f"{'' if known else 'unknown '}planner.name {name!r} where this planner option's is "
                         f"{expected!r}: the option sets it; pick the planner with planner=<option> (planner=herald, "
                         f"planner=table_wise, ...)")


#: ``planner.input_dist_thread`` values (``ShardedHeraldEmbeddingBagCollection.input_dist_in_thread``)
INPUT_DIST_THREAD = {"auto": None, "on": True, "off": False}


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
        top_fraction: the share of each table's rows ``selector=top_fraction`` replicates, in [0, 1].
        mode: the cold layout, stock ROW_WISE blocks (kept for a common planner schema).
        dense_sync: ``forward_ordered`` (each dense layer's gradient sum waited for at its next forward,
            ``sharding/dense_sync.py``) or ``ddp``; DDP where the model of time picks a stock plan.
        link_mbit: each rank's link rate in Mbit/s; ``auto`` (the default): measured at start by a timed
            collective among the job's ranks (``planner/link_probe.py``); null: unknown (herald's plan
            is kept). With a rate the planner trains the candidate the model of time predicts fastest
            (``planner/time_model.py``): herald's plan, stock TABLE_WISE, TorchRec's default plan, or a
            per-table mix.
        collective_latency_ms: time a collective costs beyond its bytes; ``auto`` (the default): measured
            at start with the rate (1 ms, gloo on 2 shared cores, when it cannot be).
        allreduce_mbit: the rate all-reduces get of the link, in Mbit/s (a transport can give them another share
            of it than the all-to-alls); ``auto`` (the default): measured at start with ``link_mbit`` where that is
            measured, else ``link_mbit``'s; null: ``link_mbit``'s.
        cpu_us_per_lookup: herald's extra CPU per lookup over stock's fused kernels (measured here).
        input_dist_thread: herald's per-step input dist's host work (the id bookkeeping, the read of its sizes,
            the message) on a worker thread of each herald EBC's own, its collectives kept on the training
            thread: ``auto`` (where the ids are on a GPU), ``on`` or ``off``.
    """

    name: str = "herald"
    hot_memory_budget_bytes: Optional[int] = DEFAULT_HOT_MEMORY_BUDGET_BYTES
    stats_batches: int = 20
    selector: str = "cost_model"
    top_fraction: float = 0.02
    mode: str = "row_wise"
    dense_sync: str = "forward_ordered"
    link_mbit: Any = "auto"  # float | "auto" | None (OmegaConf has no Union)
    collective_latency_ms: Any = "auto"  # float | "auto"
    allreduce_mbit: Any = "auto"  # float | "auto" | None
    cpu_us_per_lookup: float = _LINK_DEFAULTS["cpu_us_per_lookup"]
    input_dist_thread: str = "auto"

    def __post_init__(self) -> None:
        _check_name(self.name, "herald")
        if self.input_dist_thread not in INPUT_DIST_THREAD:
            raise ValueError(f"unknown planner.input_dist_thread {self.input_dist_thread!r}; expected one of "
                             f"{list(INPUT_DIST_THREAD)}")
        if self.selector not in HOT_SET_SELECTORS:
            raise ValueError(f"unknown planner.selector {self.selector!r}; expected one of {sorted(HOT_SET_SELECTORS)}")
        if self.hot_memory_budget_bytes is not None and int(self.hot_memory_budget_bytes) < 0:
            raise ValueError(f"planner.hot_memory_budget_bytes must be >= 0, got {self.hot_memory_budget_bytes}")
        if int(self.stats_batches) < 1:
            raise ValueError(f"planner.stats_batches must be >= 1, got {self.stats_batches}")
        if self.mode != "row_wise":
            raise ValueError(f"planner.mode of planner=herald is its cold layout, row_wise; got {self.mode!r}")
        _check_dense_sync(self.dense_sync)
        if self.link_mbit is not None and self.link_mbit != "auto" and (
                not is_number(self.link_mbit) or not 0 < self.link_mbit < math.inf):
            raise ValueError(f"planner.link_mbit must be > 0 Mbit/s, auto (measured at start) or null (unknown), "
                             f"got {self.link_mbit!r}")
        if self.allreduce_mbit is not None and self.allreduce_mbit != "auto" and (
                not is_number(self.allreduce_mbit) or not 0 < self.allreduce_mbit < math.inf):
            raise ValueError(f"planner.allreduce_mbit must be > 0 Mbit/s, auto (measured at start with "
                             f"planner.link_mbit) or null (planner.link_mbit's), got {self.allreduce_mbit!r}")
        if self.collective_latency_ms != "auto" and (
                not is_number(self.collective_latency_ms) or not 0 < self.collective_latency_ms < math.inf):
            raise ValueError(f"planner.collective_latency_ms must be > 0 ms or auto (measured at start), "
                             f"got {self.collective_latency_ms!r}")
        for key, v in (("cpu_us_per_lookup", self.cpu_us_per_lookup), ("top_fraction", self.top_fraction)):
            if isinstance(v, (str, bool)) or not math.isfinite(float(v)) or float(v) < 0:
                raise ValueError(f"planner.{key} must be a finite number >= 0, got {v!r}")
        if float(self.top_fraction) > 1:
            raise ValueError(f"planner.top_fraction must be at most 1 (the share of each table's rows replicated), "
                             f"got {self.top_fraction}")

    def not_applied(self) -> List[str]:
        """One line for each option set away from its default where nothing reads it (``top_fraction`` with the
        cost model's selector)."""
        default = HeraldPlannerConfig.__dataclass_fields__["top_fraction"].default
        out = []
        if self.selector != "top_fraction" and self.top_fraction != default:
            out.append(f"planner.top_fraction={self.top_fraction} is not applied: it sizes the hot set of "
                       f"planner.selector=top_fraction, and the selector is {self.selector}")
        if self.link_mbit is None and self.allreduce_mbit not in (None, "auto"):
            out.append(f"planner.allreduce_mbit={self.allreduce_mbit} is not applied: planner.link_mbit=null keeps "
                       f"herald's plan whatever the link, and nothing is priced")
        return out

    def prices_one_rank_locally(self, world_size: int) -> bool:
        """At one rank with the link left to measure (``auto``), no embedding crosses a link: there is no rate to
        measure, herald's plan saves nothing, and priced on a link that carries no bytes the model of time keeps
        stock TABLE_WISE (an explicit ``link_mbit``, or null, is taken as given)."""
        return world_size == 1 and self.link_mbit == "auto"

    @property
    def wants_probe(self) -> bool:
        """The link rate or the collective latency is to be measured at start (``auto``); never where
        ``link_mbit`` is null (herald's plan whatever the link: nothing is priced)."""
        return self.link_mbit == "auto" or (self.link_mbit is not None and self.collective_latency_ms == "auto")

    def with_measured(self, probe: Optional["LinkProbe"]) -> "HeraldPlannerConfig":
        """This config with each ``auto`` link value replaced by what ``probe`` measured; with no probe
        (one rank, or it failed) the rate is unknown and the latency its configured default."""
        rate = self.link_mbit if self.link_mbit != "auto" else (probe.link_mbit if probe else None)
        allreduce = self.allreduce_mbit
        if allreduce == "auto":  # (measured with the rate; a rate given is every collective's)
            allreduce = probe.allreduce_mbit if probe is not None and self.link_mbit == "auto" else None
        return replace(self, link_mbit=rate, collective_latency_ms=self._latency_ms(probe), allreduce_mbit=allreduce)

    def _latency_ms(self, probe: Optional["LinkProbe"] = None) -> float:
        """``collective_latency_ms`` as given; for ``auto`` what ``probe`` measured, else the default."""
        if self.collective_latency_ms != "auto":
            return float(self.collective_latency_ms)
        return probe.latency_ms if probe else _LINK_DEFAULTS["collective_latency_ms"]

    def hot_set_selector(self) -> Any:
        """The configured :class:`~torchrec_herald.planner.hot_set.HotSetSelector`; the cost model prices
        in time when the link is known (``link_mbit``), else in bytes."""
        from torchrec_herald.planner.hot_set import CostModelHotSetSelector, TopFractionHotSetSelector

        if self.selector == "top_fraction":
            return TopFractionHotSetSelector(self.top_fraction)
        return CostModelHotSetSelector(pricing=self.link_model())

    def link_model(self) -> Optional[LinkModel]:
        """The link the planner prices (None when ``link_mbit`` is not given)."""
        if self.link_mbit is None or self.link_mbit == "auto":
            return None  # unknown, or measured at start (``with_measured``)
        allreduce = None if self.allreduce_mbit in (None, "auto") else float(self.allreduce_mbit)
        return LinkModel(link_mbit=float(self.link_mbit), collective_latency_ms=self._latency_ms(),
                         cpu_us_per_lookup=float(self.cpu_us_per_lookup), allreduce_mbit=allreduce)
