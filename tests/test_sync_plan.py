"""Herald's communication plan (torchrec_herald/pipeline/sync_plan.py): hand-built traces with known exact
plans, LRU vs Belady, dirty evictions, argument errors, and the exactness checker (passes on lazy/eager
plans of random traces, fails on deliberately broken planners)."""

from __future__ import annotations

import random
from typing import Dict, List, Sequence

import pytest
import torch

from torchrec_herald.pipeline.input_allocator import Locality
from torchrec_herald.testing.reference_plans import (
    EagerSyncPlanner,
    ExactnessError,
    LazySyncPlanner,
    StepPlan,
    StepReads,
    SyncCounters,
    check_exact,
    simulate,
)

T = "t"


def _loc(world_size: int, n: int, hot: Sequence[int] = ()) -> Locality:
    return Locality(world_size=world_size, num_embeddings={T: n}, hot_ids={T: torch.tensor(list(hot))})


def _trace(world_size: int, steps: Sequence[Dict[int, Sequence[int]]]) -> List[StepReads]:
    """steps[t] = {rank: rows read}; ranks left out read nothing."""
    return [{T: [list(s.get(r, [])) for r in range(world_size)]} for s in steps]


def _rows(t: torch.Tensor) -> List[List[int]]:
    return t.tolist()


# ------------------------------------------------------------------------------------ hand traces


@pytest.mark.parametrize("route", ["owner", "direct"])
def test_hot_row_read_by_both_ranks_every_step(route: str) -> None:
    loc = _loc(2, 4, hot=[1])  # row 1: hot, home rank 0 (block 2)
    trace = _trace(2, [{0: [1], 1: [1]}] * 4)
    lazy = simulate(trace, LazySyncPlanner(loc, 0.5, window=3, route=route), keep_plans=True, check=True)
    # step 0: both copies fresh, rank 1's gradient goes to rank 0; later steps: + rank 1 pulls the update
    assert [c.reduce for c in lazy.per_step] == [1, 1, 1, 1]
    assert [c.update_pull for c in lazy.per_step] == [0, 1, 1, 1]
    assert [c.vectors for c in lazy.per_step] == [1, 2, 2, 2]  # 2(|S|-1) once running
    assert _rows(lazy.plans[1].tables[T].update_pull) == [[1, 0, 1]]
    assert _rows(lazy.plans[1].tables[T].reduce) == [[1, 1, 0]]
    eager = simulate(trace, EagerSyncPlanner(loc), keep_plans=True, check=True)
    assert [c.vectors for c in eager.per_step] == [2, 2, 2, 2]  # reduce + deliver, every step
    assert eager.total.hit_rate == 1.0 and eager.total.deliver == 4


def test_three_ranks_hot_row_owner_vs_direct_vs_eager() -> None:
    loc = _loc(3, 6, hot=[0])  # row 0: hot, home rank 0, read by ranks 1 and 2 every step
    trace = _trace(3, [{1: [0], 2: [0]}] * 3)
    owner = simulate(trace, LazySyncPlanner(loc, 0.5, route="owner"), check=True)
    assert [c.vectors for c in owner.per_step] == [2, 4, 4]  # 2 gradients home (+ 2 pulls from home)
    direct = simulate(trace, LazySyncPlanner(loc, 0.5, route="direct"), keep_plans=True, check=True)
    assert [c.vectors for c in direct.per_step] == [1, 2, 2]  # 2(|S|-1): reducer is rank 1
    assert _rows(direct.plans[0].tables[T].reduce) == [[0, 2, 1]]
    assert _rows(direct.plans[1].tables[T].update_pull) == [[0, 1, 2]]
    eager = simulate(trace, EagerSyncPlanner(loc), check=True)
    assert [c.vectors for c in eager.per_step] == [4, 4, 4]  # 2 gradients home + deliver to 2 replicas


