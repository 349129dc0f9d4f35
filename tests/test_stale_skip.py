"""Slipstream stale-update skipping (torchrec_herald/pipeline/stale_skip.py, wired in HeraldTrainPipeline
and the herald EBC).

Pure (no process group):

* the threshold search on a synthetic case with known saturated rows: 100 hot rows, 30 of them
  saturated (movement in (0, 0.01)), the others moving 0.05..0.5; 30 % of the sampled inputs touch
  only saturated rows, the rest an active or a cold row. :class:`StaleSkipper` (snapshots → movement
  → :func:`search_threshold`) lands the skipped share in ``0.3 ± 0.08`` with a ``T`` that separates the
  saturated rows from the active ones, and classifies exactly the saturated rows as stale; with 35 %
  saturated inputs the share is still in the band;
* :func:`search_threshold` edge cases: ``t_max`` too small → ``(t_max, its share)``; no scores →
  ``(0, 0)``; the returned share is always the share of scores below the returned ``T``;
* the phases of a run (off / snapshot_a / measure / snapshot_b / skip / off before a classification);
* bad options are ValueErrors naming the option (unknown granularity, target outside (0, 1),
  tolerance, start/gap/every, t_max, snapshots beyond the run).

Two ranks, one process group (``_runs``, cached), 16 steps, window 2, first snapshot at step 2,
second at step 5:

* ``row`` granularity, row-wise Adagrad, ``sync="lazy"`` and ``sync="eager"``: the hot rows
  classified stale at the second snapshot keep their weights and row-wise Adagrad state bit for bit
  through the 11 skip-phase steps although the trained batches read them; every other hot row read
  in those steps changed; the skipped updates are counted; every rank ends with the same model; after
  ``detach()`` the model trained on with herald's own path updates the formerly frozen rows again.
  Eager: the ``herald_hot_sync`` bytes of the skip-phase steps drop to exactly the live rows' share of
  a run without skipping on the same batches;
* ``input`` granularity (SGD, lazy, every id of the first batches hot so that some samples read hot
  rows only, target 0.1): the samples trained per step drop (some steps train fewer than ``2·B``),
  ``skipped_inputs`` is the number of samples missing and ``skipped_updates`` their lookups, a skipped
  sample reads stale rows only, and the rows read only by skipped samples keep their values;
* skipping on a plan without hot rows is a ValueError mentioning hot replication.

Driver: ``pipeline.skip=row`` records its thresholds, the skipped share and the exact reference in
``metrics["approximate"]``; bad ``pipeline.skip*`` values (and snapshots beyond the run) fail before
anything is trained.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from herald_harness import error_of
from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.pipeline.stale_skip import SkipConfig, StaleSkipper, search_threshold

# ------------------------------------------------------------------------------------------ pure


def _synthetic(saturated_share: float, seed: int = 0) -> Dict[str, Any]:
    """Hot rows 0..29 saturated (0 < movement < 0.01), 30..99 active (0.05..0.5); 1000 inputs of 1 to 4
    lookups: ``saturated_share`` of them only saturated rows, the others at least one active row, a
    third of those also a cold row (score ``inf``: never skipped)."""
    g = torch.Generator().manual_seed(seed)
    movement = torch.cat([0.0005 + 0.009 * torch.rand(30, generator=g), 0.05 + 0.45 * torch.rand(70, generator=g)])
    n = 1000
    n_sat = round(saturated_share * n)
    inputs = []
    for i in range(n):
        rows = torch.randint(0, 30, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        if i >= n_sat:
            rows[0] = int(torch.randint(30, 100, (1,), generator=g))
        inputs.append((rows, i >= n_sat and i % 3 == 0))
    order = torch.randperm(n, generator=g).tolist()
    return {"movement": movement, "inputs": [inputs[i] for i in order]}


def _scores(inputs: List[Any], movement: torch.Tensor) -> torch.Tensor:
    """Per input: the largest movement among its lookups, ``inf`` with a cold lookup."""
    return torch.tensor([float("inf") if cold else float(movement[rows].max()) for rows, cold in inputs])


@pytest.mark.parametrize("share", [0.30, 0.35])
def test_threshold_search_hits_the_target_and_separates_saturated_rows(share: float) -> None:
    syn = _synthetic(share)
    mv = syn["movement"]
    skipper = StaleSkipper(SkipConfig("input", target=0.3, tolerance=0.08, t_max=0.1), num_hot=100)
    start = torch.randn(100, 4, generator=torch.Generator().manual_seed(1))
    delta = torch.zeros(100, 4)
    delta[torch.arange(100), torch.arange(100) % 4] = mv * torch.where(torch.arange(100) % 2 == 0, 1.0, -1.0)
    skipper.take_snapshot(start, second=False)
    skipper.take_snapshot(start + delta, second=True)
    assert torch.allclose(skipper.movement, mv, atol=1e-6)  # max |Δ| per row
    scores = _scores(syn["inputs"], skipper.movement)
    skipper.set_threshold(7, scores)
    T, got = skipper.threshold, skipper.achieved_share
    assert abs(got - 0.3) <= 0.08, got
    assert got == float((scores < T).double().mean())
    assert skipper.history == [(7, T, got, int(skipper.stale.sum()))]
    if share == 0.30:
        # the saturated inputs are exactly the 30 %: T lies between the saturated and the active rows
        assert float(skipper.movement[:30].max()) < T <= float(skipper.movement[30:].min())
        assert skipper.stale.tolist() == [True] * 30 + [False] * 70
        assert got == 0.3
    else:
        assert T <= float(skipper.movement[:30].max())  # stops inside the saturated rows: 0.3 reached
        assert not bool(skipper.stale[30:].any()) and 0 < int(skipper.stale.sum()) < 30


def test_search_threshold_edge_cases() -> None:
    scores = torch.tensor([0.2, 0.3, 0.05, float("inf"), 0.5])
    # even t_max skips less than the target: (t_max, the share it does skip)
    assert search_threshold(scores, 0.5, 0.1) == (0.1, 0.2)
    assert search_threshold(scores, 0.3, 0.01) == (0.01, 0.0)
    # nothing sampled
    assert search_threshold(torch.empty(0), 0.3, 0.1) == (0.0, 0.0)
    # reachable: the smallest T reaching the target (up to the bisection's resolution)
    T, share = search_threshold(scores, 0.4, 1.0)
    assert share == 0.4 and 0.2 < T <= 0.2 + 1e-6
    T, share = search_threshold(torch.zeros(10), 0.3, 0.1)  # every row frozen solid: any T > 0 skips all
    assert share == 1.0 and 0.0 < T < 1e-9
    for target in (0.1, 0.5, 0.8):
        T, share = search_threshold(scores, target, 10.0)
        assert share == float((scores < T).double().mean()) and share >= target
    assert search_threshold(scores, 0.9, 10.0) == (10.0, 0.8)  # an inf score (cold lookup) is never skipped


def test_phases() -> None:
    skipper = StaleSkipper(SkipConfig("row", start=2, gap=3, every=10), num_hot=4)
    phases = [skipper.phase(s) for s in range(24)]
    assert phases[:13] == ["off", "off", "snapshot_a", "measure", "measure", "snapshot_b"] + ["off"] * 6 + \
        ["snapshot_a"], phases  # "off" after snapshot_b until a classification exists
    skipper.take_snapshot(torch.zeros(4, 2), second=False)
    skipper.take_snapshot(torch.tensor([[0.0, 0.001], [0.5, 0.0], [0.0, 0.0], [0.2, -0.3]]), second=True)
    skipper.set_threshold(5, torch.tensor([0.001, 0.5, 0.0, 0.3]))
    assert skipper.stale.tolist() == [True, False, True, False]
    assert [skipper.phase(s) for s in range(6, 12)] == ["skip"] * 6
    assert [skipper.phase(s) for s in (12, 13, 14, 15, 16, 22)] == \
        ["snapshot_a", "measure", "measure", "snapshot_b", "skip", "snapshot_a"]
    skipper.take_snapshot(torch.zeros(4, 2), second=False)  # a new window: the classification is dropped
    assert skipper.phase(16) == "off" and skipper.stale.numel() == 0


@pytest.mark.parametrize("kwargs,expected", [
    (dict(granularity="sample"), "unknown pipeline.skip 'sample'; known: ['input', 'row'] or null"),
    (dict(granularity="row", target=0.0), "pipeline.skip_target must be in (0, 1), got 0.0"),
    (dict(granularity="row", target=1.0), "pipeline.skip_target must be in (0, 1), got 1.0"),
    (dict(granularity="input", target=1.5), "pipeline.skip_target must be in (0, 1), got 1.5"),
    (dict(granularity="row", target=0.3, tolerance=0.5), "pipeline.skip_tolerance must be in [0, min(target"),
    (dict(granularity="row", gap=0), "skip_gap >= 1"),
    (dict(granularity="row", gap=10, every=10), "skip_every > skip_gap"),
    (dict(granularity="row", start=-1), "pipeline.skip_start >= 0"),
    (dict(granularity="row", t_max=0.0), "pipeline.skip_t_max must be in (0, 1000]"),
])
def test_bad_skip_config_is_a_value_error(kwargs: Dict[str, Any], expected: str) -> None:
    msg = error_of(lambda: SkipConfig(**kwargs))
    assert msg.startswith("ValueError: ") and expected in msg, msg


def test_snapshots_beyond_the_run_are_rejected() -> None:
    c = SkipConfig("row", start=20, gap=10)
    c.check_run_length(31)
    c.check_run_length(None)  # unknown length (e.g. a file source): nothing to check
    for steps in (30, 25, 5):
        msg = error_of(lambda: c.check_run_length(steps))
        assert msg.startswith("ValueError: ") and "pipeline.skip snapshots at steps 20 and 30" in msg, msg
        assert f"the run's {steps} steps" in msg and "pipeline.skip_start" in msg, msg


# ------------------------------------------------------------------------------------------ 2 ranks

STEPS, WINDOW, START, GAP = 16, 2, 2, 3
OFF_STEPS = 48  # input skipping with scheduling off: long enough for the refill rate to read extra slices
SNAP_B = START + GAP  # the step whose progress() takes the second snapshot and classifies
ADAGRAD = dict(optimizer="rowwise_adagrad", via="fused_params")
RUNS: Dict[str, Dict[str, Any]] = {  # name -> harness cfg + pipeline sync + skip (granularity, t_max, target) or None
    "row_lazy": dict(ADAGRAD, pipe_sync="lazy", skip=("row", 0.1, 0.3)),
    "row_eager": dict(ADAGRAD, pipe_sync="eager", skip=("row", 0.1, 0.3)),
    "eager_no_skip": dict(ADAGRAD, pipe_sync="eager", skip=None),
    "input_lazy": dict(optimizer="sgd", via="apply", pipe_sync="lazy", skip=("input", 1.0, 0.1), hot_min_count=1),
}
# input skipping on whole global batches (stale inputs dropped, each batch refilled with live samples),
# samples where loaded: scheduled serially and scheduled ahead; with scheduling off (hot replication
# alone under TorchRec's pipeline) each rank refills from its own slices, and a run without skipping
# replays the batches it fed
_WHOLE = dict(RUNS["input_lazy"], skip=("input", 100.0, 0.3), whole=True, pipe=dict(allocator="identity", scheduling="on", global_batches=True,
                                                         run_ahead=False))
RUNS.update({
    "input_whole": _WHOLE,
    "input_whole_ahead": dict(_WHOLE, pipe=dict(_WHOLE["pipe"], run_ahead=True)),
    "input_off": dict(_WHOLE, steps=OFF_STEPS, pipe=dict(scheduling="off", global_batches=True)),
    "input_off_replay": dict(_WHOLE, steps=OFF_STEPS, whole=False, skip=None, replay="input_off",
                             pipe=dict(scheduling="off")),
})
# input skipping that pays, and one whose classifier costs more than it saves (its measured time fixed)
RUNS.update({f"input_off_{name}": dict(_WHOLE, steps=OFF_STEPS, every=20, cost_s=cost,
                                       pipe=dict(scheduling="off", global_batches=True))
             for name, cost in (("cheap", 1e-9), ("costly", 1.0))})
# scheduling=auto with input skipping active while it probes (on -> off -> the decision, forced here)
RUNS.update({f"input_auto_{m}": dict(_WHOLE, steps=OFF_STEPS, decide=m,
                                     pipe=dict(scheduling="auto", probe_steps=4, global_batches=True))
             for m in ("on", "off")})


def _one_run(rank: int, world: int, cfg: Dict[str, Any], earlier: Dict[str, Any]) -> Dict[str, Any]:
    from herald_harness import build, full_state
    from torchrec_herald.data import TrainStream
    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.traffic import TrafficMeter

    b = build(world, dict({"steps": STEPS}, **cfg, planner="herald"))
    skip = None if cfg["skip"] is None else SkipConfig(cfg["skip"][0], start=START, gap=GAP, every=cfg.get("every", 100),
                                                       t_max=cfg["skip"][1], target=cfg["skip"][2], tolerance=0.05)
    pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], torch.device("cpu"), sync=cfg["pipe_sync"], window=WINDOW,
                               skip=skip, **cfg.get("pipe", {}))
    ebc = pipe.ebc
    n = ebc.layout.num_rows
    out: Dict[str, Any] = {"hot_keys": ebc.layout.hot_keys.clone(), "B": b["batch_size"]}

    def snapshot() -> Dict[str, torch.Tensor]:
        return {"w": ebc.hot_values(), "state": ebc.store.hot_state[: ebc.layout.num_hot].clone()}

    hook = pipe.skip_hook
    if skip is not None:
        orig_phase = hook.before_step

        def before_step(p: Any, step: int) -> None:
            orig_phase(p, step)
            if pipe.skipper.phase(step) == "snapshot_b":  # type: ignore[union-attr]
                out["at_b"] = snapshot()
                out["stale"] = pipe.skipper.stale.clone()  # type: ignore[union-attr]
                out["stale_keys"] = hook.frozen_keys.clone()

        hook.before_step = before_step  # type: ignore[method-assign]
        dropped = torch.zeros(n, dtype=torch.int64)  # lookups of dropped samples, per row
        orig_drop = hook.filter_inputs

        def drop(p: Any, batch: Any, train_step: int) -> Any:
            kept = orig_drop(p, batch, train_step)
            before = torch.bincount(pipe.batch_keys(batch.sparse_features), minlength=n)
            after = torch.bincount(pipe.batch_keys(kept.sparse_features), minlength=n)
            dropped.add_(before - after)
            return kept

        hook.filter_inputs = drop  # type: ignore[method-assign]
        out["dropped"] = dropped
    it: Any = (TrainStream(b["data"], rank, world, b["batch_size"], whole=True) if cfg.get("whole")
               else iter(earlier[cfg["replay"]]["fed"]) if cfg.get("replay")
               else b["data"].train_batches(rank, world, b["batch_size"]))
    fed: List[Any] = []  # scheduling off with input skipping: the batches this rank's refilled stream fed
    orig_next: Any = None

    def record_fed(*a: Any) -> Any:
        batch = orig_next(*a)  # type: ignore[misc]
        fed.append(batch)
        return batch
    trained_keys: List[torch.Tensor] = []  # per step: the rows this rank's trained batch reads
    skipped_by_step: List[int] = []  # inputs skipped so far, after each step
    sizes: List[int] = []
    losses: List[float] = []
    meter = TrafficMeter(embedding_dim=8)
    pipe.fill(it)
    if "cost_s" in cfg:  # the classifier's measured time per step, fixed
        real_count_cost = pipe.skip_hook.count_cost  # type: ignore[union-attr]
        pipe.skip_hook.count_cost = lambda seconds: real_count_cost(cfg["cost_s"])  # type: ignore[union-attr,method-assign]
    if cfg.get("decide"):
        pipe.switch.decide = lambda on_ms, off_ms: cfg["decide"]  # type: ignore[union-attr,method-assign]
    if pipe.rank_inputs is not None:
        fed.extend(pipe.window_batches())  # the first window, read before TorchRec's pipeline takes over
        orig_next = pipe.rank_inputs.next
        pipe.rank_inputs.next = record_fed  # type: ignore[method-assign]
    step = 0
    while True:
        if pipe.window_batches():  # the head of the window is the batch progress() trains (after input skipping)
            trained = pipe.window_batches()[0]
            trained_keys.append(torch.unique(pipe.batch_keys(trained.sparse_features)))
            sizes.append(int(trained.labels.numel()))
        try:
            with meter if step >= SNAP_B else contextlib.nullcontext():
                losses.append(float(pipe.progress(it)[0].sum()))
        except StopIteration:
            break
        skipped_by_step.append(pipe.stats.skipped_inputs)
        step += 1
    out.update(final=snapshot(), steps=step, trained_keys=trained_keys, sizes=sizes, stats=copy.copy(pipe.stats),
               losses=losses, mode=pipe.mode, ahead_s=pipe.stats.ahead_s,
               skip_tags=meter.tag_summary(), state=full_state(b["dmp"]),
               history=list(pipe.skipper.history) if pipe.skipper else [],
               movement=pipe.skipper.movement if pipe.skipper else None, fed=fed,
               untrained=pipe.rank_inputs.untrained_total if pipe.rank_inputs is not None else 0,
               skipped_by_step=skipped_by_step, verdicts=list(hook.verdicts) if hook is not None else [])
    # the detached model trains every row again (herald's own per-step path, a second pass over the data)
    model = pipe.detach()
    after_keys = []
    for _, batch in zip(range(2), b["data"].train_batches(rank, world, b["batch_size"])):
        after_keys.append(torch.unique(pipe.batch_keys(batch.sparse_features)))
        loss, _ = model(batch)
        b["optimizer"].zero_grad()
        loss.backward()
        b["optimizer"].step()
    out.update(after_detach=snapshot(), after_detach_keys=torch.unique(torch.cat(after_keys)))
    return out


def _worker(rank: int, world: int) -> Dict[str, Any]:
    from herald_harness import build
    from torchrec_herald.pipeline import HeraldTrainPipeline

    out: Dict[str, Any] = {}
    for n, cfg in RUNS.items():
        out[n] = _one_run(rank, world, cfg, out)
    nohot = build(world, dict(planner="herald", steps=3, hot_min_count=10 ** 9))
    out["nohot"] = error_of(lambda: HeraldTrainPipeline(nohot["dmp"], nohot["optimizer"], torch.device("cpu"),
                                                        skip=SkipConfig("row")))
    return out


@functools.lru_cache(maxsize=None)
def _runs() -> List[Dict[str, Any]]:
    return run_multiprocess(_worker, 2, timeout_s=600)


def _skip_step_reads(res: List[Dict[str, Any]], name: str) -> torch.Tensor:
    """Union over ranks of the rows read by the batches trained from the second snapshot on."""
    return torch.unique(torch.cat([k for r in res for k in r[name]["trained_keys"][SNAP_B:]]))


@pytest.mark.parametrize("name", ["row_lazy", "row_eager"])
def test_row_skipping_leaves_stale_rows_untouched(name: str) -> None:
    res = _runs()
    r0 = res[0][name]
    assert r0["steps"] == STEPS and len(r0["history"]) == 1 and r0["history"][0][0] == SNAP_B
    stale = r0["stale"]
    hot_keys = r0["hot_keys"]
    assert 0 < int(stale.sum()) < stale.numel()
    assert torch.equal(r0["stale_keys"], hot_keys[stale])
    _, T, share, n_stale = r0["history"][0]
    assert abs(share - 0.3) <= 0.08 and n_stale == int(stale.sum())
    assert bool((r0["movement"][stale] < T).all()) and bool((r0["movement"][~stale] >= T).all())
    read = torch.isin(hot_keys, _skip_step_reads(res, name))
    assert int((read & stale).sum()) > 20 and int((read & ~stale).sum()) > 20  # both kinds really read
    for r in res:
        x = r[name]
        assert torch.equal(x["stale"], stale)  # the same classification on every rank
        a, f = x["at_b"], x["final"]
        assert torch.equal(f["w"][stale], a["w"][stale])  # skipped: no update at all
        assert torch.equal(f["state"][stale], a["state"][stale])  # nor to the row-wise Adagrad state
        live = read & ~stale
        changed = (f["w"][live] != a["w"][live]).any(1) & (f["state"][live] != a["state"][live])
        assert bool(changed.all()), int((~changed).sum())
        assert torch.equal(f["w"], res[0][name]["final"]["w"])  # every replica the same
        for k, v in x["state"].items():
            assert torch.equal(v, res[0][name]["state"][k]), k
            assert bool(torch.isfinite(v).all())
    st = r0["stats"]
    assert 0 < st.skipped_updates < st.candidate_updates
    assert st.skipped_inputs == 0
    # after detach() nothing stays frozen: the model trained on with herald's own path updates every hot
    # row it reads, the formerly stale ones included
    read_after = torch.isin(hot_keys, torch.unique(torch.cat([r[name]["after_detach_keys"] for r in res])))
    assert int((read_after & stale).sum()) > 20
    for r in res:
        before, after = r[name]["final"], r[name]["after_detach"]
        moved = (after["w"] != before["w"]).any(1) & (after["state"] != before["state"])
        assert bool(moved[read_after].all()), int((read_after & stale & ~moved).sum())


def test_eager_row_skipping_cuts_hot_sync_bytes() -> None:
    res = _runs()
    for r in res:
        skip = r["row_eager"]["skip_tags"]["herald_hot_sync"]["bytes"]
        base = r["eager_no_skip"]["skip_tags"]["herald_hot_sync"]["bytes"]
        stale = r["row_eager"]["stale"]
        live = 1 - int(stale.sum()) / stale.numel()
        assert skip < base
        assert skip / base == pytest.approx(live, rel=1e-6)  # dense sync: the live rows only
    # the runs trained the same batches up to the classification
    a, b = res[0]["row_eager"]["trained_keys"], res[0]["eager_no_skip"]["trained_keys"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_input_skipping_drops_samples_and_leaves_their_rows_untouched() -> None:
    res = _runs()
    name = "input_lazy"
    B = res[0][name]["B"]
    per_step = torch.tensor([r[name]["sizes"] for r in res]).sum(0)  # samples trained per step, both ranks
    assert len(per_step) == STEPS
    assert bool((per_step[:SNAP_B + WINDOW] == 2 * B).all())  # nothing skipped before the classification
    assert int((per_step < 2 * B).sum()) >= 3 and int(per_step.min()) >= 2  # fewer samples trained
    skipped = sum(r[name]["stats"].skipped_inputs for r in res)
    assert skipped == int((2 * B - per_step).sum()) > 0
    dropped = sum(r[name]["dropped"] for r in res)
    assert sum(r[name]["stats"].skipped_updates for r in res) == int(dropped.sum())
    _, T, share, n_stale = res[0][name]["history"][0]
    assert abs(share - 0.1) <= 0.05 and n_stale > 0  # the sampled share of skippable inputs: in the band
    stale_keys = res[0][name]["stale_keys"]
    dropped_rows = dropped.nonzero().flatten()
    assert bool(torch.isin(dropped_rows, stale_keys).all())  # a skipped sample reads stale hot rows only
    only_skipped = dropped_rows[~torch.isin(dropped_rows, _skip_step_reads(res, name))]
    assert only_skipped.numel() >= 10  # (24 hot rows here)
    hot_keys = res[0][name]["hot_keys"]
    pos = torch.searchsorted(hot_keys, only_skipped)
    for r in res:
        a, f = r[name]["at_b"]["w"], r[name]["final"]["w"]
        assert torch.equal(f[pos], a[pos])
        assert not torch.equal(f, a)  # the trained samples' rows did move
        for k, v in r[name]["state"].items():
            assert torch.equal(v, res[0][name]["state"][k]), k


def test_input_skipping_on_whole_global_batches_refills_them_and_runs_ahead() -> None:
    """On whole global batches the stale inputs are dropped before the batch enters and it is refilled
    from the next ones: every step but the last trains a full global batch, an epoch takes fewer steps,
    and every loader sample is trained or skipped (but for a tail of fewer than W). Scheduling ahead
    trains bit for bit what scheduling serially trains."""
    res = _runs()
    ref = [r["input_whole"] for r in res]
    B = ref[0]["B"]
    per_step = torch.tensor([r["sizes"] for r in ref]).sum(0)  # samples trained per step, both ranks
    steps = ref[0]["steps"]
    skipped = ref[0]["stats"].skipped_inputs  # (counted on the global batches: every rank the same)
    assert skipped > 0 and all(r["stats"].skipped_inputs == skipped for r in ref)
    assert steps < STEPS and len(per_step) == steps
    assert bool((per_step[:-1] == 2 * B).all()) and 0 < int(per_step[-1]) <= 2 * B
    assert 0 <= STEPS * 2 * B - int(per_step.sum()) - skipped < 2
    assert all(r["stats"].inputs_read == STEPS * 2 * B for r in ref)  # every loader sample read once
    assert all(r["input_lazy"]["stats"].inputs_read == 0 for r in res)  # (per-rank batches: nothing refilled)
    for r, x in zip(ref, (r["input_whole_ahead"] for r in res)):
        assert x["steps"] == steps and x["history"] == r["history"]
        for k in ("skipped_inputs", "skipped_updates", "candidate_updates"):
            assert getattr(x["stats"], k) == getattr(r["stats"], k), k
        assert x["ahead_s"] > 0 and x["sizes"] == r["sizes"] and x["losses"] == r["losses"]
        assert torch.equal(x["final"]["w"], r["final"]["w"])
        assert all(torch.equal(x["state"][k], v) for k, v in r["state"].items())


def test_input_skipping_with_scheduling_off_refills_each_ranks_own_slices_and_trains_what_it_feeds() -> None:
    """Scheduling off (hot replication alone under TorchRec's pipeline): each rank classifies and
    refills from its own slices only, reading the same number of slices per step as every other rank,
    so all ranks end at the same step. The classification is the one scheduling on makes; every slice
    sample is trained, skipped or (the carry at the end) counted untrained; the batches are full but
    the last; and the model trains exactly as a run without skipping fed the same batches."""
    res = _runs()
    runs = [r["input_off"] for r in res]
    B, steps = runs[0]["B"], runs[0]["steps"]
    assert all(x["mode"] == "off" and x["steps"] == steps for x in runs) and steps < OFF_STEPS
    for r, x in zip(res, runs):
        st = x["stats"]
        assert x["history"] == r["input_whole"]["history"]  # the same threshold sample and classification
        sizes = [int(b.labels.numel()) for b in x["fed"]]
        assert len(sizes) == steps and all(n >= B for n in sizes[:-1]) and 0 < sizes[-1]
        assert sum(sizes) + st.skipped_inputs + x["untrained"] == OFF_STEPS * B  # every slice sample accounted
        assert st.skipped_inputs > 0 and x["untrained"] < B
        assert st.inputs_read == OFF_STEPS * 2 * B  # every global batch read once (its slices, by both ranks)
        replay = r["input_off_replay"]
        assert replay["steps"] == steps and replay["losses"] == x["losses"]
        assert torch.equal(replay["final"]["w"], x["final"]["w"])
        assert all(torch.equal(replay["state"][k], v) for k, v in x["state"].items())


def test_input_skipping_across_the_auto_probes_switches_reads_every_global_batch_once() -> None:
    """``scheduling=auto`` switching on -> off -> on (or staying off) while input skipping refills: the
    whole global batches' leftover live samples pass to the per-rank streams, the per-rank carry is
    dropped (counted) when scheduling comes back on, every rank trains the same number of steps and every
    global batch is read exactly once."""
    res = _runs()
    for m in ("on", "off"):
        runs = [r[f"input_auto_{m}"] for r in res]
        B = runs[0]["B"]
        assert all(x["mode"] == m and x["steps"] == runs[0]["steps"] < OFF_STEPS for x in runs), m
        assert all(x["stats"].inputs_read == OFF_STEPS * 2 * B for x in runs), m
        assert all(x["stats"].skipped_inputs > 0 and x["history"] == runs[0]["history"] for x in runs), m
        assert all(math.isfinite(loss) for x in runs for loss in x["losses"]), m
        assert torch.equal(runs[0]["final"]["w"], runs[1]["final"]["w"]), m  # the replicas agree


def test_input_skipping_pauses_where_its_classifier_costs_more_time_than_it_saves() -> None:
    """Each threshold search judges the classifier's measured time per step (the slowest rank's) against
    the time the skipped share saves: a costly classifier pauses skipping until a later search finds it
    pays (none here: its cost stays), a cheap one keeps skipping; every rank judges alike."""
    res = _runs()
    for name, paused in (("cheap", False), ("costly", True)):
        runs = [r[f"input_off_{name}"] for r in res]
        verdicts = runs[0]["verdicts"]  # (a third search, at step 45, only where the run is still going)
        assert [v[0] for v in verdicts] == [SNAP_B, SNAP_B + 20, SNAP_B + 40][:len(verdicts)] and len(verdicts) >= 2
        assert [v[1] for v in verdicts] == [False] + [paused] * (len(verdicts) - 1), name
        assert all(x["verdicts"] == verdicts for x in runs), name
        assert verdicts[0][2] == 0.0 and verdicts[1][2] == pytest.approx(1e-6 if name == "cheap" else 1000.0), name
        for x in runs:
            by_step = x["skipped_by_step"]
            assert by_step[START + 20 - 1] > 0, name  # the first classification (steps 6-19) skipped inputs
            if name == "costly":
                assert by_step[-1] == by_step[START + 20 - 1], name  # nothing skipped after the pause
            else:
                assert by_step[START + 40 - 1] > by_step[START + 20 - 1], name  # skipping again after step 25


def test_the_skip_searchs_step_time_is_the_devices_work_waited_for_at_each_end_of_a_span() -> None:
    """On a GPU the host only queues a step's work: the search's step time waits for the device where its span of
    steps begins (the first step, after another run's turn) and ends (a snapshot, a turn's end), and not inside."""
    from herald_harness import QueuedDevice

    from torchrec_herald.pipeline.stale_skip import StaleSkipHook

    device = QueuedDevice(0.02)
    hook = StaleSkipHook(SkipConfig("input", start=20), num_hot=4, device_sync=device.sync)
    for step in range(3):  # (no snapshot before step 20)
        device.steps = step
        hook.before_step(None, step)  # type: ignore[arg-type]
        device.queued += device.step_s
    device.steps = 3
    hook.stop_clock()  # (the other run's turn)
    for step in range(3, 5):
        device.steps = step
        hook.before_step(None, step)  # type: ignore[arg-type]
        device.queued += device.step_s
    device.steps = 5
    hook.stop_clock()
    assert device.synced_before == [0, 3, 3, 5]
    cost_ms, step_ms = hook._timings_since_search()
    assert 20.0 <= step_ms < 20.0 + 10.0, step_ms  # 5 steps of 20 ms queued, not ~0


def _skip_clock_across_an_eval_pass(rank: int, world: int) -> Tuple[float, int]:
    """3 training steps of 1 s, an eval pass of 2 batches of 100 s each (``model.eval()``, TorchRec's ``dlrm_main``
    pattern), 2 more training steps of 1 s, on the skip search's clock (a fixed one): its ms per step and the steps
    it timed."""
    from types import SimpleNamespace

    from herald_harness import build
    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.pipeline import stale_skip

    b = build(world, dict(RUNS["input_lazy"], steps=8, planner="herald"))
    pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], torch.device("cpu"), sync="lazy", window=WINDOW,
                               skip=SkipConfig("input", start=20, gap=GAP))  # (no snapshot in these steps)
    clock = [0.0]
    stale_skip.time = SimpleNamespace(perf_counter=lambda: clock[0])  # type: ignore[attr-defined]
    it = b["data"].train_batches(rank, world, b["batch_size"])

    def train(steps: int) -> None:
        for _ in range(steps):
            pipe.progress(it)
            clock[0] += 1.0

    train(3)
    b["dmp"].eval()
    evals = SyntheticCriteo(scale=b["data"].scale, num_train_batches=2, seed=7).train_batches(rank, world,
                                                                                              b["batch_size"])
    with torch.no_grad():
        for _ in range(2):
            pipe.progress(evals)
            clock[0] += 100.0
    b["dmp"].train()
    train(2)
    _, step_ms = pipe.skip_hook._timings_since_search()  # type: ignore[union-attr]
    return step_ms, pipe.skip_hook is not None


def test_the_skip_searchs_step_time_leaves_out_an_eval_pass() -> None:
    """Input skipping judges its classifier against the step time since its last search: an eval pass between
    training steps is no training step's time (it counted: 3 + 200 + 1 s over 4 steps, 51 s a step, here)."""
    for step_ms, hooked in run_multiprocess(_skip_clock_across_an_eval_pass, 2):
        assert hooked and step_ms == 1000.0


