"""Herald's exact lazy plan split by row ownership (docs/design.md §3, Herald (b); docs/design.md §6): each rank plans only
the rows it is home to, from the read keys the other ranks send it, so its scheduling work and metadata
grow with its own reads and rows, not with every rank's samples (W·B).

Each rank's :class:`ExecPlan` is the global ``TensorLazySyncPlanner`` plan restricted to this rank: the
transfers it sends or receives, the rows it reduces, its own reads and evictions (tested equal on random
traces). A rank plays two roles:

- **reader**: its LRU caches (which remote rows it holds, when each was last read). What enters and what
  leaves them depends on its own reads only.
- **home**: for the rows of its block and the hot rows homed there, which rank holds the latest version,
  which ranks cache each row and whether that copy is the latest, and the hot replicas' flags.

One step is two variable-size all-to-alls of int64 words (``exchange``):

1. reader → home: the keys it reads in the next step (look-ahead), its keys of this step unless they went
   ahead last step, and the rows it evicts after this step;
2. home → reader: one flag byte per key read this step (pull it; you apply its update), and the rows the
   reader must push home (before the reads, after the step, on eviction).
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.keymap import SortedKeyMap, expand_ranges
from torchrec_herald.layout import RowLayout, cache_capacities, layout_of
from torchrec_herald.pipeline.lazy_sync import lru_victims, readers_by_key, reads_of_latest, set_master
from torchrec_herald.plans import (CommPlanner, ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers,
                                   transfer_order)

__all__ = ["HomeSplitLazyPlanner", "Exchange"]

#: sends one int64 tensor to each rank (list index = destination), returns the one from each rank
Exchange = Callable[[List[torch.Tensor]], List[torch.Tensor]]

_PULL, _REDUCE_HERE = 1, 2  # reply flag bits


def _pack_bytes(flags: torch.Tensor) -> torch.Tensor:
    """uint8 flags as int64 words (8 per word, zero padded)."""
    pad = (-flags.numel()) % 8
    return torch.cat([flags, torch.zeros(pad, dtype=torch.uint8)]).view(torch.int64)


def _message(*parts: torch.Tensor, head: Sequence[int] = ()) -> torch.Tensor:
    """``[*head, len(part) for each part, *parts]`` as one int64 tensor."""
    return torch.cat([torch.tensor([*head, *(p.numel() for p in parts)], dtype=torch.int64), *parts])


def _parse(msg: torch.Tensor, n_head: int, n_parts: int) -> Tuple[List[int], List[torch.Tensor]]:
    head = msg[: n_head + n_parts].tolist()
    sizes = head[n_head:]
    return head[:n_head], list(msg[n_head + n_parts:].split(sizes))[:n_parts]


class HomeSplitLazyPlanner(CommPlanner):
    """The owner-route LRU lazy plan, computed by row ownership on rank ``rank`` (module docstring).

    Args:
        locality: the layout (hot rows, ROW_WISE blocks).
        rank: this rank.
        exchange: the all-to-all :meth:`plan_step` and :meth:`flush` use (one int64 tensor per rank).
        capacity_fraction, window, capacity_rows: as :class:`~torchrec_herald.pipeline.lazy_sync.TensorLazySyncPlanner`.
    """

    def __init__(self, locality: object, rank: int, exchange: Optional[Exchange] = None,
                 capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        lay: RowLayout = layout_of(locality)
        self.layout, self.window, self.W, self.rank = lay, int(window), lay.world_size, int(rank)
        self.exchange = exchange
        caps = cache_capacities(lay, capacity_fraction, capacity_rows)
        self.capacity = torch.tensor([caps[t] for t in lay.tables], dtype=torch.int64)
        self.num_rows = lay.num_rows
        self._own_hot = lay.home_of(lay.hot_keys) == self.rank  # the hot slots homed here
        self.reset()

    def reset(self) -> None:
        """Initial state: every copy valid, caches empty."""
        # reader
        self.cache = SortedKeyMap(last_use=torch.int64)
        self.cache_count = torch.zeros(len(self.capacity), dtype=torch.int64)
        self._sent_next: Optional[torch.Tensor] = None
        # home
        self.dirty = SortedKeyMap(master=torch.int64)
        self.copies = SortedKeyMap(valid=torch.bool)  # key x·W + r: rank r caches row x
        self.hot_valid = torch.ones(self.W, self.layout.num_hot, dtype=torch.bool)
        self._next_reads: List[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * self.W
        self.step = 0

    def state_bytes(self) -> int:
        """Bytes of scheduler state on this rank."""
        return (self.cache.nbytes() + self.dirty.nbytes() + self.copies.nbytes() + self.hot_valid.numel()
                + sum(k.numel() * 8 for k in self._next_reads))

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planning by home keeps no global cache view: the input allocator must be "
                           "pipeline.allocator=identity")

    # ------------------------------------------------------------------ reader
    def _by_home(self, keys: torch.Tensor) -> List[torch.Tensor]:
        """``keys`` (sorted) grouped by home rank, each group sorted."""
        h = self.layout.home_of(keys)
        order = torch.sort(h, stable=True).indices
        return list(keys.index_select(0, order).split(torch.bincount(h, minlength=self.W).tolist()))

    def _lru_victims(self) -> torch.Tensor:
        """Trim each table's cache to capacity, least recently used first (ties: lower key); sorted keys."""
        excess = (self.cache_count - self.capacity).clamp(min=0)
        if not bool(excess.any()):
            return torch.empty(0, dtype=torch.int64)
        x = self.cache.keys
        victims = torch.sort(lru_victims(self.layout.table_of(x), self.cache.col("last_use"), excess, self.step)).values
        self.cache_count.clamp_(max=self.capacity)
        vx = x.index_select(0, victims)
        self.cache.remove_at(victims)
        return vx

    def reader_messages(self, window: Sequence[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
        """Stage 1 (this rank as reader): admit this step's reads to the caches, trim them, and build the
        message to each home."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        me, lay = self.rank, self.layout
        now = torch.as_tensor(window[0][me], dtype=torch.int64)
        if now.numel():
            lo, hi = torch.aminmax(now)
            if int(lo) < 0 or int(hi) >= self.num_rows:
                raise ValueError(f"read keys outside [0, {self.num_rows})")
        nxt = (torch.as_tensor(window[1][me], dtype=torch.int64) if len(window) > 1 and self.window > 1
               else torch.empty(0, dtype=torch.int64))
        t = lay.table_of(now)
        cold = (lay.hot_slot(now) < 0) & (lay.home_of(now, t) != me)
        xc, tc = now.masked_select(cold), t.masked_select(cold)
        pos, found = self.cache.find(xc)
        self.cache.col("last_use").index_fill_(0, pos.masked_select(found), self.step)
        self._new = xc.masked_select(~found)
        self.cache.insert(self._new, last_use=self.step)
        self.cache_count += torch.bincount(tc.masked_select(~found), minlength=len(self.capacity))
        self._victims = self._lru_victims()
        has_now = not (self._sent_next is not None and torch.equal(self._sent_next, now))
        self._sent_next = nxt if len(window) > 1 and self.window > 1 else None
        self._now, self._now_by_home = now, self._by_home(now)
        empty = torch.empty(0, dtype=torch.int64)
        return [_message(n if has_now else empty, x, v, head=[int(has_now)])
                for n, x, v in zip(self._now_by_home, self._by_home(nxt), self._by_home(self._victims))]

    # ------------------------------------------------------------------ home
    def _master(self, x: torch.Tensor) -> torch.Tensor:
        m = self.dirty.get(x, "master")
        return torch.where(m >= 0, m, torch.full_like(m, self.rank))

    def _push_home(self, x: torch.Tensor) -> torch.Tensor:
        """Dirty rows ``x`` (sorted) go home: ``(key, master, home)``."""
        if not x.numel():
            return no_transfers()
        m = self._master(x)
        slot = self.layout.hot_slot(x)
        self.hot_valid[self.rank, slot[slot >= 0]] = True
        self.dirty.remove(x)
        return torch.stack([x, m, torch.full_like(m, self.rank)], 1)

    def home_replies(self, received: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Stage 2 (this rank as home): plan the step for the rows homed here from every reader's message;
        returns the reply to each reader and keeps this rank's own share of the plan."""
        me, W, lay = self.rank, self.W, self.layout
        now, nxt, vic = [], [], []
        for r, msg in enumerate(received):
            (has_now,), (n, x, v) = _parse(msg, 1, 3)
            now.append(n if has_now else self._next_reads[r])
            nxt.append(x)
            vic.append(v)
        self._next_reads = nxt
        R = torch.cat([torch.full((k.numel(),), r, dtype=torch.int64) for r, k in enumerate(now)])
        R, X, perm, ux, inv, nS, starts, first = readers_by_key(R, torch.cat(now))
        slot_X = lay.hot_slot(X)
        slot_u = slot_X.index_select(0, starts)
        m = self._master(ux)
        pre = self._push_home(ux.masked_select((m != me) & ~((nS == 1) & (first == m))))
        hot = slot_X >= 0
        cold = ~hot & (R != me)
        ok, pos, found = reads_of_latest(X, R, slot_X, cold, self.hot_valid, self.dirty, self.copies, W)
        hi = hot.nonzero().squeeze(1)
        new = cold & ~found
        need = (~ok).nonzero().squeeze(1)
        Xn = X.index_select(0, need)
        src = self._master(Xn)
        if bool((src != me).any()):  # after the pre-read pushes, every row another rank reads is at home
            raise RuntimeError("home-split plan: a pull whose source is not the row's home")
        pull = torch.stack([Xn, src, R.index_select(0, need)], 1)
        pull_miss = new.index_select(0, need)
        self.hot_valid[R[hi], slot_X[hi]] = True
        self.copies.col("valid").index_fill_(0, pos.masked_select(found), True)
        self.copies.insert(torch.sort((X * W + R).masked_select(new)).values, valid=True)
        cnt = SyncCounters(reads=X.numel(), hits=int(ok.sum()), cache_reads=int(cold.sum()),
                           cache_hits=int((ok & cold).sum()), miss_pull=int(pull_miss.sum()))
        cnt.update_pull = need.numel() - cnt.miss_pull
        reducer = torch.where(nS == 1, first, torch.full_like(first, me))
        red_of = reducer.index_select(0, inv)
        sends = (R != red_of).nonzero().squeeze(1)
        reduce = torch.stack([X[sends], R[sends], red_of[sends]], 1)
        cnt.reduce = len(reduce)
        # the step's updates: every other copy is outdated
        hot_u = slot_u >= 0
        s = slot_u[hot_u]
        self.hot_valid[:, s] = False
        self.hot_valid[reducer[hot_u], s] = True
        xc, rc = ux[~hot_u], reducer[~hot_u]
        p, _ = expand_ranges(torch.searchsorted(self.copies.keys, xc * W), torch.searchsorted(self.copies.keys, xc * W + W))
        valid = self.copies.col("valid").index_fill_(0, p, False)
        remote = rc != me
        pos_r, found_r = self.copies.find(xc[remote] * W + rc[remote])
        valid.index_fill_(0, pos_r.masked_select(found_r), True)
        set_master(self.dirty, ux, reducer, torch.full_like(reducer, me))
        # look-ahead: a dirty row another rank reads in the next step goes home now
        R1 = torch.cat([torch.full((k.numel(),), r, dtype=torch.int64) for r, k in enumerate(nxt)])
        X1 = torch.cat(nxt)
        m1 = self._master(X1)
        post = self._push_home(torch.unique(X1.masked_select((m1 != me) & (R1 != m1))))
        cnt.update_push = len(pre) + len(post)
        # evictions: a victim holding the only latest version goes home
        Rv = torch.cat([torch.full((k.numel(),), r, dtype=torch.int64) for r, k in enumerate(vic)])
        Xv = torch.cat(vic)
        d = self._master(Xv) == Rv
        miss = torch.stack([Xv[d], Rv[d], torch.full((int(d.sum()),), me, dtype=torch.int64)], 1)
        self.dirty.remove(torch.sort(Xv[d]).values)
        self.copies.remove(torch.sort(Xv * W + Rv).values)
        cnt.miss_push = len(miss)
        self._share = dict(pre=pre, pull=pull, pull_miss=pull_miss, reduce=reduce, post=post,
                           miss=sort_transfers(miss), update=ux.masked_select(reducer == me), counters=cnt)
        # replies: per read key its flags; per reader the rows it pushes home
        flags = torch.zeros(X.numel(), dtype=torch.uint8)
        flags[need] |= _PULL
        flags |= (red_of == R).to(torch.uint8) * _REDUCE_HERE
        # back in each reader's key order: readers in rank order, keys in the order they were sent
        f_all = torch.empty(X.numel(), dtype=torch.uint8).index_copy_(0, perm, flags)
        by_reader = f_all.split([k.numel() for k in now])
        pushes = [self._by_source(t) for t in (pre, post, miss)]
        return [_message(_pack_bytes(by_reader[r]), *(p[r] for p in pushes), head=[by_reader[r].numel()])
                for r in range(W)]

    def _by_source(self, t: torch.Tensor) -> List[torch.Tensor]:
        """The keys of transfers ``t`` grouped by source rank (each group in ``t``'s order)."""
        order = torch.sort(t[:, 1], stable=True).indices
        return list(t[order, 0].split(torch.bincount(t[:, 1], minlength=self.W).tolist()))

    # ------------------------------------------------------------------ this rank's plan
    def assemble(self, replies: Sequence[torch.Tensor]) -> ExecPlan:
        """Stage 3: this rank's :class:`ExecPlan` from the homes' replies and its own home share."""
        me, W = self.rank, self.W
        sh = self._share
        pulls, miss_flags, reduces, updates = [sh["pull"]], [sh["pull_miss"]], [sh["reduce"]], [sh["update"]]
        pre, post, miss = [sh["pre"]], [sh["post"]], [sh["miss"]]
        for q, msg in enumerate(replies):
            (n,), (packed, p_pre, p_post, p_miss) = _parse(msg, 1, 4)
            if q == me:  # this rank's own rows: its home share holds every decision
                continue
            f = packed.view(torch.uint8)[:n]
            keys = self._now_by_home[q]
            xp = keys[(f & _PULL) > 0]
            pulls.append(torch.stack([xp, torch.full_like(xp, q), torch.full_like(xp, me)], 1))
            miss_flags.append(torch.isin(xp, self._new))
            here = (f & _REDUCE_HERE) > 0
            updates.append(keys[here])
            xr = keys[~here]
            reduces.append(torch.stack([xr, torch.full_like(xr, me), torch.full_like(xr, q)], 1))
            for acc, k in ((pre, p_pre), (post, p_post), (miss, p_miss)):
                acc.append(torch.stack([k, torch.full_like(k, me), torch.full_like(k, q)], 1))
        pull = torch.cat(pulls)
        order = transfer_order(pull)
        pull, pull_miss = pull[order], torch.cat(miss_flags)[order]
        upd = torch.sort(torch.cat(updates)).values
        reads = [torch.empty(0, dtype=torch.int64)] * W
        reads[me] = self._now
        evictions = [torch.empty(0, dtype=torch.int64)] * W
        evictions[me] = self._victims
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=sort_transfers(torch.cat(pre)), pull=pull,
                        pull_miss=pull_miss, reduce=sort_transfers(torch.cat(reduces)), update_keys=upd,
                        reducer=torch.full_like(upd, me), update_push=sort_transfers(torch.cat(post)),
                        miss_push=sort_transfers(torch.cat(miss)), evictions=evictions, counters=sh["counters"],
                        partial=True)
        self.step += 1
        return plan

    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """This rank's share of the step's plan (collective: two all-to-alls through ``exchange``)."""
        if self.exchange is None:
            raise RuntimeError("HomeSplitLazyPlanner.plan_step needs an exchange (an all-to-all)")
        replies = self.home_replies(self.exchange(self.reader_messages(window)))
        return self.assemble(self.exchange(replies))

    # ------------------------------------------------------------------ flush
    def flush_messages(self) -> List[torch.Tensor]:
        """Flush, stage 1 (home): the dirty rows go home, outdated hot replicas of rows homed here pull;
        tell each rank what it pushes and what it receives."""
        me = self.rank
        push = self._push_home(self.dirty.keys.clone())
        r, i = (~self.hot_valid & self._own_hot.unsqueeze(0)).nonzero(as_tuple=True)
        x = self.layout.hot_keys[i]
        pull = sort_transfers(torch.stack([x, torch.full_like(x, me), r], 1))
        self._flush_share = (push, pull)
        pushes = self._by_source(push)
        pulls = self._by_source(pull[:, [0, 2, 1]])  # grouped by receiver
        return [_message(pushes[q], pulls[q]) for q in range(self.W)]

    def flush_assemble(self, received: Sequence[torch.Tensor]) -> FlushPlan:
        """Flush, stage 2: this rank's :class:`FlushPlan`; resets the state."""
        me = self.rank
        push, pull = self._flush_share
        pushes, pulls = [push], [pull]
        for q, msg in enumerate(received):
            if q == me:
                continue
            _, (k_push, k_pull) = _parse(msg, 0, 2)
            pushes.append(torch.stack([k_push, torch.full_like(k_push, me), torch.full_like(k_push, q)], 1))
            pulls.append(torch.stack([k_pull, torch.full_like(k_pull, q), torch.full_like(k_pull, me)], 1))
        dropped = [torch.empty(0, dtype=torch.int64)] * self.W
        dropped[me] = self.cache.keys.clone()
        self.reset()
        return FlushPlan(push=sort_transfers(torch.cat(pushes)), pull=sort_transfers(torch.cat(pulls)),
                         dropped=dropped, partial=True)

    def flush(self) -> FlushPlan:
        """This rank's share of the flush (collective: one all-to-all through ``exchange``)."""
        if self.exchange is None:
            raise RuntimeError("HomeSplitLazyPlanner.flush needs an exchange (an all-to-all)")
        return self.flush_assemble(self.exchange(self.flush_messages()))
