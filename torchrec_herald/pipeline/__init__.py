"""Herald scheduling (in progress): the location-aware input allocator and the (pure, trace-level)
communication planner with its exactness checker. The look-ahead train pipeline that executes them
comes with the Herald scheduling issue."""

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
from torchrec_herald.pipeline.sync_plan import (
    EagerSyncPlanner,
    LazySyncPlanner,
    SyncCounters,
    SyncPlanner,
    check_exact,
    simulate,
)

__all__ = [
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
