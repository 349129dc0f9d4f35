"""The planner's one pricing module: turns bytes, collectives and per-lookup work into one unit.

:class:`ByteCount` prices in bytes alone (the unit the hot-set cost model has always used, and what it
uses when the link is unknown). :class:`LinkModel` prices in milliseconds for a given per-rank link rate,
a per-collective latency and herald's extra CPU per lookup (``planner.link_mbit``,
``planner.collective_latency_ms``, ``planner.cpu_us_per_lookup``). Both implement :class:`Pricing`, so
the hot-set cost model (``planner/hot_set.py``) and the plan decision (:func:`decide`) price the same way.

:func:`decide` answers "does herald's plan pay on this link" (docs/design.md §6): herald trades link time
(fewer bytes) for collectives and CPU work per step. It compares the predicted per-step cost of
herald's plan with stock TABLE_WISE's (its exact reference) and keeps herald only where it is
predicted faster; the planner then plans TABLE_WISE and says why.

Predicted cost per rank and step (the dense all-reduce and the model's compute are the same for both
and cancel out):

    stock  = bytes_TW / W / rate + c_TW · latency
    herald = bytes_herald / W / rate + c_herald · latency + cpu_per_lookup · lookups / W

with the bytes of the planner's own traffic model (``HotSpec.expected``) and ``c_TW`` / ``c_herald``
the collectives per rank and step TrafficMeter counts besides the dense all-reduce.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Optional, TypeVar

import torch

if TYPE_CHECKING:
    from torchrec_herald.planner.time_model import LinkDecision, PlanLoad

__all__ = ["ByteCount", "HERALD_COLLECTIVES", "LinkModel", "Pricing", "STOCK_TW_COLLECTIVES", "decide",
           "default_plan_load"]

Amount = TypeVar("Amount", float, torch.Tensor)


class Pricing(abc.ABC):
    """A price for each kind of work a plan does per step, in :attr:`unit`."""

    unit: str = ""

    @abc.abstractmethod
    def bytes(self, nbytes: Amount) -> Amount:
        """The price of sending ``nbytes`` (a float or a tensor of per-row amounts) from one rank."""

    @abc.abstractmethod
    def collectives(self, n: float) -> float:
        """The price of ``n`` collectives beyond their bytes."""

    @abc.abstractmethod
    def lookups(self, n: float) -> float:
        """The price of herald's extra work on ``n`` lookups."""


class ByteCount(Pricing):
    """Bytes only: collectives and lookups cost nothing (the link is unknown)."""

    unit = "B"

    def bytes(self, nbytes: Amount) -> Amount:
        return nbytes

    def collectives(self, n: float) -> float:
        return 0.0

    def lookups(self, n: float) -> float:
        return 0.0

#: collectives per rank and step besides the dense all-reduce (TrafficMeter, 2 ranks, 200 steps):
#: stock TABLE_WISE under TrainPipelineSparseDist: input dist (splits, ids) + pooled all-to-all + its gradient
STOCK_TW_COLLECTIVES = 5
#: herald's hot replication: counts + ids, pooled + gradient, hot sync (sparse exchange + dense all-reduce)
HERALD_COLLECTIVES = 7


@dataclass(frozen=True)
class LinkModel(Pricing):
    """Time, in milliseconds: the link and herald's CPU price (``planner.link_mbit``, ``planner.collective_latency_ms``,
    ``planner.cpu_us_per_lookup``).

    Args:
        link_mbit: each rank's link rate in Mbit/s (> 0).
        collective_latency_ms: time a collective costs beyond its bytes (>= 0): a fabric's ~0.02 ms;
            gloo on 2 shared CPU cores ~1 ms (RESULTS.md, "Speed under emulated bandwidth").
        cpu_us_per_lookup: herald's extra CPU time per lookup over stock's fused kernels (>= 0), measured as
            (herald hot replication's compute − TABLE_WISE's) / lookups per rank at an unlimited link.
    """

    link_mbit: float
    collective_latency_ms: float = 1.0
    cpu_us_per_lookup: float = 0.6

    def __post_init__(self) -> None:
        if not self.link_mbit > 0:
            raise ValueError(f"planner.link_mbit must be > 0 Mbit/s (or null: unknown), got {self.link_mbit}")
        if self.collective_latency_ms < 0:
            raise ValueError(f"planner.collective_latency_ms must be >= 0, got {self.collective_latency_ms}")
        if self.cpu_us_per_lookup < 0:
            raise ValueError(f"planner.cpu_us_per_lookup must be >= 0, got {self.cpu_us_per_lookup}")

    unit = "ms"

    def transfer_ms(self, nbytes: float) -> float:
        """Milliseconds to send ``nbytes`` over the link."""
        return nbytes * 8 / (self.link_mbit * 1e3)

    def bytes(self, nbytes: Amount) -> Amount:
        return nbytes * (8 / (self.link_mbit * 1e3))

    def collectives(self, n: float) -> float:
        return n * self.collective_latency_ms

    def lookups(self, n: float) -> float:
        return n * self.cpu_us_per_lookup / 1e3