def test_skipping_needs_hot_rows() -> None:
    for r in _runs():
        msg = r["nohot"]
        assert msg.startswith("ValueError: ") and "pipeline.skip needs hot replication" in msg, msg


# ------------------------------------------------------------------------------------------ driver

SMALL = ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "data.num_train_batches=12", "data.num_eval_batches=2",
         "batch_size=64", "log_every=4", "data.scale=0.001", "pipeline.skip_start=2", "pipeline.skip_gap=3",
         "pipeline.window=2"]
BAD = {
    "target": ["pipeline.skip=row", "pipeline.skip_target=1.5"],
    "granularity": ["pipeline.skip=sample"],
    "beyond": ["pipeline.skip=input", "pipeline.skip_start=8", "pipeline.skip_gap=4"],
    "beyond_default": ["pipeline.skip=row", "pipeline.skip_start=20", "pipeline.skip_gap=10"],
    "staleness_eager": ["pipeline.staleness=1", "pipeline.sync=eager"],
    # refused by the approximate run's plan: before its exact reference trains (it was refused after)
    "nohot": ["pipeline.skip=input", "planner.hot_memory_budget_bytes=0"],
}


def _driver(rank: int, world: int, run_dir: str) -> Dict[str, Any]:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    out: Dict[str, Any] = {}
    tsv, evals = Path(run_dir) / "day_0.tsv", Path(run_dir) / "day_1.tsv"
    if rank == 0:  # 5 global batches of 2 × 64: a file's data ending before the first measuring window
        line = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a"] * 26) + "\n"
        tsv.write_text(line * 640)
        evals.write_text(line * 8)
    torch.distributed.barrier()
    bad = dict(BAD, file=["pipeline.skip=input", "data=criteo_tsv", f"data.paths={tsv}", f"data.eval_paths={evals}"])
    for name, extra in bad.items():
        d = Path(run_dir) / f"bad_{name}"
        base = [o for o in SMALL if not o.startswith("data.num_")] if name == "file" else SMALL
        out[name] = error_of(lambda: run_training(compose_config(base + extra), d, show_progress=False))
        out[f"{name}_trained"] = (d / "exact_reference").exists() or (d / "metrics.json").exists()
    out["metrics"] = run_training(compose_config(SMALL + ["pipeline.skip=row", "optimizer=rowwise_adagrad"]),
                                  Path(run_dir) / "run", show_progress=False)
    off = Path(run_dir) / "row_off"  # scheduling off trains eagerly, whatever pipeline.sync (lazy) says
    out["row_off"] = run_training(compose_config(SMALL + ["pipeline.skip=row", "pipeline.scheduling=off"]), off,
                                  show_progress=False)
    out["row_off_losses"] = [json.loads((d / "losses.json").read_text()) for d in (off, off / "exact_reference")]
    return out


