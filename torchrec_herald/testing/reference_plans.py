"""Test and benchmark support: the readable reference of Herald's communication plan (docs/design.md §3, Herald
(b)), its exactness checker and trace simulator. Live training runs the tensor planners of
``torchrec_herald/pipeline/lazy_sync.py`` (tested against these); nothing in training imports this module.

Worker caches of remote rows and a lazy, exact sync plan computed from a window of the next ``K`` global
batches. Planning core only: pure Python, no ``torch.distributed``; every rank computing
:meth:`SyncPlanner.plan_step` on the same window gets the same :class:`StepPlan`.

Layout (a :class:`~torchrec_herald.pipeline.input_allocator.Locality`): a *hot* row of a table is replicated
on every rank; a *cold* row ``x`` is owned by rank ``owner(x) = x // block`` (stock ROW_WISE blocks,
``block = ceil(n/W)``). Every row also has a **home**, ``owner(x)`` for hot rows too: where its gradients
are summed and where a rank's unpushed updates go. A rank may keep a bounded **cache** of remote cold rows:
``C`` rows per rank per table (``ceil(capacity_fraction · n)`` or given per table, ``1 ≤ C ≤ n``), LRU by
last use (default) or Belady (evict the row whose next use by this rank within the window is farthest;
rows not used in the window first; ties: least recently used). A step's own rows are pinned while the
step runs (a cache may briefly exceed ``C``); after the update it is trimmed back to ``C``.

Training semantics planned for (exact mode). When row ``x`` is read in step ``t`` by the set ``S`` of
ranks, exactly those ranks produce a gradient of ``x`` in step ``t``; the gradients are summed at one
place (the *reducer*) which applies **one** optimizer update (weights and row-wise Adagrad state) on top of
the latest version. A row's *version* is the number of updates applied to it. Exact means: **every read
sees every earlier update** (the reader's copy has the latest version). Weight and Adagrad-state deltas
are additive, so any number of pending updates travel to an outdated copy as one message.

Transfers and what they cost. Every transfer below moves **one embedding vector** (``D`` floats, ``4D``
bytes: a row, a merged delta or a gradient; a row/delta also carries its one Adagrad-state float) plus a
``4`` B row id (:data:`ROW_ID_BYTES`), whatever the number of updates it merges:

* ``reduce``      — a reader's gradient to the reducer (step ``t`` with ``|S| ≥ 2``);
* ``miss_pull``   — a reader that holds no copy of a remote cold row pulls it;
* ``update_pull`` — a reader whose copy is outdated pulls the accumulated delta (one message);
* ``update_push`` — a rank holding unpushed updates of a row sends them to the row's home because
  another rank will read the row;
* ``miss_push``   — a cached row with unpushed updates is evicted: its updates go home (dirty eviction);
* ``deliver``     — eager sync only: after each update, the home sends it to every other holder.

Planners (swappable; :class:`SyncPlanner`):

* :class:`LazySyncPlanner` — the plan of the issue. ``route="owner"`` (default; the released Herald /
  parameter-server rule): the home is the only relay. ``|S| = 1``: the reader updates its own copy and
  keeps the update (its copy is *dirty*, the home's is stale) — nothing moves. ``|S| ≥ 2``: every reader
  other than the home sends its gradient home (``reduce``); the home updates. A dirty rank pushes its
  accumulated update home (``update_push``) only when another rank reads the row in the next step
  ("pushes accumulated gradients only for keys another worker needs at t+1, plus evicted dirty rows";
  planned with the look-ahead of ``window[1]`` and placed after step ``t``'s update; with ``K = 1`` the
  same push is placed before step ``t+1``'s reads), or when the dirty row is evicted (``miss_push``).
  A reader pulls from the home only when its copy is missing (``miss_pull``) or outdated
  (``update_pull``); a rank that does not read the row again gets nothing (lazy). ``route="direct"``
  (docs/design.md's exact floor, peer to peer): the reducer is a reader — the one that reads the row again
  soonest within the window (ties: the rank already holding the latest version, then the home, then the
  lowest rank) — and outdated readers pull straight from the latest holder, so a row read by the same
  ``S`` in consecutive steps costs ``2(|S|−1)`` transfers (``|S|−1`` reduce + ``|S|−1`` deliver); no
  ``update_push`` (the home only gets dirty evictions). With unbounded caches this is the exact minimum
  for a fixed placement of samples up to the reducer choice: a step needs ``|S|−1`` gradient messages, and
  every read by a rank whose copy is older than the latest update needs one incoming message. docs/design.md's
  ``2(|S|−1)`` per touched row and step is below it (it charges nothing to a rank that reads a row
  another rank updated since, e.g. ``S = {0}`` then ``{1}``).
* :class:`EagerSyncPlanner` — the baseline (herald's eager hot sync today): every reader other than the
  home sends its gradient home, the home updates and ``deliver``s the update to **every** other holder
  (all ``W−1`` other replicas of a hot row; every cached copy of a cold row) in the same step. Without a
  cache (default) a remote cold read is ``miss_pull`` + ``reduce`` every time (herald's cold path).
  Lazy with ``route="owner"`` never moves more vectors than eager on the same layout and cache.

Helpers: :func:`simulate` runs a planner over a trace (per-step :class:`SyncCounters` and total vectors);
:func:`check_exact` replays plans with symbolic versions and raises :class:`ExactnessError` when a read
misses an earlier update, gradients are not summed exactly once, an update is lost, or a cache is over
capacity.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from torchrec_herald.comm import INDEX_BYTES
from torchrec_herald.layout import cache_capacities, layout_of
from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.plans import TRANSFER_KINDS, ExecPlan, SyncCounters, no_transfers

__all__ = [
    "CACHE_POLICIES",
    "EagerSyncPlanner",
    "ExactnessError",
    "LazySyncPlanner",
    "ROUTES",
    "ROW_ID_BYTES",
    "SimulationResult",
    "StepPlan",
    "StepReads",
    "SyncCounters",
    "SyncPlanner",
    "TablePlan",
    "TRANSFER_KINDS",
    "check_exact",
    "simulate",
    "to_step_plan",
]

#: bytes of a row id on herald's wire (int32)
ROW_ID_BYTES = INDEX_BYTES
CACHE_POLICIES = ("lru", "belady")
ROUTES = ("owner", "direct")

Rows = Union[torch.Tensor, Sequence[int]]
#: one step's reads: table -> ``[W]`` row ids read by each rank (any order, duplicates allowed);
#: a table left out is not read in that step.
StepReads = Mapping[str, Sequence[Rows]]

_INF = math.inf


# ------------------------------------------------------------------------------------------ types


def _pairs(rows: List[Tuple[int, int, int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


@dataclass
class TablePlan:
    """The transfers of one table in one step. Each transfer tensor is int64 ``[N, 3]`` of
    ``(row, src rank, dst rank)``, sorted by row then rank. Order within a step (how :func:`check_exact`
    replays it): ``push_before_read`` (``update_push`` placed before the reads: only without look-ahead),
    ``miss_pull`` and ``update_pull``, the reads, ``reduce`` and the one update per read row,
    ``update_push`` (look-ahead: for the next step's readers), ``miss_push``, ``evictions``, ``deliver``.
    """

    table: str
    world_size: int
    push_before_read: torch.Tensor
    miss_pull: torch.Tensor
    update_pull: torch.Tensor
    reduce: torch.Tensor
    update_push: torch.Tensor
    miss_push: torch.Tensor
    deliver: torch.Tensor
    #: per rank: cached rows dropped after the step (sorted)
    evictions: List[torch.Tensor]
    counters: SyncCounters = field(default_factory=SyncCounters)

    def pulls(self, rank: int) -> torch.Tensor:
        """int64 ``[M, 2]``: ``(row, from rank)`` of every row ``rank`` pulls before its reads (missing or
        outdated), sorted by row."""
        t = torch.cat([self.miss_pull, self.update_pull])
        t = t[t[:, 2] == rank][:, :2]
        return t[torch.argsort(t[:, 0], stable=True)] if t.numel() else t

    def pushes(self, rank: int) -> torch.Tensor:
        """int64 ``[M, 2]``: ``(row, to rank)`` of every accumulated update ``rank`` pushes home in this step
        (``update_push`` before or after the reads, and dirty evictions), sorted by row."""
        t = torch.cat([self.push_before_read, self.update_push, self.miss_push])
        t = t[t[:, 1] == rank][:, [0, 2]]
        return t[torch.argsort(t[:, 0], stable=True)] if t.numel() else t


@dataclass
class StepPlan:
    """The plan of one step: one :class:`TablePlan` per table (locality order) and the step's totals."""

    step: int
    tables: Dict[str, TablePlan]
    counters: SyncCounters


class ExactnessError(AssertionError):
    """A plan replay found a read that misses an earlier update (or another exactness violation)."""


# ------------------------------------------------------------------------------------------ input


def _row_list(rows: Rows, n: int, table: str, rank: int) -> List[int]:
    t = torch.as_tensor(rows, dtype=torch.int64).flatten()
    if not t.numel():
        return []
    t = torch.unique(t)
    if int(t[0]) < 0 or int(t[-1]) >= n:
        raise ValueError(f"table {table!r}, rank {rank}: row ids outside [0, {n})")
    return t.tolist()


def _normalize(step: StepReads, loc: Locality) -> Dict[str, List[List[int]]]:
    """table -> [W] sorted unique row lists (every table of the locality; missing tables: no reads)."""
    unknown = sorted(set(step) - set(loc.tables))
    if unknown:
        raise ValueError(f"reads of unknown tables {unknown} (tables: {loc.tables})")
    out: Dict[str, List[List[int]]] = {}
    for t in loc.tables:
        per_rank = step.get(t)
        if per_rank is None:
            out[t] = [[] for _ in range(loc.world_size)]
            continue
        if len(per_rank) != loc.world_size:
            raise ValueError(f"table {t!r}: reads need one row set per rank ({loc.world_size}), got {len(per_rank)}")
        out[t] = [_row_list(r, loc.num_embeddings[t], t, i) for i, r in enumerate(per_rank)]
    return out


def _readers(per_rank: List[List[int]]) -> Dict[int, List[int]]:
    """row -> sorted ranks reading it, rows in ascending order."""
    acc: Dict[int, List[int]] = {}
    for r, rows in enumerate(per_rank):
        for x in rows:
            acc.setdefault(x, []).append(r)
    return dict(sorted(acc.items()))


# ------------------------------------------------------------------------------------------ state


class _Table:
    """Cache and version state of one table (shared by the planners)."""

    def __init__(self, name: str, loc: Locality, capacity: int) -> None:
        self.name = name
        self.W = loc.world_size
        self.n = loc.num_embeddings[name]
        self.block = loc.block_sizes[name]  # type: ignore[index]
        self.hot = set(loc.hot_ids[name].tolist())
        self.capacity = capacity
        self.version: Dict[int, int] = {}  # row -> updates applied (default 0)
        self.master: Dict[int, int] = {}  # row -> rank holding the latest version (default: home)
        # rank -> row -> version of that rank's copy, for copies whose version is not 0 or that are cached
        self.copies: List[Dict[int, int]] = [{} for _ in range(self.W)]
        self.cache: List["OrderedDict[int, int]"] = [OrderedDict() for _ in range(self.W)]  # row -> last use

    def home(self, x: int) -> int:
        return x // self.block

    def remote_cold(self, x: int, r: int) -> bool:
        return x not in self.hot and self.home(x) != r

    def held(self, r: int, x: int) -> Optional[int]:
        v = self.copies[r].get(x)
        if v is not None:
            return v
        return None if self.remote_cold(x, r) else 0

    def latest(self, x: int) -> int:
        return self.version.get(x, 0)

    def get_master(self, x: int) -> int:
        return self.master.get(x, self.home(x))

    def set_copy(self, r: int, x: int, v: int) -> None:
        self.copies[r][x] = v

    def drop(self, r: int, x: int) -> None:
        del self.copies[r][x]
        del self.cache[r][x]

    def touch(self, r: int, x: int, step: int) -> None:
        c = self.cache[r]
        c[x] = step
        c.move_to_end(x)

    def victims(self, r: int, policy: str, next_use: Dict[int, int]) -> List[int]:
        """Rows ``r`` must evict to get back to capacity, in eviction order."""
        c = self.cache[r]
        excess = len(c) - self.capacity
        if excess <= 0:
            return []
        if policy == "lru":
            return list(itertools.islice(c, excess))
        order = list(c)  # LRU order
        pos = {x: i for i, x in enumerate(order)}
        order.sort(key=lambda x: (-next_use.get(x, _INF), pos[x]))
        return order[:excess]


# ------------------------------------------------------------------------------------------ planners


class SyncPlanner(abc.ABC):
    """Plans the transfers of each step from a window of reads, keeping the cache/version state.

    Args:
        locality: the layout (hot rows, ROW_WISE owners; its ``cache`` field is ignored).
        window: ``K``, the steps of look-ahead a plan may use (``window[0]`` is the current step).
    """

    def __init__(self, locality: Locality, window: int = 1) -> None:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.locality = locality
        self.window = int(window)
        self.step = 0
        self._tables: Dict[str, _Table] = {}
        self._init_state()

    def _capacity(self, table: str) -> int:
        return 0

    def _init_state(self) -> None:
        self.step = 0
        self._tables = {t: _Table(t, self.locality, self._capacity(t)) for t in self.locality.tables}

    def reset(self) -> None:
        """Forget all cache and version state (a new run)."""
        self._init_state()

    def plan_step(self, window: Sequence[StepReads]) -> StepPlan:
        """Plan the current step (``window[0]``) using up to ``K − 1`` further steps; advances the state.

        Raises:
            ValueError: an empty window, unknown tables, a wrong number of ranks, row ids out of range.
        """
        if len(window) < 1:
            raise ValueError("plan_step needs a window with at least the current step")
        steps = [_normalize(s, self.locality) for s in list(window)[: self.window]]
        plans: Dict[str, TablePlan] = {}
        total = SyncCounters()
        for t in self.locality.tables:
            tp = self._plan_table(self._tables[t], [s[t] for s in steps])
            plans[t] = tp
            total = total + tp.counters
        plan = StepPlan(step=self.step, tables=plans, counters=total)
        self.step += 1
        return plan

    @abc.abstractmethod
    def _plan_table(self, tab: _Table, window: List[List[List[int]]]) -> TablePlan:
        """Plan one table: ``window[k][r]`` = sorted rows rank ``r`` reads ``k`` steps ahead."""

    # shared pieces -----------------------------------------------------------------------------

    def _pull_and_read(self, tab: _Table, readers: Dict[int, List[int]], src_of: Dict[int, int],
                       cnt: SyncCounters, miss: List[Tuple[int, int, int]], upd: List[Tuple[int, int, int]]) -> None:
        for x, S in readers.items():
            v_latest = tab.latest(x)
            src = src_of[x]
            for r in S:
                v = tab.held(r, x)
                cold = tab.remote_cold(x, r)
                cnt.reads += 1
                cnt.cache_reads += cold
                if v == v_latest:
                    cnt.hits += 1
                    cnt.cache_hits += cold
                elif v is None:
                    miss.append((x, src, r))
                    cnt.miss_pull += 1
                else:
                    upd.append((x, src, r))
                    cnt.update_pull += 1
                if v != v_latest:
                    tab.set_copy(r, x, v_latest)
                if cold:
                    tab.touch(r, x, self.step)

    def _evict(self, tab: _Table, policy: str, window: List[List[List[int]]], cnt: SyncCounters,
               miss_push: List[Tuple[int, int, int]]) -> List[torch.Tensor]:
        evictions: List[torch.Tensor] = []
        for r in range(tab.W):
            next_use: Dict[int, int] = {}
            if policy == "belady" and len(tab.cache[r]) > tab.capacity:
                for k in range(len(window) - 1, 0, -1):
                    for x in window[k][r]:
                        next_use[x] = k
            out = tab.victims(r, policy, next_use)
            for x in out:
                if tab.get_master(x) == r:  # dirty: the only copy with the latest updates
                    h = tab.home(x)
                    miss_push.append((x, r, h))
                    cnt.miss_push += 1
                    tab.set_copy(h, x, tab.copies[r][x])
                    tab.master.pop(x, None)
                tab.drop(r, x)
            evictions.append(torch.tensor(sorted(out), dtype=torch.int64))
        return evictions


def _next_use(ahead: List[List[set]], r: int, x: int) -> float:
    """Steps until rank ``r`` reads ``x`` again within the look-ahead (``inf``: not in the window)."""
    for k, step in enumerate(ahead, 1):
        if x in step[r]:
            return k
    return _INF


class LazySyncPlanner(SyncPlanner):
    """Lazy, exact plan (see the module docstring): pull a row only when missing or outdated, push a rank's
    accumulated updates only when another rank reads the row next, or on dirty eviction.

    Args:
        locality: the layout.
        capacity_fraction: cache capacity per rank per table as a fraction of the table's rows (in
            ``(0, 1]``; ``ceil(fraction · n)`` rows, at least 1).
        policy: ``"lru"`` (default) or ``"belady"`` (next use within the window).
        window: ``K >= 1``.
        route: ``"owner"`` (default; via the home) or ``"direct"`` (peer to peer, docs/design.md's floor).
        capacity_rows: optional per-table capacity in rows (``1 ≤ C ≤ n``), overriding the fraction.
    """

    def __init__(self, locality: Locality, capacity_fraction: float = 0.05, policy: str = "lru", window: int = 5,
                 route: str = "owner", capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        if policy not in CACHE_POLICIES:
            raise ValueError(f"policy must be one of {CACHE_POLICIES}, got {policy!r}")
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.policy = policy
        self.route = route
        self.capacities = cache_capacities(locality.layout, capacity_fraction, capacity_rows)
        super().__init__(locality, window)

    def _capacity(self, table: str) -> int:
        return self.capacities[table]

    def _push_home(self, tab: _Table, x: int, out: List[Tuple[int, int, int]], cnt: SyncCounters) -> None:
        m, h = tab.get_master(x), tab.home(x)
        out.append((x, m, h))
        cnt.update_push += 1
        tab.set_copy(h, x, tab.copies[m][x])
        tab.master.pop(x, None)

    def _plan_table(self, tab: _Table, window: List[List[List[int]]]) -> TablePlan:
        cnt = SyncCounters()
        readers = _readers(window[0])
        pre: List[Tuple[int, int, int]] = []
        post: List[Tuple[int, int, int]] = []
        miss: List[Tuple[int, int, int]] = []
        upd: List[Tuple[int, int, int]] = []
        red: List[Tuple[int, int, int]] = []
        mpush: List[Tuple[int, int, int]] = []
        owner_route = self.route == "owner"
        ahead = [[set(rows) for rows in step] for step in window[1:]] if not owner_route else []
        if owner_route:  # dirty rows another rank reads now (only when the last plan had no look-ahead)
            for x, S in readers.items():
                m = tab.get_master(x)
                if m != tab.home(x) and S != [m]:
                    self._push_home(tab, x, pre, cnt)
        self._pull_and_read(tab, readers, {x: tab.get_master(x) for x in readers}, cnt, miss, upd)
        for x, S in readers.items():
            h, m = tab.home(x), tab.get_master(x)
            if len(S) == 1:
                reducer = S[0]
            elif owner_route:
                reducer = h  # fresh: the home is the master here (pushed above or never left)
            else:  # the reader that reads the row next within the window keeps the latest version
                reducer = min(S, key=lambda r: (_next_use(ahead, r, x), r != m, r != h, r))
            for r in S:
                if r != reducer:
                    red.append((x, r, reducer))
                    cnt.reduce += 1
            v = tab.latest(x) + 1
            tab.version[x] = v
            tab.set_copy(reducer, x, v)
            if reducer == h:
                tab.master.pop(x, None)
            else:
                tab.master[x] = reducer
        if owner_route and len(window) > 1:  # look-ahead: push for the next step's other readers
            for x, S in _readers(window[1]).items():
                m = tab.get_master(x)
                if m != tab.home(x) and S != [m]:
                    self._push_home(tab, x, post, cnt)
        evictions = self._evict(tab, self.policy, window, cnt, mpush)
        return TablePlan(table=tab.name, world_size=tab.W, push_before_read=_pairs(pre), miss_pull=_pairs(miss),
                         update_pull=_pairs(upd), reduce=_pairs(red), update_push=_pairs(post),
                         miss_push=_pairs(mpush), deliver=_pairs([]), evictions=evictions, counters=cnt)


class EagerSyncPlanner(SyncPlanner):
    """Eager baseline: every update is delivered to every holder in the step it happens (see the module
    docstring). ``capacity_fraction=None`` (default): no cache of remote cold rows (herald's cold path).

    Args:
        locality: the layout.
        capacity_fraction: optional cache of remote cold rows, as for :class:`LazySyncPlanner`.
        policy: cache eviction policy.
        window: ``K`` (used only by ``policy="belady"``).
        capacity_rows: optional per-table capacity in rows.
    """

    def __init__(self, locality: Locality, capacity_fraction: Optional[float] = None, policy: str = "lru",
                 window: int = 1, capacity_rows: Optional[Mapping[str, int]] = None) -> None:
        if policy not in CACHE_POLICIES:
            raise ValueError(f"policy must be one of {CACHE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.capacities = cache_capacities(locality.layout, capacity_fraction, capacity_rows)
        super().__init__(locality, window)

    def _capacity(self, table: str) -> int:
        return self.capacities.get(table, 0)

    def _plan_table(self, tab: _Table, window: List[List[List[int]]]) -> TablePlan:
        cnt = SyncCounters()
        readers = _readers(window[0])
        miss: List[Tuple[int, int, int]] = []
        upd: List[Tuple[int, int, int]] = []
        red: List[Tuple[int, int, int]] = []
        mpush: List[Tuple[int, int, int]] = []
        dlv: List[Tuple[int, int, int]] = []
        self._pull_and_read(tab, readers, {x: tab.home(x) for x in readers}, cnt, miss, upd)
        for x, S in readers.items():
            h = tab.home(x)
            for r in S:
                if r != h:
                    red.append((x, r, h))
                    cnt.reduce += 1
            v = tab.latest(x) + 1
            tab.version[x] = v
            tab.set_copy(h, x, v)
        evictions = self._evict(tab, self.policy, window, cnt, mpush)
        for x in readers:
            h, v = tab.home(x), tab.latest(x)
            for r in range(tab.W):
                if r != h and tab.held(r, x) is not None:
                    dlv.append((x, h, r))
                    cnt.deliver += 1
                    tab.set_copy(r, x, v)
        return TablePlan(table=tab.name, world_size=tab.W, push_before_read=_pairs([]), miss_pull=_pairs(miss),
                         update_pull=_pairs(upd), reduce=_pairs(red), update_push=_pairs([]),
                         miss_push=_pairs(mpush), deliver=_pairs(dlv), evictions=evictions, counters=cnt)


# ------------------------------------------------------------------------------------------ simulation


@dataclass
class SimulationResult:
    """What :func:`simulate` returns: per-step totals, their sum, and the plans (when kept)."""

    per_step: List[SyncCounters]
    total: SyncCounters
    plans: List[StepPlan]

    @property
    def vectors(self) -> int:
        """Embedding vectors moved over the whole trace."""
        return self.total.vectors

    @property
    def vectors_per_step(self) -> float:
        return self.total.vectors / len(self.per_step) if self.per_step else 0.0


def simulate(reads_per_step: Sequence[StepReads], planner: SyncPlanner, keep_plans: bool = False,
             check: bool = False) -> SimulationResult:
    """Run ``planner`` over a trace: step ``t`` is planned from ``reads_per_step[t : t + K]``.

    Args:
        reads_per_step: the trace (one :data:`StepReads` per step).
        planner: a fresh planner (its state is reset first).
        keep_plans: keep every :class:`StepPlan` in the result.
        check: replay the plans with :func:`check_exact` (implies keeping them while checking).
    """
    planner.reset()
    per_step: List[SyncCounters] = []
    plans: List[StepPlan] = []
    total = SyncCounters()
    for t in range(len(reads_per_step)):
        plan = planner.plan_step(reads_per_step[t: t + planner.window])
        per_step.append(plan.counters)
        total = total + plan.counters
        if keep_plans or check:
            plans.append(plan)
    if check:
        caps = {t: tab.capacity for t, tab in planner._tables.items()}
        check_exact(planner.locality, reads_per_step, plans, capacity=caps)
    return SimulationResult(per_step=per_step, total=total, plans=plans if keep_plans else [])


# ------------------------------------------------------------------------------------------ checker


def check_exact(locality: Locality, reads_per_step: Sequence[StepReads], plans: Sequence[StepPlan],
                capacity: Optional[Mapping[str, int]] = None) -> None:
    """Replay ``plans`` on ``reads_per_step`` with symbolic versions (a copy's version = number of updates
    it has) and raise :class:`ExactnessError` unless, at every step and table:

    * every transfer's source holds a copy and never sends an older version than the receiver has;
      pushes go to the row's home; a ``miss_pull`` fills a missing copy, an ``update_pull`` refreshes one;
    * every read sees the latest version (every earlier update);
    * the gradients of a read row are summed exactly once: the ``reduce`` messages of the row all go to one
      reducer, their senders plus the reducer (when it reads) are exactly the readers, and the reducer holds
      the latest version when it applies the one update (a row read by one rank and no reduce message: that
      rank updates);
    * an eviction drops a cached remote cold copy and never the last copy with the latest version;
    * (with ``capacity``) no rank caches more than ``capacity[table]`` remote cold rows after a step.

    Independent of the planners' internals: it only sees the locality, the reads and the plans.
    """
    if len(plans) != len(reads_per_step):
        raise ExactnessError(f"{len(plans)} plans for {len(reads_per_step)} steps")
    replays = {t: _Replay(locality, t) for t in locality.tables}
    for step, (reads, plan) in enumerate(zip(reads_per_step, plans, strict=True)):
        norm = _normalize(reads, locality)
        for t in locality.tables:
            tp = plan.tables.get(t)
            if tp is None:
                raise ExactnessError(f"step {step}: no plan for table {t!r}")
            replays[t].replay(step, norm[t], tp, None if capacity is None else capacity.get(t, 0))


class _Replay:
    """Symbolic replay of one table's plans for :func:`check_exact`."""

    def __init__(self, loc: Locality, table: str) -> None:
        self.table = table
        self.W = loc.world_size
        self.hot = set(loc.hot_ids[table].tolist())
        self.block = loc.block_sizes[table]  # type: ignore[index]
        self.latest: Dict[int, int] = {}
        self.copies: List[Dict[int, int]] = [{} for _ in range(self.W)]
        self.step = 0

    def default(self, r: int, x: int) -> bool:
        return x in self.hot or x // self.block == r

    def held(self, r: int, x: int) -> Optional[int]:
        v = self.copies[r].get(x)
        return v if v is not None else (0 if self.default(r, x) else None)

    def where(self, kind: str, x: int) -> str:
        return f"step {self.step}, table {self.table!r}, row {x}, {kind}"

    def move(self, kind: str, rows: torch.Tensor, to_home: bool = False, fill: Optional[bool] = None) -> None:
        for x, s, d in rows.tolist():
            vs, vd = self.held(s, x), self.held(d, x)
            if vs is None:
                raise ExactnessError(f"{self.where(kind, x)}: source rank {s} holds no copy")
            if to_home and d != x // self.block:
                raise ExactnessError(f"{self.where(kind, x)}: pushed to rank {d}, not the home {x // self.block}")
            if fill is True and vd is not None:
                raise ExactnessError(f"{self.where(kind, x)}: rank {d} already holds a copy")
            if fill is False and vd is None:
                raise ExactnessError(f"{self.where(kind, x)}: rank {d} holds no copy to update")
            if vd is not None and vs < vd:
                raise ExactnessError(f"{self.where(kind, x)}: rank {s} sends version {vs} over newer {vd}")
            self.copies[d][x] = vs

    def replay(self, step: int, reads: List[List[int]], tp: TablePlan, capacity: Optional[int]) -> None:
        self.step = step
        latest, copies, where = self.latest, self.copies, self.where
        self.move("update_push (before reads)", tp.push_before_read, to_home=True, fill=False)
        self.move("miss_pull", tp.miss_pull, fill=True)
        self.move("update_pull", tp.update_pull, fill=False)
        readers = _readers(reads)
        for x, S in readers.items():
            for r in S:
                v = self.held(r, x)
                if v != latest.get(x, 0):
                    raise ExactnessError(f"{where('read', x)}: rank {r} reads version {v}, latest is "
                                         f"{latest.get(x, 0)} (misses an earlier update)")
        grads: Dict[int, List[Tuple[int, int]]] = {}
        for x, s, d in tp.reduce.tolist():
            grads.setdefault(x, []).append((s, d))
        extra = sorted(set(grads) - set(readers))
        if extra:
            raise ExactnessError(f"step {step}, table {self.table!r}: reduce messages for unread rows {extra[:5]}")
        for x, S in readers.items():
            msgs = grads.get(x, [])
            if not msgs:
                if len(S) != 1:
                    raise ExactnessError(f"{where('reduce', x)}: read by ranks {S} but gradients not summed")
                reducer = S[0]
            else:
                dsts = {d for _, d in msgs}
                if len(dsts) != 1:
                    raise ExactnessError(f"{where('reduce', x)}: gradients sent to several ranks {sorted(dsts)}")
                reducer = dsts.pop()
                contributors = sorted([s for s, _ in msgs] + ([reducer] if reducer in S else []))
                if contributors != S:
                    raise ExactnessError(f"{where('reduce', x)}: gradients of ranks {contributors}, readers {S}")
            v = latest.get(x, 0)
            if self.held(reducer, x) != v:
                raise ExactnessError(f"{where('update', x)}: reducer rank {reducer} holds version "
                                     f"{self.held(reducer, x)}, latest is {v}")
            latest[x] = v + 1
            copies[reducer][x] = v + 1
        self.move("update_push", tp.update_push, to_home=True, fill=False)
        self.move("miss_push", tp.miss_push, to_home=True, fill=False)
        for r, rows in enumerate(tp.evictions):
            for x in rows.tolist():
                if self.default(r, x):
                    raise ExactnessError(f"{where('eviction', x)}: rank {r} evicts a hot or owned row")
                v = copies[r].pop(x, None)
                if v is None:
                    raise ExactnessError(f"{where('eviction', x)}: rank {r} evicts a row it does not hold")
                if v == latest.get(x, 0) and not any(self.held(q, x) == v for q in range(self.W)):
                    raise ExactnessError(f"{where('eviction', x)}: rank {r} drops the last copy of version "
                                         f"{v} (an update is lost)")
        self.move("deliver", tp.deliver, fill=False)
        if capacity is not None:
            for r in range(self.W):
                cached = sum(1 for x in copies[r] if not self.default(r, x))
                if cached > capacity:
                    raise ExactnessError(f"step {step}, table {self.table!r}: rank {r} caches {cached} rows > "
                                         f"capacity {capacity}")


def to_step_plan(plan: ExecPlan, locality: Any) -> StepPlan:
    """An executed plan (global keys) as the per-table :class:`StepPlan` (table-local row ids) that
    :func:`check_exact` replays (``locality``: a ``Locality`` or its ``RowLayout``)."""
    lay = layout_of(locality)
    tables: Dict[str, TablePlan] = {}
    for i, name in enumerate(lay.tables):
        lo = int(lay.table_offsets[i])
        hi = lo + lay.num_embeddings[i]

        def part(t: torch.Tensor) -> torch.Tensor:
            s = t[(t[:, 0] >= lo) & (t[:, 0] < hi)].clone()
            s[:, 0] -= lo
            return s

        tables[name] = TablePlan(
            table=name, world_size=lay.world_size, push_before_read=part(plan.push_before_read),
            miss_pull=part(plan.pull[plan.pull_miss]), update_pull=part(plan.pull[~plan.pull_miss]),
            reduce=part(plan.reduce), update_push=part(plan.update_push), miss_push=part(plan.miss_push),
            deliver=no_transfers(), evictions=[e[(e >= lo) & (e < hi)] - lo for e in plan.evictions])
    return StepPlan(step=plan.step, tables=tables, counters=plan.counters)
