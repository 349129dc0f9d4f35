"""Hot/cold split of a KeyedJaggedTensor and owner bucketing of cold ids (fbgemm ops).

Every op runs where its inputs are (CPU, or the rows' GPU: no host round trip of the ids).
Hot ids (a replica on every rank) are remapped to rows of the concatenated hot buffer; cold ids are
bucketized to their row-wise owner with fbgemm's ``block_bucketize_sparse_features`` (the op TorchRec's
ROW_WISE input dist uses), keeping one sub-bag per (owner, feature, sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch


@dataclass
class HotColdSplit:
    """One rank's local batch, split. Bags are indexed ``b = feature * B + sample``."""

    hot_rows: torch.Tensor  # int64 rows of the hot buffer, in bag order
    hot_offsets: torch.Tensor  # int64 [F*B + 1]
    bag_lengths: torch.Tensor  # int64 [F*B] full bag lengths (hot + cold), for MEAN pooling
    sub_lengths: torch.Tensor  # int64 [W * F * B] cold ids per (owner, feature, sample)
    cold_local_ids: torch.Tensor  # int64 owner-local row ids, ordered by (owner, feature, sample)


def first_invalid_id(values: torch.Tensor, lengths: torch.Tensor, rows_per_feature: torch.Tensor,
                     batch_size: int, bag_of_value: Optional[torch.Tensor] = None) -> Optional[Tuple[int, int]]:
    """(feature index, id) of the first id < 0 or >= its table's rows, or None; ``bag_of_value``: each
    value's bag (``b = feature * B + sample``) when the caller has it already."""
    if bag_of_value is None:
        bag_of_value = bags_of_values(lengths, values.numel())
    feature_of_value = bag_of_value // batch_size
    bad = (values < 0) | (values >= rows_per_feature[feature_of_value])
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0, 0])
    return int(feature_of_value[i]), int(values[i])


def split_hot_cold(values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
                   table_offsets: torch.Tensor, hot_keys: torch.Tensor, block_sizes: torch.Tensor,
                   world_size: int, batch_size: int, bag_of_value: Optional[torch.Tensor] = None) -> HotColdSplit:
    """Split valid ids into hot rows and owner-bucketized cold ids.

    Args:
        values, lengths: the KJT's values and lengths (feature-major, ``F*B`` lengths).
        feature_table: int64 [F] table index of each feature.
        table_offsets: int64 [T] offset of each table in the global row space.
        hot_keys: sorted int64 global keys (``table_offsets[t] + id``) of all hot rows; a hot row's
            position in it is its row in the hot buffer.
        block_sizes: int64 [F] row-wise block size of each feature's table (``ceil(n / W)``).
        bag_of_value: each value's bag, when the caller has it already.
    """
    num_bags = lengths.numel()
    if bag_of_value is None:
        bag_of_value = bags_of_values(lengths, values.numel())
    feature_of_value = bag_of_value // batch_size
    keys = table_offsets[feature_table[feature_of_value]] + values
    if hot_keys.numel():
        pos = torch.searchsorted(hot_keys, keys).clamp_(max=hot_keys.numel() - 1)
        is_hot = hot_keys[pos] == keys
    else:
        pos = torch.zeros_like(keys)
        is_hot = torch.zeros_like(keys, dtype=torch.bool)
    hot_counts = torch.bincount(bag_of_value[is_hot], minlength=num_bags)
    hot_offsets = offsets_from_lengths(hot_counts)
    cold = ~is_hot
    cold_lengths = torch.bincount(bag_of_value[cold], minlength=num_bags)
    sub_lengths, cold_local = torch.ops.fbgemm.block_bucketize_sparse_features(
        cold_lengths, values[cold], bucketize_pos=False, sequence=False, block_sizes=block_sizes,
        my_size=world_size, weights=None)[:2]
    return HotColdSplit(hot_rows=pos[is_hot], hot_offsets=hot_offsets, bag_lengths=lengths.to(torch.int64),
                        sub_lengths=sub_lengths.to(torch.int64), cold_local_ids=cold_local.to(torch.int64))


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[0, cumsum(lengths)] as int64 (TBE offsets), where ``lengths`` is."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def bags_of_values(lengths: torch.Tensor, num_values: int) -> torch.Tensor:
    """Each value's bag index (``repeat_interleave`` of the bags by ``lengths``), where ``lengths`` is;
    ``num_values`` (their sum, known to the caller) spares a device a host synchronisation."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                   output_size=num_values)


def row_block_sizes(num_embeddings: Sequence[int], world_size: int) -> List[int]:
    """Stock ROW_WISE block size per table: ``ceil(n / W)``."""
    return [(n + world_size - 1) // world_size for n in num_embeddings]


def local_block_rows(num_embeddings: int, block: int, rank: int) -> Tuple[int, int]:
    """(first row, number of rows) of ``rank``'s row-wise block of a table."""
    start = min(num_embeddings, rank * block)
    return start, max(0, min(num_embeddings, start + block) - start)
