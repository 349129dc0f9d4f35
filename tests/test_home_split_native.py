"""The compiled planner by home (``CompiledHomeSplitPlanner``) against its Python reference
(``HomeSplitLazyPlanner``): the same messages, the same plan and flush on random traces with hot rows,
small caches (evictions), look-ahead and reads sent ahead; and the build's one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from torchrec_herald.native import NativeUnavailable
from torchrec_herald.pipeline.home_split import HomeSplitLazyPlanner, transpose_messages
from torchrec_herald.pipeline.home_split_native import CompiledHomeSplitPlanner
from torchrec_herald.plans import ExecPlan

from test_lazy_sync import CASES, STEPS, _keys, _locality, _trace

PLAN_TENSORS = ("push_before_read", "pull", "pull_miss", "reduce", "update_keys", "reducer", "update_push",
                "miss_push")


def _step(planners: list, window: list) -> tuple:
    sent = [p.reader_messages(window) for p in planners]
    replies = [p.home_replies(m) for p, m in zip(planners, transpose_messages(sent))]
    return sent, replies, [p.assemble(m) for p, m in zip(planners, transpose_messages(replies))]


def _same_messages(a: list, b: list, where: tuple) -> None:
    for r, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x.counts, y.counts), (where, r)
        assert torch.equal(x.data, y.data), (where, r)


@pytest.mark.parametrize("world,window,seed,fraction", CASES + [(5, 3, 21, 0.02), (8, 2, 22, 0.1)])
def test_compiled_planner_by_home_equals_the_python_reference(world: int, window: int, seed: int,
                                                              fraction: float) -> None:
    loc = _locality(world)
    trace = [_keys(loc, s) for s in _trace(world, STEPS, seed)]
    ref = [HomeSplitLazyPlanner(loc, r, capacity_fraction=fraction, window=window) for r in range(world)]
    nat = [CompiledHomeSplitPlanner(loc, r, capacity_fraction=fraction, window=window) for r in range(world)]
    evicted = ahead = 0
    for t in range(STEPS):
        win = trace[t: t + window]
        sr, rr, pr = _step(ref, win)
        sn, rn, pn = _step(nat, win)
        _same_messages(sr, sn, (t, "reader"))
        _same_messages(rr, rn, (t, "home"))
        for me, (a, b) in enumerate(zip(pr, pn)):
            assert isinstance(b, ExecPlan) and b.partial and b.step == a.step == t
            for name in PLAN_TENSORS:
                assert torch.equal(getattr(a, name), getattr(b, name)), (t, me, name)
            for r in range(world):
                assert torch.equal(a.reads[r], b.reads[r]) and torch.equal(a.evictions[r], b.evictions[r]), (t, me, r)
            assert a.counters == b.counters, (t, me)
            evicted += b.evictions[me].numel()
        ahead += sum(int(m.section(0)[0].sum() == 0) for m in sn)
    if fraction < 1.0:
        assert evicted > 0  # the small caches were exercised
    if window > 1:
        assert ahead > 0  # reads went ahead, and the homes used them
    fr = [p.flush_assemble(m) for p, m in zip(ref, transpose_messages([p.flush_messages() for p in ref]))]
    fn = [p.flush_assemble(m) for p, m in zip(nat, transpose_messages([p.flush_messages() for p in nat]))]
    for me, (a, b) in enumerate(zip(fr, fn)):
        assert torch.equal(a.push, b.push) and torch.equal(a.pull, b.pull), me
        assert torch.equal(a.dropped[me], b.dropped[me]), me
    assert any(f.push.numel() for f in fn)  # something was dirty at the flush
    # after the flush both start over: the next step is planned alike
    _, _, pr = _step(ref, trace[:window])
    _, _, pn = _step(nat, trace[:window])
    for a, b in zip(pr, pn):
        assert torch.equal(a.pull, b.pull) and torch.equal(a.reduce, b.reduce)


def test_compiled_planner_names_bad_reads() -> None:
    loc = _locality(2)
    p = CompiledHomeSplitPlanner(loc, 0)
    n = loc.layout.num_rows
    with pytest.raises(ValueError, match=rf"read keys outside \[0, {n}\)"):
        p.reader_messages([[torch.tensor([0, n]), torch.tensor([1])]])
    with pytest.raises(ValueError, match="must be sorted and unique"):
        p.reader_messages([[torch.tensor([3, 1]), torch.tensor([1])]])
    with pytest.raises(RuntimeError, match="needs an exchange"):
        p.plan_step([[torch.tensor([0]), torch.tensor([1])]])
    with pytest.raises(RuntimeError, match="allocator=identity"):
        p.local_on(torch.tensor([0]))


def test_a_stale_build_is_refused_with_how_to_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec_herald.native as native

    monkeypatch.setattr(native, "source_sha", lambda: "0" * 16)
    native._load.cache_clear()
    try:
        with pytest.raises(NativeUnavailable, match=r"built from another version of home_split\.cpp, row_store\.cpp, global_plan\.cpp, id_split\.cpp, greedy_assign\.cpp, "
                                                   r"synthetic_sample\.cpp, batch_keys\.cpp, common\.h: "
                                                   r"run `make setup`"):
            native.load()
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
    native.load()


def _run_build(env_extra: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-m", "torchrec_herald.native.build"], env=env, capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)


def test_a_missing_compiler_is_named_in_one_line(tmp_path: Path) -> None:
    out = _run_build({"CXX": "no-such-compiler-g++"}, tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: no C++ compiler: no-such-compiler-g++ is not on PATH; install one (e.g. apt-get install "
                     "g++) or set CXX, then re-run `make setup` (or use pipeline.scheduler_impl=python)"]


def test_a_failed_compile_names_the_first_error_and_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec_herald.native as native
    from torchrec_herald.native import build as nb

    bad = tmp_path / "home_split.cpp"
    bad.write_text("int f() { return undeclared_name; }\n")  # (no torch header: it fails at once)
    monkeypatch.setattr(nb, "SOURCES", (bad,))
    monkeypatch.setattr(nb, "BUILD_DIR", tmp_path / "_build")
    monkeypatch.setattr(nb, "MODULE", "herald_native_broken")
    monkeypatch.setattr(nb, "source_sha", lambda: "0" * 16)
    with pytest.raises(nb.NativeBuildError) as e:
        nb.build()
    msg = str(e.value)
    assert "\n" not in msg
    assert "error:" in msg and "undeclared_name" in msg
    assert msg.endswith(f"(full log: {tmp_path / '_build' / 'build.log'})")
    assert "undeclared_name" in (tmp_path / "_build" / "build.log").read_text()
    assert native.available()  # the real build is untouched


def test_planning_auto_plans_globally_at_two_ranks_and_by_home_beyond() -> None:
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    def planned(world: int, **kw: object) -> tuple:
        c, why = HeraldPipelineConfig(**kw).resolve_planning(world)
        return c.planning, c.allocator, why

    assert planned(2)[:2] == ("global", "greedy")
    assert planned(2)[2] == ("pipeline.planning=auto -> global at W=2 <= 2: planning every row with the input "
                             "allocator measured faster there")
    for world in (3, 4, 8, 128):
        p, a, why = planned(world)
        assert (p, a) == ("by_home", "identity") and why.startswith(f"pipeline.planning=auto -> by_home at W={world}:")
        assert "the input allocator is off (identity)" in why
    assert planned(8, allocator="greedy") == (
        "global", "greedy", "pipeline.planning=auto -> global: pipeline.allocator=greedy needs every rank's view; at "
        "W=8 each rank then plans every rank's rows, a CPU cost a step that grows with W·B (0.33 s a rank-step at "
        "W=8, off the critical path only while it is shorter than the step); by home it grows with the rank's own "
        "reads")
    assert planned(2, allocator="greedy")[2] == ("pipeline.planning=auto -> global: pipeline.allocator=greedy needs "
                                                 "every rank's view")  # (where auto plans globally anyway)
    assert planned(8, staleness=1)[0] == "global" and planned(8, skip="input")[0] == "global"
    assert planned(8, sync="eager")[0] == "global" and planned(8, scheduling="off")[0] == "global"
    assert planned(8, planning="global") == ("global", "greedy", "pipeline.planning=global (set)")
    assert planned(2, planning="by_home")[:2] == ("by_home", "identity")
    # by home the loader gives each rank its batch, the scheduler runs ahead, the probe decides
    c, why = HeraldPipelineConfig().resolve(whole_batches=True, world_size=4)
    assert (c.planning, c.global_batches, c.run_ahead, c.scheduling) == ("by_home", False, True, "auto")
    with pytest.raises(ValueError, match=r"unknown pipeline.scheduler_impl 'fast'; known: \['auto', 'compiled', 'python'\]"):
        HeraldPipelineConfig(scheduler_impl="fast")


def test_a_missing_compiled_scheduler_fails_before_training_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec_herald.native as native
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    monkeypatch.setattr(native, "unavailable_reason", lambda: "herald's compiled scheduler is not built (x.so is missing): "
                        "run `make setup`")
    with pytest.raises(ValueError, match=r"^pipeline.scheduler_impl=compiled: herald's compiled scheduler is not built"):
        HeraldPipelineConfig(scheduler_impl="compiled").resolve(whole_batches=False, world_size=4)
    c, why = HeraldPipelineConfig().resolve(whole_batches=False, world_size=4)  # auto: the reference, said once
    assert why[-1].startswith("pipeline.scheduler_impl=auto -> python")
    # the global plans (exact and HET) are compiled too: the same error where every rank plans globally
    with pytest.raises(ValueError, match=r"^pipeline.scheduler_impl=compiled: herald's compiled scheduler is not built"):
        HeraldPipelineConfig(scheduler_impl="compiled", staleness=1).resolve(whole_batches=True, world_size=2)
    c, why = HeraldPipelineConfig(staleness=1).resolve(whole_batches=True, world_size=2)
    assert c.planning == "global" and why[-1].startswith("pipeline.scheduler_impl=auto -> python")
    # eager sync builds the planner too (its scores feed the allocator): the same error
    with pytest.raises(ValueError, match=r"^pipeline.scheduler_impl=compiled: herald's compiled scheduler is not built"):
        HeraldPipelineConfig(scheduler_impl="compiled", sync="eager").resolve(whole_batches=True, world_size=2)
