"""Herald scheduling: the look-ahead train pipeline (:class:`HeraldTrainPipeline`), the location-aware
input allocator, the lazy exact communication plan (tensor planner run every step, and the trace-level
reference planners with their exactness checker), and the opt-in approximate modes (bounded staleness,
stale-update skipping)."""

from torchrec_herald.pipeline.input_allocator import (
    GreedyLocalityAllocator,
    IdentityAllocator,
    InputAllocator,
    Locality,
    TopKTablesAllocator,
    build_allocator,
    local_lookup_share,
    remote_cold_lookups,
    score,
)
from torchrec_herald.pipeline.lazy_sync import ExecPlan, TensorLazySyncPlanner
from torchrec_herald.pipeline.sync_plan import (
    EagerSyncPlanner,
    LazySyncPlanner,
    SyncCounters,
    SyncPlanner,
    check_exact,
    simulate,
)
from torchrec_herald.pipeline.stale_skip import SkipConfig, StaleSkipper
from torchrec_herald.pipeline.staleness import StalenessPlanner
from torchrec_herald.pipeline.train_pipeline import HeraldTrainPipeline, SchedulerStats

__all__ = [
    "ExecPlan",
    "HeraldTrainPipeline",
    "SchedulerStats",
    "SkipConfig",
    "StaleSkipper",
    "StalenessPlanner",
    "TensorLazySyncPlanner",
    "EagerSyncPlanner",
    "LazySyncPlanner",
    "SyncCounters",
    "SyncPlanner",
    "check_exact",
    "simulate",
    "GreedyLocalityAllocator",
    "IdentityAllocator",
    "InputAllocator",
    "Locality",
    "TopKTablesAllocator",
    "build_allocator",
    "local_lookup_share",
    "remote_cold_lookups",
    "score",
]
