"""Scheduling off the critical path (issue 10): ``pipeline.global_batches`` (every rank reads the whole
global batch and allocates/plans alone), ``pipeline.run_ahead`` (a worker thread schedules batch t+K and
plans step t+1 while step t trains) and ``pipeline.scheduling=auto`` (time scheduling on and off, keep
the faster).

* The global-batch path, with and without run-ahead, trains **bit for bit** what the per-rank path
  (scores all-gathered, samples exchanged, reads all-gathered) trains: the same per-step losses on every
  rank, the same final weights, the same samples moved and the same plan counters; and it sends no
  scheduling or sample bytes (TrafficMeter tags).
* ``off`` is hot replication alone under TorchRec's ``TrainPipelineSparseDist`` (this rank's slice of
  each global batch) and trains what stock TABLE_WISE trains.
* ``auto`` switches on its schedule (flushing the plan), decides the same on every rank, and trains
  what stock TABLE_WISE trains (1e-5 relative, as every exactness test).
* Stopping a run-ahead run early (a plan already made for the next step) and detaching leaves the
  model stock TABLE_WISE has after the same steps.
* A bad id in one rank's part of a global batch is one ValueError on every rank, naming the rank.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Dict, List, Tuple
from unittest import mock

import pytest
import torch

from herald_harness import MappedData, QueuedDevice, error_of, weight_rtol
from torchrec_herald.data import TrainStream
from torchrec_herald.pipeline.auto_scheduling import ON_MARGIN
from torchrec_herald.dist_utils import run_multiprocess

STEPS = 24
RTOL = 1e-5
COMMON = dict(optimizer="rowwise_adagrad", via="apply", pooling="SUM", steps=STEPS, batch_size=32)
AUTO = dict(global_batches=True, run_ahead=True, scheduling="auto", probe_steps=4)
BY_HOME_AUTO = dict(planning="by_home", scheduling="auto", probe_steps=4)


def _run(rank: int, world: int, cfg: Dict[str, Any], pipeline: Any, global_batches: bool,
         stop_after: int = 0, decide: str = "") -> Dict[str, Any]:
    from herald_harness import build, full_state, run_steps

    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.traffic import TrafficMeter

    # ``decide``: the probe's decision forced (timings on 2 shared cores decide either way)
    from torchrec_herald.pipeline.auto_scheduling import SchedulingSwitch

    forced = (mock.patch.object(SchedulingSwitch, "decide", staticmethod(lambda on_ms, off_ms: decide))
              if decide else contextlib.nullcontext())
    b = build(world, cfg)
    B = b["batch_size"]
    it: Any = b["data"].train_batches(rank, world, B)
    if global_batches:  # as trainer.train_stream: whole batches, switched to this rank's slices while off
        it = RecordedStream(b["data"], rank, world, B, whole=True)
    with forced, TrafficMeter(embedding_dim=8) as meter:
        if stop_after:  # stop mid-run: the run-ahead thread has planned the next step; detach flushes
            pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], **pipeline)
            losses = [pipe.progress(it)[0].item() for _ in range(stop_after)]
            pipe.detach()
        elif pipeline == "plain":
            losses = run_steps(b["dmp"], b["optimizer"], it, "plain")
            pipe = None
        else:
            losses = run_steps(b["dmp"], b["optimizer"], it, pipeline)
            pipe = run_steps.last_pipeline  # type: ignore[attr-defined]
    out = {"losses": losses, "state": full_state(b["dmp"]), "tags": meter.tag_summary(), "wait_s": meter.wait_s}
    if pipe is not None:
        out.update(moved=pipe.stats.moved_samples, counters=pipe.stats.counters, report=pipe.scheduling_report(),
                   overlapped=pipe.stats.ahead_s, comm_ahead=pipe.stats.comm_ahead_s)
    if isinstance(it, RecordedStream):
        out["reads"] = it.reads
    return out


class RecordedStream(TrainStream):
    """A ``TrainStream`` that records ``(global batch, samples read)`` of each batch it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads: List[Tuple[int, int]] = []

    def __next__(self) -> Any:
        position, batch = self.position, super().__next__()
        self.reads.append((position, batch.labels.numel()))
        return batch


