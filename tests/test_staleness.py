"""HET bounded staleness (torchrec_herald/pipeline/staleness.py, executed by sharding/plan_exec.py).

Pure (no process group):

* :class:`StalenessPlanner` replayed on random skewed traces next to :class:`RefStaleness`, a small
  dict-based implementation of the rules written here from the module's description (home version
  ``hv``, per-copy ``base`` and ``pending``; lag measured when the read happens, i.e. after the step's
  pre-read pushes): every transfer row for row with its ``add`` flag, the evictions, the step counters,
  the stale reads and the largest lag served. Over every trace no read is more than ``s`` versions
  behind (and with ``s > 0`` some reads are stale and some pushes add: not vacuous); after ``flush()``
  ``hv[x]`` is the number of updates applied to row ``x`` (with ``s = 0`` one per step in which any rank
  read it; with ``s > 0`` one per read, each reader updating its own copy, no gradient sent) and
  the flush's transfers are the reference's. With ``s = 0`` the planner never adds, never serves a
  stale read and never holds a pending update.
* a hand-made trace where a refreshing copy's pre-read push puts another reader more than ``s``
  versions behind: that reader is refreshed too.
* bad ``staleness`` values / ``sync=eager`` are ValueErrors.

Two ranks, one process group (``_runs``, cached): 50 steps of SGD (``apply_optimizer_in_backward``)
and of row-wise Adagrad (fused params) through ``HeraldTrainPipeline``:

* ``staleness=0`` trains what stock TABLE_WISE and the exact herald pipeline train: per-step loss
  (mean over ranks) and every final ``state_dict`` tensor within ``RTOL`` relative; no stale read;
* ``staleness=1`` and ``3``: ``stats.max_staleness <= s`` with ``stale_reads > 0``; training is finite
  and after the final flush every rank's state is identical;
* identity allocation (the same batches on the same rank whatever ``s``), SGD, every embedding
  gradient recorded at the executor: for s in {0, 1, 3} the final tables equal the initial ones minus
  ``lr ·`` the sum of all gradients applied (no update lost or counted twice by replacing/adding
  pushes), and s = 1, 3 move fewer embedding vectors (pulls + reduces + pushes) than s = 0.

Driver: ``planner=herald pipeline=herald pipeline.staleness=1`` trains the exact reference first and
records it in ``metrics["approximate"]``; a negative ``pipeline.staleness`` fails before anything is
trained.
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from herald_harness import error_of, weight_rtol
from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.pipeline.staleness import StalenessPlanner

# ------------------------------------------------------------------------------------------ reference

NUM_ROWS = {"a": 50, "b": 200, "c": 7, "d": 3, "e": 1}
HOT = {"a": [1, 3], "b": [0, 5, 9, 150], "d": [0]}


def _locality(world: int) -> Locality:
    return Locality(world_size=world, num_embeddings=dict(NUM_ROWS),
                    hot_ids={t: torch.tensor(ids) for t, ids in HOT.items()})


def _trace(loc: Locality, steps: int, seed: int) -> List[List[torch.Tensor]]:
    """Per step, per rank: sorted unique global keys; skewed (row ~ n·u³), 0 to 12 draws per rank and
    table (a rank sometimes reads nothing of a table)."""
    g = torch.Generator().manual_seed(seed)
    off = loc.layout.table_offsets
    out = []
    for _ in range(steps):
        per: List[List[torch.Tensor]] = [[] for _ in range(loc.world_size)]
        for i, n in enumerate(NUM_ROWS.values()):
            for r in range(loc.world_size):
                k = int(torch.randint(0, 13, (1,), generator=g))
                per[r].append(off[i] + torch.unique((torch.rand(k, generator=g) ** 3 * n).long()))
        out.append([torch.cat(p).sort().values for p in per])
    return out


class RefStaleness:
    """The staleness rules one row at a time (dicts). Per step, for the rows each rank reads:

    * read: a rank without a copy pulls it from home (miss); the home reads its own copy (lag 0);
      a copy more than ``s`` home versions behind *when the read happens* is refreshed (pulled), its
      pending updates pushed home first -- those pushes raise the home version, so the refreshed set
      grows until no read copy is more than ``s`` behind; a copy 1..s behind is served stale;
    * write, ``s > 0``: every rank that read a row updates its own copy (the home's: ``hv += 1``; any
      other: ``pending += 1``, pushed home once ``> s``); no gradient is sent;
    * write, ``s = 0``: a row read by one rank is updated on that rank's copy as above; a row read by
      several ranks: gradients sent to the home, which applies one update (``hv += 1``);
    * push (rank by rank): *replace* when ``hv == base`` of the pusher, else *add*; ``hv += u``,
      ``base += u``, ``pending = 0``;
    * evict: LRU per (rank, table) down to the capacity (ties: lower key); a dirty victim is pushed.
    """

    def __init__(self, loc: Locality, s: int, fraction: float) -> None:
        self.s, self.W = s, loc.world_size
        self.rows: List[Tuple[str, int]] = [(t, i) for t, n in loc.num_embeddings.items() for i in range(n)]
        hot = {t: set(loc.hot_ids[t].tolist()) for t in loc.tables}
        self.hot = {k for k, (t, i) in enumerate(self.rows) if i in hot[t]}
        self.home = [i // loc.block_sizes[t] for t, i in self.rows]
        self.cap = {t: max(1, math.ceil(fraction * n)) for t, n in loc.num_embeddings.items()}
        self.reset()

    def reset(self) -> None:
        self.hv: Dict[int, int] = defaultdict(int)
        self.base: Dict[Tuple[int, int], int] = defaultdict(int)
        self.pending: Dict[Tuple[int, int], int] = defaultdict(int)
        self.cache: List[Dict[int, int]] = [{} for _ in range(self.W)]  # key -> last use
        self.step = 0

    def _lag(self, r: int, x: int) -> int:
        return 0 if self.home[x] == r else self.hv[x] - self.base[r, x]

    def _push(self, pairs: List[Tuple[int, int]]) -> List[Tuple[int, int, int, bool]]:
        out = []
        for r in range(self.W):
            for q, x in pairs:
                if q != r:
                    continue
                u = self.pending[r, x]
                assert u > 0
                out.append((x, r, self.home[x], self.hv[x] != self.base[r, x]))
                self.hv[x] += u
                self.base[r, x] += u
                self.pending[r, x] = 0
        return sorted(out)

    def plan_step(self, reads: List[List[int]]) -> Dict[str, Any]:
        s, W = self.s, self.W
        pairs = [(r, x) for r in range(W) for x in reads[r]]
        held = {(r, x): x in self.hot or self.home[x] == r or x in self.cache[r] for r, x in pairs}
        refresh = {p for p in pairs if held[p] and self._lag(*p) > s}
        while True:  # what the pending pushes of refreshing copies do to the other copies' lag
            ahead: Dict[int, int] = defaultdict(int)
            for p in pairs:
                if p in refresh and self.pending[p] > 0:
                    ahead[p[1]] += self.pending[p]
            more = {(r, x) for r, x in pairs if held[r, x] and self.home[x] != r and (r, x) not in refresh
                    and self.hv[x] + ahead[x] - self.base[r, x] > s}
            if not more:
                break
            refresh |= more
        pre = self._push([p for p in pairs if p in refresh and self.pending[p] > 0])
        c = dict(miss_pull=0, update_pull=0, hits=0, reads=len(pairs), cache_hits=0, cache_reads=0)
        stale, max_lag, pull = 0, 0, []
        for r, x in pairs:
            cold = x not in self.hot and self.home[x] != r
            if not held[r, x] or (r, x) in refresh:
                c["miss_pull" if not held[r, x] else "update_pull"] += 1
                pull.append((x, self.home[x], r, not held[r, x]))
                self.base[r, x] = self.hv[x]
            else:
                c["hits"] += 1
                c["cache_hits"] += cold
                lag = self._lag(r, x)  # at read time: after the pre-read pushes
                assert lag <= s
                if lag > 0:
                    stale, max_lag = stale + 1, max(max_lag, lag)
            if cold:
                c["cache_reads"] += 1
                self.cache[r][x] = self.step
        readers: Dict[int, List[int]] = defaultdict(list)
        for r, x in pairs:
            readers[x].append(r)
        reduce, over, updates = [], [], []
        for x in sorted(readers):
            rs = readers[x]
            if s > 0:  # every reader updates its own copy
                updaters = sorted(rs)
            else:  # one update: the only reader's, or at home with the readers' gradients sent there
                updaters = [rs[0] if len(rs) == 1 else self.home[x]]
                reduce += [(x, r, updaters[0]) for r in rs if r != updaters[0]]
            for updater in updaters:
                updates.append((x, updater))
                if updater == self.home[x]:
                    self.hv[x] += 1
                else:
                    self.pending[updater, x] += 1
                    if self.pending[updater, x] > s:
                        over.append((updater, x))
        post = self._push(over)
        victims = []
        for r in range(W):
            v: List[int] = []
            for t, cap in self.cap.items():
                keys = sorted(x for x in self.cache[r] if self.rows[x][0] == t)
                excess = len(keys) - cap
                if excess > 0:
                    v += sorted(keys, key=lambda x: self.cache[r][x])[:excess]  # stable: ties by key
            victims.append(sorted(v))
        miss_push = self._push([(r, x) for r in range(W) for x in victims[r] if self.pending[r, x] > 0])
        for r in range(W):
            for x in victims[r]:
                del self.cache[r][x]
                self.base[r, x] = 0
        c.update(update_push=len(pre) + len(post), miss_push=len(miss_push), reduce=len(reduce))
        self.step += 1
        return dict(pre=pre, pull=sorted(pull), reduce=sorted(reduce), post=post, miss_push=miss_push,
                    victims=victims, counters=c, stale=stale, max_lag=max_lag, updates=updates)

    def flush(self) -> Dict[str, Any]:
        push = self._push(sorted((r, x) for (r, x), u in list(self.pending.items()) if u > 0))
        pull = sorted((x, self.home[x], r) for x in self.hot for r in range(self.W)
                      if self.home[x] != r and self.hv[x] > self.base[r, x])
        dropped = [sorted(c) for c in self.cache]
        hv = {x: v for x, v in self.hv.items() if v}
        self.reset()
        return dict(push=push, pull=pull, dropped=dropped, hv=hv)


class _Recording(StalenessPlanner):
    """Keeps the hot rows' home versions the flush leaves (before it resets the state)."""

    def reset(self) -> None:
        if hasattr(self, "hv_hot"):
            self.final_hv_hot = self.hv_hot.clone()
        super().reset()

    def max_pending(self) -> int:
        """The most updates any copy holds back."""
        both = torch.cat([self.pending_hot.flatten(), self.entries.col("pending")])
        return int(both.max()) if both.numel() else 0

    def lags(self) -> Dict[Tuple[int, int], int]:
        """(rank, key) -> home versions behind, of every cached copy."""
        x = self.entries.keys // self.W
        lag = self.hv_cold.get(x, "hv", 0) - self.entries.col("base")
        return {(int(k) % self.W, int(k) // self.W): int(v) for k, v in zip(self.entries.keys, lag)}


def _with_add(t: torch.Tensor, add: torch.Tensor) -> List[Tuple[int, int, int, bool]]:
    assert len(t) == len(add)
    return sorted((*row, bool(a)) for row, a in zip(t.tolist(), add.tolist()))


CASES = [  # (W, s, seed, capacity fraction)
    (2, 0, 0, 0.1),
    (4, 0, 1, 0.05),
    (2, 1, 2, 0.1),
    (3, 1, 3, 0.05),
    (3, 3, 4, 1.0),  # caches as large as the tables: no evictions
    (4, 2, 5, 0.05),
    (4, 3, 6, 0.2),
]
STEPS = 60


@pytest.mark.parametrize("world,s,seed,fraction", CASES)
def test_planner_matches_reference_and_bounds_the_lag(world: int, s: int, seed: int, fraction: float) -> None:
    loc = _locality(world)
    vec, ref = _Recording(loc, s, fraction), RefStaleness(loc, s, fraction)
    updates = torch.zeros(vec.num_rows, dtype=torch.int64)
    seen = defaultdict(int)
    for t, reads in enumerate(_trace(loc, STEPS, seed)):
        plan = vec.plan_step([reads])
        exp = ref.plan_step([r.tolist() for r in reads])
        assert plan.step == t
        assert _with_add(plan.push_before_read, plan.push_before_read_add) == exp["pre"], t
        assert _with_add(plan.pull, plan.pull_miss) == exp["pull"], t
        assert [tuple(r) for r in plan.reduce.tolist()] == exp["reduce"], t
        assert _with_add(plan.update_push, plan.update_push_add) == exp["post"], t
        assert _with_add(plan.miss_push, plan.miss_push_add) == exp["miss_push"], t
        assert [v.tolist() for v in plan.evictions] == exp["victims"], t
        c = plan.counters
        got = {k: getattr(c, k) for k in exp["counters"]}
        assert got == exp["counters"], (t, got, exp["counters"])
        assert (plan.stale_reads, plan.max_staleness) == (exp["stale"], exp["max_lag"]), t
        assert plan.max_staleness <= s
        # the updates: with s = 0 one per row read (the union of reads), with s > 0 one per read, each
        # on its reader's copy; no gradient travels then
        assert list(zip(plan.update_keys.tolist(), plan.reducer.tolist())) == exp["updates"], t
        if s == 0:
            assert torch.equal(plan.update_keys, torch.unique(torch.cat(reads)))
        else:
            assert len(plan.update_keys) == sum(len(r) for r in reads) and plan.reduce.numel() == 0
        updates.index_add_(0, plan.update_keys, torch.ones_like(plan.update_keys))
        seen["stale"] += plan.stale_reads
        seen["max_lag"] = max(seen["max_lag"], plan.max_staleness)
        seen["add"] += int(plan.push_before_read_add.sum() + plan.update_push_add.sum() + plan.miss_push_add.sum())
        seen["replace"] += int((~plan.update_push_add).sum())
        seen["miss_push"] += c.miss_push
        seen["update_pull"] += c.update_pull
        assert vec.max_pending() <= s  # no copy holds back more than s updates
        # a cached copy lags its home as the reference's does (its home version is kept while cached)
        assert vec.lags() == {(r, x): ref.hv[x] - ref.base[r, x] for r, x in vec.lags()}, t
    if s > 0:  # not vacuous: stale reads served, some pushes add, some replace
        assert seen["stale"] > 0 and seen["max_lag"] >= 1 and seen["add"] > 0 and seen["replace"] > 0, seen
    if fraction < 1.0 and s > 0:  # (with s = 0 no copy is ever dirty after its step)
        assert seen["miss_push"] > 0, seen  # dirty evictions pushed
    assert seen["update_pull"] > 0, seen
    # the flush: the reference's transfers; afterwards every update applied is counted at home
    fp = vec.flush()
    exp = ref.flush()
    assert _with_add(fp.push, fp.push_add) == exp["push"]
    assert [tuple(r) for r in fp.pull.tolist()] == exp["pull"]
    assert [d.tolist() for d in fp.dropped] == exp["dropped"]
    hot = loc.layout.hot_keys
    assert torch.equal(vec.final_hv_hot, updates[hot])  # every update of a hot row counted at home
    assert {x: int(updates[x]) for x in updates.nonzero().flatten().tolist()} == exp["hv"]
    # and the state is a fresh planner's
    assert len(vec.entries) == 0 and len(vec.hv_cold) == 0 and len(vec.dirty) == 0
    assert not vec.hv_hot.any() and not vec.base_hot.any() and not vec.pending_hot.any()
    assert vec.step == 0


@pytest.mark.parametrize("world,seed", [(2, 7), (3, 8), (4, 9)])
def test_zero_staleness_never_adds_and_never_serves_stale(world: int, seed: int) -> None:
    loc = _locality(world)
    vec = StalenessPlanner(loc, 0, 0.05)
    pushes = 0
    for reads in _trace(loc, STEPS, seed):
        plan = vec.plan_step([reads])
        for add in (plan.push_before_read_add, plan.update_push_add, plan.miss_push_add):
            assert not bool(add.any())
        assert plan.stale_reads == 0 and plan.max_staleness == 0
        assert plan.push_before_read.numel() == 0  # nothing is ever held back, so nothing to push first
        assert not bool(vec.pending_hot.any()) and not bool(vec.entries.col("pending").any())
        pushes += len(plan.update_push) + len(plan.miss_push)
    assert pushes > 0
    fp = vec.flush()
    assert fp.push.numel() == 0 and not bool(fp.push_add.any())


def test_pre_read_push_refreshes_other_copies_it_puts_beyond_s() -> None:
    """W = 3, s = 1, hot row 0 (home: rank 0). Rank 1 holds one pending update (base 0); the home
    applies two updates; rank 2 refreshes at version 2 and updates its own copy (pending 1) while the
    home applies its third. When ranks 1 and 2 read the row, rank 1 (lag 3) refreshes and first pushes
    its update home (additive: the home moved on); that puts rank 2's copy 2 behind, so it is refreshed
    too (its own pending update pushed first), not served 2 versions stale. Both readers then update
    their own copies: no gradient is sent."""
    loc = Locality(world_size=3, num_embeddings={"t": 6}, hot_ids={"t": torch.tensor([0])})
    p = StalenessPlanner(loc, staleness=1, capacity_fraction=1.0)
    none = torch.empty(0, dtype=torch.int64)
    row = torch.tensor([0])
    p.plan_step([[none, row, none]])  # rank 1 alone: its copy, pending 1 (<= s: kept)
    assert int(p.pending_hot[1, 0]) == 1 and int(p.hv_hot[0]) == 0
    p.plan_step([[row, none, none]])  # home: hv 1
    p.plan_step([[row, none, none]])  # home: hv 2
    plan = p.plan_step([[row, none, row]])  # rank 2 lag 2 > s: refreshed (base 2); home: hv 3; rank 2: pending 1
    assert plan.pull.tolist() == [[0, 0, 2]] and int(p.hv_hot[0]) == 3 and int(p.base_hot[2, 0]) == 2
    assert plan.reduce.numel() == 0 and plan.update_keys.tolist() == [0, 0] and plan.reducer.tolist() == [0, 2]
    assert int(p.pending_hot[2, 0]) == 1
    plan = p.plan_step([[none, row, row]])
    # rank 1 (hv 3, base 0) then rank 2 (hv 3 + 1, base 2): both add
    assert plan.push_before_read.tolist() == [[0, 1, 0], [0, 2, 0]]
    assert plan.push_before_read_add.tolist() == [True, True]
    assert plan.pull.tolist() == [[0, 0, 1], [0, 0, 2]]  # both readers refreshed at version 5
    assert plan.stale_reads == 0 and plan.max_staleness == 0
    assert plan.counters.update_pull == 2 and plan.counters.update_push == 2 and plan.counters.reduce == 0
    assert int(p.hv_hot[0]) == 5 and p.base_hot[1:, 0].tolist() == [5, 5]
    assert p.pending_hot[1:, 0].tolist() == [1, 1]  # each reader's own update, held back (<= s)


def test_bad_staleness_is_a_value_error() -> None:
    from torchrec_herald.pipeline import HeraldTrainPipeline

    loc = _locality(2)
    for bad in (-1, 1.5):
        msg = error_of(lambda: StalenessPlanner(loc, bad))
        assert msg.startswith("ValueError: ") and f"pipeline.staleness must be an integer >= 0, got {bad}" in msg, msg
    # the pipeline checks its arguments before it looks at the model
    cpu = torch.device("cpu")
    msg = error_of(lambda: HeraldTrainPipeline(None, None, cpu, staleness=-1))  # type: ignore[arg-type]
    assert msg.startswith("ValueError: ") and "pipeline.staleness must be null (exact) or an integer >= 0" in msg, msg
    msg = error_of(lambda: HeraldTrainPipeline(None, None, cpu, staleness=1, sync="eager"))  # type: ignore[arg-type]
    assert msg.startswith("ValueError: ") and "pipeline.staleness needs pipeline.sync=lazy" in msg, msg


# ------------------------------------------------------------------------------------------ 2 ranks

TRAIN_STEPS = 50
RTOL = 1e-5
LR = 0.05
SGD = dict(optimizer="sgd", via="apply", lr=LR)
ADAGRAD = dict(optimizer="rowwise_adagrad", via="fused_params")
#: the greedy allocator with a free move on these per-rank batches (as on whole global batches; the default
#: moves a sample there only where one lookup made local pays for its bytes)
GREEDY = dict(allocator="greedy", move_penalty=0)
#: name -> harness cfg (planner herald unless stock); "pipeline": HeraldTrainPipeline kwargs
RUNS: Dict[str, Dict[str, Any]] = {
    "sgd_stock": dict(SGD, planner="table_wise"),
    "sgd_exact": dict(SGD, pipeline=dict(GREEDY)),
    "sgd_s0": dict(SGD, pipeline=dict(GREEDY, staleness=0)),
    "sgd_s1": dict(SGD, pipeline=dict(GREEDY, staleness=1)),
    # (the per-rank references scheduled on the critical path: the runs "_ahead" below are compared with them)
    "sgd_s3": dict(SGD, pipeline=dict(GREEDY, staleness=3, run_ahead=False)),
    "adagrad_stock": dict(ADAGRAD, planner="table_wise"),
    "adagrad_exact": dict(ADAGRAD, pipeline=dict(GREEDY)),
    "adagrad_s0": dict(ADAGRAD, pipeline=dict(GREEDY, staleness=0)),
    "adagrad_s1": dict(ADAGRAD, pipeline=dict(GREEDY, staleness=1, run_ahead=False)),
    # identity allocation: every s trains the same batches on the same ranks; gradients recorded
    "id_s0": dict(SGD, pipeline=dict(staleness=0, allocator="identity"), record=True),
    "id_s1": dict(SGD, pipeline=dict(staleness=1, allocator="identity"), record=True),
    "id_s3": dict(SGD, pipeline=dict(staleness=3, allocator="identity"), record=True),
    # whole global batches scheduled ahead: the next step's pulls are prefetched while this one ends
    "sgd_s3_ahead": dict(SGD, pipeline=dict(staleness=3, global_batches=True, run_ahead=True), whole=True),
    "adagrad_s1_ahead": dict(ADAGRAD, pipeline=dict(staleness=1, global_batches=True, run_ahead=True), whole=True),
}


def _one_run(rank: int, world: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    from herald_harness import build, full_state, gather_state, train
    from torchrec_herald.data import TrainStream
    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.traffic import TrafficMeter

    cfg = dict(cfg, steps=TRAIN_STEPS)
    if cfg.get("planner") == "table_wise":
        return train(rank, world, dict(cfg, pipeline="plain"))
    b = build(world, dict(cfg, planner="herald"))
    dmp = b["dmp"]
    pipe = HeraldTrainPipeline(dmp, b["optimizer"], torch.device("cpu"), **cfg["pipeline"])
    ebc = pipe.ebc
    grad_sum = torch.zeros(ebc.layout.num_rows, ebc.embedding_dim, dtype=torch.float64)
    if cfg.get("record"):
        ex = ebc.plan_executor
        orig = ex.after_backward

        def after_backward(plan: Any, ws_keys: torch.Tensor, ws_grad: torch.Tensor, *started: Any) -> None:
            grad_sum.index_add_(0, ws_keys, ws_grad.double())
            orig(plan, ws_keys, ws_grad, *started)

        ex.after_backward = after_backward
    prefetched = [0]
    ex = ebc.plan_executor
    prefetch = ex.prefetch

    def counted(plan: Any) -> None:
        prefetch(plan)
        prefetched[0] += ex._prefetched is not None

    ex.prefetch = counted
    # the pushes that travelled with the next step's pulls: pulls read from a replacing pusher, copies of an
    # added update sent to another rank's puller, rows a rank sent itself
    merged = {"steps": 0, "rerouted": 0, "copies": 0, "to_itself": 0}
    merge = ex._additive_pushes_with_next_pulls

    def counted_merge(plan: Any, next_plan: Any) -> Any:
        both = merge(plan, next_plan)
        if both is not None:
            t, add, _ = both
            n_push = len(plan.update_push) + len(plan.miss_push) + len(next_plan.push_before_read)
            pulls = t[n_push: n_push + len(next_plan.pull)]
            merged["steps"] += 1
            merged["rerouted"] += int((pulls[:, 1] != next_plan.pull[:, 1]).sum())
            copies = t[n_push + len(next_plan.pull):]
            assert bool(add[n_push + len(next_plan.pull):].all())
            merged["copies"] += int((copies[:, 1] != copies[:, 2]).sum())
            merged["to_itself"] += int((t[:, 1] == t[:, 2]).sum())
        return both

    ex._additive_pushes_with_next_pulls = counted_merge
    it: Any = (TrainStream(b["data"], rank, world, b["batch_size"], whole=True) if cfg.get("whole")
               else b["data"].train_batches(rank, world, b["batch_size"]))
    losses = []
    with TrafficMeter(embedding_dim=8) as meter:
        while True:
            try:
                losses.append(pipe.progress(it)[0].item())
            except StopIteration:
                break
    state = full_state(dmp)
    return {"losses": losses, "state": state, "raw_state": dict(gather_state(dmp.state_dict()), hot=ebc.hot_values()),
            "initial": b["initial"], "tags": meter.tag_summary(), "stats": pipe.stats, "grad_sum": grad_sum,
            "tables": list(ebc.layout.tables), "offsets": ebc.layout.table_offsets.clone(), "prefetched": prefetched[0],
            "merged": merged}


def _worker(rank: int, world: int, names: List[str]) -> Dict[str, Dict[str, Any]]:
    return {n: _one_run(rank, world, RUNS[n]) for n in names}


@functools.lru_cache(maxsize=None)
def _runs() -> List[Dict[str, Dict[str, Any]]]:
    return run_multiprocess(_worker, 2, list(RUNS), timeout_s=600)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def _mean_losses(name: str) -> torch.Tensor:
    return torch.tensor([r[name]["losses"] for r in _runs()], dtype=torch.float64).mean(0)


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.parametrize("against", ["stock", "exact"])
def test_zero_staleness_trains_exactly(opt: str, against: str) -> None:
    res = _runs()
    s0, ref = f"{opt}_s0", f"{opt}_{against}"
    h, s = _mean_losses(s0), _mean_losses(ref)
    assert len(h) == len(s) == TRAIN_STEPS
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL
    for r in res:
        a, b = r[s0]["state"], r[ref]["state"]
        assert set(a) == set(b) and sum(".embedding_bags." in k for k in a) == 26
        bad = {k: _rel(a[k], b[k]) for k in b if not _rel(a[k], b[k]) <= weight_rtol(
            "rowwise_adagrad" if opt == "adagrad" else "sgd")}
        assert not bad, bad
    st = res[0][s0]["stats"]
    assert st.steps == TRAIN_STEPS and st.stale_reads == 0 and st.max_staleness == 0
    init = res[0][ref]["initial"]
    assert all(not torch.equal(res[0][ref]["state"][k], init[k]) for k in init)  # training moved everything


@pytest.mark.parametrize("name,s", [("sgd_s1", 1), ("sgd_s3", 3), ("adagrad_s1", 1), ("id_s1", 1), ("id_s3", 3)])
def test_positive_staleness_is_bounded_finite_and_consistent(name: str, s: int) -> None:
    res = _runs()
    st = res[0][name]["stats"]
    assert st.steps == TRAIN_STEPS
    assert 0 < st.stale_reads and 1 <= st.max_staleness <= s, (st.stale_reads, st.max_staleness)
    assert st.stale_reads < st.counters.reads
    for r in res:
        assert r[name]["stats"].counters == st.counters  # every rank ran the same plans
        assert (r[name]["stats"].stale_reads, r[name]["stats"].max_staleness) == (st.stale_reads, st.max_staleness)
        assert all(math.isfinite(x) and 0 < x < 10 for x in r[name]["losses"])
        assert all(bool(torch.isfinite(v).all()) for v in r[name]["state"].values())
    # after the final flush every rank holds the same model (the gathered state, the hot replicas)
    a, b = res[0][name]["raw_state"], res[1][name]["raw_state"]
    assert set(a) == set(b) and sum(".embedding_bags." in k for k in a) == 26
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # approximate, but close to the exact run: the mean loss of the last 25 steps
    exact = name.split("_")[0] + "_exact" if not name.startswith("id_") else "sgd_exact"
    h, e = _mean_losses(name)[-25:].mean(), _mean_losses(exact)[-25:].mean()
    assert abs(float(h / e) - 1) < 0.05, (float(h), float(e))


@pytest.mark.parametrize("name", ["id_s0", "id_s1", "id_s3"])
def test_sgd_tables_are_initial_minus_lr_times_all_gradients(name: str) -> None:
    """Conservation through replacing and additive pushes: with SGD every update is ``-lr · g``, so
    after the flush each table row is its initial value minus lr times every gradient applied to it
    (whichever rank applied it, whenever it reached home)."""
    res = _runs()
    total = sum(r[name]["grad_sum"] for r in res)
    r0 = res[0][name]
    worst, moved = 0.0, 0
    for t, name_t in enumerate(r0["tables"]):
        key = next(k for k in r0["state"] if k.endswith(f"embedding_bags.{name_t}.weight"))
        init = r0["initial"][key].double()
        lo = int(r0["offsets"][t])
        expected = init - LR * total[lo: lo + init.shape[0]]
        worst = max(worst, float((r0["state"][key].double() - expected).abs().max()))
        moved += int((expected != init).any(1).sum())
    assert moved > 1000
    assert worst < 1e-6, worst  # float32 rounding only (a lost or doubled update is ~1e-4 here)


def _vectors(r: Dict[str, Any], *tags: str) -> float:
    return sum(r["tags"].get(t, {}).get("embedding_vectors", 0.0) for t in tags)


def _plan_vectors(r: Dict[str, Any]) -> float:
    """The plan's vectors sent (run ahead, a step's pushes travel with the next pulls: ``herald_push_pull``)."""
    return _vectors(r, "herald_pull", "herald_reduce", "herald_update_push", "herald_push_pull")


@pytest.mark.parametrize("name,ref", [("sgd_s3_ahead", "sgd_s3"), ("adagrad_s1_ahead", "adagrad_s1")])
def test_staleness_scheduled_ahead_prefetches_and_trains_bit_for_bit_like_the_per_rank_path(name: str, ref: str) -> None:
    """Run ahead on whole global batches, each step's pushes (and the next plan's pushes before its reads)
    travel in one all-to-all with the next step's pulls, which a rank applies after the pushes of their
    rows as the home does; the training is the per-rank path's, bit for bit."""
    for r in _runs():
        got, want = r[name], r[ref]
        # every step but the first and the window's last ones (no next plan made ahead)
        assert got["prefetched"] >= TRAIN_STEPS - 5 and want["prefetched"] == 0
        assert got["merged"]["steps"] >= TRAIN_STEPS - 5 and want["merged"]["steps"] == 0
        assert got["tags"]["herald_push_pull"]["calls"] == got["merged"]["steps"]
        # pulls read from the pusher that replaces the row, and pushes a refreshing rank sends itself
        assert got["merged"]["rerouted"] > 0 and got["merged"]["to_itself"] > 0
        assert got["losses"] == want["losses"]
        assert all(torch.equal(got["state"][k], v) for k, v in want["state"].items())
        assert got["stats"].stale_reads == want["stats"].stale_reads > 0


def test_staleness_moves_fewer_vectors_on_the_same_batches() -> None:
    res = _runs()
    reads = {n: res[0][n]["stats"].counters.reads for n in ("id_s0", "id_s1", "id_s3")}
    assert len(set(reads.values())) == 1, reads  # the same rows read: the same batches, the same ranks
    vec = {n: sum(_plan_vectors(r[n]) for r in res) for n in ("id_s0", "id_s1", "id_s3")}
    plan = {n: res[0][n]["stats"].counters.vectors for n in ("id_s0", "id_s1", "id_s3")}
    assert vec["id_s1"] < 0.9 * vec["id_s0"] and vec["id_s3"] < vec["id_s1"], vec
    assert plan["id_s1"] < plan["id_s0"] and plan["id_s3"] < plan["id_s1"], plan
    # the executor moved what the plans say (pulls/pushes: plus the final flush's)
    for n in vec:
        c = res[0][n]["stats"].counters
        assert sum(r[n]["tags"].get("herald_reduce", {}).get("embedding_vectors", 0) for r in res) == c.reduce
        assert sum(_vectors(r[n], "herald_pull", "herald_update_push", "herald_push_pull") for r in res) >= \
            c.miss_pull + c.update_pull + c.update_push + c.miss_push
        if not sum(_vectors(r[n], "herald_push_pull") for r in res):
            assert sum(_vectors(r[n], "herald_pull") for r in res) >= c.miss_pull + c.update_pull


# ------------------------------------------------------------------------------------------ driver

SMALL = ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "data.num_train_batches=12", "data.num_eval_batches=2",
         "batch_size=64", "log_every=4", "data.scale=0.001"]


def _driver(rank: int, world: int, overrides: List[str], run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    metrics = run_training(compose_config(SMALL + overrides), Path(run_dir), show_progress=False)
    bad = error_of(lambda: run_training(compose_config(SMALL + ["pipeline.staleness=-1"]),
                                        Path(run_dir) / "bad", show_progress=False))
    return {"metrics": metrics, "bad": bad, "bad_trained": (Path(run_dir) / "bad").exists()}


def test_driver_records_the_exact_reference(tmp_path: Path) -> None:
    res = run_multiprocess(_driver, 2, ["pipeline.staleness=1"], str(tmp_path), timeout_s=300)
    m = res[0]["metrics"]
    a = m["approximate"]
    assert a["staleness"] == 1 and a["skip"] is None
    ref_auc = a["reference"]["eval"]["auc"]
    assert isinstance(ref_auc, float) and 0.0 < ref_auc < 1.0
    assert math.isfinite(a["auc_delta"]) and math.isfinite(a["logloss_delta"])
    assert a["auc_delta"] == pytest.approx(m["eval"]["auc"] - ref_auc)
    assert 0 < a["max_staleness"] <= 1 and 0 < a["stale_read_share"] < 1
    assert a["skipped_update_share"] == 0 and a["skip_thresholds"] == []
    assert m["herald_pipeline"]["max_staleness"] == a["max_staleness"]
    ref = json.loads((tmp_path / "exact_reference" / "metrics.json").read_text())
    assert ref["approximate"] == {} and ref["config"]["pipeline"]["staleness"] is None
    assert ref["eval"]["auc"] == ref_auc and ref["steps"] == m["steps"] == 12
    assert json.loads((tmp_path / "metrics.json").read_text())["approximate"]["max_staleness"] == a["max_staleness"]
    assert res[1]["metrics"]["approximate"]["reference"]["eval"] == a["reference"]["eval"]
    for r in res:  # a bad value fails before the reference is trained
        assert r["bad"].startswith("ValueError: ") and "pipeline.staleness must be null (exact) or an integer >= 0, " \
            "got -1" in r["bad"], r["bad"]
        assert not r["bad_trained"]


@pytest.mark.parametrize("world,s,seed", [(3, 1, 21), (4, 2, 22)])
def test_local_on_counts_cached_copies_at_most_s_behind_and_scores_sum_it(world: int, s: int, seed: int) -> None:
    """What the allocator counts as local under bounded staleness, checked against the reference's state:
    a hot row, a row of the rank's own block, or a cached copy at most ``s`` home versions behind; and
    the per-sample scores built sparsely equal the sums over that matrix."""
    loc = _locality(world)
    vec, ref = StalenessPlanner(loc, s, 0.1), RefStaleness(loc, s, 0.1)
    for reads in _trace(loc, 25, seed):
        vec.plan_step([reads])
        ref.plan_step([r.tolist() for r in reads])
    n = loc.layout.num_rows
    got = vec.local_on(torch.arange(n))
    lagging = 0
    for x in range(n):
        for r in range(world):
            cached = x in ref.cache[r]
            fresh = cached and ref.hv[x] - ref.base[r, x] <= s
            lagging += cached and not fresh
            assert bool(got[r, x]) == (x in ref.hot or ref.home[x] == r or fresh), (x, r)
    assert lagging > 0  # the trace leaves copies more than s behind, which do not count
    keys = torch.randint(0, n, (400,), generator=torch.Generator().manual_seed(seed))
    sample = torch.randint(0, 30, (400,), generator=torch.Generator().manual_seed(seed + 1))
    dense = torch.zeros(world, 30, dtype=torch.int64).index_add_(1, sample, got[:, keys].to(torch.int64)).T
    assert torch.equal(vec.local_scores(keys, sample, 30).to(torch.int64), dense)



def _random_pushes(g: torch.Generator, n: int, keys: int, world: int) -> torch.Tensor:
    """``n`` (key, src, dst) transfers with distinct (key, src) pairs."""
    pairs = torch.randperm(keys * world, generator=g)[:n]
    return torch.stack([pairs // world, pairs % world, torch.randint(0, world, (n,), generator=g)], 1)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_push_and_pull_merge_gives_the_torch_ops_transfers(seed: int) -> None:
    """The compiled merge of a bounded-staleness plan's three phases of pushes with the next plan's pulls
    (``additive_merge``) gives the torch ops' transfers, add flags and phases: rerouted pulls behind a
    replacing push, copies of each added update for the puller, None where a rank pushes one row twice."""
    from torchrec_herald import native
    from torchrec_herald.sharding.plan_exec import merge_additive_pushes

    g, W, keys = torch.Generator().manual_seed(seed), 3, 40
    mod = native.load()
    for trial in range(20):
        sizes = torch.randint(0, 12, (3,), generator=g).tolist()
        both = _random_pushes(g, sum(sizes), keys, W)
        if trial % 4 == 3 and both.numel():  # one rank pushes a row twice: in two phases
            both[-1, :2] = both[0, :2]
        phases = list(both.split(sizes))
        flags = [None if trial % 5 == 0 else torch.rand(len(t), generator=g) < 0.6 for t in phases]
        pulls = torch.stack([torch.randint(0, keys, (9,), generator=g), torch.randint(0, W, (9,), generator=g),
                             torch.randint(0, W, (9,), generator=g)], 1)[: trial % 10]
        want = merge_additive_pushes(phases, flags, pulls, W)
        got = merge_additive_pushes(phases, flags, pulls, W, mod)
        assert (want is None) == (got is None), (trial, sizes)
        if want is not None:
            assert all(torch.equal(a, b) for a, b in zip(want, got)), trial
            assert got[1].dtype == torch.bool and got[2].dtype == torch.int64
