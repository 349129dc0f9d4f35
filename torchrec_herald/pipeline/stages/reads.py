"""Stage 3 of a batch entering the window: the rows each rank's share reads (sorted unique global keys),
which the plan stage needs from every rank (lazy sync only). Three bodies:

* :func:`reads_from_assignment`: whole global batches: every rank's reads follow from the assignment,
  computed alone, no collective;
* :func:`gathered_reads`: per-rank batches: every rank's keys all-gathered (int32 on the wire);
* :func:`own_reads`: planning by home: this rank's keys only (they go to their homes when the step is
  planned).

Sorting and dropping repeats is one compiled pass (``native/batch_keys.cpp``, a radix sort) where the
module is built; the numpy and torch ops below otherwise.
"""

from __future__ import annotations

import numpy as np
import torch

from torchrec_herald.native import load_if_built
from torchrec_herald.pipeline.context import HeraldBatchContext, SchedulingEnv
from torchrec_herald.pipeline.stages import StageHost, register_stage

__all__ = ["gathered_reads", "own_reads", "reads_from_assignment", "reads_stage"]


@register_stage("reads", 40)
def reads_stage(host: StageHost, ctx: HeraldBatchContext) -> None:
    """The strategy's reads body (from the assignment, gathered, or this rank's own)."""
    host.strategy.collect_reads(ctx, host.reads_needed, host.lazy)


def _sorted_unique(keys: torch.Tensor) -> torch.Tensor:
    native = load_if_built()
    if native is not None:  # = torch.unique(keys) of keys >= 0
        return native.sorted_unique_keys(keys)
    # = torch.unique(keys): numpy's sort, then dropping repeats, is several times faster on CPU than
    # torch.unique and than numpy 2's np.unique (a hash table): 0.09 vs 0.50 / 0.58 ms for a step's 13k keys
    return torch.unique_consecutive(torch.from_numpy(np.sort(keys.numpy())))


def reads_from_assignment(env: SchedulingEnv, ctx: HeraldBatchContext, reads_needed: bool) -> None:
    """Every rank's reads from the assignment (``ctx.rank_of``), when ``reads_needed``; ``ctx.keys``
    becomes this rank's samples' keys, in its batch's order."""
    assert ctx.keys is not None and ctx.rank_of is not None and ctx.sample_of_key is not None
    native = load_if_built()
    if native is not None and reads_needed:
        reads, counts, ctx.keys = native.reads_by_rank(ctx.keys, ctx.sample_of_key, ctx.rank_of, env.world,
                                                       env.layout.num_rows, env.rank)
        ctx.reads = list(reads.split(counts.tolist()))
        ctx.rank_of = ctx.sample_of_key = None
        return
    key_rank = ctx.rank_of.index_select(0, ctx.sample_of_key)
    mine = key_rank == env.rank
    if reads_needed:  # also while scheduling is off: "auto" may turn it back on
        n = env.layout.num_rows
        both = _sorted_unique(key_rank * n + ctx.keys)  # by rank, then key
        per_rank = torch.bincount(both // n, minlength=env.world).tolist()
        ctx.reads = [part - r * n for r, part in enumerate(both.split(per_rank))]
    ctx.keys = ctx.keys[mine]  # this rank's samples' keys, in its batch's order
    ctx.rank_of = ctx.sample_of_key = None


def gathered_reads(env: SchedulingEnv, ctx: HeraldBatchContext) -> None:
    """(collective) Every rank's sorted unique read keys, all-gathered as int32."""
    assert ctx.keys is not None
    mine = _sorted_unique(ctx.keys)
    ctx.reads = [k.to(torch.int64) for k in env.gather_varlen(mine.to(torch.int32), "herald_schedule_meta")]


def own_reads(env: SchedulingEnv, ctx: HeraldBatchContext) -> None:
    """This rank's sorted unique read keys; the other ranks' entries empty."""
    assert ctx.keys is not None
    mine = _sorted_unique(ctx.keys)
    ctx.reads = [mine[:0]] * env.world
    ctx.reads[env.rank] = mine