def _worker(rank: int, world: int) -> Dict[str, Any]:
    herald = dict(COMMON, planner="herald")
    out: Dict[str, Any] = {
        # gathered: every rank plans all; the greedy allocator with a free move, as on whole global batches
        # (on per-rank batches allocator=auto moves a sample only where one lookup made local pays for it)
        "per_rank": _run(rank, world, herald, dict(planning="global", allocator="greedy", move_penalty=0,
                                                   run_ahead=False), False),
        # the same run ahead in the worker thread, its collectives on a group of its own (a user's own loader)
        "per_rank_ahead": _run(rank, world, herald, dict(planning="global", allocator="greedy", move_penalty=0), False),
        "global": _run(rank, world, herald, dict(global_batches=True, run_ahead=False, scheduling="on"), True),
        "ahead": _run(rank, world, herald, dict(global_batches=True, run_ahead=True, scheduling="on"), True),
        "auto": _run(rank, world, herald, AUTO, True),
        "auto_on": _run(rank, world, herald, AUTO, True, decide="on"),
        "auto_off": _run(rank, world, herald, AUTO, True, decide="off"),
        # planning by home probes too (per-rank batches, samples where loaded), either decision exact
        "by_home_auto_on": _run(rank, world, herald, BY_HOME_AUTO, False, decide="on"),
        "by_home_auto_off": _run(rank, world, herald, BY_HOME_AUTO, False, decide="off"),
        # HET's bounded staleness: its pushes travel with the next step's pulls when run ahead
        "per_rank_s1": _run(rank, world, herald, dict(planning="global", allocator="greedy", move_penalty=0,
                                                      staleness=1, run_ahead=False), False),
        "per_rank_ahead_s1": _run(rank, world, herald, dict(planning="global", allocator="greedy", move_penalty=0,
                                                            staleness=1), False),
        "ahead_s1": _run(rank, world, herald, dict(global_batches=True, run_ahead=True, scheduling="on", staleness=1),
                         True),
        "off": _run(rank, world, herald, dict(global_batches=True, run_ahead=True, scheduling="off"), True),
        "stock": _run(rank, world, dict(COMMON, planner="table_wise"), "plain", False),
        "stopped": _run(rank, world, herald, dict(global_batches=True, run_ahead=True, scheduling="on"), True,
                        stop_after=9),
        "stock_9": _run(rank, world, dict(COMMON, planner="table_wise", steps=9), "plain", False),
    }
    if world == 2:
        from herald_harness import build

        b = build(world, dict(herald, steps=4))
        feature = b["data"].feature_names[3]

        def poison(step: int, r: int, w: int, bs: int, batch: Any) -> Any:
            """Global batch 2: sample B+1 (rank 1's part) gets an id past its table."""
            if step != 2:
                return batch
            kjt = batch.sparse_features
            values = kjt.values().clone()
            start = int(kjt.offsets()[3 * bs + bs // 2 + 1])
            values[start] = 10**6
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths())
            return type(batch)(dense_features=batch.dense_features, sparse_features=kjt, labels=batch.labels)

        from torchrec_herald.pipeline import HeraldTrainPipeline

        data = MappedData(b["data"], poison)
        pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], global_batches=True, run_ahead=True,
                                   scheduling="on", window=1)
        it = data.train_batches(0, 1, world * b["batch_size"])
        out["bad_id"] = error_of(lambda: [pipe.progress(it) for _ in range(4)])
        # steps 0 and 1 trained whole (step 1 took the bad batch's job and ended first); a flush then leaves
        # stock's model after those two steps
        out["bad_id_steps"] = pipe.stats.steps
        pipe.flush()
        from herald_harness import full_state

        out["bad_id_state"] = full_state(b["dmp"])
        out["stock_2"] = _run(rank, world, dict(COMMON, planner="table_wise", steps=2), "plain", False)
        out["feature"] = feature
    return out