def test_hot_row_one_merged_delivery_not_three() -> None:
    loc = _loc(2, 4, hot=[1])  # home rank 0
    trace = _trace(2, [{0: [1]}, {0: [1]}, {0: [1]}, {1: [1]}])
    lazy = simulate(trace, LazySyncPlanner(loc, 0.5, window=2), keep_plans=True, check=True)
    assert [c.vectors for c in lazy.per_step] == [0, 0, 0, 1]
    step3 = lazy.plans[3].tables[T]
    assert _rows(step3.pulls(1)) == [[1, 0]] and lazy.total.update_pull == 1
    assert lazy.per_step[3].hits == 0 and lazy.per_step[3].reads == 1
    eager = simulate(trace, EagerSyncPlanner(loc), check=True)
    assert eager.total.deliver == 4 and eager.total.vectors == 5  # 3 deliveries + (gradient home + delivery)


@pytest.mark.parametrize("window", [1, 2])
def test_cold_row_updated_by_rank0_then_read_by_rank1(window: int) -> None:
    loc = _loc(3, 9)  # blocks of 3: row 7 owned by rank 2
    trace = _trace(3, [{0: [7]}, {0: [7]}, {0: [7]}, {1: [7]}])
    lazy = simulate(trace, LazySyncPlanner(loc, 0.5, window=window), keep_plans=True, check=True)
    c = lazy.total
    assert (c.miss_pull, c.update_pull, c.update_push, c.miss_push, c.reduce) == (2, 0, 1, 0, 0)
    assert lazy.per_step[0].miss_pull == 1 and lazy.per_step[0].cache_reads == 1
    assert [s.cache_hits for s in lazy.per_step] == [0, 1, 1, 0]
    if window == 2:  # look-ahead: the push of 3 merged updates is planned after step 2
        assert _rows(lazy.plans[2].tables[T].pushes(0)) == [[7, 2]]
        assert _rows(lazy.plans[2].tables[T].update_push) == [[7, 0, 2]]
    else:  # no look-ahead: the same push is placed before step 3's reads
        assert _rows(lazy.plans[3].tables[T].push_before_read) == [[7, 0, 2]]
    assert _rows(lazy.plans[3].tables[T].pulls(1)) == [[7, 2]]
    direct = simulate(trace, LazySyncPlanner(loc, 0.5, window=window, route="direct"), keep_plans=True, check=True)
    assert direct.total.vectors == 2 and _rows(direct.plans[3].tables[T].miss_pull) == [[7, 0, 1]]
    eager = simulate(trace, EagerSyncPlanner(loc), check=True)
    assert eager.total.vectors == 8  # pull + gradient back, every step


@pytest.mark.parametrize("policy, misses, evicted, pushes", [
    ("lru", 5, [[], [], [4], [5], [6]], 3),
    ("belady", 3, [[], [], [6], [], []], 1),
])
def test_lru_vs_belady_and_dirty_eviction_pushes(policy: str, misses: int, evicted: List[List[int]],
                                                  pushes: int) -> None:
    loc = _loc(2, 8)  # rows 4..7 owned by rank 1; rank 0 caches 2 of them
    trace = _trace(2, [{0: [4]}, {0: [5]}, {0: [6]}, {0: [4]}, {0: [5]}])
    res = simulate(trace, LazySyncPlanner(loc, capacity_rows={T: 2}, policy=policy, window=5), keep_plans=True,
                   check=True)
    assert res.total.miss_pull == misses and res.total.cache_hits == 5 - misses
    assert [p.tables[T].evictions[0].tolist() for p in res.plans] == evicted
    assert all(p.tables[T].evictions[1].numel() == 0 for p in res.plans)
    # rank 0 was the only reader of each evicted row: its updates go home on eviction
    assert res.total.miss_push == pushes and res.total.update_push == 0
    assert _rows(res.plans[2].tables[T].miss_push) == [[evicted[2][0], 0, 1]]
    assert res.total.vectors == misses + pushes


def test_clean_eviction_pushes_nothing() -> None:
    loc = _loc(2, 8)
    # row 5 read by both ranks at step 0: rank 0's gradient is reduced at the owner, its copy stays clean
    trace = _trace(2, [{0: [5], 1: [5]}, {0: [6]}])
    res = simulate(trace, LazySyncPlanner(loc, capacity_rows={T: 1}), keep_plans=True, check=True)
    assert res.plans[1].tables[T].evictions[0].tolist() == [5]
    assert res.total.miss_push == 0 and res.total.reduce == 1 and res.total.miss_pull == 2


