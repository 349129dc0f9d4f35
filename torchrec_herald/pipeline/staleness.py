"""HET's per-row bounded staleness (DESIGN §3; HET, VLDB'22): an opt-in approximate plan for Herald's
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
* **write**: a row read by one rank is updated on that rank's copy (``u += 1``) and pushed home once
  ``u > s`` (``update_push``); a row read by several ranks has their gradients summed at its home, which
  applies one update (as the exact plan does: the update rule sees the summed gradient);
* **evict**: a cached row with pending updates is always pushed home (``miss_push``).

A push *replaces* the home's copy when the home has not changed since the pusher's base (then the two are
equal but for the pusher's updates), else it *adds* the accumulated update. With ``s = 0`` every read
sees every earlier update and every push replaces: the exact mode's training, bit for bit.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.plans import ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers, transfer_order

__all__ = ["StalenessPlanner"]


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
        if int(staleness) != staleness or int(staleness) < 0:
            raise ValueError(f"pipeline.staleness must be an integer >= 0, got {staleness}")
        self.staleness = int(staleness)
        super().__init__(locality, capacity_fraction, window, capacity_rows)

    def reset(self) -> None:
        super().reset()
        self.hv = torch.zeros(self.num_rows, dtype=torch.int64)
        self.base = torch.zeros(self.W, self.num_rows, dtype=torch.int64)
        self.pending = torch.zeros(self.W, self.num_rows, dtype=torch.int64)

    # ------------------------------------------------------------------ helpers
    def _push(self, R: torch.Tensor, X: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Push the pending updates of copies ``(R[i], X[i])`` home, rank by rank (a row pushed by several
        ranks: the first may replace, the others add). Returns ``(key, src, home)`` rows and add flags."""
        out, add = [], []
        for r in range(self.W):
            x = X[R == r]
            if not x.numel():
                continue
            u = self.pending[r, x]
            add.append(self.hv[x] != self.base[r, x])
            self.hv[x] += u
            self.base[r, x] += u
            self.pending[r, x] = 0
            out.append(torch.stack([x, torch.full_like(x, r), self.home[x]], 1))
        if not out:
            return no_transfers(), torch.empty(0, dtype=torch.bool)
        return torch.cat(out), torch.cat(add)

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
        reads = [torch.as_tensor(k, dtype=torch.int64) for k in window[0]]
        R, X = self._pairs(reads)
        ux, inv, nS, first = self._readers(R, X)
        cnt_reads = X.numel()
        home_read = self.home[X] == R
        held = self.is_hot[X] | home_read | self.cached[R, X]
        lag = torch.where(home_read, torch.zeros_like(X), self.hv[X] - self.base[R, X])
        miss = ~held
        refresh = held & ~home_read & (lag > s)
        # a refreshing copy's pending updates go home before the reads; they raise the home version the
        # other copies are read against, which may put one of those more than s behind too (and its own
        # pending updates then go home as well): grow the refreshed set to its fixed point, then push
        # once, rank by rank (the executor applies a row's pushes in rank order: the first may replace)
        pending = self.pending[R, X]
        while True:
            pend = refresh & (pending > 0)
            if not bool(pend.any()):  # (always so with s = 0: nothing is ever held back)
                break
            ahead = torch.zeros(ux.numel(), dtype=torch.int64).index_add_(0, inv[pend], pending[pend])[inv]
            grown = refresh | (held & ~home_read & (self.hv[X] + ahead - self.base[R, X] > s))
            if bool((grown == refresh).all()):
                break
            refresh = grown
        pre, pre_add = self._push(R[pend], X[pend])
        lag = torch.where(home_read, torch.zeros_like(X), self.hv[X] - self.base[R, X])  # at read time
        need = miss | refresh
        pull = torch.stack([X[need], self.home[X[need]], R[need]], 1)
        pull_miss = miss[need]
        self.base[R[need], X[need]] = self.hv[X[need]]
        hits = ~need
        stale = hits & (lag > 0)
        # cache bookkeeping (remote cold rows), LRU as in the exact plan
        cold = ~self.is_hot[X] & ~home_read
        new = cold & ~self.cached[R, X]
        self._admit_to_caches(R, X, cold, new)
        # writes: one reader updates its copy; several readers' gradients are summed at home
        updater, reduce = self._reducers(R, X, ux, inv, nS, first)
        at_home = updater == self.home[ux]
        self.hv[ux[at_home]] += 1
        local = ux[~at_home]
        lr = updater[~at_home]
        self.pending[lr, local] += 1
        over = self.pending[lr, local] > s
        post, post_add = self._push(lr[over], local[over])
        miss_push, evictions = self._evict()
        cnt = self._counters(cnt_reads, hits, cold, pull_miss, reduce, len(pre) + len(post), len(miss_push[0]))
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=pre, pull=pull, pull_miss=pull_miss,
                        reduce=sort_transfers(reduce), update_keys=ux, reducer=updater, update_push=post,
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
        """LRU trim as in the exact plan; an evicted copy with pending updates is always pushed home."""
        v = self._lru_victims()
        R, X = v // self.num_rows, v % self.num_rows
        victims = list(X.split(torch.bincount(R, minlength=self.W).tolist()))
        dirty = self.pending[R, X] > 0
        pushes = self._push(R[dirty], X[dirty])
        self.cached[R, X] = False
        self.last_use[R, X] = -1
        self.base[R, X] = 0
        return pushes, victims

    def flush(self) -> FlushPlan:
        """Push every pending update home, refresh every lagging hot replica, drop the caches; reset."""
        R, X = (self.pending > 0).nonzero(as_tuple=True)
        push, add = self._push(R, X)
        push, add = self._by_key(push, add)
        hot = self.is_hot.nonzero().flatten()
        lag = self.hv[hot].unsqueeze(0) - self.base[:, hot]
        not_home = self.home[hot].unsqueeze(0) != torch.arange(self.W).unsqueeze(1)
        pull = self._hot_pulls((lag > 0) & not_home)
        dropped = self._cached_rows()
        self.reset()
        return FlushPlan(push=push, pull=pull, dropped=dropped, push_add=add)

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]``: what the input allocator counts as local on rank r — a hot replica, r's
        own block, or a cache entry at most ``s`` versions behind (hot replicas count as the exact
        plan counts them, so ``s = 0`` allocates exactly as the exact mode does)."""
        ranks = torch.arange(self.W).unsqueeze(1)
        home = self.home[keys].unsqueeze(0) == ranks
        fresh = (self.hv[keys].unsqueeze(0) - self.base[:, keys]) <= self.staleness
        return home | self.is_hot[keys].unsqueeze(0) | (self.cached[:, keys] & fresh)
