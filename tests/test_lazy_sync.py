"""The vectorised lazy planner (torchrec_herald/pipeline/lazy_sync.py) against the readable reference.

:class:`TensorLazySyncPlanner` is pinned to ``LazySyncPlanner(route="owner", policy="lru")`` of
``sync_plan.py`` on random skewed traces (several world sizes and windows, tables with hot rows, tiny
tables with fewer rows than ranks, ranks that read nothing in a step): every transfer kind row for row,
the per-rank evictions and the step counters. Its plans pass :func:`check_exact` with the per-table cache
capacity, and broken copies of them do not. :meth:`TensorLazySyncPlanner.flush` sends exactly the dirty
rows home and refreshes exactly the outdated hot replicas, and leaves a fresh planner's state.
:meth:`~TensorLazySyncPlanner.local_on` (what the input allocator scores as local) matches the reference
state. Bad arguments are ValueErrors. Pure and fast: no process group.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.plans import ExecPlan
from torchrec_herald.testing.reference_plans import (
    ExactnessError,
    LazySyncPlanner,
    StepPlan,
    check_exact,
    to_step_plan,
)

STEPS = 40
TRANSFERS = ("push_before_read", "miss_pull", "update_pull", "reduce", "update_push", "miss_push")

#: rows per table: a mid table, a larger one, a tiny one (W=4: blocks of 2 rows), one with fewer rows
#: than ranks (some ranks own nothing), and a one-row table
NUM_ROWS = {"a": 50, "b": 200, "c": 7, "d": 3, "e": 1}
HOT = {"a": [1, 3], "b": [0, 5, 9, 150], "d": [0]}


def _locality(world: int) -> Locality:
    return Locality(world_size=world, num_embeddings=dict(NUM_ROWS),
                    hot_ids={t: torch.tensor(ids) for t, ids in HOT.items()})


def _trace(world: int, steps: int, seed: int) -> List[Dict[str, List[torch.Tensor]]]:
    """table -> per rank sorted unique rows; skewed (row ~ n·u³: low rows hot), 0 to 12 draws per rank
    and table, so a rank sometimes reads nothing of a table."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = {}
        for name, n in NUM_ROWS.items():
            step[name] = [torch.unique((torch.rand(int(torch.randint(0, 13, (1,), generator=g)), generator=g) ** 3
                                        * n).long()) for _ in range(world)]
        out.append(step)
    return out


def _keys(loc: Locality, step: Dict[str, List[torch.Tensor]]) -> List[torch.Tensor]:
    """Per rank: the sorted global keys (table offset + row) of a trace step."""
    off = loc.layout.table_offsets
    return [torch.cat([off[i] + step[t][r] for i, t in enumerate(loc.tables)]).sort().values
            for r in range(loc.world_size)]


def _sorted_rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, 3)
    if not t.numel():
        return t
    return t[torch.argsort((t[:, 0] * 1000 + t[:, 1]) * 1000 + t[:, 2])]


def _run(world: int, window: int, seed: int, fraction: float, steps: int = STEPS
         ) -> Tuple[Locality, list, List[StepPlan], List[StepPlan], TensorLazySyncPlanner, LazySyncPlanner]:
    """Both planners over one trace: (locality, trace, reference plans, tensor plans as StepPlans, both planners)."""
    loc = _locality(world)
    trace = _trace(world, steps, seed)
    ref = LazySyncPlanner(loc, capacity_fraction=fraction, policy="lru", window=window, route="owner")
    vec = TensorLazySyncPlanner(loc, capacity_fraction=fraction, window=window)
    ref_plans, vec_plans = [], []
    for t in range(steps):
        win = trace[t: t + window]
        ref_plans.append(ref.plan_step(win))
        vec_plans.append(to_step_plan(vec.plan_step([_keys(loc, s) for s in win]), loc))
    return loc, trace, ref_plans, vec_plans, vec, ref


CASES = [  # (W, K, seed, capacity fraction)
    (2, 1, 0, 0.1),
    (2, 5, 1, 0.1),
    (3, 1, 2, 0.05),
    (3, 2, 3, 0.2),
    (4, 2, 4, 0.1),
    (4, 5, 5, 0.05),
    (4, 5, 6, 1.0),  # caches as large as the tables: no evictions
]


