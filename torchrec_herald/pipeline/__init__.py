"""Herald scheduling: the look-ahead train pipeline (:class:`HeraldTrainPipeline`), the location-aware
input allocator, the planners of the lazy exact communication plan (plan types in ``torchrec_herald.plans``;
the trace-level reference planners and their exactness checker in ``torchrec_herald.testing``), and the
opt-in approximate modes (bounded staleness, stale-update skipping)."""

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
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.pipeline.options import HeraldPipelineConfig
from torchrec_herald.pipeline.stale_skip import SkipConfig, StaleSkipHook, StaleSkipper
from torchrec_herald.pipeline.staleness import StalenessPlanner
from torchrec_herald.pipeline.train_pipeline import HeraldBatchContext, HeraldTrainPipeline, SchedulerStats

__all__ = [
    "HeraldBatchContext",
    "HeraldPipelineConfig",
    "HeraldTrainPipeline",
    "SchedulerStats",
    "SkipConfig",
    "StaleSkipHook",
    "StaleSkipper",
    "StalenessPlanner",
    "TensorLazySyncPlanner",
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