def test_driver_records_skipping_and_rejects_bad_options(tmp_path: Path) -> None:
    res = run_multiprocess(_driver, 2, str(tmp_path), timeout_s=300)
    expected = {
        "target": "pipeline.skip_target must be in (0, 1), got 1.5",
        "granularity": "unknown pipeline.skip 'sample'",
        "beyond": "pipeline.skip snapshots at steps 8 and 12 are beyond the run's 12 steps",
        "beyond_default": "pipeline.skip snapshots at steps 20 and 30 are beyond the run's 12 steps",
        "staleness_eager": "pipeline.staleness needs pipeline.sync=lazy",
        "nohot": "pipeline.skip needs hot replication: this plan has no hot rows (planner=herald with a "
                 "planner.hot_memory_budget_bytes that holds some rows)",
        # skipping never started, with no word, where a file's data ended before its first measuring window
        "file": "pipeline.skip snapshots at steps 2 and 5 are beyond the run's 5 steps",
    }
    for r in res:
        for name, msg in expected.items():
            assert r[name].startswith("ValueError: ") and msg in r[name], (name, r[name])
            assert not r[f"{name}_trained"], name  # failed before the exact reference was trained
    m = res[0]["metrics"]
    a = m["approximate"]
    assert a["skip"] == "row" and a["staleness"] is None
    assert 0.0 < a["reference"]["eval"]["auc"] < 1.0 and math.isfinite(a["auc_delta"])
    assert 0 < a["skipped_update_share"] < 1
    assert len(a["skip_thresholds"]) == 1 and a["skip_thresholds"][0][0] == 5
    assert a["max_staleness"] == 0 and a["stale_read_share"] == 0
    ref = json.loads((tmp_path / "run" / "exact_reference" / "metrics.json").read_text())
    assert ref["config"]["pipeline"]["skip"] is None and ref["eval"] == a["reference"]["eval"]
    assert res[1]["metrics"]["approximate"]["skip_thresholds"] == a["skip_thresholds"]
    # skip=row with scheduling off froze nothing under the default sync=lazy: it reported a skipped share and
    # trained the exact model, loss for loss
    assert res[0]["row_off"]["approximate"]["skipped_update_share"] > 0
    skipped, exact = res[0]["row_off_losses"]
    assert skipped[:5] == exact[:5] and skipped != exact  # (exact until the first skip, at step 5)
