"""The compiled global plans (``CompiledLazySyncPlanner``, ``CompiledStalenessPlanner``) against their tensor
references (``TensorLazySyncPlanner``, ``StalenessPlanner``): the same plan, counters and allocator scores
at every step and the same flush, on random skewed traces with hot rows, small caches (evictions),
look-ahead and staleness bounds 0 to 3; and bad reads named as the reference names them."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.pipeline.lazy_sync_native import CompiledLazySyncPlanner, CompiledStalenessPlanner
from torchrec_herald.pipeline.staleness import StalenessPlanner
from torchrec_herald.plans import ExecPlan

from herald_harness import error_of
from test_lazy_sync import CASES, _keys, _locality, _trace

STEPS = 60
PLAN_TENSORS = ("push_before_read", "pull", "pull_miss", "reduce", "update_keys", "reducer", "update_push",
                "miss_push", "push_before_read_add", "update_push_add", "miss_push_add")


def _same_plan(a: ExecPlan, b: ExecPlan, where: Any) -> None:
    assert b.step == a.step and b.additive == a.additive, where
    for name in PLAN_TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x.reshape(y.shape) if x.numel() == y.numel() == 0 else x, y), \
            (where, name, x.tolist(), y.tolist())
    for r in range(len(a.reads)):
        assert torch.equal(a.reads[r], b.reads[r]) and torch.equal(a.evictions[r], b.evictions[r]), (where, r)
    assert a.counters == b.counters, (where, a.counters, b.counters)
    assert (a.stale_reads, a.max_staleness) == (b.stale_reads, b.max_staleness), where


def _replay(ref: Any, nat: Any, trace: List[List[torch.Tensor]], window: int, loc: Any, seed: int) -> dict:
    seen = {"evicted": 0, "pre": 0, "post": 0, "miss_push": 0, "stale": 0, "added": 0}
    g = torch.Generator().manual_seed(seed)
    n = loc.layout.num_rows
    for t in range(len(trace)):
        win = trace[t: t + window]
        a, b = ref.plan_step(win), nat.plan_step(win)
        _same_plan(a, b, t)
        seen["evicted"] += sum(e.numel() for e in b.evictions)
        seen["pre"] += len(b.push_before_read)
        seen["post"] += len(b.update_push)
        seen["miss_push"] += len(b.miss_push)
        seen["stale"] += b.stale_reads
        seen["added"] += int(b.update_push_add.sum()) + int(b.push_before_read_add.sum()) if b.additive else 0
        keys = torch.randint(0, n, (200,), generator=g)
        sample = torch.randint(0, 20, (200,), generator=g)
        assert torch.equal(ref.local_scores(keys, sample, 20), nat.local_scores(keys, sample, 20)), t
        assert torch.equal(ref.local_on(keys), nat.local_on(keys)), t
        assert all(torch.equal(x, y) for x, y in zip(ref.cached_rows(), nat.cached_rows())), t
    fa, fb = ref.flush(), nat.flush()
    assert torch.equal(fa.push, fb.push) and torch.equal(fa.pull, fb.pull), (fa.push.tolist(), fb.push.tolist())
    assert torch.equal(fa.push_add, fb.push_add)
    assert all(torch.equal(x, y) for x, y in zip(fa.dropped, fb.dropped))
    seen["flushed"] = len(fb.push) + len(fb.pull)
    # after the flush both start over: the first steps are planned alike again
    for t in range(3):
        _same_plan(ref.plan_step(trace[t: t + window]), nat.plan_step(trace[t: t + window]), ("after flush", t))
    assert nat.step == ref.step == 3
    return seen


@pytest.mark.parametrize("world,window,seed,fraction", CASES + [(8, 2, 22, 0.1)])
def test_compiled_global_plan_equals_the_tensor_planner(world: int, window: int, seed: int, fraction: float) -> None:
    loc = _locality(world)
    trace = [_keys(loc, s) for s in _trace(world, STEPS, seed)]
    seen = _replay(TensorLazySyncPlanner(loc, fraction, window), CompiledLazySyncPlanner(loc, fraction, window),
                   trace, window, loc, seed)
    assert (seen["pre"] > 0) == (window == 1) and (seen["post"] > 0) == (window > 1), seen
    if fraction < 1.0:
        assert seen["evicted"] > 0 and seen["miss_push"] > 0, seen
    assert seen["flushed"] > 0, seen


@pytest.mark.parametrize("world,s,seed,fraction", [(2, 0, 30, 0.1), (2, 1, 31, 0.1), (3, 3, 32, 0.05), (4, 2, 33, 0.1),
                                                   (4, 3, 34, 1.0), (8, 1, 35, 0.1)])
def test_compiled_staleness_plan_equals_the_tensor_planner(world: int, s: int, seed: int, fraction: float) -> None:
    loc = _locality(world)
    trace = [_keys(loc, st) for st in _trace(world, STEPS, seed)]
    seen = _replay(StalenessPlanner(loc, s, fraction), CompiledStalenessPlanner(loc, s, fraction), trace, 1, loc, seed)
    assert (seen["pre"] > 0) == (s > 0) and seen["post"] > 0, seen  # (s = 0 holds no update back)
    assert (seen["stale"] > 0) == (s > 0) and (seen["added"] > 0) == (s > 0), seen
    if fraction < 1.0:
        assert seen["evicted"] > 0 and (seen["miss_push"] > 0) == (s > 0), seen


def test_compiled_global_plans_name_bad_reads_as_the_reference_does() -> None:
    loc = _locality(2)
    n = loc.layout.num_rows
    for planner in (CompiledLazySyncPlanner(loc), CompiledStalenessPlanner(loc, 1)):
        assert error_of(lambda: planner.plan_step([[torch.tensor([0, n]), torch.tensor([1])]])) \
            == f"ValueError: read keys outside [0, {n})"
        assert error_of(lambda: planner.plan_step([[torch.tensor([3, 1]), torch.tensor([1])]])) == \
            "ValueError: the global plan: this step's read keys of rank 0 must be sorted and unique (torch.unique)"
        assert error_of(lambda: planner.plan_step([[torch.tensor([1])]])) == \
            "ValueError: reads need one key set per rank (2), got 1"
        assert planner.step == 0  # nothing planned
        assert error_of(lambda: planner.local_scores(torch.tensor([n]), torch.tensor([0]), 1)) == \
            f"ValueError: allocator keys outside [0, {n})"
        assert error_of(lambda: planner.local_scores(torch.tensor([0]), torch.tensor([1]), 1)) == \
            "ValueError: allocator sample index outside [0, 1)"
    with pytest.raises(TypeError, match="holds its state in compiled code"):
        import copy
        copy.deepcopy(CompiledLazySyncPlanner(loc))
