"""Herald's lazy, exact communication plan (docs/design.md §3, Herald (b)) as tensor operations, fast enough to
run every step: the owner-route LRU plan of the readable reference ``LazySyncPlanner``.

``LazySyncPlanner`` (``torchrec_herald/testing/reference_plans.py``) is the reference (dicts, one row at a time);
:class:`TensorLazySyncPlanner` here keeps the same state in sorted tensors over the *global row space*
(key = table offset + row id, tables concatenated) and plans a step with a few dozen vectorised ops. It
produces the **same transfers** as the reference with ``route="owner", policy="lru"`` (tested on random
traces; ``torchrec_herald.testing.reference_plans`` holds the reference, the exactness checker and the
conversion of a plan for it).

State, only where it differs from the stock layout (docs/design.md §6: nothing dense over all rows × ranks):
``dirty`` maps each row whose latest version is not at its home to the rank holding it (its *master*);
``entries`` holds one entry per cached copy (remote cold row ``x`` on rank ``r``, keyed ``x·W + r``) with
its LRU time and whether it is the latest; ``hot_valid [W, num_hot]`` says which hot replicas are the
latest. A home copy is the latest exactly when its row is not dirty. Memory: ``16·dirty rows +
17·cache entries + W·hot rows`` bytes. Every rank runs the planner on the same reads and gets the same
plan, so the transfers it implies need no further metadata on the wire: a receiver knows which rows
arrive, from whom, in which order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.keymap import SortedKeyMap, expand_ranges
from torchrec_herald.layout import RowLayout, cache_capacities, layout_of
from torchrec_herald.plans import CommPlanner, ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers

__all__ = ["TensorLazySyncPlanner", "lru_victims", "readers_by_key", "reads_of_latest", "set_master"]

_PAIRS_PER_CHUNK = 1 << 22  # (lookup, cache entry) pairs expanded at once by local_scores


def reads_of_latest(X: torch.Tensor, R: torch.Tensor, slot_X: torch.Tensor, cold: torch.Tensor,
                    hot_valid: torch.Tensor, dirty: SortedKeyMap, copies: SortedKeyMap, W: int
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whether read ``(R[i], X[i])`` finds the latest version where it reads (a hot replica, a home copy
    that is not dirty, a valid cache entry: ``copies`` keyed x·W + r, with a ``valid`` column, holding
    remote cold copies only); returns ``(ok, position in copies, found in copies)``."""
    hot = slot_X >= 0
    pos, found = copies.find(X * W + R)
    ok = torch.zeros(X.numel(), dtype=torch.bool)
    hi = hot.nonzero().squeeze(1)
    ok[hi] = hot_valid[R[hi], slot_X[hi]]
    at_home = (~hot & ~cold).nonzero().squeeze(1)
    ok[at_home] = ~dirty.contains(X[at_home])
    ci = found.nonzero().squeeze(1)
    ok[ci] = copies.col("valid")[pos[ci]]
    return ok, pos, found


