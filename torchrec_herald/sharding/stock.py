"""Stock TorchRec sharder that also offers ROW_WISE / TABLE_ROW_WISE on CPU (TorchRec offers them only on cuda)."""

from __future__ import annotations

from typing import List

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType


class CpuEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` whose sharding types include ROW_WISE on cpu (works with gloo)."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = list(super().sharding_types(compute_device_type))
        for extra in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
            if extra not in types:
                types.append(extra)
        return types