# ------------------------------------------------------------------------------------ errors and API


def test_argument_errors() -> None:
    loc = _loc(2, 8)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="capacity_fraction"):
            LazySyncPlanner(loc, bad)
    for rows in (0, 9):
        with pytest.raises(ValueError, match="capacity"):
            LazySyncPlanner(loc, capacity_rows={T: rows})
    with pytest.raises(ValueError, match="window"):
        LazySyncPlanner(loc, 0.5, window=0)
    with pytest.raises(ValueError, match="window"):
        EagerSyncPlanner(loc, window=0)
    with pytest.raises(ValueError, match="policy"):
        LazySyncPlanner(loc, 0.5, policy="fifo")
    with pytest.raises(ValueError, match="route"):
        LazySyncPlanner(loc, 0.5, route="ring")
    p = LazySyncPlanner(loc, 0.5)
    with pytest.raises(ValueError, match="window"):
        p.plan_step([])
    with pytest.raises(ValueError, match="one row set per rank"):
        p.plan_step([{T: [[1]]}])
    with pytest.raises(ValueError, match="outside"):
        p.plan_step([{T: [[8], []]}])
    with pytest.raises(ValueError, match="unknown tables"):
        p.plan_step([{"u": [[1], []]}])


def test_counters_and_plan_api() -> None:
    c = SyncCounters(miss_pull=1, update_pull=2, update_push=3, miss_push=4, reduce=5, deliver=6, hits=3, reads=4)
    assert c.vectors == 21 and c.hit_rate == 0.75 and c.bytes(16) == 21 * 68
    assert (c + c).vectors == 42 and SyncCounters().hit_rate == 1.0
    loc = Locality(world_size=2, num_embeddings={"a": 8, "b": 4}, hot_ids={"b": torch.tensor([0])})
    plan = LazySyncPlanner(loc, 0.5).plan_step([{"a": [torch.tensor([6, 6, 1]), [1]]}, {"b": [[0], [0]]}])
    assert isinstance(plan, StepPlan) and list(plan.tables) == ["a", "b"] and plan.step == 0
    a = plan.tables["a"]
    assert _rows(a.pulls(0)) == [[6, 1]] and _rows(a.pulls(1)) == [[1, 0]] and a.pushes(0).shape == (0, 2)
    assert _rows(a.reduce) == [[1, 1, 0]] and plan.counters.reads == 3
    assert plan.tables["b"].counters.reads == 0  # a table left out of a step is not read


def _random_trace(rng: random.Random, world_size: int, sizes: Dict[str, int], steps: int) -> List[StepReads]:
    def rows(n: int) -> List[int]:  # skewed: low ids are hot
        return [min(int(rng.paretovariate(1.0)) - 1, n - 1) for _ in range(rng.randint(0, 4))]
    return [{t: [rows(n) for _ in range(world_size)] for t, n in sizes.items()} for _ in range(steps)]


def test_plans_are_deterministic() -> None:
    loc = Locality(world_size=3, num_embeddings={"a": 20}, hot_ids={"a": torch.tensor([0, 1])})
    trace = _random_trace(random.Random(3), 3, {"a": 20}, 15)
    runs = [simulate(trace, LazySyncPlanner(loc, 0.2, "belady", 3, "direct"), keep_plans=True) for _ in range(2)]
    for p, q in zip(*(r.plans for r in runs), strict=True):
        for name in ("miss_pull", "update_pull", "reduce", "update_push", "miss_push"):
            assert torch.equal(getattr(p.tables["a"], name), getattr(q.tables["a"], name))


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("seed", range(6))
def test_exact_on_random_traces_and_lazy_never_moves_more(seed: int) -> None:
    rng = random.Random(seed)
    W = 2 + seed % 3
    sizes = {"a": 10 + seed, "b": 7, "c": 3}
    loc = Locality(world_size=W, num_embeddings=sizes,
                   hot_ids={"a": torch.tensor([0, 2, 5]), "c": torch.arange(3)})
    trace = _random_trace(rng, W, sizes, 40)
    for frac in (0.1, 0.3, 1.0):
        for policy in ("lru", "belady"):
            for k in (1, 4):
                eager = simulate(trace, EagerSyncPlanner(loc, frac, policy, k), check=True)
                for route in ("owner", "direct"):
                    lazy = simulate(trace, LazySyncPlanner(loc, frac, policy, k, route), check=True)
                    assert lazy.total.reads == eager.total.reads
                    if route == "owner":  # same caches: lazy never moves more than eager
                        assert lazy.vectors <= eager.vectors, (frac, policy, k)
                        assert lazy.total.miss_pull == eager.total.miss_pull
    no_cache = simulate(trace, EagerSyncPlanner(loc), check=True)
    lazy = simulate(trace, LazySyncPlanner(loc, 0.1), check=True)
    assert lazy.vectors <= no_cache.vectors


