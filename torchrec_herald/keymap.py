"""A sorted-array map from int64 keys to int64 / bool columns: per-row state held only for the rows that
have some (DESIGN §6: per-rank state grows with the rank's caches and window, never with all rows).

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
        pos = torch.searchsorted(self.keys, q)
        if not len(self):
            return pos, torch.zeros(q.shape, dtype=torch.bool)
        found = self.keys.index_select(0, pos.clamp(max=len(self) - 1).view(-1)).view(q.shape) == q
        return pos, found & (pos < len(self))

    def get(self, q: torch.Tensor, name: str, default: int = -1) -> torch.Tensor:
        """Column ``name`` at each of ``q``, ``default`` where absent."""
        pos, found = self.find(q)
        col = self.cols[name]
        out = torch.full(q.shape, default, dtype=col.dtype)
        if len(self):
            out = torch.where(found, col.index_select(0, pos.clamp(max=len(self) - 1).view(-1)).view(q.shape), out)
        return out

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
        is_new = torch.zeros(n + n_new, dtype=torch.bool)
        is_new[at] = True
        old_at = (~is_new).nonzero().flatten()
        keys = torch.empty(n + n_new, dtype=torch.int64)
        keys[at], keys[old_at] = new, self.keys
        self.keys = keys
        for c, d in self._dtypes.items():
            col = torch.empty(n + n_new, dtype=d)
            col[at] = torch.as_tensor(values[c], dtype=d).expand(n_new)
            col[old_at] = self.cols[c]
            self.cols[c] = col

    def remove_at(self, positions: torch.Tensor) -> None:
        """Delete the keys at ``positions`` (positions into :attr:`keys`)."""
        if not positions.numel():
            return
        keep = torch.ones(len(self), dtype=torch.bool)
        keep[positions] = False
        self.keys = self.keys[keep]
        self.cols = {c: v[keep] for c, v in self.cols.items()}

    def remove(self, q: torch.Tensor) -> None:
        """Delete those of ``q`` that are keys."""
        pos, found = self.find(q)
        self.remove_at(pos[found])

    def nbytes(self) -> int:
        """Bytes held by the keys and columns."""
        return int(self.keys.numel() * 8 + sum(v.numel() * v.element_size() for v in self.cols.values()))


def expand_ranges(lo: torch.Tensor, hi: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(positions, owner)``: every ``p`` in ``[lo[i], hi[i])`` for each ``i``, with its ``i``."""
    count = (hi - lo).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(lo.numel()), count)
    start = torch.cumsum(count, 0) - count
    return lo.index_select(0, owner) + torch.arange(owner.numel()) - start.index_select(0, owner), owner