@functools.lru_cache(maxsize=None)
def results(world: int) -> List[Dict[str, Any]]:
    return run_multiprocess(_worker, world, timeout_s=600)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def _close(h: Dict[str, torch.Tensor], s: Dict[str, torch.Tensor]) -> None:
    assert set(h) == set(s)
    bad = {k: rel(h[k], s[k]) for k in s if not rel(h[k], s[k]) <= weight_rtol(COMMON["optimizer"])}
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("run", ["global", "ahead"])
def test_global_batches_train_bit_for_bit_like_the_per_rank_path(world: int, run: str) -> None:
    for r in results(world):
        ref, got = r["per_rank"], r[run]
        assert len(got["losses"]) == STEPS and got["losses"] == ref["losses"]
        assert all(torch.equal(got["state"][k], ref["state"][k]) for k in ref["state"])
        assert got["moved"] == ref["moved"] > 0 and got["counters"] == ref["counters"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ref, run", [("per_rank", "per_rank_ahead"), ("per_rank_s1", "per_rank_ahead_s1")])
def test_per_rank_batches_scheduled_ahead_train_bit_for_bit_as_on_the_critical_path(world: int, ref: str,
                                                                                    run: str) -> None:
    """A loader of each rank's own batches (not a TrainStream): the scores, samples and reads exchanged by the
    run-ahead thread on its own group train what the same exchanges on the critical path train."""
    for r in results(world):
        a, b = r[ref], r[run]
        assert len(b["losses"]) == STEPS and b["losses"] == a["losses"]
        assert all(torch.equal(b["state"][k], a["state"][k]) for k in a["state"])
        assert b["moved"] == a["moved"] > 0 and b["counters"] == a["counters"]
        # the exchanges ran in the worker thread: its collectives' time is counted there
        assert b["overlapped"] > 0 and a["overlapped"] == 0 and b["comm_ahead"] > 0 and a["comm_ahead"] == 0
        assert {"herald_samples", "herald_schedule_meta"} <= set(b["tags"])
        assert b["tags"]["herald_samples"] == a["tags"]["herald_samples"]
    # the rows moved, the pushes and the next pulls in one all-to-all (summed over the ranks: a rerouted pull is
    # sent by the pusher instead of the home): the exact plan's are the same rows; HET's as for whole global
    # batches (test_run_ahead_sends_bounded_staleness_pushes_with_the_next_pulls_...)
    moved = ("herald_pull", "herald_update_push", "herald_push_pull")
    ahead, serial = (sum(r[name]["tags"].get(t, {}).get("embedding_vectors", 0.0) for r in results(world) for t in moved)
                     for name in (run, ref))
    assert results(world)[0][run]["tags"]["herald_push_pull"]["calls"] >= STEPS // 2
    if ref == "per_rank":
        assert ahead == serial > 0, (ahead, serial)
    else:
        assert serial > 0 and (ahead <= serial if world == 2 else ahead > serial), (ahead, serial)


@pytest.mark.parametrize("world", [2, 3])
def test_global_batches_send_no_scheduling_or_sample_bytes(world: int) -> None:
    for r in results(world):
        assert {"herald_samples", "herald_schedule_meta"} <= set(r["per_rank"]["tags"])
        for run in ("global", "ahead"):
            assert not {"herald_samples", "herald_schedule_meta"} & set(r[run]["tags"]), r[run]["tags"]
        assert r["ahead"]["overlapped"] > 0 and r["global"]["overlapped"] == 0
        assert r["stock"]["wait_s"] > 0  # TrafficMeter timed stock's collectives (async ones via wait())


@pytest.mark.parametrize("world", [2, 3])
def test_run_ahead_sends_each_steps_pushes_with_the_next_steps_pulls_in_one_all_to_all(world: int) -> None:
    """With the next plan made ahead, the exact plan's pushes and the next step's pulls travel in one
    all-to-all (``herald_push_pull``), a pull of a row pushed home now sent by its pusher: the same rows
    move as in two collectives (and the training is bit for bit the per-rank path's, above)."""
    moved = ("herald_pull", "herald_update_push", "herald_push_pull")
    res = results(world)
    for r in res:
        ahead, serial = r["ahead"]["tags"], r["global"]["tags"]
        assert ahead["herald_push_pull"]["calls"] >= STEPS // 2, ahead
        assert "herald_push_pull" not in serial and "herald_push_pull" not in r["per_rank"]["tags"]
    # (summed over the ranks: a rerouted pull is sent by the pusher instead of the home)
    rows = [sum(r[run]["tags"].get(t, {}).get("embedding_vectors", 0.0) for r in res for t in moved)
            for run in ("ahead", "global")]
    assert rows[0] == rows[1] > 0, rows


@pytest.mark.parametrize("world", [2, 3])
def test_run_ahead_sends_bounded_staleness_pushes_with_the_next_pulls_and_trains_bit_for_bit_alike(world: int) -> None:
    """HET's pushes add to their home's row, so a pull of a pushed row is read from the home before the
    push and every push of that row goes to the puller too, who adds it as the home does: one all-to-all
    a step, and the training is the per-rank path's (two collectives) bit for bit. At 3 ranks a puller
    may be neither the home nor the pusher: such copies travel besides the rows of two collectives."""
    moved = ("herald_pull", "herald_update_push", "herald_push_pull")
    res = results(world)
    for r in res:
        ref, got = r["per_rank_s1"], r["ahead_s1"]
        assert len(got["losses"]) == STEPS and got["losses"] == ref["losses"]
        assert all(torch.equal(got["state"][k], ref["state"][k]) for k in ref["state"])
        assert got["counters"] == ref["counters"] and got["counters"].update_push > 0
        assert got["tags"]["herald_push_pull"]["calls"] >= STEPS // 2, got["tags"]
        assert "herald_push_pull" not in ref["tags"]
    rows = [sum(r[run]["tags"].get(t, {}).get("embedding_vectors", 0.0) for r in res for t in moved)
            for run in ("ahead_s1", "per_rank_s1")]
    # 2 ranks: a puller is the pusher (its own update stays local, as does a pull read from itself); 3: copies
    # of an added update to a third rank travel too
    assert rows[1] > 0 and (rows[0] <= rows[1] if world == 2 else rows[0] > rows[1]), rows


@pytest.mark.parametrize("world", [2, 3])
def test_auto_scheduling_probes_both_modes_decides_alike_and_stays_exact(world: int) -> None:
    res = results(world)
    reports = [r["auto"]["report"] for r in res]
    assert reports[0]["setting"] == "auto" and reports[0]["decided"] is True
    assert reports[0]["mode"] in ("on", "off") and all(rep == reports[0] for rep in reports)
    on_ms, off_ms = reports[0]["on_ms_per_step"], reports[0]["off_ms_per_step"]
    assert reports[0]["mode"] == ("on" if on_ms < (1 - ON_MARGIN) * off_ms else "off")
    # the probe ran with scheduling off (steps 6-13, under TrainPipelineSparseDist): hot rows synced then
    assert "herald_hot_sync" in res[0]["auto"]["tags"] and "herald_pull" in res[0]["auto"]["tags"]
    h = torch.tensor([r["auto"]["losses"] for r in res], dtype=torch.float64).mean(0)
    s = torch.tensor([r["stock"]["losses"] for r in res], dtype=torch.float64).mean(0)
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL
    for r in res:
        _close(r["auto"]["state"], r["stock"]["state"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("decided", ["on", "off"])
def test_either_probe_decision_trains_every_batch_once_like_stock(world: int, decided: str) -> None:
    """The probe's off phase runs under TorchRec's pipeline, which reads batches ahead: whichever mode
    wins, the run trains each global batch once, in order, as stock does."""
    res = results(world)
    for r in res:
        run = r[f"auto_{decided}"]
        assert run["report"]["mode"] == decided and run["report"]["decided"] is True
        assert len(run["losses"]) == STEPS
        _close(run["state"], r["stock"]["state"])
    h = torch.tensor([r[f"auto_{decided}"]["losses"] for r in res], dtype=torch.float64).mean(0)
    s = torch.tensor([r["stock"]["losses"] for r in res], dtype=torch.float64).mean(0)
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("decided", ["on", "off"])
def test_planning_by_home_probes_and_either_decision_trains_like_stock(world: int, decided: str) -> None:
    res = results(world)
    for r in res:
        run = r[f"by_home_auto_{decided}"]
        rep = run["report"]
        assert (rep["planning"], rep["setting"], rep["mode"], rep["decided"]) == ("by_home", "auto", decided, True), rep
        assert len(run["losses"]) == STEPS and "herald_schedule_meta" in run["tags"]
        _close(run["state"], r["stock"]["state"])
    h = torch.tensor([r[f"by_home_auto_{decided}"]["losses"] for r in res], dtype=torch.float64).mean(0)
    s = torch.tensor([r["stock"]["losses"] for r in res], dtype=torch.float64).mean(0)
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL


@pytest.mark.parametrize("world", [2, 3])
def test_scheduling_off_is_hot_replication_alone_under_torchrecs_pipeline(world: int) -> None:
    res = results(world)
    for r in res:
        off = r["off"]
        assert len(off["losses"]) == STEPS and {k: off["report"][k] for k in ("setting", "mode", "planning")} == \
            {"setting": "off", "mode": "off", "planning": "global"}
        assert "herald_pooled" in off["tags"] and "herald_pull" not in off["tags"] and off["moved"] == 0
        _close(off["state"], r["stock"]["state"])
    h = torch.tensor([r["off"]["losses"] for r in res], dtype=torch.float64).mean(0)
    s = torch.tensor([r["stock"]["losses"] for r in res], dtype=torch.float64).mean(0)
    assert float(((h - s).abs() / s.abs()).max()) <= RTOL


@pytest.mark.parametrize("world", [2, 3])
def test_stopping_a_run_ahead_run_early_leaves_stock_weights(world: int) -> None:
    res = results(world)
    for r in res:
        assert len(r["stopped"]["losses"]) == 9
        _close(r["stopped"]["state"], r["stock_9"]["state"])


def test_bad_id_in_one_ranks_part_of_a_global_batch_is_one_error_on_every_rank() -> None:
    for r in results(2):
        msg = r["bad_id"]
        assert msg.startswith("ValueError: id 1000000 of feature "), msg
        assert f"'{r['feature']}'" in msg and "rank 1's batch" in msg, msg
        # raised by the third progress(), before it trained anything: the second step ended whole
        assert r["bad_id_steps"] == 2
        _close(r["bad_id_state"], r["stock_2"]["state"])


def test_options_of_the_run_ahead_path_are_checked() -> None:
    from torchrec_herald.pipeline.options import HeraldPipelineConfig
    from torchrec_herald.pipeline.stale_skip import SkipConfig

    # scheduling=auto where the batches are per rank: the probe cannot run, scheduling stays on (said in one
    # line); the per-rank batches' scheduling still runs ahead (its exchanges on a group of its own)
    config, why = HeraldPipelineConfig(scheduling="auto", global_batches=False).resolve(whole_batches=True, world_size=2)
    assert (config.scheduling, config.run_ahead) == ("on", True) and why == [
        "pipeline.planning=auto -> global at W=2 <= 2: planning every row with the input allocator measured faster there",
        "pipeline.scheduling=auto -> on: the probe needs whole global batches on every rank, or planning by home"]
    # a loader that is not a TrainStream: the same; run_ahead=false is kept
    config, _ = HeraldPipelineConfig().resolve(whole_batches=False, world_size=2)
    assert (config.global_batches, config.run_ahead) == (False, True)
    config, _ = HeraldPipelineConfig(run_ahead=False).resolve(whole_batches=False, world_size=2)
    assert (config.global_batches, config.run_ahead) == (False, False)
    with pytest.raises(ValueError, match=r"unknown pipeline.scheduling 'maybe'; known: \['on', 'off', 'auto'\]"):
        HeraldPipelineConfig(scheduling="maybe", global_batches=True)
    with pytest.raises(ValueError, match="pipeline.probe_steps must be >= 2, got 1"):
        HeraldPipelineConfig(probe_steps=1)
    # the probe's off phase trains the window's batches within its own steps: none may be left over
    with pytest.raises(ValueError, match=r"pipeline.window=5 is larger than the 3 steps scheduling=auto probes with "
                                         r"scheduling on \(pipeline.probe_steps=2: probe_steps // 2 \+ probe_steps\)"):
        HeraldPipelineConfig(scheduling="auto", probe_steps=2, window=5, global_batches=True).resolve(True, 2)
    for no_probe in (dict(scheduling="on", global_batches=True), dict(scheduling="auto", global_batches=False)):
        HeraldPipelineConfig(probe_steps=2, window=5, **no_probe).resolve(True, 2)
    # skipping runs on whole global batches and ahead, like the exact plan
    config, _ = HeraldPipelineConfig(global_batches=True, skip=SkipConfig(granularity="input")).resolve(True, 2)
    assert (config.global_batches, config.run_ahead, config.scheduling) == (True, True, "auto")


def test_hydra_defaults_schedule_ahead_with_skipping_too_and_staleness_keeps_the_plan_on() -> None:
    """The trainer's stream can read whole global batches: the defaults then schedule ahead and probe."""
    from torchrec_herald.config import compose_config, validate
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    def decided(overrides: List[str]) -> Tuple[Any, ...]:
        pipeline = validate(compose_config(["planner=herald", "pipeline=herald", *overrides])).pipeline
        assert isinstance(pipeline, HeraldPipelineConfig)
        c, _ = pipeline.resolve(True, 2)
        return c.global_batches, c.run_ahead, c.scheduling

    assert decided([]) == (True, True, "auto")
    assert decided(["pipeline.skip=input"]) == (True, True, "auto")
    assert decided(["pipeline.skip=row"]) == (True, True, "auto")
    assert decided(["pipeline.staleness=1"]) == (True, True, "on")  # its plan stays on


def test_run_ahead_batches_are_consumed_in_order() -> None:
    """The trainer's global stream for a herald pipeline is the source's global batches, in order."""
    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.pipeline.train_pipeline import select_samples

    data = SyntheticCriteo(scale=0.001, num_train_batches=3, seed=1)
    glob = list(data.train_batches(0, 1, 8))
    mine = list(itertools.chain.from_iterable(data.train_batches(r, 2, 4) for r in range(2)))
    for i, g in enumerate(glob):
        for r in range(2):
            part = select_samples(g, torch.arange(r * 4, (r + 1) * 4))
            ref = list(data.train_batches(r, 2, 4))[i]
            assert torch.equal(part.dense_features, ref.dense_features) and torch.equal(part.labels, ref.labels)
            assert torch.equal(part.sparse_features.values(), ref.sparse_features.values())
            assert torch.equal(part.sparse_features.lengths(), ref.sparse_features.lengths())
    assert len(mine) == 6


@pytest.mark.parametrize("world", [2, 3])
def test_scheduling_off_reads_only_this_ranks_slice_of_each_global_batch(world: int) -> None:
    """While scheduling is off the stream reads this rank's B samples of a global batch, not all W·B:
    each global batch is read once, in order, whichever mode reads it."""
    B = COMMON["batch_size"]
    probe_end = 2 * (AUTO["probe_steps"] // 2 + AUTO["probe_steps"]) + 2  # the probe's steps and its drain
    for r in results(world):
        for run in ("off", "auto", "auto_on", "auto_off", "global", "ahead"):
            assert [p for p, _ in r[run]["reads"]] == list(range(STEPS)), run
        assert r["off"]["reads"] == [(i, B) for i in range(STEPS)]
        assert r["global"]["reads"] == [(i, world * B) for i in range(STEPS)]
        off, on = dict(r["auto_off"]["reads"]), dict(r["auto_on"]["reads"])
        assert off[0] == on[0] == world * B  # the probe starts with scheduling on
        assert all(off[i] == B for i in range(probe_end, STEPS))  # decided off: slices from the probe on
        assert on[STEPS - 1] == world * B and B in on.values()  # the probe's off phase read slices


def test_auto_keeps_scheduling_only_where_it_wins_by_the_margin() -> None:
    from torchrec_herald.pipeline.auto_scheduling import SchedulingSwitch

    assert SchedulingSwitch.decide(43.3, 47.8) == "on"  # 9 % faster (50 Mbit/s, 2 ranks, this host)
    assert SchedulingSwitch.decide(31.1, 31.7) == "off"  # a 2 % tie (200 Mbit/s with other work beside)
    assert SchedulingSwitch.decide(33.7, 30.4) == "off"
    assert SchedulingSwitch.decide(0.97 * 30.0 - 1e-9, 30.0) == "on"
    assert SchedulingSwitch.decide(30.0, 30.0) == "off"


@pytest.mark.parametrize("cut", [None, "turn", "eval"])
def test_auto_times_the_probe_by_the_devices_work_waiting_once_at_each_end_of_a_timed_span(cut: Any) -> None:
    """On a GPU the host only queues a step's work: ``scheduling=auto``'s probe waits for the device where a timed
    span of one mode begins and ends (and where another run's turn, or an eval pass, cuts a span: ``stop_clock``),
    so each mode's time is the device's (here 4 timed steps of 20 ms queued work each), with one wait at each end
    instead of one a step."""
    from types import SimpleNamespace

    from torchrec_herald.pipeline.auto_scheduling import SchedulingSwitch

    device = QueuedDevice(0.02)
    host = SimpleNamespace(mode="on", stats=SimpleNamespace(steps=0))
    host.enter_mode = lambda mode: setattr(host, "mode", mode)
    switch = SchedulingSwitch(host, "auto", 4, lambda: None, None, 1, 0, device_sync=device.sync)  # type: ignore[arg-type]
    # probe_steps=4: steps 0-1 on untimed, 2-5 on timed, 6-7 off untimed, 8-11 off timed, 12-13 the drain
    assert switch.probe_length() == 14
    modes = []
    for step in range(switch.probe_length()):
        host.stats.steps = device.steps = step
        switch.before_step()
        modes.append(host.mode)
        device.queued += device.step_s  # (the step's launches return at once)
        if cut is not None and step + 1 == 4:
            device.steps = host.stats.steps = step + 1
            if cut == "turn":
                switch.stop_clock()  # (the other run's turn)
            else:  # an eval step through TorchRec's pipeline queues 50 ms of the device's work: no probe step's
                switch._delegate = SimpleNamespace(progress=lambda it: setattr(device, "queued", device.queued + 0.05))
                switch.eval_in_flight(iter(()))
                switch._delegate = None
    assert modes == ["on"] * 6 + ["off"] * 8
    expected = [2, 6, 8, 12] if cut is None else [2, 4, 4, 6, 8, 12]
    assert device.synced_before == expected
    probe = switch.probe
    assert probe["steps"] == {"on": 4, "off": 4}
    for mode in ("on", "off"):  # the device's 4 × 20 ms, not the host's launches (~0)
        assert 0.08 <= probe["seconds"][mode] < 0.08 + 0.05, probe


def test_device_sync_waits_on_a_cuda_device_only() -> None:
    from torchrec_herald.dist_utils import device_sync

    assert device_sync("cpu") is None and device_sync(torch.device("cpu")) is None
    assert callable(device_sync("cuda:0"))  # (not called: no GPU needed)


def _chain_worker(rank: int, world: int) -> Dict[str, Any]:
    """Each run-ahead job of 6 exact steps, as ``(steps trained when submitted, step it plans, plan made
    ahead)``: once with no checkpoint schedule, once with a checkpoint after 5 steps."""
    from herald_harness import build

    from torchrec_herald.pipeline import HeraldTrainPipeline
    from torchrec_herald.pipeline.run_ahead import RunAhead

    out: Dict[str, Any] = {}
    for name, due in (("plain", None), ("checkpoint_after_5", lambda n: n == 5)):
        b = build(world, dict(COMMON, planner="herald", steps=12))
        it = RecordedStream(b["data"], rank, world, b["batch_size"], whole=True)
        pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], global_batches=True, run_ahead=True,
                                   scheduling="on", window=3)
        if due is not None:
            pipe.checkpoint_schedule(due)
        jobs: List[Tuple[int, int, bool]] = []
        own = RunAhead.submit

        def recorded(ahead: Any, job: Any, it: Any, train_step: int, plan_ahead: bool, window: List[Any]) -> None:
            jobs.append((pipe.stats.steps, window[0].train_step if window else train_step, plan_ahead))
            own(ahead, job, it, train_step, plan_ahead, window)

        with mock.patch.object(RunAhead, "submit", recorded):
            for _ in range(6):
                pipe.progress(it)
        pipe.detach()
        out[name] = jobs
    return out


def test_the_run_ahead_thread_plans_the_step_after_next_while_a_step_trains_but_not_across_a_checkpoint() -> None:
    for r in run_multiprocess(_chain_worker, 2, timeout_s=600):
        # the first step's job plans step 1; from then on, while step t trains (t + 1 steps counted), the
        # next job starts at once and plans step t + 2
        assert r["plain"] == [(0, 1, True)] + [(t + 1, t + 2, True) for t in range(6)]
        # step 5 follows the checkpoint after 5 steps: no job plans it ahead (the step plans it on the critical
        # path, after the checkpoint's flush) and none starts during step 4 (it would plan step 5 again); step
        # 5 starts the job that plans step 6, and the chain goes on
        assert r["checkpoint_after_5"] == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True), (4, 5, False),
                                           (5, 6, True), (6, 7, True)]


