"""A sorted-array map from int64 keys to int64 / bool columns: per-row state held only for the rows that
have some (docs/design.md §6: per-rank state grows with the rank's caches and window, never with all rows).

Hand-written because torch has no vectorised hash map and fbgemm's CPU hash tables are not exposed to
Python; lookups are one ``searchsorted``, inserts one merge of two sorted arrays (no re-sort).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

__all__ = ["SortedKeyMap", "expand_ranges"]


class SortedKeyMap:
    """Unique int64 keys kept sorted, each with one value per column (``columns``: name → dtype).

    ``find`` answers for a batch of keys at once; ``insert`` adds keys not yet present; ``remove`` deletes.
    Every column is a tensor aligned with :attr:`keys` and may be written in place through :meth:`col`.
    """

    def __init__(self, **columns: torch.dtype) -> None:
        self._dtypes = dict(columns)
        self.clear()

    def clear(self) -> None:
        """Remove every key."""
        self.keys = torch.empty(0, dtype=torch.int64)
        self.cols: Dict[str, torch.Tensor] = {c: torch.empty(0, dtype=d) for c, d in self._dtypes.items()}

    def __len__(self) -> int:
        return int(self.keys.numel())

    def col(self, name: str) -> torch.Tensor:
        """Column ``name`` (aligned with :attr:`keys`)."""
        return self.cols[name]

    def find(self, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(position, found)`` of each of ``q``: where it is (``found``) or would be inserted."""
        q = q.to(torch.int64)
        n = len(self)
        if not n or not q.numel():
            return torch.zeros(q.shape, dtype=torch.int64), torch.zeros(q.shape, dtype=torch.bool)
        pos = torch.searchsorted(self.keys, q)
        at = pos.clamp(max=n - 1)
        found = (self.keys.index_select(0, at) if q.dim() == 1
                 else self.keys.index_select(0, at.view(-1)).view(q.shape)) == q
        return pos, found

    def get(self, q: torch.Tensor, name: str, default: int = -1) -> torch.Tensor:
        """Column ``name`` at each of ``q``, ``default`` where absent."""
        col = self.cols[name]
        if not len(self) or not q.numel():
            return torch.full(q.shape, default, dtype=col.dtype)
        pos, found = self.find(q)
        got = col.index_select(0, pos.clamp(max=len(self) - 1).view(-1)).view(q.shape)
        return got.masked_fill_(~found, default)

    def contains(self, q: torch.Tensor) -> torch.Tensor:
        """bool: each of ``q`` is a key."""
        return self.find(q)[1]

    def insert(self, new: torch.Tensor, **values: torch.Tensor) -> None:
        """Add ``new`` (sorted, unique, none present) with a value per column (a tensor or a scalar)."""
        n_new = int(new.numel())
        if not n_new:
            return
        missing = set(self._dtypes) - set(values)
        if missing:
            raise ValueError(f"insert needs a value for columns {sorted(missing)}")
        n = len(self)
        at = torch.searchsorted(self.keys, new) + torch.arange(n_new)  # new keys' places in the merge
        old_at = torch.arange(n) + torch.searchsorted(new, self.keys)  # old keys' places in the merge
        keys = torch.empty(n + n_new, dtype=torch.int64)
        keys.index_copy_(0, at, new).index_copy_(0, old_at, self.keys)
        self.keys = keys
        for c, d in self._dtypes.items():
            col = torch.empty(n + n_new, dtype=d)
            col.index_copy_(0, at, torch.as_tensor(values[c], dtype=d).expand(n_new).contiguous())
            self.cols[c] = col.index_copy_(0, old_at, self.cols[c])

    def remove_at(self, positions: torch.Tensor) -> None:
        """Delete the keys at ``positions`` (positions into :attr:`keys`)."""
        if not positions.numel():
            return
        keep = torch.ones(len(self), dtype=torch.bool).index_fill_(0, positions, False)
        self.keys = self.keys.masked_select(keep)
        self.cols = {c: v.masked_select(keep) for c, v in self.cols.items()}

    def remove(self, q: torch.Tensor) -> None:
        """Delete those of ``q`` that are keys."""
        if not len(self) or not q.numel():
            return
        pos, found = self.find(q)
        self.remove_at(pos.masked_select(found))

    def nbytes(self) -> int:
        """Bytes held by the keys and columns."""
        return int(self.keys.numel() * 8 + sum(v.numel() * v.element_size() for v in self.cols.values()))


def expand_ranges(lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(positions, owner)``: every ``p`` in ``[lo[i], hi[i])`` for each ``i``, with its ``i``."""
    count = (hi - lo).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(lo.numel()), count)
    start = torch.cumsum(count, 0) - count
    return lo.index_select(0, owner) + torch.arange(owner.numel()) - start.index_select(0, owner), owner
