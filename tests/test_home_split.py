"""Planning by home (``HomeSplitLazyPlanner``): each rank's plan is the global ``TensorLazySyncPlanner``
plan restricted to that rank, on random traces with hot rows, small caches and look-ahead; its flush
likewise; its messages carry only keys of the rank's own reads and evictions."""

from __future__ import annotations

from typing import List

import pytest
import torch

from torchrec_herald.pipeline.home_split import HomeSplitLazyPlanner, transpose_messages
from torchrec_herald.pipeline.lazy_sync import TensorLazySyncPlanner
from torchrec_herald.plans import ExecPlan, sort_transfers

from test_lazy_sync import CASES, STEPS, _keys, _locality, _trace

TRANSFERS = ("push_before_read", "pull", "reduce", "update_push", "miss_push")


def _restricted(plan: ExecPlan, name: str, me: int) -> torch.Tensor:
    t = getattr(plan, name)
    return sort_transfers(t[(t[:, 1] == me) | (t[:, 2] == me)])


def _split_step(planners: List[HomeSplitLazyPlanner], window: list) -> List[ExecPlan]:
    replies = [p.home_replies(m) for p, m in zip(planners, transpose_messages([p.reader_messages(window) for p in planners]))]
    return [p.assemble(m) for p, m in zip(planners, transpose_messages(replies))]


@pytest.mark.parametrize("world,window,seed,fraction", CASES)
def test_each_ranks_plan_is_the_global_plan_restricted_to_it(world: int, window: int, seed: int,
                                                             fraction: float) -> None:
    loc = _locality(world)
    trace = [_keys(loc, s) for s in _trace(world, STEPS, seed)]
    glob = TensorLazySyncPlanner(loc, capacity_fraction=fraction, window=window)
    split = [HomeSplitLazyPlanner(loc, r, capacity_fraction=fraction, window=window) for r in range(world)]
    evicted = 0
    for t in range(STEPS):
        win = trace[t: t + window]
        g = glob.plan_step(win)
        parts = _split_step(split, win)
        for me, p in enumerate(parts):
            for name in TRANSFERS:
                assert torch.equal(getattr(p, name), _restricted(g, name, me)), (t, me, name)
            sel = (g.pull[:, 1] == me) | (g.pull[:, 2] == me)
            order = torch.argsort((g.pull[sel, 0] * 65536 + g.pull[sel, 1]) * 65536 + g.pull[sel, 2])
            assert torch.equal(p.pull_miss, g.pull_miss[sel][order]), (t, me)
            assert torch.equal(p.update_keys, g.update_keys[g.reducer == me]), (t, me)
            assert bool((p.reducer == me).all())
            assert torch.equal(p.reads[me], win[0][me])
            assert torch.equal(p.evictions[me], g.evictions[me]), (t, me)
            evicted += p.evictions[me].numel()
        # the homes' counters add up to the global plan's
        total = parts[0].counters
        for p in parts[1:]:
            total = total + p.counters
        assert total == g.counters, t
    if fraction < 1.0:
        assert evicted > 0  # the small caches were exercised
    fg = glob.flush()
    fs = [p.flush_assemble(m) for p, m in zip(split, transpose_messages([p.flush_messages() for p in split]))]
    for me, f in enumerate(fs):
        for name in ("push", "pull"):
            t = getattr(fg, name)
            assert torch.equal(getattr(f, name), sort_transfers(t[(t[:, 1] == me) | (t[:, 2] == me)])), (me, name)
        assert torch.equal(f.dropped[me], fg.dropped[me])


def test_reads_travel_once_and_only_to_their_home() -> None:
    """With look-ahead a rank's reads go to their homes one step ahead and are not sent again; without
    it they go in their own step. No message holds a key of another home."""
    loc = _locality(3)
    trace = [_keys(loc, s) for s in _trace(3, 6, 11)]
    for window in (1, 3):
        split = [HomeSplitLazyPlanner(loc, r, capacity_fraction=0.2, window=window) for r in range(3)]
        for t in range(6):
            win = trace[t: t + window]
            msgs = [p.reader_messages(win) for p in split]
            for r, m in enumerate(msgs):
                flag, flag_to = m.section(0)
                ahead = window > 1 and t > 0
                assert flag_to.tolist() == [0, 1, 2] and flag.tolist() == [0 if ahead else 1] * 3
                for s in (1, 2, 3):  # this step's reads, the next step's, the evictions: each to its home
                    keys, to = m.section(s)
                    assert torch.equal(loc.layout.home_of(keys), to)
                for q in range(3):
                    n_now, n_next = int(m.counts[q, 1]), int(m.counts[q, 2])
                    assert n_now == (0 if ahead else int((loc.layout.home_of(win[0][r]) == q).sum()))
                    if window > 1 and len(win) > 1:
                        assert n_next == int((loc.layout.home_of(win[1][r]) == q).sum())
            replies = [p.home_replies(m) for p, m in zip(split, transpose_messages(msgs))]
            for p, m in zip(split, transpose_messages(replies)):
                p.assemble(m)


def test_plan_step_without_an_exchange_is_refused() -> None:
    p = HomeSplitLazyPlanner(_locality(2), 0)
    with pytest.raises(RuntimeError, match="needs an exchange"):
        p.plan_step([[torch.tensor([0]), torch.tensor([1])]])
    with pytest.raises(RuntimeError, match="allocator=identity"):
        p.local_on(torch.tensor([0]))


def test_planning_by_home_config_names_each_clashing_key() -> None:
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    HeraldPipelineConfig(planning="by_home", allocator="identity")  # the supported combination
    HeraldPipelineConfig(planning="by_home")  # allocator=auto: identity by home
    with pytest.raises(ValueError, match=r"needs allocator=identity.*got pipeline\.allocator=greedy$"):
        HeraldPipelineConfig(planning="by_home", allocator="greedy")
    with pytest.raises(ValueError, match=r"got pipeline\.allocator=greedy, pipeline\.staleness=2$"):
        HeraldPipelineConfig(planning="by_home", allocator="greedy", staleness=2)
    with pytest.raises(ValueError, match=r"unknown pipeline.planning 'nope'; known: \['auto', 'global', 'by_home'\]"):
        HeraldPipelineConfig(planning="nope")
