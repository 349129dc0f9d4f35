"""Herald's lazy, exact communication plan (DESIGN §3, Herald (b)) as tensor operations, fast enough to
run every step: the owner-route LRU plan of :class:`~torchrec_herald.pipeline.sync_plan.LazySyncPlanner`.

:class:`LazySyncPlanner` in ``sync_plan.py`` is the readable reference (dicts, one row at a time);
:class:`TensorLazySyncPlanner` here keeps the same state as ``[W, N]`` tensors over the *global row space*
(key = table offset + row id, tables concatenated) and plans a step with a few dozen vectorised ops. It
produces the **same transfers** as the reference with ``route="owner", policy="lru"`` (tested on random
traces), and :meth:`ExecPlan.to_step_plan` converts a plan for :func:`~torchrec_herald.pipeline.sync_plan.check_exact`.

State per row ``x``: ``master[x]`` (the rank holding the latest version; its home ``x // block`` when
clean), per rank ``valid[r, x]`` (r's copy is the latest), ``cached[r, x]`` (r caches remote cold row x),
``last_use[r, x]`` (LRU). Hot rows are held by every rank, a cold row by its home, cached rows by the cache.
Every rank runs the planner on the same reads and gets the same plan, so the transfers it implies need no
further metadata on the wire: a receiver knows which rows arrive, from whom, in which order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.pipeline.sync_plan import StepPlan, SyncCounters, TablePlan, _capacities

__all__ = ["ExecPlan", "FlushPlan", "TensorLazySyncPlanner", "transfers_between"]

_EMPTY = torch.empty(0, 3, dtype=torch.int64)


def transfers_between(t: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Keys of the ``(key, src, dst)`` rows of ``t`` from ``src`` to ``dst``, in ``t``'s order."""
    return t[(t[:, 1] == src) & (t[:, 2] == dst), 0]


@dataclass
class ExecPlan:
    """One step's plan over global keys. Each transfer tensor is int64 ``[N, 3]`` of ``(key, src, dst)``
    sorted by key, then src, then dst; in execution order: ``push_before_read`` (only without look-ahead),
    pulls (``miss_pull`` and ``update_pull`` merged in ``pull``, ``pull_miss`` telling which), the reads,
    ``reduce`` + one update per read row at ``reducer``, ``update_push``, ``miss_push``, ``evictions``."""

    step: int
    reads: List[torch.Tensor]  # per rank: sorted unique keys read
    push_before_read: torch.Tensor
    pull: torch.Tensor
    pull_miss: torch.Tensor  # bool [len(pull)]
    reduce: torch.Tensor
    update_keys: torch.Tensor  # sorted keys updated this step (= union of reads)
    reducer: torch.Tensor  # int64 [len(update_keys)] rank applying each row's update
    update_push: torch.Tensor
    miss_push: torch.Tensor
    evictions: List[torch.Tensor]  # per rank: cached keys dropped after the step
    counters: SyncCounters = field(default_factory=SyncCounters)

    def to_step_plan(self, locality: Locality) -> StepPlan:
        """The per-table :class:`StepPlan` (table-local row ids) the trace-level tools understand."""
        offsets = locality._table_offsets
        tables: Dict[str, TablePlan] = {}

        def part(t: torch.Tensor, i: int) -> torch.Tensor:
            lo, hi = int(offsets[i]), int(offsets[i]) + locality.num_embeddings[name]
            s = t[(t[:, 0] >= lo) & (t[:, 0] < hi)].clone()
            s[:, 0] -= lo
            return s

        for i, name in enumerate(locality.tables):
            lo = int(offsets[i])
            hi = lo + locality.num_embeddings[name]
            ev = [e[(e >= lo) & (e < hi)] - lo for e in self.evictions]
            tables[name] = TablePlan(
                table=name, world_size=locality.world_size, push_before_read=part(self.push_before_read, i),
                miss_pull=part(self.pull[self.pull_miss], i), update_pull=part(self.pull[~self.pull_miss], i),
                reduce=part(self.reduce, i), update_push=part(self.update_push, i),
                miss_push=part(self.miss_push, i), deliver=_EMPTY.clone(), evictions=ev)
        return StepPlan(step=self.step, tables=tables, counters=self.counters)


@dataclass
class FlushPlan:
    """Bring every copy back to the stock layout: dirty rows go home (``push``), then every outdated hot
    replica pulls the latest version from home (``pull``); every cache is dropped (``dropped``)."""

    push: torch.Tensor
    pull: torch.Tensor
    dropped: List[torch.Tensor]