def _a_loaders_batches_said_global(rank: int, world: int, whole: bool) -> str:
    from herald_harness import build

    from torchrec_herald.pipeline import HeraldTrainPipeline

    b = build(world, dict(COMMON, planner="herald"))
    B, data = b["batch_size"], b["data"]
    it = iter(data.train_batches(0, 1, world * B) if whole else data.train_batches(rank, world, B))
    pipe = HeraldTrainPipeline(b["dmp"], b["optimizer"], b["device"], global_batches=True, run_ahead=False,
                               scheduling="on", window=2)
    return error_of(lambda: [pipe.progress(it) for _ in range(3)])


@pytest.mark.parametrize("whole", [True, False])
def test_global_batches_from_a_loader_of_each_ranks_own_batches_are_refused_on_every_rank(whole: bool) -> None:
    """``global_batches=True`` given a loader of each rank's own batches trained each rank's "slice" of its own batch
    (losses off by 1.4e-2 a step, with scheduling off) or broke gloo (scheduling on): every rank now checks that
    its batch is every rank's (a digest of ids, lengths and labels, gathered with the batch's description)."""
    got = run_multiprocess(_a_loaders_batches_said_global, 2, whole)
    if whole:
        assert got == ["no error", "no error"]
    else:
        assert got[0] == got[1] == (
            "ValueError: HeraldTrainPipeline, batch 0: pipeline.global_batches=true says every rank's loader yields the "
            "same whole global batch, but the labels or dense features of rank(s) [1] differ from rank 0's; a loader of "
            "each rank's own batches needs global_batches=false (or null)")