class _SkipsADelivery(LazySyncPlanner):
    """Broken: forgets the first update_pull of each plan (the copy stays outdated)."""

    def plan_step(self, window: Sequence[StepReads]) -> StepPlan:
        plan = super().plan_step(window)
        for tp in plan.tables.values():
            tp.update_pull = tp.update_pull[1:]
        return plan


class _DropsDirtyEvictions(LazySyncPlanner):
    """Broken: evicts dirty rows without pushing their updates home."""

    def plan_step(self, window: Sequence[StepReads]) -> StepPlan:
        plan = super().plan_step(window)
        for tp in plan.tables.values():
            tp.miss_push = tp.miss_push[:0]
        return plan


class _NoReduce(EagerSyncPlanner):
    """Broken: readers' gradients are never summed."""

    def plan_step(self, window: Sequence[StepReads]) -> StepPlan:
        plan = super().plan_step(window)
        for tp in plan.tables.values():
            tp.reduce = tp.reduce[:0]
        return plan


def test_checker_fails_on_broken_planners() -> None:
    loc = _loc(2, 4, hot=[1])
    merged = _trace(2, [{0: [1]}, {0: [1]}, {0: [1]}, {1: [1]}])
    with pytest.raises(ExactnessError, match="misses an earlier update"):
        simulate(merged, _SkipsADelivery(loc, 0.5), check=True)
    lru = _trace(2, [{0: [4]}, {0: [5]}, {0: [6]}, {0: [4]}, {0: [5]}])
    with pytest.raises(ExactnessError, match="update is lost"):
        simulate(lru, _DropsDirtyEvictions(_loc(2, 8), capacity_rows={T: 2}), check=True)
    with pytest.raises(ExactnessError, match="not summed"):
        simulate(_trace(2, [{0: [1], 1: [1]}]), _NoReduce(loc), check=True)
    # and on random traces the skipped delivery is caught too
    rng = random.Random(11)
    sizes = {"a": 12}
    rloc = Locality(world_size=3, num_embeddings=sizes, hot_ids={"a": torch.tensor([0, 1])})
    with pytest.raises(ExactnessError):
        simulate(_random_trace(rng, 3, sizes, 30), _SkipsADelivery(rloc, 0.3), check=True)


def test_checker_catches_capacity_and_wrong_push_target() -> None:
    loc = _loc(2, 8)
    trace = _trace(2, [{0: [4, 5, 6]}])
    plan = LazySyncPlanner(loc, capacity_rows={T: 3}).plan_step(trace)
    check_exact(loc, trace, [plan], capacity={T: 3})
    with pytest.raises(ExactnessError, match="capacity"):
        check_exact(loc, trace, [plan], capacity={T: 2})
    trace2 = _trace(2, [{0: [4]}, {0: [5]}])
    plans = simulate(trace2, LazySyncPlanner(loc, capacity_rows={T: 1}), keep_plans=True).plans
    plans[1].tables[T].miss_push = torch.tensor([[4, 0, 0]])  # "pushed" to itself, not to the owner
    with pytest.raises(ExactnessError, match="not the home"):
        check_exact(loc, trace2, plans)