class TensorLazySyncPlanner:
    """Vectorised owner-route, LRU lazy plan (see the module docstring).

    Args:
        locality: the layout (hot rows, ROW_WISE blocks; its ``cache`` field is ignored).
        capacity_fraction: cache capacity per rank per table as a fraction of the table's rows (``(0, 1]``).
        window: ``K >= 1``: steps of look-ahead (only the next step's reads change the plan: pushes for it).
        capacity_rows: optional per-table capacity in rows (``1 ≤ C ≤ n``), overriding the fraction.
    """

    def __init__(self, locality: Locality, capacity_fraction: float = 0.05, window: int = 5,
                 capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.locality = locality
        self.window = int(window)
        self.W = locality.world_size
        caps = _capacities(locality, capacity_fraction, capacity_rows)
        self.capacity = torch.tensor([caps[t] for t in locality.tables], dtype=torch.int64)
        n = locality._rows
        self.num_rows = int(n.sum())
        self.table_lo = locality._table_offsets.clone()
        self.table_hi = self.table_lo + n
        table_of = torch.repeat_interleave(torch.arange(len(n)), n)
        local_id = torch.arange(self.num_rows) - self.table_lo[table_of]
        self.table_of = table_of
        self.home = local_id // locality._blocks[table_of]
        self.is_hot = torch.zeros(self.num_rows, dtype=torch.bool)
        self.is_hot[locality._hot_keys] = True
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
    def _pairs(self, reads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(reads) != self.W:
            raise ValueError(f"reads need one key set per rank ({self.W}), got {len(reads)}")
        R = torch.cat([torch.full((len(k),), r, dtype=torch.int64) for r, k in enumerate(reads)])
        X = torch.cat([torch.as_tensor(k, dtype=torch.int64) for k in reads])
        if X.numel() and (int(X.min()) < 0 or int(X.max()) >= self.num_rows):
            raise ValueError(f"read keys outside [0, {self.num_rows})")
        return R, X

    @staticmethod
    def _readers(R: torch.Tensor, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """unique rows, inverse, reader count, lowest reader."""
        ux, inv, nS = torch.unique(X, return_inverse=True, return_counts=True)
        first = torch.full((ux.numel(),), -1, dtype=torch.int64).scatter_reduce(0, inv, R, "amin",
                                                                                include_self=False)
        return ux, inv, nS, first

    def _push_home(self, ux: torch.Tensor, nS: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Dirty rows read by some rank other than their master go home first: ``(key, master, home)``."""
        m, h = self.master[ux], self.home[ux]
        need = (m != h) & ~((nS == 1) & (first == m))
        x = ux[need]
        out = torch.stack([x, m[need], h[need]], 1)
        self.valid[h[need], x] = True
        self.master[x] = h[need]
        return out

    @staticmethod
    def _sorted(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return _EMPTY.clone()
        key = (t[:, 0] * 65536 + t[:, 1]) * 65536 + t[:, 2]
        return t[torch.argsort(key)]

    # ------------------------------------------------------------------ planning
    def plan_step(self, window: Sequence[Sequence[torch.Tensor]]) -> ExecPlan:
        """Plan ``window[0]`` (per rank: the sorted unique keys it reads), with ``window[1]`` (if given)
        as look-ahead; advances the state. Every rank calling this on the same window gets the same plan."""
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        cnt = SyncCounters()
        reads = [torch.as_tensor(k, dtype=torch.int64) for k in window[0]]
        R, X = self._pairs(reads)
        ux, inv, nS, first = self._readers(R, X)
        pre = self._push_home(ux, nS, first)
        # pulls: every read whose copy is not the latest, from the row's master
        ok = self.valid[R, X]
        held = self.is_hot[X] | (self.home[X] == R) | self.cached[R, X]
        src = self.master[X]
        need = ~ok
        pull = torch.stack([X[need], src[need], R[need]], 1)
        pull_miss = ~held[need]
        self.valid[R, X] = True
        cold = ~self.is_hot[X] & (self.home[X] != R)
        new = cold & ~self.cached[R, X]
        self.cached[R[cold], X[cold]] = True
        self.last_use[R[cold], X[cold]] = self.step
        self.cache_count.index_put_((R[new], self.table_of[X[new]]), torch.ones(int(new.sum()), dtype=torch.int64),
                                    accumulate=True)
        cnt.reads, cnt.hits = X.numel(), int(ok.sum())
        cnt.cache_reads, cnt.cache_hits = int(cold.sum()), int((ok & cold).sum())
        cnt.miss_pull, cnt.update_pull = int(pull_miss.sum()), int((~pull_miss).sum())
        # one update per read row: by its only reader, or at home when several ranks read it
        reducer = torch.where(nS == 1, first, self.home[ux])
        red_of = reducer[inv]
        sends = R != red_of
        reduce = torch.stack([X[sends], R[sends], red_of[sends]], 1)
        cnt.reduce = int(sends.sum())
        self.valid[:, ux] = False
        self.valid[reducer, ux] = True
        self.master[ux] = reducer
        # look-ahead: a dirty row another rank reads in the next step is pushed home now
        post = _EMPTY.clone()
        if len(window) > 1 and self.window > 1:
            R1, X1 = self._pairs([torch.as_tensor(k, dtype=torch.int64) for k in window[1]])
            ux1, _, nS1, first1 = self._readers(R1, X1)
            post = self._push_home(ux1, nS1, first1)
        cnt.update_push = len(pre) + len(post)
        miss_push, evictions = self._evict()
        cnt.miss_push = len(miss_push)
        plan = ExecPlan(step=self.step, reads=reads, push_before_read=self._sorted(pre), pull=pull, pull_miss=pull_miss,
                        reduce=self._sorted(reduce), update_keys=ux, reducer=reducer, update_push=self._sorted(post),
                        miss_push=self._sorted(miss_push), evictions=evictions, counters=cnt)
        order = torch.argsort((pull[:, 0] * 65536 + pull[:, 1]) * 65536 + pull[:, 2]) if pull.numel() else None
        if order is not None:
            plan.pull, plan.pull_miss = pull[order], pull_miss[order]
        self.step += 1
        return plan

    def _evict(self) -> tuple[torch.Tensor, List[torch.Tensor]]:
        """Trim every (rank, table) cache back to capacity, least recently used first (ties: lower key);
        a victim holding the only latest version is pushed home (``miss_push``)."""
        pushes: List[torch.Tensor] = []
        evictions: List[torch.Tensor] = []
        over = self.cache_count > self.capacity.unsqueeze(0)
        for r in range(self.W):
            victims: List[torch.Tensor] = []
            for t in over[r].nonzero().flatten().tolist():
                lo, hi = int(self.table_lo[t]), int(self.table_hi[t])
                keys = self.cached[r, lo:hi].nonzero().flatten() + lo
                excess = int(self.cache_count[r, t] - self.capacity[t])
                order = torch.sort(self.last_use[r, keys], stable=True).indices[:excess]
                victims.append(keys[order])
                self.cache_count[r, t] -= excess
            v = torch.cat(victims) if victims else torch.empty(0, dtype=torch.int64)
            dirty = v[self.master[v] == r]
            if dirty.numel():
                h = self.home[dirty]
                pushes.append(torch.stack([dirty, torch.full_like(dirty, r), h], 1))
                self.valid[h, dirty] = True
                self.master[dirty] = h
            self.cached[r, v] = False
            self.valid[r, v] = False
            self.last_use[r, v] = -1
            evictions.append(torch.sort(v).values)
        return (torch.cat(pushes) if pushes else _EMPTY.clone()), evictions

    def flush(self) -> FlushPlan:
        """Plan the transfers that bring every copy back to the stock layout (see :class:`FlushPlan`)
        and reset the state to it."""
        dirty = (self.master != self.home).nonzero().flatten()
        push = torch.stack([dirty, self.master[dirty], self.home[dirty]], 1)
        self.valid[self.home[dirty], dirty] = True
        hot = self.is_hot.nonzero().flatten()
        r, i = (~self.valid[:, hot]).nonzero(as_tuple=True)
        x = hot[i]
        pull = self._sorted(torch.stack([x, self.home[x], r], 1))
        dropped = [self.cached[q].nonzero().flatten() for q in range(self.W)]
        self.reset()
        return FlushPlan(push=self._sorted(push), pull=pull, dropped=dropped)

    def local_on(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[W, len(keys)]``: what the input allocator counts as a local lookup of row ``keys[i]`` on
        rank r — a hot replica, a row of r's own block, or a valid entry of r's cache."""
        ranks = torch.arange(self.W).unsqueeze(1)
        return (self.is_hot[keys].unsqueeze(0) | (self.home[keys].unsqueeze(0) == ranks)
                | (self.cached[:, keys] & self.valid[:, keys]))


def capacity_rows_of(locality: Locality, capacity_fraction: float) -> Dict[str, int]:
    """Per-table cache capacity in rows for a fraction (``ceil(f · n)``, at least 1)."""
    return {t: max(1, math.ceil(capacity_fraction * n)) for t, n in locality.num_embeddings.items()}