def readers_by_key(R: torch.Tensor, X: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Read pairs ``(R[i], X[i])`` (R ascending in the concatenation) in (key, rank) order: a key's readers
    are adjacent, lowest rank first, so pulls and reduces come out sorted by (key, src, dst). Returns
    ``(R, X, perm, unique keys, inverse, reader count, first pair of each key, lowest reader)``."""
    X, perm = torch.sort(X, stable=True)
    R = R.index_select(0, perm)
    ux, inv, nS = torch.unique_consecutive(X, return_inverse=True, return_counts=True)
    starts = torch.cumsum(nS, 0) - nS
    return R, X, perm, ux, inv, nS, starts, R.index_select(0, starts)


def set_master(dirty: SortedKeyMap, x: torch.Tensor, m: torch.Tensor, home: torch.Tensor) -> None:
    """Rows ``x`` (sorted, unique) now have their latest version on ranks ``m``: ``dirty`` keeps those
    whose master is not their ``home``."""
    clean = m == home
    dirty.remove(x.masked_select(clean))
    xd, md = x.masked_select(~clean), m.masked_select(~clean)
    pos, found = dirty.find(xd)
    dirty.col("master").index_copy_(0, pos.masked_select(found), md.masked_select(found))
    dirty.insert(xd.masked_select(~found), master=md.masked_select(~found))


def lru_victims(seg: torch.Tensor, last_use: torch.Tensor, excess: torch.Tensor, step: int) -> torch.Tensor:
    """Positions of the cache entries (in key order, entry i in cache segment ``seg[i]``, last read at
    ``last_use[i]`` ≤ ``step``) that trim each segment by ``excess[segment]``: least recently used first,
    ties to the lower key."""
    sel = (excess.index_select(0, seg) > 0).nonzero().squeeze(1)  # in key order within each segment
    g = seg.index_select(0, sel)
    order = torch.sort(g * (step + 2) + last_use.index_select(0, sel) + 1, stable=True).indices  # stable: ties by key
    sel, g = sel.index_select(0, order), g.index_select(0, order)
    count = torch.bincount(g, minlength=excess.numel())
    rank_in_seg = torch.arange(sel.numel()) - (torch.cumsum(count, 0) - count).index_select(0, g)
    return sel.masked_select(rank_in_seg < excess.index_select(0, g))


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
        self._set_layout(locality, capacity_fraction, window, capacity_rows)
        self.reset()

    def _set_layout(self, locality: Any, capacity_fraction: float, window: int,
                    capacity_rows: Optional[Mapping[str, int]]) -> None:
        """The layout, look-ahead, rank count, per-table cache capacities and row count (checked)."""
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        lay: RowLayout = layout_of(locality)
        self.layout = lay
        self.window = int(window)
        self.W = lay.world_size
        caps = cache_capacities(lay, capacity_fraction, capacity_rows)
        self.capacity = torch.tensor([caps[t] for t in lay.tables], dtype=torch.int64)
        self.num_rows = lay.num_rows

    def _entry_columns(self) -> Dict[str, torch.dtype]:
        """The columns of a cache entry (a subclass may add its own)."""
        return {"last_use": torch.int64, "valid": torch.bool}

    def reset(self) -> None:
        """Initial state: every hot replica and every home copy valid, caches empty."""
        self.hot_valid = torch.ones(self.W, self.layout.num_hot, dtype=torch.bool)
        self.dirty = SortedKeyMap(master=torch.int64)
        self.entries = SortedKeyMap(**self._entry_columns())
        self.cache_count = torch.zeros(self.W, len(self.capacity), dtype=torch.int64)
        self.step = 0

    def state_bytes(self) -> int:
        """Bytes of scheduler state this planner holds (dirty rows, cache entries, hot replica flags)."""
        return self.dirty.nbytes() + self.entries.nbytes() + self.hot_valid.numel() + self.cache_count.numel() * 8

    # ------------------------------------------------------------------ helpers
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

    def _master(self, x: torch.Tensor, home: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rank holding the latest version of each row of ``x``."""
        home = self.layout.home_of(x) if home is None else home
        if not len(self.dirty):
            return home
        m = self.dirty.get(x, "master")
        return torch.where(m >= 0, m, home)

    def _entry_ranges(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[lo, hi)``: where the cached copies of each row of ``x`` lie in ``entries`` (keyed x·W + r)."""
        k = self.entries.keys
        return torch.searchsorted(k, x * self.W), torch.searchsorted(k, x * self.W + self.W)

    def _entry_positions(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions in ``entries`` of every cached copy of the rows ``x``, and which row each is of."""
        return expand_ranges(*self._entry_ranges(x))

    def _push_home(self, x: torch.Tensor) -> torch.Tensor:
        """Dirty rows ``x`` (sorted) go home: ``(key, master, home)``; the home copies become the latest."""
        if not x.numel():
            return no_transfers()
        h = self.layout.home_of(x)
        m = self._master(x, h)
        slot = self.layout.hot_slot(x)
        hot = slot >= 0
        self.hot_valid[h[hot], slot[hot]] = True
        self.dirty.remove(x)
        return torch.stack([x, m, h], 1)

    def _admit_to_caches(self, R: torch.Tensor, X: torch.Tensor, table: torch.Tensor, cold: torch.Tensor,
                         new: torch.Tensor, found: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Reads ``(R[i], X[i])`` of remote cold rows (``cold``) enter (``new``)
        or refresh their LRU entry; every such copy is now the latest. ``found``: their
        ``entries.find`` when the caller has it."""
        T = self.cache_count.shape[1]
        pos, hit = self.entries.find(X * self.W + R) if found is None else found
        old = pos.masked_select(hit & cold)
        self.entries.col("last_use").index_fill_(0, old, self.step)
        self.entries.col("valid").index_fill_(0, old, True)
        fresh = {c: 0 for c in self.entries.cols} | {"last_use": self.step, "valid": True}
        self.entries.insert(torch.sort((X * self.W + R).masked_select(new)).values, **fresh)
        self.cache_count += torch.bincount(R.masked_select(new) * T + table.masked_select(new),
                                           minlength=self.W * T).view(self.W, T)

    @staticmethod
    def _reducers(R: torch.Tensor, X: torch.Tensor, inv: torch.Tensor, nS: torch.Tensor, first: torch.Tensor,
                  home_u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One update per read row: by its only reader, or at home when several ranks read it. Returns
        (reducer of each unique row, the ``(key, reader, reducer)`` gradient sends, in read order)."""
        reducer = torch.where(nS == 1, first, home_u)
        red_of = reducer.index_select(0, inv)
        sends = (R != red_of).nonzero().squeeze(1)
        return reducer, torch.stack([X.index_select(0, sends), R.index_select(0, sends), red_of.index_select(0, sends)], 1)

    def _hot_pulls(self, stale: torch.Tensor) -> torch.Tensor:
        """``(key, home, rank)`` pulls refreshing the hot replicas where ``stale`` (bool ``[W, num_hot]``)."""
        r, i = stale.nonzero(as_tuple=True)
        x = self.layout.hot_keys[i]
        return sort_transfers(torch.stack([x, self.layout.home_of(x), r], 1))

    def cached_rows(self) -> List[torch.Tensor]:
        """Per rank, the keys it caches (sorted)."""
        k = self.entries.keys
        r, x = k % self.W, k // self.W  # x ascends within each rank
        return [x[r == q] for q in range(self.W)]

    # ------------------------------------------------------------------ planning
    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """Plan ``window[0]`` (per rank: the sorted unique keys it reads), with ``window[1]`` (if given)
        as look-ahead; advances the state. Every rank calling this on the same window gets the same plan."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        lay = self.layout
        cnt = SyncCounters()
        reads = [torch.as_tensor(k, dtype=torch.int64) for k in window[0]]
        R, X = self._pairs(reads)
        R, X, _, ux, inv, nS, starts, first = readers_by_key(R, X)
        table_X = lay.table_of(X)
        home_X, slot_X = lay.home_of(X, table_X), lay.hot_slot(X)
        home_u, slot_u = home_X.index_select(0, starts), slot_X.index_select(0, starts)
        # dirty rows read by some rank other than their master go home first
        m = self._master(ux, home_u)
        pre = self._push_home(ux.masked_select((m != home_u) & ~((nS == 1) & (first == m))))
        # pulls: every read whose copy is not the latest, from the row's master
        hot = slot_X >= 0
        cold = ~hot & (home_X != R)
        ok, pos, found = reads_of_latest(X, R, slot_X, cold, self.hot_valid, self.dirty, self.entries, self.W)
        hi = hot.nonzero().squeeze(1)
        new = cold & ~found
        need = (~ok).nonzero().squeeze(1)
        Xn = X.index_select(0, need)
        pull = torch.stack([Xn, self._master(Xn, home_X.index_select(0, need)), R.index_select(0, need)], 1)
        pull_miss = new.index_select(0, need)  # = not held (not hot, not home, not cached)
        self.hot_valid[R[hi], slot_X[hi]] = True  # (a home read is of a clean row: already the latest)
        self._admit_to_caches(R, X, table_X, cold, new, (pos, found))
        cnt.reads, cnt.hits = X.numel(), int(ok.sum())
        cnt.cache_reads, cnt.cache_hits = int(cold.sum()), int((ok & cold).sum())
        cnt.miss_pull = int(pull_miss.sum())
        cnt.update_pull = need.numel() - cnt.miss_pull
        # read pairs in (key, rank) order: the sends come out sorted by (key, src, dst)
        reducer, reduce = self._reducers(R, X, inv, nS, first, home_u)
        cnt.reduce = len(reduce)
        self._updated(ux, reducer, home_u, slot_u)
        # look-ahead: a dirty row another rank reads in the next step is pushed home now
        post = no_transfers()
        if len(window) > 1 and self.window > 1:
            R1, X1 = self._pairs([torch.as_tensor(k, dtype=torch.int64) for k in window[1]])
            # (a rank reads a row at most once: a row with several readers has one other than its master)
            h1 = lay.home_of(X1)
            m1 = self._master(X1, h1)
            post = self._push_home(torch.unique(X1.masked_select((m1 != h1) & (R1 != m1))))
        cnt.update_push = len(pre) + len(post)
        miss_push, evictions = self._evict()
        cnt.miss_push = len(miss_push)
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss,
                        reduce=reduce, update_keys=ux, reducer=reducer, update_push=post,
                        miss_push=sort_transfers(miss_push), evictions=evictions, counters=cnt)
        self.step += 1
        return plan

    def _updated(self, ux: torch.Tensor, reducer: torch.Tensor, home_u: torch.Tensor, slot_u: torch.Tensor) -> None:
        """Rows ``ux`` were updated on ``reducer``: every other copy is outdated."""
        hot = slot_u >= 0
        s = slot_u[hot]
        self.hot_valid[:, s] = False
        self.hot_valid[reducer[hot], s] = True
        cold = ~hot
        xc, rc = ux.masked_select(cold), reducer.masked_select(cold)
        p, _ = self._entry_positions(xc)
        valid = self.entries.col("valid").index_fill_(0, p, False)
        remote = rc != home_u.masked_select(cold)  # the only reader, remote: it cached the row in this step
        pos, found = self.entries.find(xc.masked_select(remote) * self.W + rc.masked_select(remote))
        valid.index_fill_(0, pos.masked_select(found), True)
        set_master(self.dirty, ux, reducer, home_u)

    def _lru_victims(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(entry positions, ranks, keys)`` of the cached rows that trim every (rank, table) cache back
        to capacity, least recently used first (ties: lower key), sorted by rank then key; the cache
        counts are set to the trimmed sizes, the rest of the state is the caller's."""
        empty = torch.empty(0, dtype=torch.int64)
        excess = (self.cache_count - self.capacity.unsqueeze(0)).clamp(min=0).view(-1)
        if not bool(excess.any()):
            return empty, empty, empty
        T = self.cache_count.shape[1]
        k = self.entries.keys
        r, x = k % self.W, k // self.W
        seg = r * T + self.layout.table_of(x)
        victims = lru_victims(seg, self.entries.col("last_use"), excess, self.step)
        self.cache_count.clamp_(max=self.capacity)  # the over-full caches lose their excess
        vr, vx = r.index_select(0, victims), x.index_select(0, victims)
        o = torch.sort(vr * self.num_rows + vx).indices
        return victims[o], vr[o], vx[o]

    def _evict(self) -> tuple[torch.Tensor, List[torch.Tensor]]:
        """Trim the caches (:meth:`_lru_victims`); a victim holding the only latest version is pushed home
        (``miss_push``)."""
        victims, rv, xv = self._lru_victims()
        d = (self._master(xv) == rv).nonzero().squeeze(1)  # dirty: push home
        xd, rd = xv.index_select(0, d), rv.index_select(0, d)
        self.dirty.remove(xd)  # (a victim's home is never its rank: caches hold remote rows only)
        self.entries.remove_at(victims)
        return torch.stack([xd, rd, self.layout.home_of(xd)], 1), list(xv.split(torch.bincount(rv, minlength=self.W).tolist()))

    def flush(self) -> FlushPlan:
        """Plan the transfers that bring every copy back to the stock layout (see :class:`FlushPlan`)
        and reset the state to it."""
        dirty = self.dirty.keys
        home = self.layout.home_of(dirty)
        push = torch.stack([dirty, self.dirty.col("master"), home], 1)
        slot = self.layout.hot_slot(dirty)
        hot = slot >= 0
        self.hot_valid[home[hot], slot[hot]] = True
        pull = self._hot_pulls(~self.hot_valid)
        dropped = self.cached_rows()
        self.reset()
        return FlushPlan(push=sort_transfers(push), pull=pull, dropped=dropped)

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]``: what the input allocator counts as a local lookup of row ``keys[i]`` on
        rank r — a hot replica, a row of r's own block, or a valid entry of r's cache."""
        keys = torch.as_tensor(keys, dtype=torch.int64)
        k = keys.reshape(-1)
        ranks = torch.arange(self.W).unsqueeze(1)
        out = self.layout.is_hot(k).unsqueeze(0) | (self.layout.home_of(k).unsqueeze(0) == ranks)
        p, owner = self._entry_positions(k)
        live = self._entry_counts_as_local(p)
        p, owner = p[live], owner[live]
        out[self.entries.keys[p] % self.W, owner] = True
        return out.view(self.W, *keys.shape)

    def local_scores(self, keys: torch.Tensor, sample: torch.Tensor, num_samples: int) -> torch.Tensor:
        """int32 ``[num_samples, W]``: lookups of each sample local to each rank (``sample[i]`` the sample
        of ``keys[i]``), = ``InputAllocator.local_scores(keys, sample, num_samples, self.local_on)`` but
        built from the few ranks each key is local on (a hot key counts on every rank; a cold one on its
        home and its valid cache entries), never as a ``[W, len(keys)]`` matrix."""
        k, sample = keys.to(torch.int64).reshape(-1), sample.to(torch.int64).reshape(-1)
        W = self.W
        hot = self.layout.is_hot(k)
        out = torch.bincount(sample[hot], minlength=num_samples).to(torch.int32).unsqueeze(1).repeat(1, W)
        kc, sc = k[~hot], sample[~hot]
        flat = out.view(-1)
        flat.index_add_(0, sc * W + self.layout.home_of(kc), torch.ones(kc.numel(), dtype=torch.int32))
        # each lookup of a cached row counts on every rank caching it: expand in chunks of lookups so the
        # (lookup, entry) pairs held at once stay bounded (a popular row may be cached on many ranks)
        ek = self.entries.keys
        lo, hi = self._entry_ranges(kc)
        some = (hi > lo).nonzero().squeeze(1)
        lo, hi, sc = lo[some], hi[some], sc[some]
        ends = torch.cumsum(hi - lo, 0)
        a = 0
        while a < lo.numel():
            b = max(a + 1, int(torch.searchsorted(ends, int(ends[a]) - int(hi[a] - lo[a]) + _PAIRS_PER_CHUNK)))
            p, owner = expand_ranges(lo[a:b], hi[a:b])
            live = self._entry_counts_as_local(p)
            p, owner = p[live], owner[live] + a
            flat.index_add_(0, sc.index_select(0, owner) * W + ek.index_select(0, p) % W,
                            torch.ones(p.numel(), dtype=torch.int32))
            a = b
        return out

    def _entry_counts_as_local(self, positions: torch.Tensor) -> torch.Tensor:
        """bool: the cache entries at ``positions`` count as local reads (the exact plan: the latest)."""
        return self.entries.col("valid")[positions]
