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
    """One rank's local batch, split. Bags are indexed ``b = feature * B + sample``; ``N`` ids in all, the
    first ``n_cold`` of them cold once bucketized (``n_cold = sub_lengths.sum()``, which the caller reads
    from the host with its other sizes: the split itself never waits for the host)."""

    hot_offsets: torch.Tensor  # int64 [F*B + 1]: hot ids per bag, as TBE offsets
    bag_lengths: torch.Tensor  # int64 [F*B] full bag lengths (hot + cold), for MEAN pooling
    sub_lengths: torch.Tensor  # int64 [W * F * B] cold ids per (owner, feature, sample)
    bucketed_ids: torch.Tensor  # int64 [N]: the cold ids' owner-local rows ordered by (owner, feature,
    #                             sample), then one placeholder per hot id
    bucketed_hot_rows: torch.Tensor  # int64 [N]: in the same order, ``num_hot`` (a spare row past the hot buffer)
    #                                  for each cold id, then the hot ids' rows of the hot buffer in bag order


def out_of_table(values: torch.Tensor, rows_per_feature: torch.Tensor, feature_of_value: torch.Tensor) -> torch.Tensor:
    """Each id outside its feature's table (``< 0`` or ``>= rows``), where the ids are (no host read)."""
    return (values < 0) | (values >= rows_per_feature.index_select(0, feature_of_value))


def invalid_ids(values: torch.Tensor, rows_per_feature: torch.Tensor, feature_of_value: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each id's invalidity (:func:`out_of_table`) and, without a host read, the first invalid one as an
    int64 pair on the ids' device: ``(feature index + 1, id)``, or ``(0, 0)`` if every id is inside its table."""
    bad = out_of_table(values, rows_per_feature, feature_of_value)
    if values.numel() == 0:
        return bad, torch.zeros(2, dtype=torch.int64, device=values.device)
    # the first maximum: the first bad id, if any (a 1-element index: indexing with a 0-dim tensor would
    # read it on the host)
    i = torch.argmax(bad.to(torch.uint8)).view(1)
    code = torch.cat([feature_of_value.index_select(0, i) + 1, values.index_select(0, i)])
    return bad, code * bad.index_select(0, i)


def first_invalid_id(values: torch.Tensor, lengths: torch.Tensor, rows_per_feature: torch.Tensor,
                     batch_size: int) -> Optional[Tuple[int, int]]:
    """(feature index, id) of the first id < 0 or >= its table's rows, or None. Reads the host."""
    feature_of_value = bags_of_values(lengths, values.numel()) // batch_size
    feature, value = invalid_ids(values, rows_per_feature, feature_of_value)[1].tolist()
    return None if feature == 0 else (feature - 1, value)


def key_offset_and_spare(table_offsets: torch.Tensor, feature_table: torch.Tensor, block_sizes: torch.Tensor,
                         world_size: int) -> torch.Tensor:
    """int64 ``[F, 2]``: per feature, its table's offset in the global key space and the first id of the
    spare bucket past the owners' blocks (``world_size * block_sizes``), where :func:`split_hot_cold`
    sends a hot id."""
    return torch.stack([table_offsets[feature_table], world_size * block_sizes], 1).contiguous()


def split_hot_cold(values: torch.Tensor, lengths: torch.Tensor, feature_table: torch.Tensor,
                   table_offsets: torch.Tensor, hot_keys: torch.Tensor, block_sizes: torch.Tensor,
                   world_size: int, batch_size: int, feature_of_value: Optional[torch.Tensor] = None,
                   feature_key_table: Optional[torch.Tensor] = None) -> HotColdSplit:
    """Split valid ids into hot rows and owner-bucketized cold ids, with no host synchronisation.

    One ``block_bucketize_sparse_features`` call does both: each hot id is sent to a spare bucket
    ``world_size`` (after the owners'), so the spare bucket's lengths are the hot ids per bag and no
    boolean mask (sized by the data) is needed.

    Args:
        values, lengths: the KJT's values and lengths (feature-major, ``F*B`` lengths), all ids valid.
        feature_table: int64 [F] table index of each feature.
        table_offsets: int64 [T] offset of each table in the global row space.
        hot_keys: sorted int64 global keys (``table_offsets[t] + id``) of all hot rows; a hot row's
            position in it is its row in the hot buffer.
        block_sizes: int64 [F] row-wise block size of each feature's table (``ceil(n / W)``).
        feature_of_value: each value's feature, when the caller has it already.
        feature_key_table: :func:`key_offset_and_spare` of these arguments, when the caller keeps it
            (one gather a step instead of four ops: a GPU's step is its host's launches).
    """
    num_bags, num_hot = lengths.numel(), hot_keys.numel()
    if feature_of_value is None:
        feature_of_value = bags_of_values(lengths, values.numel()) // batch_size
    if num_hot:
        if feature_key_table is None:
            feature_key_table = key_offset_and_spare(table_offsets, feature_table, block_sizes, world_size)
        offset_spare = feature_key_table[feature_of_value]
        keys = offset_spare[:, 0] + values
        pos = torch.searchsorted(hot_keys, keys).clamp_(max=num_hot - 1)
        is_hot = hot_keys[pos] == keys
        row_or_spare = torch.where(is_hot, pos, num_hot)
        # a hot id goes to the spare bucket: the first id past the owners' blocks (every cold id is inside them)
        to_bucket = torch.where(is_hot, offset_spare[:, 1], values)
    else:
        to_bucket = values
    new_lengths, bucketed, _, _, permute = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, to_bucket, bucketize_pos=False, sequence=True, block_sizes=block_sizes,
        my_size=world_size + 1, weights=None)
    new_lengths = new_lengths.to(torch.int64)
    if num_hot:  # the hot ids' rows moved to where block_bucketize put them: after the cold ids, in bag order
        hot_rows = torch.empty_like(row_or_spare).index_copy_(0, permute.to(torch.int64), row_or_spare)
    else:  # every id cold: each one's spare row (no permutation of a constant)
        hot_rows = torch.zeros_like(values)
    return HotColdSplit(hot_offsets=offsets_from_lengths(new_lengths[world_size * num_bags:]),
                        bag_lengths=lengths.to(torch.int64), sub_lengths=new_lengths[: world_size * num_bags],
                        bucketed_ids=bucketed.to(torch.int64), bucketed_hot_rows=hot_rows)


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[0, cumsum(lengths)] as int64 (TBE offsets), where ``lengths`` is: fbgemm's one-op complete cumsum
    (TorchRec's ``_to_offsets``) rather than a zeros, a cumsum and a copy (a GPU's step is its host's)."""
    return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))


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
