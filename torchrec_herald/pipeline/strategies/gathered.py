"""Scheduling strategy ``gathered``: each rank reads its own batch; the samples' scores and every rank's
read keys are all-gathered and samples move in all-to-alls, so every rank plans every row alike. It runs
ahead in the run-ahead thread, its collectives on a gloo group of the scheduler's own (as planning by
home's), so that a user's own loader of per-rank batches gets its scheduling off the critical path too."""

from __future__ import annotations

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages.allocate import allocate_own_batch
from torchrec_herald.pipeline.stages.reads import gathered_reads
from torchrec_herald.pipeline.strategies import SchedulingStrategy, register_strategy

__all__ = ["GatheredStrategy"]


@register_strategy
class GatheredStrategy(SchedulingStrategy):
    """Each rank's own batch; scores, samples and reads exchanged by collectives; a global plan."""

    name = "gathered"
    can_run_ahead = True

    def allocate(self, ctx: HeraldBatchContext) -> None:
        allocate_own_batch(self.env, ctx)

    def collect_reads(self, ctx: HeraldBatchContext, reads_needed: bool, lazy: bool) -> None:
        if lazy:
            gathered_reads(self.env, ctx)
