"""Stage 30 of a batch entering the window: Slipstream's input-granularity skipping drops the samples all
of whose lookups are stale hot rows (``pipeline.skip=input``; ``pipeline/stale_skip.py`` decides), from
this rank's own batch. Whole global batches are filtered before they enter (and refilled with live
samples) by :class:`~torchrec_herald.pipeline.stale_skip.LiveInputStream`."""

from __future__ import annotations

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["skip_inputs_stage"]


@register_stage("skip_inputs", 30)
def skip_inputs_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """With input-granularity skipping on per-rank batches: filter ``ctx.batch``; its keys follow when
    samples went."""
    skip = host.skip_hook
    if skip is None or skip.granularity != "input" or host.live_inputs is not None:
        return
    assert ctx.batch is not None
    before = ctx.batch.labels.shape[0]
    ctx.batch = skip.filter_inputs(host, ctx.batch, ctx.train_step)
    if ctx.batch.labels.shape[0] != before:
        ctx.keys = host.env.batch_keys(ctx.batch.sparse_features)