@pytest.mark.parametrize("world,window,seed,fraction", CASES)
def test_tensor_planner_matches_reference_owner_lru(world: int, window: int, seed: int, fraction: float) -> None:
    loc, _, ref_plans, vec_plans, _, _ = _run(world, window, seed, fraction)
    seen = dict.fromkeys(TRANSFERS, 0)
    evicted = 0
    for t, (a_plan, b_plan) in enumerate(zip(ref_plans, vec_plans)):
        assert b_plan.step == t
        for name in loc.tables:
            a, b = a_plan.tables[name], b_plan.tables[name]
            for f in TRANSFERS:
                x, y = _sorted_rows(getattr(a, f)), getattr(b, f).reshape(-1, 3)
                assert torch.equal(x, y), (t, name, f, x.tolist(), y.tolist())
                seen[f] += len(x)
            assert len(b.evictions) == world
            for r in range(world):
                assert torch.equal(torch.sort(a.evictions[r]).values, b.evictions[r]), (t, name, r)
                evicted += len(b.evictions[r])
        assert a_plan.counters == b_plan.counters, (t, a_plan.counters, b_plan.counters)
    # the traces exercise the transfers they are meant to (push_before_read only exists without look-ahead)
    for f in ("miss_pull", "update_pull", "reduce"):
        assert seen[f] > 0, f
    assert (seen["push_before_read"] > 0) == (window == 1), seen
    assert (seen["update_push"] > 0) == (window > 1), seen
    if fraction < 1.0:
        assert evicted > 0 and seen["miss_push"] > 0, (evicted, seen)
    else:
        assert evicted == 0 and seen["miss_push"] == 0


def _capacity(vec: TensorLazySyncPlanner) -> Dict[str, int]:
    return {t: int(c) for t, c in zip(vec.layout.tables, vec.capacity)}


@pytest.mark.parametrize("world,window,seed,fraction", [CASES[1], CASES[2], CASES[5]])
def test_tensor_plans_pass_check_exact_with_capacity(world: int, window: int, seed: int, fraction: float) -> None:
    loc, trace, _, vec_plans, vec, _ = _run(world, window, seed, fraction)
    caps = _capacity(vec)
    assert caps == {t: max(1, math.ceil(fraction * n)) for t, n in NUM_ROWS.items()}
    check_exact(loc, trace, vec_plans, capacity=caps)
    # one row less of capacity is caught: the caches are really full at times
    tight = {t: c - 1 for t, c in caps.items()}
    with pytest.raises(ExactnessError, match="capacity"):
        check_exact(loc, trace, vec_plans, capacity=tight)


def _drop_first(plans: List[StepPlan], kind: str) -> List[StepPlan]:
    """A deep copy of ``plans`` with the first row of transfer ``kind`` (any table) removed."""
    plans = copy.deepcopy(plans)
    for p in plans:
        for name, tp in p.tables.items():
            rows = getattr(tp, kind)
            if len(rows):
                p.tables[name] = dataclasses.replace(tp, **{kind: rows[1:]})
                return plans
    raise AssertionError(f"no {kind} row to drop")


@pytest.mark.parametrize("kind,window", [("miss_pull", 5), ("update_pull", 5), ("reduce", 5), ("update_push", 5),
                                         ("miss_push", 5), ("push_before_read", 1)])
def test_broken_tensor_plan_raises_exactness_error(kind: str, window: int) -> None:
    loc, trace, _, vec_plans, vec, _ = _run(3, window, 7, 0.05)
    check_exact(loc, trace, vec_plans, capacity=_capacity(vec))
    with pytest.raises(ExactnessError):
        check_exact(loc, trace, _drop_first(vec_plans, kind), capacity=_capacity(vec))


def test_broken_eviction_raises_exactness_error() -> None:
    """Forgetting an eviction leaves a cache over capacity; evicting a row twice evicts one not held."""
    loc, trace, _, vec_plans, vec, _ = _run(2, 2, 8, 0.05)
    step = next(i for i, p in enumerate(vec_plans) if any(len(e) for tp in p.tables.values() for e in tp.evictions))
    name, r = next((n, r) for n, tp in vec_plans[step].tables.items() for r, e in enumerate(tp.evictions) if len(e))
    kept = copy.deepcopy(vec_plans)
    ev = kept[step].tables[name].evictions
    ev[r] = ev[r][1:]
    with pytest.raises(ExactnessError, match="capacity"):
        check_exact(loc, trace, kept, capacity=_capacity(vec))
    twice = copy.deepcopy(vec_plans)
    ev = twice[step].tables[name].evictions
    ev[r] = torch.cat([ev[r], ev[r][:1]])
    with pytest.raises(ExactnessError, match="does not hold"):
        check_exact(loc, trace, twice, capacity=_capacity(vec))


