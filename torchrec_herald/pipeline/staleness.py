"""HET's per-row bounded staleness (docs/design.md §3; HET, VLDB'22): an opt-in approximate plan for Herald's
worker caches and hot replicas, where a copy may lag its home by up to ``s`` updates, for reads and writes.

Per row ``x``: ``hv[x]``, the updates merged at its home (the row's ROW_WISE owner, the "server"). Per
rank ``r`` holding a copy (a hot replica or a cache entry; the home's own copy is the server's):
``b[r, x]``, the home version its copy is based on, and ``u[r, x]``, local updates not yet pushed (the
accumulated update itself, weights and row-wise Adagrad state, is kept by the executor as the copy minus
its base). Per step, for the rows each rank reads:

* **read**: a rank without a copy pulls it (``miss_pull``); a copy more than ``s`` home versions behind
  (``hv − b > s``) is refreshed (``update_pull``; its own pending updates are pushed home first); any
  other copy is used as is — *served stale* when ``0 < hv − b ≤ s``. The lag is the one at read time,
  after those pre-read pushes (which may put another reader's copy more than ``s`` behind: it is
  refreshed too);
* **write**: with ``s > 0`` every rank that read a row updates its own copy with its own gradient, as
  HET's workers do: the home's copy is the server's (``hv += 1``), any other copy counts the update
  (``u += 1``) and is pushed home once ``u > s`` (``update_push``). No gradient travels. With ``s = 0``
  a row read by several ranks has their gradients summed at its home, which applies one update (the
  exact plan's rule: the update rule sees the summed gradient);
* **evict**: a cached row with pending updates is always pushed home (``miss_push``).

A push *replaces* the home's copy when the home has not changed since the pusher's base (then the two are
equal but for the pusher's updates), else it *adds* the accumulated update. With ``s = 0`` every read
sees every earlier update and every push replaces: the exact mode's training, bit for bit.

State is held only for the copies that exist (docs/design.md §6): ``b`` and ``u`` of a hot replica in
``[W, num_hot]`` tensors, of a cache entry as two more columns of the exact plan's entries; ``hv`` of a hot
row in ``[num_hot]``, of a cold row only while some rank caches it (only differences ``hv − b`` matter, so
a row that nobody caches may forget it).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.keymap import SortedKeyMap
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.plans import ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers, transfer_order

__all__ = ["StalenessPlanner", "checked_staleness"]


def checked_staleness(staleness: Any) -> int:
    """``staleness`` as an int, or ValueError naming ``pipeline.staleness`` (an integer ``s >= 0``)."""
    if int(staleness) != staleness or int(staleness) < 0:
        raise ValueError(f"pipeline.staleness must be an integer >= 0, got {staleness}")
    return int(staleness)


class StalenessPlanner(TensorLazySyncPlanner):
    """Bounded-staleness plan (see the module docstring) over the same layout and LRU caches as the
    exact :class:`TensorLazySyncPlanner`.

    Args:
        locality: the layout (hot rows, ROW_WISE blocks).
        staleness: ``s >= 0``, the home versions a copy may lag (reads) and the local updates it may hold
            back (writes).
        capacity_fraction, window, capacity_rows: as for :class:`TensorLazySyncPlanner` (the plan itself
            needs no look-ahead; the window feeds the input allocator).
    """

    def __init__(self, locality: Any, staleness: int, capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        self.staleness = checked_staleness(staleness)
        super().__init__(locality, capacity_fraction, window, capacity_rows)

    def _entry_columns(self) -> Dict[str, torch.dtype]:
        return super()._entry_columns() | {"base": torch.int64, "pending": torch.int64}

    def reset(self) -> None:
        super().reset()
        nh = self.layout.num_hot
        self.hv_hot = torch.zeros(nh, dtype=torch.int64)
        self.base_hot = torch.zeros(self.W, nh, dtype=torch.int64)
        self.pending_hot = torch.zeros(self.W, nh, dtype=torch.int64)
        self.hv_cold = SortedKeyMap(hv=torch.int64)

    def state_bytes(self) -> int:
        return (super().state_bytes() + self.hv_cold.nbytes()
                + 8 * (self.hv_hot.numel() + self.base_hot.numel() + self.pending_hot.numel()))

    # ------------------------------------------------------------------ per row / per copy
    def _cached_anywhere(self, x: torch.Tensor) -> torch.Tensor:
        """bool: some rank caches row ``x[i]`` (its home version is then kept)."""
        lo, hi = self._entry_ranges(x)
        return hi > lo

    def _hv(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Home version of rows ``x`` (``slot``: their hot slots, -1 for cold)."""
        hot = slot >= 0
        return torch.where(hot, self.hv_hot[slot.clamp(min=0)] if self.hv_hot.numel() else torch.zeros_like(x),
                           self.hv_cold.get(x, "hv", 0))

    def _hv_add(self, x: torch.Tensor, slot: torch.Tensor, delta: torch.Tensor) -> None:
        """``hv[x] += delta`` (``x`` unique)."""
        hot = slot >= 0
        self.hv_hot.index_add_(0, slot[hot], delta[hot])
        xc, dc = x[~hot], delta[~hot]
        xc, order = torch.sort(xc)
        dc = dc[order]
        pos, found = self.hv_cold.find(xc)
        self.hv_cold.col("hv").index_add_(0, pos[found], dc[found])
        self.hv_cold.insert(xc[~found], hv=dc[~found])

    def _copy(self, R: torch.Tensor, X: torch.Tensor, slot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where copies ``(R[i], X[i])`` are: hot mask, entry position, entry found."""
        pos, found = self.entries.find(X * self.W + R)
        return slot >= 0, pos, found & (slot < 0)

    def _field(self, R: torch.Tensor, slot: torch.Tensor, where: Tuple[torch.Tensor, ...], name: str) -> torch.Tensor:
        """``base`` or ``pending`` of copies (0 where there is no copy)."""
        hot, pos, found = where
        dense = self.base_hot if name == "base" else self.pending_hot
        out = torch.zeros(R.numel(), dtype=torch.int64)
        hi, ei = hot.nonzero().squeeze(1), found.nonzero().squeeze(1)
        out[hi] = dense[R[hi], slot[hi]]
        out[ei] = self.entries.col(name)[pos[ei]]
        return out

    def _set_field(self, R: torch.Tensor, slot: torch.Tensor, where: Tuple[torch.Tensor, ...], name: str,
                   value: torch.Tensor) -> None:
        """Set ``base`` or ``pending`` of copies that exist."""
        hot, pos, found = where
        dense = self.base_hot if name == "base" else self.pending_hot
        hi, ei = hot.nonzero().squeeze(1), found.nonzero().squeeze(1)
        dense[R[hi], slot[hi]] = value[hi]
        self.entries.col(name)[pos[ei]] = value[ei]

    # ------------------------------------------------------------------ helpers
    def _push(self, R: torch.Tensor, X: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Push the pending updates of copies ``(R[i], X[i])`` (distinct pairs) home, in rank order for a
        row pushed by several ranks: each push sees the home version its predecessors left (the first may
        replace, the others add). One pass over all ranks: a push's home version is the row's version
        before the call plus the updates of the lower ranks' pushes of that row (an exclusive sum within
        the row's group). Returns ``(key, src, home)`` rows and add flags."""
        if not X.numel():
            return no_transfers(), torch.empty(0, dtype=torch.bool)
        order = torch.argsort(X * self.W + R)  # by row, then rank
        R, X = R[order], X[order]
        slot = self.layout.hot_slot(X)
        where = self._copy(R, X, slot)
        u = self._field(R, slot, where, "pending")
        base = self._field(R, slot, where, "base")
        rows, inverse, counts = torch.unique_consecutive(X, return_inverse=True, return_counts=True)
        first = torch.cumsum(counts, 0) - counts  # each row's first push
        before = torch.cumsum(u, 0) - u  # updates of all earlier pushes in this order
        by_lower_ranks = before - before[first][inverse]  # ... of the same row, by lower ranks
        add = self._hv(X, slot) + by_lower_ranks != base
        self._hv_add(rows, slot[first], torch.zeros_like(rows).index_add_(0, inverse, u))
        self._set_field(R, slot, where, "base", base + u)
        self._set_field(R, slot, where, "pending", torch.zeros_like(u))
        return torch.stack([X, R, self.layout.home_of(X)], 1), add

    @staticmethod
    def _by_key(t: torch.Tensor, flags: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``t`` sorted by (key, src, dst), with its per-row ``flags`` kept aligned."""
        if not t.numel():
            return no_transfers(), flags[:0]
        order = transfer_order(t)
        return t[order], flags[order]

    # ------------------------------------------------------------------ planning
    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """Plan ``window[0]`` (per rank: sorted unique keys read); advances the state."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        s = self.staleness
        lay = self.layout
        reads = [torch.as_tensor(k, dtype=torch.int64) for k in window[0]]
        R, X = self._pairs(reads)
        ux, inv, nS, first = self._readers(R, X)
        cnt_reads = X.numel()
        table_X = lay.table_of(X)
        home_X, slot_X = lay.home_of(X, table_X), lay.hot_slot(X)
        home_read = home_X == R
        where = self._copy(R, X, slot_X)
        cached = where[2]
        held = where[0] | home_read | cached

        def lag_now() -> torch.Tensor:  # (pushes change no entry's position: ``where`` stays right)
            lag = self._hv(X, slot_X) - self._field(R, slot_X, where, "base")
            return torch.where(home_read, torch.zeros_like(X), lag)

        lag = lag_now()
        miss = ~held
        refresh = held & ~home_read & (lag > s)
        # a refreshing copy's pending updates go home before the reads; they raise the home version the
        # other copies are read against, which may put one of those more than s behind too (and its own
        # pending updates then go home as well): grow the refreshed set to its fixed point, then push
        # once, rank by rank (the executor applies a row's pushes in rank order: the first may replace)
        pending = self._field(R, slot_X, where, "pending")
        while True:
            pend = refresh & (pending > 0)
            if not bool(pend.any()):  # (always so with s = 0: nothing is ever held back)
                break
            ahead = torch.zeros(ux.numel(), dtype=torch.int64).index_add_(0, inv[pend], pending[pend])[inv]
            grown = refresh | (held & ~home_read & (lag + ahead > s))
            if bool((grown == refresh).all()):
                break
            refresh = grown
        pre, pre_add = self._push(R[pend], X[pend])
        lag = lag_now()  # at read time
        need = miss | refresh
        pull = torch.stack([X[need], home_X[need], R[need]], 1)
        pull_miss = miss[need]
        hits = ~need
        stale = hits & (lag > 0)
        # cache bookkeeping (remote cold rows), LRU as in the exact plan; a pulled copy is based on hv now
        cold = ~where[0] & ~home_read
        self._admit_to_caches(R, X, table_X, cold, cold & ~cached)
        Rn, Xn, sn = R[need], X[need], slot_X[need]
        self._set_field(Rn, sn, self._copy(Rn, Xn, sn), "base", self._hv(Xn, sn))
        # writes (s = 0): one update per row, by its only reader or at home where several ranks' gradients
        # are summed (the exact plan's rule); (s > 0) HET's: every reader updates its own copy, no gradient
        # travels, and the copies' accumulated updates reach home by the pushes
        if s == 0:
            home_u = lay.home_of(ux)
            updater, reduce = self._reducers(R, X, inv, nS, first, home_u)
            upd_keys, slot_u = ux, lay.hot_slot(ux)
        else:
            by_key = torch.argsort(X * self.W + R)
            upd_keys, updater, home_u, slot_u = X[by_key], R[by_key], home_X[by_key], slot_X[by_key]
            reduce = no_transfers()
        at_home = updater == home_u
        xh, sh = upd_keys[at_home], slot_u[at_home]
        tracked = (sh >= 0) | self._cached_anywhere(xh)
        self._hv_add(xh[tracked], sh[tracked], torch.ones(int(tracked.sum()), dtype=torch.int64))
        local, lr, sl = upd_keys[~at_home], updater[~at_home], slot_u[~at_home]
        wl = self._copy(lr, local, sl)
        pend_l = self._field(lr, sl, wl, "pending") + 1
        self._set_field(lr, sl, wl, "pending", pend_l)
        over = pend_l > s
        post, post_add = self._push(lr[over], local[over])
        miss_push, evictions = self._evict()
        cnt = self._counters(cnt_reads, hits, cold, pull_miss, reduce, len(pre) + len(post), len(miss_push[0]))
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss,
                        reduce=sort_transfers(reduce), update_keys=upd_keys, reducer=updater, update_push=post,
                        miss_push=miss_push[0], evictions=evictions, counters=cnt, additive=True,
                        push_before_read_add=pre_add, update_push_add=post_add, miss_push_add=miss_push[1],
                        stale_reads=int(stale.sum()), max_staleness=int(lag[stale].max()) if bool(stale.any()) else 0)
        plan.push_before_read, plan.push_before_read_add = self._by_key(pre, pre_add)
        plan.update_push, plan.update_push_add = self._by_key(post, post_add)
        plan.miss_push, plan.miss_push_add = self._by_key(*miss_push)
        if pull.numel():
            plan.pull, plan.pull_miss = self._by_key(pull, pull_miss)
        self.step += 1
        return plan

    def _counters(self, reads: int, hits: torch.Tensor, cold: torch.Tensor, pull_miss: torch.Tensor,
                  reduce: torch.Tensor, pushes: int, miss_pushes: int) -> SyncCounters:
        return SyncCounters(miss_pull=int(pull_miss.sum()), update_pull=int((~pull_miss).sum()), update_push=pushes,
                            miss_push=miss_pushes, reduce=len(reduce), hits=int(hits.sum()), reads=reads,
                            cache_hits=int((hits & cold).sum()), cache_reads=int(cold.sum()))

    def _evict(self) -> Tuple[Tuple[torch.Tensor, torch.Tensor], List[torch.Tensor]]:  # type: ignore[override]
        """LRU trim as in the exact plan; an evicted copy with pending updates is always pushed home. A row
        nobody caches any more forgets its home version."""
        v, R, X = self._lru_victims()
        victims = list(X.split(torch.bincount(R, minlength=self.W).tolist()))
        dirty = self.entries.col("pending")[v] > 0
        pushes = self._push(R[dirty], X[dirty])
        self.entries.remove_at(v)
        gone = torch.unique(X)
        self.hv_cold.remove(gone[~self._cached_anywhere(gone)])
        return pushes, victims

    def flush(self) -> FlushPlan:
        """Push every pending update home, refresh every lagging hot replica, drop the caches; reset."""
        rh, ih = (self.pending_hot > 0).nonzero(as_tuple=True)
        k = self.entries.keys[self.entries.col("pending") > 0]
        push, add = self._push(torch.cat([rh, k % self.W]), torch.cat([self.layout.hot_keys[ih], k // self.W]))
        push, add = self._by_key(push, add)
        hot = self.layout.hot_keys
        lag = self.hv_hot.unsqueeze(0) - self.base_hot
        not_home = self.layout.home_of(hot).unsqueeze(0) != torch.arange(self.W).unsqueeze(1)
        pull = self._hot_pulls((lag > 0) & not_home)
        dropped = self.cached_rows()
        self.reset()
        return FlushPlan(push=push, pull=pull, dropped=dropped, push_add=add)

    def _entry_counts_as_local(self, positions: torch.Tensor) -> torch.Tensor:
        """What the input allocator counts as local on rank r: a hot replica, r's own block (as the exact
        plan counts them, so ``s = 0`` allocates exactly as the exact mode does), or — this — a cache
        entry at most ``s`` home versions behind."""
        x = self.entries.keys[positions] // self.W
        return self.hv_cold.get(x, "hv", 0) - self.entries.col("base")[positions] <= self.staleness
