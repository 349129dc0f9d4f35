"""Scheduling strategy ``global_batches``: every rank reads the whole global batch from the seekable
source and schedules it alone (docs/design.md §3, as the released Herald does): the same allocation and
plan everywhere with no collective to agree on them and no sample moved; so it can run ahead."""

from __future__ import annotations

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages.allocate import allocate_whole_batch
from torchrec_herald.pipeline.stages.reads import reads_from_assignment
from torchrec_herald.pipeline.strategies import SchedulingStrategy, register_strategy

__all__ = ["GlobalBatchesStrategy"]


@register_strategy
class GlobalBatchesStrategy(SchedulingStrategy):
    """Whole global batches on every rank, scheduled alone (``pipeline.global_batches``)."""

    name = "global_batches"
    whole_batches = True
    can_run_ahead = True
    scheduling_collectives = False

    def allocate(self, ctx: HeraldBatchContext) -> None:
        allocate_whole_batch(self.env, ctx)

    def collect_reads(self, ctx: HeraldBatchContext, reads_needed: bool, lazy: bool) -> None:
        reads_from_assignment(self.env, ctx, reads_needed)