def test_exec_plan_is_sorted_and_consistent() -> None:
    """ExecPlan invariants the executor relies on: transfers sorted by (key, src, dst), one reducer per
    read row (a reader when only one rank reads it, else its home), ``update_keys`` = union of reads."""
    loc = _locality(3)
    trace = _trace(3, 20, 9)
    vec = TensorLazySyncPlanner(loc, 0.05, window=2)
    for t in range(len(trace)):
        p: ExecPlan = vec.plan_step([_keys(loc, s) for s in trace[t: t + 2]])
        for f in ("push_before_read", "pull", "reduce", "update_push", "miss_push"):
            rows = getattr(p, f)
            assert torch.equal(rows, _sorted_rows(rows)), (t, f)
            assert bool((rows[:, 1] != rows[:, 2]).all()), (t, f)  # nothing is sent to itself
        assert p.pull_miss.shape == (len(p.pull),)
        union = torch.unique(torch.cat(p.reads))
        assert torch.equal(p.update_keys, union)
        readers = torch.stack([torch.isin(union, k) for k in p.reads])  # [W, n]
        single = readers.sum(0) == 1
        assert torch.equal(p.reducer[single], readers[:, single].int().argmax(0))
        assert torch.equal(p.reducer[~single], vec.layout.home_of(union[~single]))


def test_local_on_counts_hot_replicas_own_blocks_and_valid_cache_entries() -> None:
    """What the input allocator scores as local, checked against the reference planner's state: a hot
    row and a row of the rank's own block (whatever their version), a cached remote row only while the
    cached copy is the latest version."""
    loc, _, _, _, vec, ref = _run(3, 2, 13, 0.1, steps=12)
    keys = torch.arange(vec.num_rows)
    got = vec.local_on(keys)
    assert got.shape == (3, vec.num_rows) and got.dtype == torch.bool
    off = loc.layout.table_offsets
    stale_cached = 0
    for i, name in enumerate(loc.tables):
        tab = ref._tables[name]
        for x in range(tab.n):
            for r in range(3):
                cached = x in tab.cache[r]
                valid_cache = cached and tab.copies[r][x] == tab.latest(x)
                stale_cached += cached and not valid_cache
                expected = x in tab.hot or tab.home(x) == r or valid_cache
                assert bool(got[r, int(off[i]) + x]) == expected, (name, x, r)
    assert stale_cached > 0  # the trace leaves outdated cache entries, which do not count
    sub = keys[torch.randperm(vec.num_rows, generator=torch.Generator().manual_seed(0))[:40]]
    assert torch.equal(vec.local_on(sub), got[:, sub])  # any key order, duplicates allowed
    assert torch.equal(vec.local_on(torch.cat([sub, sub])), got[:, torch.cat([sub, sub])])
    # the allocator's per-sample scores, built sparsely, equal the sums over this matrix
    many = torch.cat([sub, sub, keys])
    sample = torch.randint(0, 50, (many.numel(),), generator=torch.Generator().manual_seed(1))
    dense = torch.zeros(3, 50, dtype=torch.int64).index_add_(1, sample, got[:, many].to(torch.int64)).T
    got = vec.local_scores(many, sample, 50)
    assert got.dtype == torch.int32 and torch.equal(got.to(torch.int64), dense)
    import torchrec_herald.pipeline.lazy_sync as lazy_sync

    chunk = lazy_sync._PAIRS_PER_CHUNK
    try:  # the same when the (lookup, cache entry) pairs are expanded a few at a time
        lazy_sync._PAIRS_PER_CHUNK = 3
        assert torch.equal(vec.local_scores(many, sample, 50).to(torch.int64), dense)
    finally:
        lazy_sync._PAIRS_PER_CHUNK = chunk


# ------------------------------------------------------------------------------------------ flush


