"""Sharders and herald's sharding type (hot-row replication + row-wise cold shards, variable-size dists)."""

from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection
from torchrec_herald.sharding.mixed import ShardedMixedEmbeddingBagCollection
from torchrec_herald.sharding.sharder import HeraldEmbeddingBagCollectionSharder
from torchrec_herald.sharding.stock import CpuEmbeddingBagCollectionSharder
from torchrec_herald.sharding.types import HERALD_HOT_ROW_WISE, HeraldParameterSharding, HotSpec

__all__ = [
    "CpuEmbeddingBagCollectionSharder",
    "HERALD_HOT_ROW_WISE",
    "HeraldEmbeddingBagCollectionSharder",
    "HeraldParameterSharding",
    "HotSpec",
    "ShardedHeraldEmbeddingBagCollection",
    "ShardedMixedEmbeddingBagCollection",
]
