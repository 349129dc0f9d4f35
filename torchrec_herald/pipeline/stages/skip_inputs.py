"""Stage 30 of a batch entering the window: Slipstream's input-granularity skipping drops the samples all
of whose lookups are stale hot rows (``pipeline.skip=input``; ``pipeline/stale_skip.py`` decides)."""

from __future__ import annotations

from torchrec_herald.pipeline.context import HeraldBatchContext
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["skip_inputs_stage"]


@register_stage("skip_inputs", 30)
def skip_inputs_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """With input-granularity skipping on: filter ``ctx.batch``; its keys follow when samples went."""
    skip = host.skip_hook
    if skip is None or skip.granularity != "input":
        return
    assert ctx.batch is not None
    before = ctx.batch.labels.numel()
    ctx.batch = skip.filter_inputs(host, ctx.batch, host.entering_step())
    if ctx.batch.labels.numel() != before:
        ctx.keys = host.env.batch_keys(ctx.batch.sparse_features)