@pytest.mark.parametrize("world,window,seed", [(2, 5, 10), (3, 1, 11), (4, 2, 12)])
def test_flush_sends_dirty_rows_home_and_refreshes_outdated_hot_replicas(world: int, window: int, seed: int
                                                                        ) -> None:
    loc, trace, _, _, vec, ref = _run(world, window, seed, 0.1, steps=15)
    # expected, from the reference planner's state (independent of the tensor planner's internals)
    off = loc.layout.table_offsets
    dirty, outdated = [], []
    for i, name in enumerate(loc.tables):
        tab = ref._tables[name]
        for x, m in tab.master.items():
            if m != tab.home(x):
                dirty.append([int(off[i]) + x, m, tab.home(x)])
        for x in sorted(tab.hot):
            for r in range(world):
                if r != tab.home(x) and tab.held(r, x) != tab.latest(x):
                    outdated.append([int(off[i]) + x, tab.home(x), r])
    assert dirty and outdated, "the trace leaves dirty rows and outdated replicas to flush"
    cached = vec.cached_rows()
    assert any(len(c) for c in cached)
    fp = vec.flush()
    assert fp.push.tolist() == sorted(dirty)
    assert fp.pull.tolist() == sorted(outdated)
    assert all(torch.equal(a, b) for a, b in zip(fp.dropped, cached))
    # the state is a fresh planner's
    fresh = TensorLazySyncPlanner(loc, 0.1, window=window)
    assert len(vec.dirty) == 0 and len(vec.entries) == 0 and vec.state_bytes() == fresh.state_bytes()
    for attr in ("hot_valid", "cache_count"):
        assert torch.equal(getattr(vec, attr), getattr(fresh, attr)), attr
    assert vec.step == 0
    # a second flush moves nothing
    again = vec.flush()
    assert again.push.numel() == 0 and again.pull.numel() == 0 and all(d.numel() == 0 for d in again.dropped)
    # and planning goes on exactly as a fresh planner would
    for t in range(5):
        win = [_keys(loc, s) for s in trace[t: t + window]]
        a, b = vec.plan_step(win), fresh.plan_step(win)
        for f in ("push_before_read", "pull", "reduce", "update_push", "miss_push", "reducer"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (t, f)
        assert a.counters == b.counters


def test_flush_of_a_fresh_planner_is_empty() -> None:
    fp = TensorLazySyncPlanner(_locality(2), 0.1).flush()
    assert fp.push.shape == (0, 3) and fp.pull.shape == (0, 3) and all(d.numel() == 0 for d in fp.dropped)


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("window", [0, -1])
def test_window_below_one_is_rejected(window: int) -> None:
    with pytest.raises(ValueError, match="window must be >= 1"):
        TensorLazySyncPlanner(_locality(2), 0.1, window=window)


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_capacity_fraction_outside_zero_one_is_rejected(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"capacity_fraction must be in \(0, 1\]"):
        TensorLazySyncPlanner(_locality(2), fraction)


def test_capacity_rows_outside_table_is_rejected() -> None:
    with pytest.raises(ValueError, match="cache capacity must be in"):
        TensorLazySyncPlanner(_locality(2), 0.1, capacity_rows={"c": 8})
    with pytest.raises(ValueError, match="unknown table"):
        TensorLazySyncPlanner(_locality(2), 0.1, capacity_rows={"zz": 1})


def _reads(world: int, *keys: Sequence[int]) -> List[torch.Tensor]:
    out = [torch.tensor(k, dtype=torch.int64) for k in keys]
    return out + [torch.empty(0, dtype=torch.int64)] * (world - len(out))


@pytest.mark.parametrize("bad", [-1, sum(NUM_ROWS.values())])
def test_keys_out_of_range_are_rejected(bad: int) -> None:
    vec = TensorLazySyncPlanner(_locality(2), 0.1, window=2)
    with pytest.raises(ValueError, match=r"read keys outside \[0, 261\)"):
        vec.plan_step([_reads(2, [0, 1], [bad])])
    # also in the look-ahead step
    vec = TensorLazySyncPlanner(_locality(2), 0.1, window=2)
    with pytest.raises(ValueError, match=r"read keys outside"):
        vec.plan_step([_reads(2, [0, 1]), _reads(2, [bad])])


@pytest.mark.parametrize("ranks", [1, 3])
def test_wrong_number_of_ranks_is_rejected(ranks: int) -> None:
    vec = TensorLazySyncPlanner(_locality(2), 0.1, window=2)
    with pytest.raises(ValueError, match=rf"one key set per rank \(2\), got {ranks}"):
        vec.plan_step([_reads(ranks, [0])[:ranks]])
    with pytest.raises(ValueError, match=rf"one key set per rank \(2\), got {ranks}"):
        vec.plan_step([_reads(2, [0]), _reads(ranks, [1])[:ranks]])


def test_empty_window_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least the current step"):
        TensorLazySyncPlanner(_locality(2), 0.1).plan_step([])


def test_a_cache_bytes_budget_shares_rows_in_proportion_to_the_tables() -> None:
    from torchrec_herald.layout import RowLayout, cache_rows_for_budget
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    lay = RowLayout.build(2, {"a": 1000, "b": 3000, "c": 10})
    # 400 rows of 68 bytes over 4010 rows: 99 + 299 + (0 -> at least 1)
    assert cache_rows_for_budget(lay, 400 * 68, 68) == {"a": 99, "b": 299, "c": 1}
    assert cache_rows_for_budget(lay, 10 ** 9, 68) == {"a": 1000, "b": 3000, "c": 10}  # at most the table
    with pytest.raises(ValueError, match=r"pipeline.cache_bytes=100 holds 1 rows of 68 bytes; the 3 tables "
                                         r"need at least one cache row each \(204 bytes\)"):
        cache_rows_for_budget(lay, 100, 68)
    with pytest.raises(ValueError, match=r"pipeline.cache_bytes must be null or a positive number of bytes, got 0"):
        HeraldPipelineConfig(cache_bytes=0)
    # the planner holds exactly those capacities
    p = TensorLazySyncPlanner(lay, 0.5, capacity_rows=cache_rows_for_budget(lay, 400 * 68, 68))
    assert p.capacity.tolist() == [99, 299, 1]
