"""HeraldTrainPipeline's options (Herald's window, allocator and worker caches; HET's bounded staleness;
Slipstream's stale-update skipping) as one dataclass, validated once, with one error per bad value
naming its ``pipeline.*`` key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torchrec_herald.pipeline.stale_skip import SkipConfig

__all__ = ["ALLOCATORS", "CACHE_POLICIES", "HeraldPipelineConfig", "PLANNING", "SCHEDULING", "SYNC_MODES"]

#: ``pipeline.allocator`` values
ALLOCATORS = ("greedy", "identity")
#: ``pipeline.sync`` values: ``lazy`` = worker caches + the exact plan; ``eager`` = herald's own
#: per-step path (hot rows all-reduced every step, cold rows looked up at their owner)
SYNC_MODES = ("lazy", "eager")
#: ``pipeline.scheduling`` values: ``on`` = the allocator and ``sync`` as configured; ``off`` = hot
#: replication alone (samples stay where loaded, herald's per-step path); ``auto`` = time both on the
#: first steps and keep the faster (needs ``global_batches``)
SCHEDULING = ("on", "off", "auto")
#: ``pipeline.planning`` values: ``global`` = every rank plans every row (the same plan everywhere);
#: ``by_home`` = each rank plans the rows it is home to from the read keys sent to it
#: (``HomeSplitLazyPlanner``: per-rank work and metadata grow with its own reads, not with W·B)
PLANNING = ("global", "by_home")
#: ``pipeline.cache`` values executed for real (Belady exists at trace level:
#: ``torchrec_herald.testing.reference_plans.LazySyncPlanner``)
CACHE_POLICIES = ("lru",)


@dataclass(frozen=True)
class HeraldPipelineConfig:
    """The ``pipeline=herald`` group (see ``conf/pipeline/herald.yaml``).

    Args:
        window: ``K >= 1``, global batches of look-ahead.
        allocator: ``greedy`` (location-aware) or ``identity`` (samples stay where loaded).
        sync: ``lazy`` (caches + plan) or ``eager`` (herald's per-step path, e.g. to measure the allocator alone).
        cache: cache eviction policy (``lru``).
        cache_fraction: cache capacity per rank per table as a fraction of the table's rows, in (0, 1].
        cache_bytes: ``None``, or the cache capacity per rank as a bytes budget (weights + optimizer
            state of the cached rows), shared among the tables in proportion to their rows; overrides
            ``cache_fraction``.
        move_penalty: local lookups a sample move must gain (``greedy_assign``'s ``move_penalty``), >= 0.
        staleness: ``None``: the exact plan; an integer ``s >= 0``: HET's bounded staleness (``sync=lazy``).
        skip: ``None`` or a :class:`~torchrec_herald.pipeline.stale_skip.SkipConfig` (Slipstream).
        global_batches: the data loader yields whole global batches (``W·B`` samples, from a seekable
            source): each rank schedules every batch alone (docs/design.md §3: no collective agrees on the
            allocation or the plan, no sample bytes move) and trains the samples assigned to it.
        run_ahead: (with ``global_batches``) a background thread schedules the next batch entering the
            window (read, keys, allocation, reads) and plans the next step while the current step trains.
        scheduling: ``on``, ``off`` (hot replication alone) or ``auto`` (measure both, keep the faster).
        probe_steps: ``auto``: steps timed in each mode (after ``probe_steps // 2`` unmeasured ones).
        planning: ``global`` (every rank plans every row) or ``by_home`` (each rank plans its own rows from
            the keys the readers send it; needs ``allocator=identity``, ``global_batches=false``, the exact
            plan and no skipping).
    """

    window: int = 5
    allocator: str = "greedy"
    sync: str = "lazy"
    cache: str = "lru"
    cache_fraction: float = 0.05
    cache_bytes: Optional[int] = None
    move_penalty: int = 0
    staleness: Optional[int] = None
    skip: Optional[SkipConfig] = None
    global_batches: bool = False
    run_ahead: bool = False
    scheduling: str = "on"
    probe_steps: int = 10
    planning: str = "global"

    def __post_init__(self) -> None:
        if int(self.window) < 1:
            raise ValueError(f"pipeline.window must be >= 1, got {self.window}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"unknown pipeline.allocator {self.allocator!r}; known: {list(ALLOCATORS)}")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"unknown pipeline.sync {self.sync!r}; known: {list(SYNC_MODES)}")
        if self.cache not in CACHE_POLICIES:
            raise ValueError(f"unknown pipeline.cache {self.cache!r}; executed policies: {list(CACHE_POLICIES)} "
                             f"(belady is trace-level only: torchrec_herald.testing.reference_plans.LazySyncPlanner)")
        if not 0.0 < float(self.cache_fraction) <= 1.0:
            raise ValueError(f"pipeline.cache_fraction={self.cache_fraction}: a cache must hold at least one row and "
                             f"at most all rows of a table; use a fraction in (0, 1]")
        if self.cache_bytes is not None and (isinstance(self.cache_bytes, bool) or int(self.cache_bytes) < 1):
            raise ValueError(f"pipeline.cache_bytes must be null or a positive number of bytes, got {self.cache_bytes}")
        if int(self.move_penalty) < 0:
            raise ValueError(f"pipeline.move_penalty must be >= 0, got {self.move_penalty}")
        s = self.staleness
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or int(s) != s or int(s) < 0:
                raise ValueError(f"pipeline.staleness must be null (exact) or an integer >= 0, got {s}")
            if self.sync != "lazy":
                raise ValueError("pipeline.staleness needs pipeline.sync=lazy (it relaxes the caches' plan)")
        if self.global_batches and self.skip is not None:
            raise ValueError("pipeline.global_batches needs pipeline.skip=null: stale-update skipping filters "
                             "each rank's batch by its own training state (set pipeline.global_batches=false)")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"unknown pipeline.scheduling {self.scheduling!r}; known: {list(SCHEDULING)}")
        if self.scheduling == "auto" and not self.global_batches:
            raise ValueError("pipeline.scheduling=auto needs pipeline.global_batches=true (both modes must "
                             "keep every rank's reads at hand)")
        if self.planning not in PLANNING:
            raise ValueError(f"unknown pipeline.planning {self.planning!r}; known: {list(PLANNING)}")
        if self.planning == "by_home":
            clash = [f"{k}={v}" for k, v, ok in (
                ("allocator", self.allocator, self.allocator == "identity"),
                ("global_batches", self.global_batches, not self.global_batches),
                ("sync", self.sync, self.sync == "lazy"), ("staleness", self.staleness, self.staleness is None),
                ("skip", self.skip, self.skip is None), ("scheduling", self.scheduling, self.scheduling == "on"))
                if not ok]
            if clash:
                raise ValueError(f"pipeline.planning=by_home keeps no global view of the caches: it needs "
                                 f"allocator=identity, global_batches=false, sync=lazy, staleness=null, skip=null "
                                 f"and scheduling=on; got pipeline.{', pipeline.'.join(clash)}")
        if int(self.probe_steps) < 2:
            raise ValueError(f"pipeline.probe_steps must be >= 2, got {self.probe_steps}")
        if self.run_ahead and not self.global_batches:
            raise ValueError("pipeline.run_ahead needs pipeline.global_batches=true (the per-rank path's "
                             "scheduling collectives must stay in step with training's)")
        object.__setattr__(self, "probe_steps", int(self.probe_steps))
        object.__setattr__(self, "window", int(self.window))
        object.__setattr__(self, "cache_fraction", float(self.cache_fraction))
        object.__setattr__(self, "move_penalty", int(self.move_penalty))
        object.__setattr__(self, "staleness", None if s is None else int(s))

    @property
    def approximate(self) -> bool:
        """An opt-in approximate mode (bounded staleness or stale-update skipping) is on."""
        return self.staleness is not None or self.skip is not None

    @classmethod
    def from_hydra(cls, p: Any, total_steps: Optional[int] = None) -> "HeraldPipelineConfig":
        """From the ``pipeline`` node of the Hydra config; with ``total_steps`` (the run's steps, if known)
        the first skip measuring window must end inside the run."""
        skip = None
        if p.get("skip") is not None:
            skip = SkipConfig(granularity=p.skip, target=p.skip_target, tolerance=p.skip_tolerance,
                              start=p.skip_start, gap=p.skip_gap, every=p.skip_every, t_max=p.skip_t_max)
            skip.check_run_length(total_steps)
        # stale-update skipping schedules per rank (its filter reads the rank's own training state)
        global_batches = bool(p.get("global_batches", False)) and skip is None
        scheduling = p.get("scheduling", "on")
        if scheduling == "auto" and (not global_batches or p.get("staleness") is not None):
            scheduling = "on"  # an approximate mode is measured against the exact plan: keep its plan on
        return cls(window=p.window, allocator=p.allocator, sync=p.sync, cache=p.cache,
                   cache_fraction=p.cache_fraction, cache_bytes=p.get("cache_bytes"), move_penalty=p.move_penalty, staleness=p.get("staleness"),
                   skip=skip, global_batches=global_batches,
                   run_ahead=bool(p.get("run_ahead", False)) and global_batches, scheduling=scheduling,
                   probe_steps=p.get("probe_steps", 10), planning=p.get("planning", "global"))
