"""The global row space herald works in (P²RES's two-fold layout): every row of every table has one key,
``table offset + id``; a hot row is replicated on every rank, a cold row lives in its stock ROW_WISE
block on its home rank. Built once per sharded module; the EBC, the row store, the plan executor, the
planners and the input allocator all read it, and none recomputes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from torchrec_herald.ops.hot_cold import local_block_rows, row_block_sizes

__all__ = ["RowLayout", "cache_capacities", "cache_rows_for_budget", "check_cache_budget", "layout_of"]


@dataclass(frozen=True, eq=False)
class RowLayout:
    """Which rank holds which row, and where (build it with :meth:`build`).

    Attributes:
        world_size: ``W``.
        tables: table names; a table's index is its position here, and its keys follow the tables before it.
        num_embeddings: rows per table.
        hot_ids: per table, the sorted unique ids replicated on every rank.
        block_sizes: per table, the ROW_WISE block size (home of a cold id ``x``: ``x // block``).
        features: KJT feature names in this layout's order; ``feature_table[f]`` serves feature f.
    """

    world_size: int
    tables: Tuple[str, ...]
    num_embeddings: Tuple[int, ...]
    hot_ids: Tuple[torch.Tensor, ...]
    block_sizes: Tuple[int, ...]
    features: Tuple[str, ...]
    feature_table: torch.Tensor
    # derived in __post_init__
    rows: torch.Tensor = field(init=False)  # int64 [T]
    table_offsets: torch.Tensor = field(init=False)  # int64 [T]: key of each table's row 0
    num_rows: int = field(init=False)
    blocks: torch.Tensor = field(init=False)  # int64 [T]
    hot_keys: torch.Tensor = field(init=False)  # sorted keys of all hot rows (= hot slot order)
    hot_counts: Tuple[int, ...] = field(init=False)
    num_hot: int = field(init=False)
    block_rows: torch.Tensor = field(init=False)  # int64 [W, T]: rows of table t in rank r's block
    block_offsets: torch.Tensor = field(init=False)  # int64 [W, T]: where they start among r's cold rows
    table_index: Dict[str, int] = field(init=False)

    @classmethod
    def build(cls, world_size: int, num_embeddings: Mapping[str, int],
              hot_ids: Optional[Mapping[str, torch.Tensor]] = None, features: Optional[Mapping[str, str]] = None,
              block_sizes: Optional[Mapping[str, int]] = None) -> "RowLayout":
        """Validate and build. ``features``: feature -> table (default: one feature per table, named as it);
        ``block_sizes``: default ``ceil(n / W)``, stock ROW_WISE's. Raises ValueError naming the table."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        tables = list(num_embeddings)
        n = {t: int(num_embeddings[t]) for t in tables}
        for t, rows in n.items():
            if rows < 1:
                raise ValueError(f"table {t!r}: num_embeddings must be >= 1, got {rows}")
        hot_ids = dict(hot_ids or {})
        unknown = sorted(set(hot_ids) - set(tables))
        if unknown:
            raise ValueError(f"hot ids for unknown tables {unknown} (tables: {tables})")
        hot: List[torch.Tensor] = []
        for t in tables:
            ids = torch.unique(torch.as_tensor(hot_ids.get(t, []), dtype=torch.int64).flatten())
            if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= n[t]):
                raise ValueError(f"table {t!r}: hot ids outside [0, {n[t]})")
            hot.append(ids)
        feats = dict(features) if features is not None else {t: t for t in tables}
        bad = sorted(f for f, t in feats.items() if t not in n)
        if bad:
            raise ValueError(f"features {bad} map to unknown tables (tables: {tables})")
        blocks = dict(zip(tables, row_block_sizes([n[t] for t in tables], world_size)), **(block_sizes or {}))
        for t, b in blocks.items():
            if t not in n:
                raise ValueError(f"block size for unknown table {t!r}")
            if b < 1 or -(-n[t] // b) > world_size:
                raise ValueError(f"table {t!r}: block size {b} does not spread {n[t]} rows over {world_size} ranks")
        index = {t: i for i, t in enumerate(tables)}
        return cls(world_size=int(world_size), tables=tuple(tables), num_embeddings=tuple(n[t] for t in tables),
                   hot_ids=tuple(hot), block_sizes=tuple(int(blocks[t]) for t in tables), features=tuple(feats),
                   feature_table=torch.tensor([index[t] for t in feats.values()], dtype=torch.int64))

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        rows = torch.tensor(self.num_embeddings, dtype=torch.int64)
        put("rows", rows)
        put("table_offsets", torch.cumsum(rows, 0) - rows)
        put("num_rows", int(rows.sum()))
        put("blocks", torch.tensor(self.block_sizes, dtype=torch.int64))
        put("hot_keys", torch.cat([self.table_offsets[t] + h for t, h in enumerate(self.hot_ids)])
            if self.hot_ids else torch.empty(0, dtype=torch.int64))
        put("hot_counts", tuple(int(h.numel()) for h in self.hot_ids))
        put("num_hot", int(sum(self.hot_counts)))
        block_rows = torch.tensor([[local_block_rows(n, b, r)[1] for n, b in zip(self.num_embeddings, self.block_sizes)]
                                   for r in range(self.world_size)], dtype=torch.int64).view(self.world_size, -1)
        put("block_rows", block_rows)
        put("block_offsets", torch.cumsum(block_rows, 1) - block_rows)
        put("table_index", {t: i for i, t in enumerate(self.tables)})

    # ------------------------------------------------------------------ per table / per feature
    def table(self, name: str) -> int:
        """Index of table ``name`` (ValueError naming the known tables)."""
        if name not in self.table_index:
            raise ValueError(f"unknown table {name!r} (tables: {list(self.tables)})")
        return self.table_index[name]

    def block_range(self, table: int, rank: int) -> Tuple[int, int]:
        """(first row, number of rows) of ``rank``'s block of ``table``."""
        return local_block_rows(self.num_embeddings[table], self.block_sizes[table], rank)

    @cached_property
    def rows_per_feature(self) -> torch.Tensor:
        """int64 [F]: rows of the table serving each feature."""
        return self.rows.index_select(0, self.feature_table)

    @cached_property
    def blocks_per_feature(self) -> torch.Tensor:
        """int64 [F]: block size of the table serving each feature."""
        return self.blocks.index_select(0, self.feature_table)

    @cached_property
    def feature_offsets(self) -> torch.Tensor:
        """int64 [F]: key of row 0 of the table serving each feature (a feature's id ``x`` has key
        ``feature_offsets[f] + x``)."""
        return self.table_offsets.index_select(0, self.feature_table)

    @cached_property
    def hot_slot_table(self) -> torch.Tensor:
        """int64 [num_hot]: table of each hot slot."""
        return torch.repeat_interleave(torch.arange(len(self.tables)), torch.tensor(self.hot_counts, dtype=torch.int64))

    def feature_keys(self, values: torch.Tensor, lengths: torch.Tensor, batch_size: int,
                     feature_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Key of every id of a KJT in this layout's feature order (values feature-major: ``lengths`` has
        ``F * batch_size`` entries); ``feature_offsets``: :attr:`feature_offsets` already on the ids'
        device (no copy per call)."""
        offsets = self.feature_offsets if feature_offsets is None else feature_offsets
        per_feature = lengths.to(torch.int64).view(len(self.features), batch_size).sum(1)
        return values.to(torch.int64) + torch.repeat_interleave(offsets, per_feature,
                                                                output_size=values.numel())  # (no host sync)

    # ------------------------------------------------------------------ per key (nothing dense over all rows)
    def table_of(self, keys: torch.Tensor) -> torch.Tensor:
        """int64: table of each key."""
        return torch.searchsorted(self.table_offsets, keys.to(torch.int64), right=True) - 1

    def _per_table(self, values: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``values[t]`` (a per-table tensor gathered for every key's table ``t``), any shape of ``t``."""
        return values.index_select(0, t) if t.dim() == 1 else values.index_select(0, t.reshape(-1)).view(t.shape)

    def home_of(self, keys: torch.Tensor, table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """int64: ROW_WISE home rank of each key (where its cold copy lives); ``table``: its
        :meth:`table_of`, when the caller has it."""
        keys = keys.to(torch.int64)
        t = self.table_of(keys) if table is None else table
        return (keys - self._per_table(self.table_offsets, t)).div_(self._per_table(self.blocks, t), rounding_mode="floor")

    def hot_slot(self, keys: torch.Tensor) -> torch.Tensor:
        """int64: position of each key in the hot replica buffer, -1 for cold keys."""
        keys = keys.to(torch.int64)
        if not self.num_hot:
            return torch.full(keys.shape, -1, dtype=torch.int64)
        pos = torch.searchsorted(self.hot_keys, keys).clamp_(max=self.num_hot - 1)
        return pos.masked_fill_(self._per_table(self.hot_keys, pos) != keys, -1)

    def is_hot(self, keys: torch.Tensor) -> torch.Tensor:
        """bool: each key is replicated on every rank."""
        return self.hot_slot(keys) >= 0

    def block_slot(self, keys: torch.Tensor, rank: int) -> torch.Tensor:
        """int64: position of each key among ``rank``'s cold rows (its fused TBE), -1 elsewhere."""
        keys = keys.to(torch.int64)
        t = self.table_of(keys)
        local = keys - self._per_table(self.table_offsets, t)
        block = self._per_table(self.blocks, t)
        slot = self._per_table(self.block_offsets[rank], t) + local - rank * block
        return slot.masked_fill_(local.div(block, rounding_mode="floor") != rank, -1)

    def hot_rows_in_block(self, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(hot slots, block positions) of the hot rows that lie in ``rank``'s cold block: the rows whose
        replica the block mirrors, so that the block is always a complete ROW_WISE shard."""
        slots, positions = [], []
        first_slot = 0
        for t in range(len(self.tables)):
            start, n = self.block_range(t, rank)
            ids = self.hot_ids[t]
            inside = (ids >= start) & (ids < start + n)
            slots.append(first_slot + inside.nonzero().flatten())
            positions.append(int(self.block_offsets[rank, t]) + ids[inside] - start)
            first_slot += int(ids.numel())
        return torch.cat(slots).to(torch.int64), torch.cat(positions).to(torch.int64)


def cache_capacities(layout: RowLayout, capacity_fraction: Optional[float],
                     capacity_rows: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """Cache capacity in rows per table (every rank the same): ``ceil(fraction * n)`` (at least 1), or
    ``capacity_rows[t]`` where given (``1 <= C <= n``)."""
    n = dict(zip(layout.tables, layout.num_embeddings))
    caps: Dict[str, int] = {}
    if capacity_fraction is not None:
        f = float(capacity_fraction)
        if not 0.0 < f <= 1.0:
            raise ValueError(f"capacity_fraction must be in (0, 1], got {capacity_fraction}")
        caps = {t: max(1, math.ceil(f * rows)) for t, rows in n.items()}
    for t, c in (capacity_rows or {}).items():
        if t not in n:
            raise ValueError(f"capacity for unknown table {t!r}")
        if not 1 <= int(c) <= n[t]:
            raise ValueError(f"table {t!r}: cache capacity must be in [1, {n[t]}] rows, got {c}")
        caps[t] = int(c)
    return caps


def check_cache_budget(budget_bytes: int, num_tables: int, row_bytes: int) -> int:
    """The rows a cache budget of ``budget_bytes`` per rank holds (``row_bytes`` a row); ValueError naming
    ``pipeline.cache_bytes`` where that is not one row per table (preflight's check and the pipeline's)."""
    rows = int(budget_bytes) // int(row_bytes)
    if rows < int(num_tables):
        raise ValueError(f"pipeline.cache_bytes={budget_bytes} holds {rows} rows of {row_bytes} bytes; the "
                         f"{num_tables} tables need at least one cache row each ({num_tables * row_bytes} bytes)")
    return rows


def cache_rows_for_budget(layout: RowLayout, budget_bytes: int, row_bytes: int) -> Dict[str, int]:
    """Cache capacity in rows per table from a bytes budget per rank (``row_bytes``: one cached row,
    weights and optimizer state): the budget's rows shared in proportion to the tables' rows, at least
    one row per table, at most the table. Raises ValueError when the budget cannot hold one row per table."""
    rows = check_cache_budget(budget_bytes, len(layout.tables), row_bytes)
    total = layout.num_rows
    return {t: max(1, min(n, rows * n // total)) for t, n in zip(layout.tables, layout.num_embeddings)}


def layout_of(obj: object) -> RowLayout:
    """The :class:`RowLayout` of ``obj``: itself, or its ``layout`` attribute (a ``Locality``)."""
    if isinstance(obj, RowLayout):
        return obj
    layout = getattr(obj, "layout", None)
    if not isinstance(layout, RowLayout):
        raise TypeError(f"expected a RowLayout or an object with a .layout, got {type(obj).__name__}")
    return layout
