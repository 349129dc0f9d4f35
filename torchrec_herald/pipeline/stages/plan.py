"""Stage 4, once per step: the step's transfers from the window's reads (Herald's lazy, exact plan,
docs/design.md §3), made by the pipeline's :class:`~torchrec_herald.plans.CommPlanner`; stale-update
skipping leaves the frozen rows out first. The head batch's plan may have been made ahead (run-ahead);
otherwise it is made here, on the critical path."""

from __future__ import annotations

import time
from typing import Any, List, Optional

import torch

from torchrec_herald.pipeline.context import HeraldBatchContext, SchedulingEnv

__all__ = ["make_plan", "plan_head"]


def make_plan(env: SchedulingEnv, window: List[HeraldBatchContext], skip: Optional[Any] = None,
              host: Any = None) -> Any:
    """The planner's plan for ``window[0]`` from the window's reads (advances the planner); ``skip``: the
    stale-update skipping hook (row granularity filters the reads; ``host`` its pipeline)."""
    t0 = time.perf_counter()
    reads = [ctx.reads for ctx in window]
    if skip is not None and skip.granularity == "row":
        reads = skip.filter_reads(host, reads)
    plan = env.planner.plan_step(reads)
    env.stats.planner_s += time.perf_counter() - t0
    return plan


def plan_head(env: SchedulingEnv, window: List[HeraldBatchContext], lazy: bool, skip: Optional[Any] = None,
              host: Any = None) -> bool:
    """Lazy sync: plan the head batch's transfers (or take its plan made ahead), count them and hand the
    plan to the EBC, which runs its pre-read transfers; returns True. Eager sync: count the rows
    stale-skipping leaves frozen; returns False."""
    head = window[0]
    if lazy:
        plan, head.plan = head.plan, None
        if plan is None:  # not made ahead: plan here, on the critical path
            t0 = time.perf_counter()
            plan = make_plan(env, window, skip, host)
            env.stats.scheduler_s += time.perf_counter() - t0
        env.stats.counters = env.stats.counters + plan.counters
        if plan.additive:
            env.stats.stale_reads += plan.stale_reads
            env.stats.max_staleness = max(env.stats.max_staleness, plan.max_staleness)
        env.ebc.begin_plan_step(plan)
        return True
    if skip is not None and skip.granularity == "row":
        assert head.batch is not None
        skip.count_reads(host, torch.unique(env.batch_keys(head.batch.sparse_features)))
    return False
