"""Deterministic per-row embedding initialisation, so a model built on ``meta`` needs no full copy.

A row's initial values depend only on ``(seed, table, row)``: rows are drawn in fixed blocks of
:data:`ROWS_PER_DRAW` from a generator seeded by ``(seed, table name, block)``. Any sharding (TABLE_WISE,
ROW_WISE, COLUMN_WISE, DATA_PARALLEL, herald's hot/cold layout) therefore materialises exactly the same
model, and each rank draws only the rows it holds (docs/design.md §6: per-rank cost grows with its own share).
The values are uniform in ``±sqrt(1/num_embeddings)``, TorchRec's default ``EmbeddingBagConfig`` bound.
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Mapping, Set

import torch
from torch import nn

__all__ = ["ROWS_PER_DRAW", "initial_rows", "init_sharded_embeddings"]

logger = logging.getLogger(__name__)

ROWS_PER_DRAW = 4096  # rows drawn per generator seed: small enough that a shard draws ~ its own rows
ROWS_PER_FILL = 1 << 18  # rows written per temporary: a table's fill holds at most this many rows twice
_MASK = (1 << 63) - 1


def _block_seed(seed: int, table: str, block: int) -> int:
    """A 63-bit seed for one block of one table (a fixed, platform-independent mix of the three)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + zlib.crc32(table.encode()) * 0xBF58476D1CE4E5B9 + int(block)) & _MASK
    x ^= x >> 31
    return (x * 0x94D049BB133111EB) & _MASK


def initial_rows(seed: int, table: str, num_embeddings: int, dim: int, start: int, stop: int) -> torch.Tensor:
    """float32 ``[stop - start, dim]``: the initial values of rows ``start .. stop-1`` of ``table``.

    Raises ValueError naming the table when the range is outside ``[0, num_embeddings]``."""
    if not 0 <= start <= stop <= num_embeddings:
        raise ValueError(f"table {table!r}: rows [{start}, {stop}) outside [0, {num_embeddings})")
    bound = math.sqrt(1.0 / num_embeddings)
    out = torch.empty(stop - start, dim, dtype=torch.float32)
    gen = torch.Generator()
    row = start
    while row < stop:
        block = row // ROWS_PER_DRAW
        lo = block * ROWS_PER_DRAW
        n = min(ROWS_PER_DRAW, num_embeddings - lo)
        gen.manual_seed(_block_seed(seed, table, block))
        drawn = torch.rand(n, dim, generator=gen)
        take = min(stop, lo + n) - row
        out[row - start: row - start + take] = drawn[row - lo: row - lo + take]
        row += take
    return out.mul_(2 * bound).sub_(bound)


def _fill(target: torch.Tensor, seed: int, table: str, num_embeddings: int, dim: int, row0: int, col0: int) -> None:
    """``target`` (rows ``row0..`` and columns ``col0..`` of ``table``) set to :func:`initial_rows`, in parts of
    :data:`ROWS_PER_FILL` rows (a shard of 10M rows drew a 10M-row temporary)."""
    rows, cols = target.shape
    for a in range(0, rows, ROWS_PER_FILL):
        b = min(rows, a + ROWS_PER_FILL)
        target[a:b].copy_(initial_rows(seed, table, num_embeddings, dim, row0 + a, row0 + b)[:, col0:col0 + cols])


def init_sharded_embeddings(dmp: nn.Module, tables: Mapping[str, int], seed: int) -> int:
    """Fill every embedding table of ``dmp`` (a DistributedModelParallel, any plan) in place with
    :func:`initial_rows`; each rank writes only the shards it holds. ``tables``: table name → rows.
    Herald modules then refresh their hot replicas from the filled blocks (a collective). Returns the
    number of rows this rank wrote."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from torchrec_herald.sharding.hot_replicated import ShardedHeraldEmbeddingBagCollection
    from torchrec_herald.sharding.types import table_of_state_key

    written = 0
    seen: Set[str] = set()
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            name = table_of_state_key(key)
            if name is None:
                continue
            if name not in tables:
                raise ValueError(f"{key}: table {name!r} is not among the model's tables {sorted(tables)}")
            n = int(tables[name])
            seen.add(name)
            if isinstance(value, ShardedTensor):
                dim = int(value.size()[1])
                for shard in value.local_shards():
                    r0, c0 = (int(o) for o in shard.metadata.shard_offsets)
                    rows, cols = (int(s) for s in shard.metadata.shard_sizes)
                    if rows and cols:
                        _fill(shard.tensor, seed, name, n, dim, r0, c0)
                        written += rows
            else:  # replicated (DATA_PARALLEL): the whole table
                _fill(value, seed, name, n, int(value.shape[1]), 0, 0)
                written += n
    missing = sorted(set(tables) - seen)
    if missing:
        raise ValueError(f"tables {missing} have no weights in the sharded model's state_dict")
    for m in dmp.modules():
        if isinstance(m, ShardedHeraldEmbeddingBagCollection):
            m.refresh_hot_from_blocks()
    logger.info("initialised %d embedding rows on this rank from seed %d (per-row draws)", written, seed)
    return written
