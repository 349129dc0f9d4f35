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

One step is two exchanges (``exchange``), each an all-to-all of per-peer counts and one of int64 words
(:class:`Messages`, built and read without a loop over peers):

1. reader → home: the keys it reads in the next step (look-ahead), its keys of this step unless they went
   ahead last step, and the rows it evicts after this step;
2. home → reader: one flag byte per key read this step (pull it; you apply its update), and the rows the
   reader must push home (before the reads, after the step, on eviction).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_herald.keymap import SortedKeyMap, expand_ranges
from torchrec_herald.layout import RowLayout, cache_capacities, layout_of
from torchrec_herald.pipeline.lazy_sync import lru_victims, readers_by_key, reads_of_latest, set_master
from torchrec_herald.plans import (CommPlanner, ExecPlan, FlushPlan, SyncCounters, no_transfers, sort_transfers,
                                   transfer_order)

__all__ = ["Exchange", "HomeSplitLazyPlanner", "HomeSplitPlanner", "Messages", "pack_messages", "transpose_messages"]

_PULL, _REDUCE_HERE = 1, 2  # reply flag bits


@dataclass
class Messages:
    """What one rank sends to every rank (or received from every rank) in one all-to-all: ``counts[peer, s]``
    int64 words of section ``s`` for (from) ``peer``; ``data`` holds them peer by peer, section by section.
    Built and read with tensor operations only: no loop over peers."""

    counts: torch.Tensor  # int64 [W, S]
    data: torch.Tensor  # int64 [counts.sum()]

    def section(self, s: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(words, peer)`` of section ``s``, peer by peer (each peer's words in the order they were put)."""
        flat = self.counts.reshape(-1)
        base = (torch.cumsum(flat, 0) - flat).view(self.counts.shape)
        pos, peer = expand_ranges(base[:, s], base[:, s] + self.counts[:, s])
        return self.data.index_select(0, pos), peer

    def wire_words(self, me: int) -> int:
        """int64 words this message puts on the wire to other ranks (its counts row and its data)."""
        c = self.counts.clone()
        c[me] = 0
        return int(c.sum()) + (self.counts.shape[0] - 1) * self.counts.shape[1]


#: sends one :class:`Messages` (one all-to-all: counts, then data), returns the one received
Exchange = Callable[[Messages], Messages]


def pack_messages(world_size: int, sections: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> Messages:
    """One message per peer from ``sections``: ``(peer, words)`` each, every word going to its peer (the
    words of a peer keep their order within a section)."""
    W, S = world_size, len(sections)
    counts = torch.zeros(W, S, dtype=torch.int64)
    for s, (peer, _) in enumerate(sections):  # a loop over the few sections, not over peers
        counts[:, s] = torch.bincount(peer, minlength=W)
    flat = counts.reshape(-1)
    base = (torch.cumsum(flat, 0) - flat).view(W, S)
    data = torch.empty(int(flat.sum()), dtype=torch.int64)
    for s, (peer, words) in enumerate(sections):
        if not peer.numel():
            continue
        if not bool((peer[1:] >= peer[:-1]).all()):
            order = torch.sort(peer, stable=True).indices
            peer, words = peer.index_select(0, order), words.index_select(0, order)
        start = torch.cumsum(counts[:, s], 0) - counts[:, s]
        pos = base[:, s].index_select(0, peer) + torch.arange(peer.numel()) - start.index_select(0, peer)
        data.index_copy_(0, pos, words.to(torch.int64))
    return Messages(counts, data)


def transpose_messages(sent: Sequence[Messages]) -> List[Messages]:
    """An in-process all-to-all: every rank's :class:`Messages` as each rank receives them (tests and
    benchmarks play all ranks in one process)."""
    W = len(sent)
    out = []
    for dst in range(W):
        counts = torch.stack([m.counts[dst] for m in sent])
        parts = []
        for m in sent:
            flat = m.counts.reshape(-1)
            lo = int(flat[: dst * m.counts.shape[1]].sum())
            parts.append(m.data[lo: lo + int(m.counts[dst].sum())])
        out.append(Messages(counts, torch.cat(parts)))
    return out


def _pack_flags(flags: torch.Tensor, owner: torch.Tensor, W: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``flags`` of each owner (``owner`` ascending) packed 8 to an int64 word per owner, zero padded:
    ``(owner of each word, words)``."""
    n = torch.bincount(owner, minlength=W)
    words = (n + 7) // 8
    base = torch.cumsum(words, 0) - words
    pos = base.index_select(0, owner) * 8 + torch.arange(owner.numel()) - (torch.cumsum(n, 0) - n).index_select(0, owner)
    buf = torch.zeros(int(words.sum()) * 8, dtype=torch.uint8).index_copy_(0, pos, flags)
    return torch.repeat_interleave(torch.arange(W), words), buf.view(torch.int64)


def _unpack_flags(words: torch.Tensor, owner: torch.Tensor, W: int) -> torch.Tensor:
    """The inverse of :func:`_pack_flags` for ``owner`` (ascending): one uint8 flag per entry."""
    n = torch.bincount(owner, minlength=W)
    base = torch.cumsum((n + 7) // 8, 0) - (n + 7) // 8
    pos = base.index_select(0, owner) * 8 + torch.arange(owner.numel()) - (torch.cumsum(n, 0) - n).index_select(0, owner)
    return words.contiguous().view(torch.uint8).index_select(0, pos)


def _sorted_member(q: torch.Tensor, sorted_keys: torch.Tensor) -> torch.Tensor:
    """bool: each of ``q`` is in ``sorted_keys`` (ascending)."""
    if not sorted_keys.numel() or not q.numel():
        return torch.zeros(q.shape, dtype=torch.bool)
    pos = torch.searchsorted(sorted_keys, q).clamp(max=sorted_keys.numel() - 1)
    return sorted_keys.index_select(0, pos) == q


class HomeSplitPlanner(CommPlanner):
    """The owner-route LRU lazy plan, computed by row ownership on rank ``rank`` (module docstring): the
    arguments, the step and the flush as two and one exchanges; a subclass implements the stages
    (:meth:`reader_messages`, :meth:`home_replies`, :meth:`assemble`, :meth:`flush_messages`,
    :meth:`flush_assemble`).

    Args:
        locality: the layout (hot rows, ROW_WISE blocks).
        rank: this rank.
        exchange: the all-to-all :meth:`plan_step` and :meth:`flush` use (one int64 tensor per rank).
        capacity_fraction, window, capacity_rows: as :class:`~torchrec_herald.pipeline.lazy_sync.TensorLazySyncPlanner`.
    """

    #: ``pipeline.scheduler_impl`` of this planner
    impl: str

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

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planning by home keeps no global cache view: the input allocator must be "
                           "pipeline.allocator=identity")

    @abc.abstractmethod
    def reader_messages(self, window: Sequence[Sequence[torch.Tensor]]) -> Messages:
        """Stage 1 (this rank as reader): the message to each home."""

    @abc.abstractmethod
    def home_replies(self, received: Messages) -> Messages:
        """Stage 2 (this rank as home): plan its own rows; the reply to each reader."""

    @abc.abstractmethod
    def assemble(self, replies: Messages) -> ExecPlan:
        """Stage 3: this rank's :class:`ExecPlan` from the homes' replies."""

    @abc.abstractmethod
    def flush_messages(self) -> Messages:
        """Flush, stage 1 (home): what each rank pushes and receives."""

    @abc.abstractmethod
    def flush_assemble(self, received: Messages) -> FlushPlan:
        """Flush, stage 2: this rank's :class:`FlushPlan`; resets the state."""

    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """This rank's share of the step's plan (collective: two all-to-alls through ``exchange``)."""
        if self.exchange is None:
            raise RuntimeError(f"{type(self).__name__}.plan_step needs an exchange (an all-to-all)")
        replies = self.home_replies(self.exchange(self.reader_messages(window)))
        return self.assemble(self.exchange(replies))

    def flush(self) -> FlushPlan:
        """This rank's share of the flush (collective: one all-to-all through ``exchange``)."""
        if self.exchange is None:
            raise RuntimeError(f"{type(self).__name__}.flush needs an exchange (an all-to-all)")
        return self.flush_assemble(self.exchange(self.flush_messages()))


class HomeSplitLazyPlanner(HomeSplitPlanner):
    """:class:`HomeSplitPlanner` in tensor code: the readable reference of the compiled planner
    (``pipeline/home_split_native.py``). Arguments as :class:`HomeSplitPlanner`."""

    impl = "python"

    def __init__(self, locality: object, rank: int, exchange: Optional[Exchange] = None,
                 capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        super().__init__(locality, rank, exchange, capacity_fraction, window, capacity_rows)
        lay = self.layout
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
        # the keys each reader sent ahead last step (flat, reader by reader) and their readers
        self._next_reads: Tuple[torch.Tensor, torch.Tensor] = (torch.empty(0, dtype=torch.int64),
                                                               torch.empty(0, dtype=torch.int64))
        self.step = 0

    def state_bytes(self) -> int:
        """Bytes of scheduler state on this rank."""
        return (self.cache.nbytes() + self.dirty.nbytes() + self.copies.nbytes() + self.hot_valid.numel()
                + 16 * self._next_reads[0].numel())

    # ------------------------------------------------------------------ reader
    def _by_home(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(home, keys)`` grouped by home rank (stable: a sorted ``keys`` stays sorted within a home)."""
        h = self.layout.home_of(keys)
        order = torch.sort(h, stable=True).indices
        return h.index_select(0, order), keys.index_select(0, order)

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

    def reader_messages(self, window: Sequence[Sequence[torch.Tensor]]) -> Messages:
        """Stage 1 (this rank as reader): admit this step's reads to the caches, trim them, and build the
        message to each home: section 0 whether this step's reads follow (one word), 1 this step's reads
        (unless they went ahead last step), 2 the next step's reads, 3 the rows evicted after this step."""
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
        self._now = now
        self._now_home, self._now_by_home = self._by_home(now)
        empty = torch.empty(0, dtype=torch.int64)
        peers = torch.arange(self.W)
        return pack_messages(self.W, [
            (peers, torch.full((self.W,), int(has_now), dtype=torch.int64)),
            (self._now_home, self._now_by_home) if has_now else (empty, empty),
            self._by_home(nxt),
            self._by_home(self._victims),
        ])

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

    def home_replies(self, received: Messages) -> Messages:
        """Stage 2 (this rank as home): plan the step for the rows homed here from every reader's message;
        returns the reply to each reader (section 0 one flag byte per key it reads, packed 8 to a word;
        1-3 the rows it pushes home before the reads, after the step, on eviction) and keeps this rank's
        own share of the plan."""
        me, W, lay = self.rank, self.W, self.layout
        flag, flag_src = received.section(0)
        has_now = torch.zeros(W, dtype=torch.bool).index_fill_(0, flag_src.masked_select(flag > 0), True)
        sent_now, sent_now_src = received.section(1)
        nxt, nxt_src = received.section(2)
        vic, vic_src = received.section(3)
        # a reader that sent no reads this step sent them ahead last step
        ahead, ahead_src = self._next_reads
        keep_ahead = ~has_now.index_select(0, ahead_src)
        if bool(keep_ahead.any()):
            X_in = torch.cat([ahead.masked_select(keep_ahead), sent_now])
            R_in = torch.cat([ahead_src.masked_select(keep_ahead), sent_now_src])
            order = torch.sort(R_in, stable=True).indices
            X_in, R_in = X_in.index_select(0, order), R_in.index_select(0, order)
        else:
            X_in, R_in = sent_now, sent_now_src
        self._next_reads = (nxt, nxt_src)
        R, X, perm, ux, inv, nS, starts, first = readers_by_key(R_in, X_in)
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
        m1 = self._master(nxt)
        post = self._push_home(torch.unique(nxt.masked_select((m1 != me) & (nxt_src != m1))))
        cnt.update_push = len(pre) + len(post)
        # evictions: a victim holding the only latest version goes home
        Rv, Xv = vic_src, vic
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
        return pack_messages(W, [_pack_flags(f_all, R_in, W)] + [(t[:, 1], t[:, 0]) for t in (pre, post, miss)])

    # ------------------------------------------------------------------ this rank's plan
    def assemble(self, replies: Messages) -> ExecPlan:
        """Stage 3: this rank's :class:`ExecPlan` from the homes' replies and its own home share."""
        me, W = self.rank, self.W
        sh = self._share
        words, _ = replies.section(0)
        f = _unpack_flags(words, self._now_home, W)
        keys, home = self._now_by_home, self._now_home
        other = home != me  # this rank's own rows: its home share holds every decision
        pull_here = other & ((f & _PULL) > 0)
        xp, hp = keys.masked_select(pull_here), home.masked_select(pull_here)
        here = (f & _REDUCE_HERE) > 0
        xr, hr = keys.masked_select(other & ~here), home.masked_select(other & ~here)

        def pushes(s: int) -> torch.Tensor:
            """Section ``s``: the rows this rank pushes to each other home, as ``(key, me, home)``."""
            k, q = replies.section(s)
            sel = q != me
            k, q = k.masked_select(sel), q.masked_select(sel)
            return torch.stack([k, torch.full_like(k, me), q], 1)

        pull = torch.cat([sh["pull"], torch.stack([xp, hp, torch.full_like(xp, me)], 1)])
        pull_miss = torch.cat([sh["pull_miss"], _sorted_member(xp, self._new)])
        order = transfer_order(pull)
        pull, pull_miss = pull[order], pull_miss[order]
        upd = torch.sort(torch.cat([sh["update"], keys.masked_select(other & here)])).values
        reduce = torch.cat([sh["reduce"], torch.stack([xr, torch.full_like(xr, me), hr], 1)])
        reads = [torch.empty(0, dtype=torch.int64)] * W
        reads[me] = self._now
        evictions = [torch.empty(0, dtype=torch.int64)] * W
        evictions[me] = self._victims
        plan = ExecPlan(step=self.step, reads=reads,
                        push_before_read=sort_transfers(torch.cat([sh["pre"], pushes(1)])), pull=pull,
                        pull_miss=pull_miss, reduce=sort_transfers(reduce), update_keys=upd,
                        reducer=torch.full_like(upd, me),
                        update_push=sort_transfers(torch.cat([sh["post"], pushes(2)])),
                        miss_push=sort_transfers(torch.cat([sh["miss"], pushes(3)])), evictions=evictions,
                        counters=sh["counters"], partial=True)
        self.step += 1
        return plan

    # ------------------------------------------------------------------ flush
    def flush_messages(self) -> Messages:
        """Flush, stage 1 (home): the dirty rows go home, outdated hot replicas of rows homed here pull;
        tell each rank what it pushes (section 0) and what it receives (section 1)."""
        me = self.rank
        push = self._push_home(self.dirty.keys.clone())
        r, i = (~self.hot_valid & self._own_hot.unsqueeze(0)).nonzero(as_tuple=True)
        x = self.layout.hot_keys[i]
        pull = sort_transfers(torch.stack([x, torch.full_like(x, me), r], 1))
        self._flush_share = (push, pull)
        return pack_messages(self.W, [(push[:, 1], push[:, 0]), (pull[:, 2], pull[:, 0])])

    def flush_assemble(self, received: Messages) -> FlushPlan:
        """Flush, stage 2: this rank's :class:`FlushPlan`; resets the state."""
        me = self.rank
        push, pull = self._flush_share
        k_push, q_push = received.section(0)
        k_pull, q_pull = received.section(1)
        sel_push, sel_pull = q_push != me, q_pull != me
        k_push, q_push = k_push.masked_select(sel_push), q_push.masked_select(sel_push)
        k_pull, q_pull = k_pull.masked_select(sel_pull), q_pull.masked_select(sel_pull)
        pushes = torch.cat([push, torch.stack([k_push, torch.full_like(k_push, me), q_push], 1)])
        pulls = torch.cat([pull, torch.stack([k_pull, q_pull, torch.full_like(k_pull, me)], 1)])
        dropped = [torch.empty(0, dtype=torch.int64)] * self.W
        dropped[me] = self.cache.keys.clone()
        self.reset()
        return FlushPlan(push=sort_transfers(pushes), pull=sort_transfers(pulls), dropped=dropped, partial=True)