def test_the_python_apis_options_are_type_checked_naming_the_key() -> None:
    """The command line's typed config refused these; the Python API cut 2.5 to 2, took "false" for true, and let an
    infinite skip_t_max search for a threshold that skipped every row."""
    from torchrec_herald.pipeline.options import HeraldPipelineConfig

    for kw, message in [
        (dict(window=2.5), "pipeline.window must be an integer, got 2.5"),
        (dict(window="abc"), "pipeline.window must be an integer, got 'abc'"),
        (dict(probe_steps=2.9), "pipeline.probe_steps must be an integer, got 2.9"),
        (dict(move_penalty=1.5), "pipeline.move_penalty must be an integer or null, got 1.5"),
        (dict(global_batches="false"), "pipeline.global_batches must be true or false or null, got 'false'"),
        (dict(run_ahead="no"), "pipeline.run_ahead must be true or false or null, got 'no'"),
        (dict(reference="no"), "pipeline.reference must be true or false, got 'no'"),
        (dict(skip="input", skip_start=1.5), "pipeline.skip_start must be an integer, got 1.5"),
        (dict(skip="input", skip_target="0.3"), "pipeline.skip_target must be a finite number, got '0.3'"),
        (dict(skip="input", skip_t_max=float("inf")), "pipeline.skip_t_max must be a finite number, got inf"),
        (dict(skip="input", skip_t_max=1e30), "pipeline.skip_t_max must be in (0, 1000], got 1e+30"),
    ]:
        assert error_of(lambda: HeraldPipelineConfig(**kw)) == f"ValueError: {message}", kw
    assert HeraldPipelineConfig(window=5.0).window == 5


@pytest.mark.parametrize("on_ms, off_ms, said", [
    (29.1, 29.8, ": scheduling saved 2.3 %, under the 3 % it must save to stay on"),
    (31.0, 29.8, ": scheduling costs more time than it saves on this link and machine"),
    (20.0, 29.8, ""),
])
def test_the_probe_says_why_scheduling_stays_off_a_near_tie_named_as_one(on_ms: float, off_ms: float,
                                                                          said: str) -> None:
    from torchrec_herald.pipeline.auto_scheduling import SchedulingSwitch

    best = SchedulingSwitch.decide(on_ms, off_ms)
    assert best == ("on" if not said else "off")
    assert SchedulingSwitch.why(on_ms, off_ms, best).startswith(said) and bool(said) == bool(
        SchedulingSwitch.why(on_ms, off_ms, best))