def decide(expected: Iterable[Mapping[str, float]], world_size: int, model: LinkModel, *,
           dense_bytes: float = 0.0, dense_sync: str = "forward_ordered",
           default_plan: Optional["PlanLoad"] = None) -> "LinkDecision":
    """Choose among herald's plan, stock TABLE_WISE and (when given) TorchRec's default plan on
    ``model``'s link, by predicted step time (``planner/time_model.py``).

    Args:
        expected: per herald table, the planner's expected traffic (``HotSpec.expected``: ``lookups``,
            ``stock_table_wise`` and ``herald_total`` bytes per step, all ranks).
        world_size: W.
        dense_bytes: bytes each rank sends per step to all-reduce the dense layers (the same for every
            plan; on the critical path under DDP, overlapped under herald's forward-ordered sync).
        dense_sync: herald's dense sync (``forward_ordered`` or ``ddp``).
        default_plan: TorchRec's default plan's load, a third candidate.
    """
    from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel, choose_plan

    expected = list(expected)
    lookups = sum(e.get("lookups", 0.0) for e in expected) / world_size
    stock_bytes = sum(e.get("stock_table_wise", 0.0) for e in expected) / world_size
    herald_bytes = sum(e.get("herald_total", 0.0) for e in expected) / world_size
    overlapped = dense_bytes if dense_sync == "forward_ordered" else 0.0
    loads = [PlanLoad("herald", herald_bytes + dense_bytes - overlapped, overlapped, HERALD_COLLECTIVES, lookups),
             PlanLoad("table_wise", stock_bytes + dense_bytes, 0.0, STOCK_TW_COLLECTIVES)]
    if default_plan is not None:
        loads.append(default_plan)
    return choose_plan(loads, StepTimeModel(link_mbit=model.link_mbit, collective_latency_ms=model.collective_latency_ms,
                                            cpu_us_per_lookup=model.cpu_us_per_lookup))


def default_plan_load(sharding_types: Mapping[str, str], expected: Mapping[str, Mapping[str, float]],
                      table_bytes: Mapping[str, float], world_size: int, dense_bytes: float) -> "PlanLoad":
    """TorchRec's default plan as a :class:`~torchrec_herald.planner.time_model.PlanLoad`: per table the
    bytes of its sharding type (TABLE_WISE and its variants as TABLE_WISE, ROW_WISE as ROW_WISE, a
    DATA_PARALLEL table's gradient all-reduce), every rank's share, plus the dense all-reduce under DDP;
    the input and output all-to-alls of each sharded type and one all-reduce for the data-parallel tables.
    """
    from torchrec_herald.planner.time_model import PlanLoad

    W = world_size
    total, kinds = 0.0, set()
    for name, st in sharding_types.items():
        e = expected.get(name, {})
        if st == "data_parallel":
            total += 2 * (W - 1) / W * table_bytes.get(name, 0.0) * W  # all ranks, ring all-reduce
            kinds.add("data_parallel")
        elif st == "row_wise":
            total += e.get("stock_row_wise", 0.0)
            kinds.add(st)
        else:
            total += e.get("stock_table_wise", 0.0)
            kinds.add("table_wise" if st in ("table_wise", "column_wise", "table_row_wise") else st)
    collectives = sum(1 if k == "data_parallel" else STOCK_TW_COLLECTIVES for k in kinds)
    return PlanLoad("default", total / W + dense_bytes, 0.0, collectives)
