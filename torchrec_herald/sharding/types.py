"""Herald's sharding type: per-table hot-row replication + row-wise cold shards (P²RES two-fold parallelism).

``ParameterSharding.sharding_type`` is a plain string in TorchRec; ours is :data:`HERALD_HOT_ROW_WISE`.
The per-table hot set rides on a ``ParameterSharding`` subclass, so it travels inside a stock
``ShardingPlan`` (and survives ``collective_plan``'s broadcast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torchrec.distributed.types import ParameterSharding, ShardingType

#: sharding type string of a herald table (hot rows replicated, cold rows row-wise, variable-size dists)
HERALD_HOT_ROW_WISE = "herald_hot_row_wise"
#: stock sharding types a table may have beside herald tables in one EBC (DATA_PARALLEL is left out:
#: its own DDP would sync the replicated tables outside herald's dense sync; a herald table whose rows
#: are all hot is the same replication, synced with the other hot rows)
MIXABLE_STOCK_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value, ShardingType.COLUMN_WISE.value,
                       ShardingType.TABLE_ROW_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
#: how hot-row gradients are summed across ranks
SYNC_MODES = ("dense", "sparse", "none")


def table_of_state_key(key: str) -> Optional[str]:
    """The table of an EBC ``state_dict`` key ``[...].embedding_bags.<table>.weight`` (None: another key)."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-3] != "embedding_bags":
        return None
    return parts[-2]


@dataclass
class HotSpec:
    """The replicated (hot) rows of one table and how their gradients are synchronised.

    Attributes:
        hot_ids: sorted, unique int64 row ids replicated on every rank (may be empty).
        sync: ``"dense"`` ring all-reduce of the hot gradient buffer, ``"sparse"`` exchange of the
            touched rows only, ``"none"`` when there are no hot rows.
        expected: the planner's expected bytes per step (all ranks) for printing/benchmarks.
    """

    hot_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    sync: str = "none"
    expected: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.hot_ids, dtype=torch.int64).flatten()
        if ids.numel() and not bool((ids[1:] > ids[:-1]).all()):
            ids = torch.unique(ids)  # sorted, unique
        self.hot_ids = ids
        if self.sync not in SYNC_MODES:
            raise ValueError(f"HotSpec.sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if ids.numel() == 0:
            self.sync = "none"
        elif self.sync == "none":
            self.sync = "dense"


@dataclass
class HeraldParameterSharding(ParameterSharding):
    """A TorchRec ``ParameterSharding`` carrying the table's :class:`HotSpec` (row-wise layout of the
    cold rows, same ``ranks`` / ``sharding_spec`` as stock ROW_WISE)."""

    hot: HotSpec = field(default_factory=HotSpec)

    def describe(self, num_embeddings: int, embedding_dim: int) -> Dict[str, Any]:
        """Plan printout for this table."""
        h = int(self.hot.hot_ids.numel())
        return {
            "sharding_type": self.sharding_type,
            "hot_rows": h,
            "hot_share_of_rows": h / max(1, num_embeddings),
            "sync": self.hot.sync,
            "replica_bytes_per_rank": h * (embedding_dim * 4 + 4),
            **{f"expected_{k}": v for k, v in self.hot.expected.items()},
        }


def hot_spec_of(ps: ParameterSharding) -> Optional[HotSpec]:
    """The HotSpec of a herald ParameterSharding, None for a stock one."""
    return ps.hot if isinstance(ps, HeraldParameterSharding) else None


def feature_read_twice(configs: Iterable[Any]) -> Optional[Tuple[str, str, str]]:
    """``(feature, first table, second table)`` where two of ``configs`` (``EmbeddingBagConfig`` s of one EBC's
    herald tables) read one KJT key, which herald's layout cannot hold (it maps a feature to one table); None
    otherwise."""
    reader: Dict[str, str] = {}
    for c in configs:
        for f in c.feature_names:
            if f in reader:
                return f, reader[f], c.name
            reader[f] = c.name
    return None
