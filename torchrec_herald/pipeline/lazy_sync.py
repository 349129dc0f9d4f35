"""Herald's lazy, exact communication plan (DESIGN §3, Herald (b)) as tensor operations, fast enough to
run every step: the owner-route LRU plan of the readable reference ``LazySyncPlanner``.

``LazySyncPlanner`` (``torchrec_herald/testing/reference_plans.py``) is the reference (dicts, one row at a time);
:class:`TensorLazySyncPlanner` here keeps the same state as ``[W, N]`` tensors over the *global row space*
(key = table offset + row id, tables concatenated) and plans a step with a few dozen vectorised ops. It
produces the **same transfers** as the reference with ``route="owner", policy="lru"`` (tested on random
traces; ``torchrec_herald.testing.reference_plans`` holds the reference, the exactness checker and the
conversion of a plan for it).

State per row ``x``: ``master[x]`` (the rank holding the latest version; its home ``x // block`` when
clean), per rank ``valid[r, x]`` (r's copy is the latest), ``cached[r, x]`` (r caches remote cold row x),
``last_use[r, x]`` (LRU). Hot rows are held by every rank, a cold row by its home, cached rows by the cache.
Every rank runs the planner on the same reads and gets the same plan, so the transfers it implies need no
further metadata on the wire: a receiver knows which rows arrive, from whom, in which order.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.layout import RowLayout, cache_capacities, layout_of
from torchrec_herald.plans import CommPlanner, ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers

__all__ = ["TensorLazySyncPlanner"]


class TensorLazySyncPlanner(CommPlanner):
    """Vectorised owner-route, LRU lazy plan (see the module docstring).

    Args:
        locality: the layout (hot rows, ROW_WISE blocks; its ``cache`` field is ignored).
        capacity_fraction: cache capacity per rank per table as a fraction of the table's rows (``(0, 1]``).
        window: ``K >= 1``: steps of look-ahead (only the next step's reads change the plan: pushes for it).
        capacity_rows: optional per-table capacity in rows (``1 ≤ C ≤ n``), overriding the fraction.
    """

    def __init__(self, locality: Any, capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        lay: RowLayout = layout_of(locality)
        self.layout = lay
        self.window = int(window)
        self.W = lay.world_size
        caps = cache_capacities(lay, capacity_fraction, capacity_rows)
        self.capacity = torch.tensor([caps[t] for t in lay.tables], dtype=torch.int64)
        self.num_rows = lay.num_rows
        self.table_lo = lay.table_offsets
        self.table_hi = lay.table_offsets + lay.rows
        self.table_of, self.home, self.is_hot = lay.table_of_row, lay.home_of_row, lay.is_hot_row
        self.reset()

    def reset(self) -> None:
        """Initial state: every hot replica and every home copy valid, caches empty."""
        W, N = self.W, self.num_rows
        ranks = torch.arange(W).unsqueeze(1)
        self.valid = self.is_hot.unsqueeze(0) | (self.home.unsqueeze(0) == ranks)
        self.cached = torch.zeros(W, N, dtype=torch.bool)
        self.last_use = torch.full((W, N), -1, dtype=torch.int64)
        self.cache_count = torch.zeros(W, len(self.capacity), dtype=torch.int64)
        self.master = self.home.clone()
        self.step = 0

    # ------------------------------------------------------------------ helpers
    # (1-D gathers and scatters below use index_select / index_fill_ / index_copy_ on flat ``r * N + x``
    # indices: same results as advanced indexing, a few times less overhead per call)
    def _pairs(self, reads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(reads) != self.W:
            raise ValueError(f"reads need one key set per rank ({self.W}), got {len(reads)}")
        R = torch.cat([torch.full((len(k),), r, dtype=torch.int64) for r, k in enumerate(reads)])
        X = torch.cat([torch.as_tensor(k, dtype=torch.int64) for k in reads])
        if X.numel():
            lo, hi = torch.aminmax(X)
            if int(lo) < 0 or int(hi) >= self.num_rows:
                raise ValueError(f"read keys outside [0, {self.num_rows})")
        return R, X

    @staticmethod
    def _readers(R: torch.Tensor, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """unique rows, inverse, reader count, lowest reader."""
        ux, inv, nS = torch.unique(X, return_inverse=True, return_counts=True)
        first = torch.full((ux.numel(),), -1, dtype=torch.int64).scatter_reduce(0, inv, R, "amin",
                                                                                include_self=False)
        return ux, inv, nS, first

    def _push_home(self, x: torch.Tensor) -> torch.Tensor:
        """Dirty rows ``x`` (sorted) go home: ``(key, master, home)``; the home copies become the latest."""
        m, h = self.master.index_select(0, x), self.home.index_select(0, x)
        self.valid.view(-1).index_fill_(0, h * self.num_rows + x, True)
        self.master.index_copy_(0, x, h)
        return torch.stack([x, m, h], 1)

    def _admit_to_caches(self, R: torch.Tensor, X: torch.Tensor, cold: torch.Tensor, new: torch.Tensor) -> None:
        """Reads ``(R[i], X[i])`` of remote cold rows (``cold``) enter (``new``) or refresh their LRU entry."""
        N, T = self.num_rows, self.cache_count.shape[1]
        fc = (R * N + X).masked_select(cold)
        self.cached.view(-1).index_fill_(0, fc, True)
        self.last_use.view(-1).index_fill_(0, fc, self.step)
        t_new = self.table_of.index_select(0, X.masked_select(new))
        self.cache_count += torch.bincount(R.masked_select(new) * T + t_new, minlength=self.W * T).view(self.W, T)

    def _reducers(self, R: torch.Tensor, X: torch.Tensor, ux: torch.Tensor, inv: torch.Tensor, nS: torch.Tensor,
                  first: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One update per read row: by its only reader, or at home when several ranks read it. Returns
        (reducer of each row of ``ux``, the ``(key, reader, reducer)`` gradient sends, in read order)."""
        reducer = torch.where(nS == 1, first, self.home.index_select(0, ux))
        red_of = reducer.index_select(0, inv)
        sends = (R != red_of).nonzero().squeeze(1)
        return reducer, torch.stack([X.index_select(0, sends), R.index_select(0, sends), red_of.index_select(0, sends)], 1)

    def _hot_pulls(self, stale: torch.Tensor) -> torch.Tensor:
        """``(key, home, rank)`` pulls refreshing the hot replicas where ``stale`` (bool ``[W, num_hot]``)."""
        hot = self.is_hot.nonzero().flatten()
        r, i = stale.nonzero(as_tuple=True)
        x = hot[i]
        return sort_transfers(torch.stack([x, self.home[x], r], 1))

    def _cached_rows(self) -> List[torch.Tensor]:
        """Per rank, the keys it caches."""
        return [self.cached[q].nonzero().flatten() for q in range(self.W)]

    # ------------------------------------------------------------------ planning
    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """Plan ``window[0]`` (per rank: the sorted unique keys it reads), with ``window[1]`` (if given)
        as look-ahead; advances the state. Every rank calling this on the same window gets the same plan."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        N = self.num_rows
        valid, cached = self.valid.view(-1), self.cached.view(-1)  # [W * N]: flat index r * N + x
        cnt = SyncCounters()
        reads = [torch.as_tensor(k, dtype=torch.int64) for k in window[0]]
        R, X = self._pairs(reads)
        # read pairs in (key, rank) order (R ascends in X's concatenation): a key's readers are adjacent,
        # lowest rank first, and pulls and reduces come out sorted by (key, src, dst) with no further sort
        X, perm = torch.sort(X, stable=True)
        R = R.index_select(0, perm)
        ux, inv, nS = torch.unique_consecutive(X, return_inverse=True, return_counts=True)
        first = R.index_select(0, torch.cumsum(nS, 0) - nS)
        # dirty rows read by some rank other than their master go home first
        m, home_u = self.master.index_select(0, ux), self.home.index_select(0, ux)
        pre = self._push_home(ux.masked_select((m != home_u) & ~((nS == 1) & (first == m))))
        home_X = self.home.index_select(0, X)
        # pulls: every read whose copy is not the latest, from the row's master
        flat = R * N + X
        ok = valid.index_select(0, flat)
        cold = ~self.is_hot.index_select(0, X) & (home_X != R)
        new = cold & ~cached.index_select(0, flat)
        need = (~ok).nonzero().squeeze(1)
        Xn = X.index_select(0, need)
        pull = torch.stack([Xn, self.master.index_select(0, Xn), R.index_select(0, need)], 1)
        pull_miss = new.index_select(0, need)  # = not held (not hot, not home, not cached)
        valid.index_fill_(0, flat, True)
        self._admit_to_caches(R, X, cold, new)
        cnt.reads, cnt.hits = X.numel(), int(ok.sum())
        cnt.cache_reads, cnt.cache_hits = int(cold.sum()), int((ok & cold).sum())
        cnt.miss_pull = int(pull_miss.sum())
        cnt.update_pull = need.numel() - cnt.miss_pull
        # read pairs in (key, rank) order: the sends come out sorted by (key, src, dst)
        reducer, reduce = self._reducers(R, X, ux, inv, nS, first)
        cnt.reduce = len(reduce)
        self.valid.index_fill_(1, ux, False)
        valid.index_fill_(0, reducer * N + ux, True)
        self.master.index_copy_(0, ux, reducer)
        # look-ahead: a dirty row another rank reads in the next step is pushed home now
        post = no_transfers()
        if len(window) > 1 and self.window > 1:
            R1, X1 = self._pairs([torch.as_tensor(k, dtype=torch.int64) for k in window[1]])
            # (a rank reads a row at most once: a row with several readers has one other than its master)
            m1 = self.master.index_select(0, X1)
            post = self._push_home(torch.unique(X1.masked_select((m1 != self.home.index_select(0, X1)) & (R1 != m1))))
        cnt.update_push = len(pre) + len(post)
        miss_push, evictions = self._evict()
        cnt.miss_push = len(miss_push)
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss,
                        reduce=reduce, update_keys=ux, reducer=reducer, update_push=post,
                        miss_push=sort_transfers(miss_push), evictions=evictions, counters=cnt)
        self.step += 1
        return plan

    def _lru_victims(self) -> torch.Tensor:
        """Flat indices ``r * N + key`` (sorted: by rank, then key) of the cached rows that trim every
        (rank, table) cache back to capacity, least recently used first (ties: lower key); the cache
        counts are set to the trimmed sizes, the rest of the state is the caller's."""
        N = self.num_rows
        over = (self.cache_count > self.capacity.unsqueeze(0)).nonzero()  # (rank, table), rank-major
        if not over.numel():
            return torch.empty(0, dtype=torch.int64)
        r_over, t_over = over[:, 0], over[:, 1]
        lo = r_over * N + self.table_lo.index_select(0, t_over)  # flat index of each segment's first row
        size = (self.table_hi - self.table_lo).index_select(0, t_over)
        cached = self.cached.view(-1)
        seg = torch.cat([cached[a:a + n] for a, n in zip(lo.tolist(), size.tolist())])
        pos = seg.nonzero().squeeze(1)
        seg_start = torch.cumsum(size, 0) - size
        grp = torch.searchsorted(seg_start, pos, right=True) - 1
        flat = pos - seg_start.index_select(0, grp) + lo.index_select(0, grp)  # r * N + key of each cached row
        # LRU order within each segment (cached rows have 0 <= last_use <= step); stable: ties by lower key
        lru = grp * (self.step + 2) + self.last_use.view(-1).index_select(0, flat) + 1
        order = torch.sort(lru, stable=True).indices
        count = torch.bincount(grp, minlength=len(over))
        g = grp.index_select(0, order)
        excess = self.cache_count[r_over, t_over] - self.capacity.index_select(0, t_over)
        self.cache_count.clamp_(max=self.capacity)  # the over-full caches lose their excess
        rank_in_seg = torch.arange(len(order)) - (torch.cumsum(count, 0) - count).index_select(0, g)
        evict = rank_in_seg < excess.index_select(0, g)
        return torch.sort(flat.index_select(0, order.masked_select(evict))).values

    def _evict(self) -> tuple[torch.Tensor, List[torch.Tensor]]:
        """Trim the caches (:meth:`_lru_victims`); a victim holding the only latest version is pushed home
        (``miss_push``)."""
        W, N = self.W, self.num_rows
        v = self._lru_victims()
        rv, xv = v // N, v % N
        d = (self.master.index_select(0, xv) == rv).nonzero().squeeze(1)  # dirty: push home
        xd, rd = xv.index_select(0, d), rv.index_select(0, d)
        h = self.home.index_select(0, xd)
        # a victim's home is never its rank (caches hold remote rows only): the scatters do not overlap
        self.valid.view(-1).index_fill_(0, h * N + xd, True)
        self.master.index_copy_(0, xd, h)
        self.cached.view(-1).index_fill_(0, v, False)
        self.valid.view(-1).index_fill_(0, v, False)
        self.last_use.view(-1).index_fill_(0, v, -1)
        return torch.stack([xd, rd, h], 1), list(xv.split(torch.bincount(rv, minlength=W).tolist()))

    def flush(self) -> FlushPlan:
        """Plan the transfers that bring every copy back to the stock layout (see :class:`FlushPlan`)
        and reset the state to it."""
        dirty = (self.master != self.home).nonzero().flatten()
        push = torch.stack([dirty, self.master[dirty], self.home[dirty]], 1)
        self.valid[self.home[dirty], dirty] = True
        pull = self._hot_pulls(~self.valid[:, self.is_hot.nonzero().flatten()])
        dropped = self._cached_rows()
        self.reset()
        return FlushPlan(push=sort_transfers(push), pull=pull, dropped=dropped)

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]``: what the input allocator counts as a local lookup of row ``keys[i]`` on
        rank r — a hot replica, a row of r's own block, or a valid entry of r's cache."""
        keys = torch.as_tensor(keys, dtype=torch.int64)
        k = keys.reshape(-1)
        ranks = torch.arange(self.W).unsqueeze(1)
        flat = (ranks * self.num_rows + k).view(-1)
        cache = self.cached.view(-1).index_select(0, flat) & self.valid.view(-1).index_select(0, flat)
        out = cache.view(self.W, -1) | self.is_hot.index_select(0, k) | (self.home.index_select(0, k) == ranks)
        return out.view(self.W, *keys.shape)
