"""The planner's one pricing module: turns bytes, collectives and per-lookup work into one unit.

:class:`ByteCount` prices in bytes alone (the unit the hot-set cost model has always used, and what it
uses when the link is unknown). :class:`LinkModel` prices in milliseconds for a given per-rank link rate (and
the rate all-reduces get of it, where measured apart), a per-collective latency and herald's extra CPU per lookup
(``planner.link_mbit``, ``planner.allreduce_mbit``, ``planner.collective_latency_ms``,
``planner.cpu_us_per_lookup``). Both implement :class:`Pricing`, so the hot-set cost model
(``planner/hot_set.py``, which prices every byte at the link's rate) and the model of time
(``planner/time_model.py``, whose :func:`~torchrec_herald.planner.time_model.decide` picks herald's plan, stock
TABLE_WISE or TorchRec's default plan, and prices all-reduces at their own rate) use one set of prices.
:data:`STOCK_TW_COLLECTIVES` and :data:`HERALD_COLLECTIVES` are the collectives per rank and step TrafficMeter counts
for each besides the dense all-reduce.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, TypeVar

import torch

__all__ = ["ByteCount", "HERALD_COLLECTIVES", "LinkModel", "Pricing", "STOCK_TW_COLLECTIVES", "is_number"]

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


def is_number(value: object) -> bool:
    """A real number (an int, a float, numpy's): not a bool, a string, a list or a mapping (what a typed key's Any,
    or an API caller, lets through)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
        allreduce_mbit: the rate an all-reduce's bytes get of each rank's link, in Mbit/s (> 0; None: ``link_mbit``,
            the all-to-alls' rate). A transport can give the two kinds different shares of one link: gloo's
            all-reduce gets ~0.93 of a shaped link where its all-to-all gets ~0.5-0.7 (RESULTS.md, "What a
            collective gets of a shaped link"); the start-up probe times both (``planner/link_probe.py``).
    """

    link_mbit: float
    collective_latency_ms: float = 1.0
    cpu_us_per_lookup: float = 0.6
    allreduce_mbit: Optional[float] = None
    #: one rank's local "link" (:meth:`local`): the one infinite rate allowed
    one_rank: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        def refuse(key: str, rule: str) -> None:
            v = getattr(self, key)  # (a number as it prints, numpy's too; anything else as its repr)
            raise ValueError(f"LinkModel.{key} (planner.{key}) must {rule}, got {v if is_number(v) else repr(v)}")

        for key in ("link_mbit", "collective_latency_ms", "cpu_us_per_lookup"):
            if not is_number(getattr(self, key)):
                refuse(key, "be a number")
        if self.one_rank and (not math.isinf(self.link_mbit) or self.collective_latency_ms != 0
                              or self.allreduce_mbit is not None):
            raise ValueError("LinkModel(one_rank=True) is one rank's local link: LinkModel.local(cpu_us_per_lookup)")
        if not self.link_mbit > 0 or (math.isinf(self.link_mbit) and not self.one_rank):
            refuse("link_mbit", "be > 0 Mbit/s (or null: unknown)")
        if not 0 <= self.collective_latency_ms < math.inf:  # (NaN fails it)
            refuse("collective_latency_ms", "be >= 0")
        if not self.cpu_us_per_lookup >= 0 or math.isinf(self.cpu_us_per_lookup):
            refuse("cpu_us_per_lookup", "be >= 0")
        if self.allreduce_mbit is not None and (not is_number(self.allreduce_mbit) or not self.allreduce_mbit > 0 or (
                math.isinf(self.allreduce_mbit) and not self.one_rank)):
            refuse("allreduce_mbit", "be > 0 Mbit/s (or null: planner.link_mbit's)")

    unit = "ms"

    @classmethod
    def local(cls, cpu_us_per_lookup: float) -> "LinkModel":
        """One rank's "link": nothing crosses it (every byte a plan would send stays on the rank) and its
        collectives are local copies, so the plans differ only in herald's extra work per lookup."""
        return cls(link_mbit=math.inf, collective_latency_ms=0.0, cpu_us_per_lookup=cpu_us_per_lookup, one_rank=True)

    @property
    def is_local(self) -> bool:
        """The one-rank link of :meth:`local`."""
        return self.one_rank

    @property
    def allreduce_rate_mbit(self) -> float:
        """The rate all-reduce bytes get (``allreduce_mbit``, else ``link_mbit``)."""
        return self.link_mbit if self.allreduce_mbit is None else self.allreduce_mbit

    def transfer_ms(self, nbytes: float, allreduce_bytes: float = 0.0) -> float:
        """Milliseconds to send ``nbytes`` over the link, of which ``allreduce_bytes`` by all-reduces (at
        :attr:`allreduce_rate_mbit`; the rest at ``link_mbit``)."""
        return self.bytes(nbytes - allreduce_bytes) + allreduce_bytes * 8 / (self.allreduce_rate_mbit * 1e3)

    def bytes(self, nbytes: Amount) -> Amount:
        return nbytes * (8 / (self.link_mbit * 1e3))

    def collectives(self, n: float) -> float:
        return n * self.collective_latency_ms

    def lookups(self, n: float) -> float:
        return n * self.cpu_us_per_lookup / 1e3
