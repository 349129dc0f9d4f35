"""Stage 30 of a batch entering the window: Slipstream's input-granularity skipping drops the samples all
of whose lookups are stale hot rows (``pipeline.skip=input``; ``pipeline/stale_skip.py`` decides). On
whole global batches every rank drops the same samples of the global batch (no collective, so the stage
runs ahead with the rest); on per-rank batches each rank filters its own share."""

from __future__ import annotations

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["skip_inputs_stage"]


@register_stage("skip_inputs", 30)
def skip_inputs_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """With input-granularity skipping on: filter ``ctx.batch`` (and, on whole global batches, the
    assignment the reads stage reads); its keys follow when samples went."""
    skip = host.skip_hook
    if skip is None or skip.granularity != "input":
        return
    assert ctx.batch is not None
    if ctx.rank_of is not None:  # whole global batch: ctx.keys are the global batch's (the reads stage narrows them)
        skip.filter_assigned(host, ctx, host.env.rank, host.env.world)
        return
    before = ctx.batch.labels.numel()
    ctx.batch = skip.filter_inputs(host, ctx.batch, ctx.train_step)
    if ctx.batch.labels.numel() != before:
        ctx.keys = host.env.batch_keys(ctx.batch.sparse_features)
