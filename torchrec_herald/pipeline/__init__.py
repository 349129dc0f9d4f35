"""Herald scheduling (in progress): the location-aware input allocator. The look-ahead train pipeline,
worker caches and the communication plan come with the Herald scheduling issue."""

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

__all__ = [
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
