"""Scheduling strategy ``by_home`` (``pipeline.planning=by_home``): each rank reads its own batch and
plans only the rows it is home to, from the read keys the readers send it (``HomeSplitLazyPlanner``):
per-rank work and metadata grow with the rank's own reads, not with W·B. It runs ahead in a thread, its
exchanges on a process group of their own, so the exchange for step t+1 travels while step t trains."""

from __future__ import annotations

from typing import Any, List

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages.allocate import allocate_own_batch
from torchrec_herald.pipeline.stages.reads import own_reads
from torchrec_herald.pipeline.strategies import SchedulingStrategy, register_strategy
from torchrec_herald.plans import SyncCounters

__all__ = ["ByHomeStrategy"]


@register_strategy
class ByHomeStrategy(SchedulingStrategy):
    """Each rank's own batch; each rank plans the rows it is home to."""

    name = "by_home"
    can_run_ahead = True

    def allocate(self, ctx: HeraldBatchContext) -> None:
        allocate_own_batch(self.env, ctx)

    def collect_reads(self, ctx: HeraldBatchContext, reads_needed: bool, lazy: bool) -> None:
        if reads_needed:  # the keys go to their homes when the step is planned (also while off: auto)
            own_reads(self.env, ctx)

    def plan_counters(self) -> SyncCounters:
        """(collective) Each rank counted the rows it is home to: the sum over ranks."""
        import torch.distributed as dist

        parts: List[Any] = [None] * self.env.world
        dist.all_gather_object(parts, self.env.stats.counters, group=self.env.pg)
        total = SyncCounters()
        for c in parts:
            total = total + c
        return total
