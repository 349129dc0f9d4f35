"""TrafficMeter counts what TorchRec itself sends, by the documented per-collective formulas."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
from herald_harness import messages_of

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.traffic import TrafficMeter, peer_lateness, reduce_summaries


def _collectives(rank: int, world: int) -> Dict[str, Any]:
    """Each collective once on a known payload; returns this rank's meter summary."""
    n = 10  # float32 elements -> 40 bytes
    with TrafficMeter(embedding_dim=5) as meter:
        dist.all_reduce(torch.ones(n))
        dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * world))
        dist.all_gather_into_tensor(torch.empty(n * world), torch.ones(n))
        dist.all_gather([torch.empty(n) for _ in range(world)], torch.ones(n))
        dist.broadcast(torch.ones(n), src=0)
        # uneven splits: rank r sends (j + 1) rows of width 3 to rank j
        splits = [j + 1 for j in range(world)]
        out_splits = [rank + 1] * world
        dist.all_to_all_single(torch.empty(sum(out_splits), 3), torch.ones(sum(splits), 3),
                               out_splits, splits)
        w = dist.all_reduce(torch.ones(n, dtype=torch.int64), async_op=True)
        w.wait()
        with meter.tag("hot", dim=2):
            dist.all_reduce(torch.ones(4))
        dist.barrier()
    return {"summary": meter.summary(), "tags": meter.tag_summary()}


@pytest.mark.parametrize("world", [2, 3])
def test_collective_byte_formulas_exact(world: int) -> None:
    res = run_multiprocess(_collectives, world)
    for rank, r in enumerate(res):
        s = r["summary"]
        nb = 40
        # all_reduce: ring 2(W-1)/W*N for the float payload, the int64 one (80 B), and the tagged 16 B one
        assert s["all_reduce"]["calls"] == 3
        assert s["all_reduce"]["bytes"] == (2 * (world - 1) * nb) // world + (2 * (world - 1) * 80) // world \
            + (2 * (world - 1) * 16) // world
        # only the tagged all_reduce counts embedding vectors (dim 2, float32)
        assert s["all_reduce"]["embedding_vectors"] == pytest.approx(((2 * (world - 1) * 16) // world) / 8)
        assert s["reduce_scatter_tensor"] == {"calls": 1, "bytes": ((world - 1) * nb * world) // world,
                                              "embedding_vectors": ((world - 1) * nb) / 20}
        assert s["all_gather_into_tensor"]["bytes"] == (world - 1) * nb
        assert s["all_gather"]["bytes"] == (world - 1) * nb
        assert s["broadcast"]["bytes"] == ((world - 1) * nb if rank == 0 else 0)
        rows_out = sum(j + 1 for j in range(world) if j != rank)
        assert s["all_to_all_single"]["bytes"] == rows_out * 3 * 4
        assert s["barrier"] == {"calls": 1, "bytes": 0, "embedding_vectors": 0.0}
        assert r["tags"] == {"hot": {"calls": 1, "bytes": (2 * (world - 1) * 16) // world,
                                     "embedding_vectors": ((2 * (world - 1) * 16) // world) / 8}}


def _meter_is_inactive_outside(rank: int, world: int) -> Dict[str, Any]:
    meter = TrafficMeter()
    with meter:
        dist.all_reduce(torch.ones(4))
    dist.all_reduce(torch.ones(4))  # not counted: outside the block
    with TrafficMeter() as outer:
        with TrafficMeter() as inner:
            dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4))
    import torch.distributed.distributed_c10d as c10d

    unpatched = not any(getattr(f, "_herald_meter", False) for f in (dist.all_reduce, c10d.all_reduce))
    with TrafficMeter() as uneven:  # rank 0 sends 16 B, rank 1 none: the sum over ranks is not W × one rank's
        dist.broadcast(torch.ones(4), src=0)
    return {"meter": meter.total(), "outer": outer.total(), "inner": inner.total(),
            "unpatched": unpatched,
            "reduced": reduce_summaries(meter.summary()), "uneven": reduce_summaries(uneven.summary())}


def test_meters_nest_and_unpatch() -> None:
    res = run_multiprocess(_meter_is_inactive_outside, 2)
    for r in res:
        assert r["meter"] == {"calls": 1, "bytes": 16, "embedding_vectors": 0.0}
        assert r["inner"]["calls"] == 1 and r["outer"]["calls"] == 2
        assert r["unpatched"]
        assert r["reduced"] == {"all_reduce": {"calls": 2, "bytes": 32, "embedding_vectors": 0.0}}
        assert r["uneven"] == {"broadcast": {"calls": 2, "bytes": 16, "embedding_vectors": 0.0}}


def _waits_by_label(rank: int, world: int) -> Dict[str, Any]:
    import time

    from torchrec_herald.traffic import traffic_tag

    dist.barrier()  # (both ranks start together: a late start-up on either side moves no wait)
    with TrafficMeter() as meter:
        with traffic_tag("sync_one"):
            if rank == 1:
                time.sleep(0.2)  # rank 0 waits in the sync collective for rank 1
            dist.all_reduce(torch.ones(4))
        with traffic_tag("async_one"):
            if rank == 1:
                time.sleep(0.2)
            work = dist.all_reduce(torch.ones(4), async_op=True)
        work.wait()  # rank 0 waits here, outside the tag: counted as async_one, the label it was started under
        dist.barrier()  # untagged
    return {"by_tag": dict(meter.wait_by_tag), "total": meter.wait_s}


def test_wait_is_attributed_to_the_label_of_the_collective_waited_for() -> None:
    res = run_multiprocess(_waits_by_label, 2)
    by_tag, total = res[0]["by_tag"], res[0]["total"]
    assert set(by_tag) == {"sync_one", "async_one", "untagged"}
    assert by_tag["sync_one"] >= 0.15 and by_tag["async_one"] >= 0.15  # the late peer's 0.2 s each
    assert abs(sum(by_tag.values()) - total) < 1e-9


def _durations(rank: int, world: int) -> Dict[str, Any]:
    import time

    from torchrec_herald.traffic import traffic_tag

    dist.barrier()  # (both ranks start together)
    with TrafficMeter(completion_times=True) as meter:
        with traffic_tag("overlapped"):
            if rank == 1:
                time.sleep(0.2)  # rank 0's call completes 0.2 s after it was made ...
            work = dist.all_reduce(torch.ones(4), async_op=True)
        time.sleep(0.5)  # ... while it works on, so its wait() finds it done
        work.wait()
        dist.barrier()
    out = {"duration": dict(meter.duration_by_tag), "by_kind": dict(meter.duration_by_kind),
           "wait": dict(meter.wait_by_tag)}
    # a call left in flight (herald's forward-ordered dense sums at a run's end) is waited for at the meter's exit:
    # its completion is timed before the process ends; and a meter that does not time completions adds no callback
    plain = TrafficMeter()
    with TrafficMeter(completion_times=True) as meter, plain:
        if rank == 1:
            time.sleep(0.2)
        dist.all_reduce(torch.ones(4), async_op=True)
    out.update(left_in_flight=dict(meter.duration_by_kind), plain=dict(plain.duration_by_kind))
    return out


def test_a_collectives_duration_runs_from_its_call_to_its_completion_where_its_wait_is_only_the_exposed_part() -> None:
    got = run_multiprocess(_durations, 2)[0]
    assert 0.15 <= got["duration"]["overlapped"] < 0.45, got  # the late peer's 0.2 s, not the 0.5 s worked beside
    assert got["wait"]["overlapped"] < 0.1, got  # done before its wait
    assert set(got["by_kind"]) == {"all_reduce", "barrier"} and got["by_kind"]["all_reduce"] == got["duration"]["overlapped"]
    assert got["left_in_flight"]["all_reduce"] >= 0.15 and got["plain"] == {}, got


def test_peer_lateness_sums_each_ranks_wait_for_its_latest_peer_at_each_collective() -> None:
    # three ranks, three collectives: the latest arrivals are 2, 10 and 25
    arrivals = [[0.0, 10.0, 20.0], [1.0, 10.0, 25.0], [2.0, 8.0, 20.0]]
    assert peer_lateness(arrivals) == [7.0, 1.0, 7.0]
    # rank 0 needed its third result at 24 (an async call worked beside), rank 2 its second at 9: 2 + 1, 0 + 1 + 5;
    # rank 1 never waited for its first (None: autograd's C++ waited for it, in the step's compute)
    assert peer_lateness(arrivals, [[0.0, 10.0, 24.0], [None, 10.0, 25.0], [2.0, 9.0, 20.0]]) == [3.0, 0.0, 6.0]
    with pytest.raises(ValueError, match=r"different numbers of collectives \(\[2, 3\]\)"):
        peer_lateness([[0.0, 1.0, 2.0], [0.0, 1.0]])
    with pytest.raises(ValueError,
                       match=r"^peer_lateness: 2 ranks' arrivals and 1 ranks' waits; every rank needs both$"):
        peer_lateness(arrivals[:2], [[0.0, 10.0, 20.0]])


def _arrivals(rank: int, world: int) -> Dict[str, Any]:
    import threading
    import time

    dist.barrier()
    with TrafficMeter(completion_times=True) as meter:
        if rank == 1:
            time.sleep(0.6)  # rank 0 waits for it at the first collective
        dist.all_reduce(torch.ones(4))
        if rank == 1:
            time.sleep(0.4)  # late again, but rank 0 works beside its async call for longer: no wait
        work = dist.all_reduce(torch.ones(4), dist.ReduceOp.SUM, None, True)  # (async by position)
        if rank == 0:
            time.sleep(0.8)
        work.wait()
        never = dist.all_reduce(torch.ones(4), async_op=True)  # its result taken from its future: never waited for
        never.get_future().wait()
        worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(2)))  # another thread's: not the step's
        worker.start()
        worker.join()
    got = [None] * world
    dist.all_gather_object(got, (meter.arrivals, meter.needed))
    return {"arrivals": [a for a, _ in got], "needed": [n for _, n in got],
            "calls": meter.summary()["all_reduce"]["calls"], "second_waited_after": [n[1] - a[1] for a, n in got]}


def test_a_meter_records_the_training_threads_arrivals_and_ranks_on_one_host_match_them_into_the_wait_for_peers(
) -> None:
    got = run_multiprocess(_arrivals, 2)[0]
    # the worker thread's call is counted, but has no arrival
    assert got["calls"] == 4 and [len(a) for a in got["arrivals"]] == [3, 3], got
    assert [n[2] for n in got["needed"]] == [None, None], got
    # at the calls: rank 0 late-waited 0.6 s, then 0.4 s; rank 1 reached the third 0.4 s before rank 0 (which worked)
    late = peer_lateness(got["arrivals"])
    assert 0.85 <= late[0] < 1.5 and 0.25 <= late[1] < 0.7, late
    exposed = peer_lateness(got["arrivals"], got["needed"])  # when needed: the second's lateness was worked beside
    assert 0.45 <= exposed[0] < 0.95 and exposed[1] < 0.1, exposed
    # the call async by position: rank 0 waited for it 0.8 s after the call, and that wait is what counts
    assert got["second_waited_after"][0] >= 0.75 and got["second_waited_after"][1] < 0.1, got


class _ClockAhead:
    """``time`` with ``perf_counter`` 100 s ahead: the clock of a rank on another host."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.ahead = 100.0  # (a test may let it drift)

    def perf_counter(self) -> float:
        return self._real.perf_counter() + self.ahead

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _two_steps_rank_1_late_on_its_own_clock(rank: int) -> Tuple[TrafficMeter, "_ClockAhead"]:
    """Two hosts, two clocks (rank 1's 100 s ahead): a meter recording two steps, in each of which rank 1 reaches the
    first all-reduce 0.3 s late; and rank 1's clock."""
    import time

    import torchrec_herald.traffic as traffic

    traffic._clock_identity = lambda: f"boot{rank}"
    clock = _ClockAhead(time)
    if rank == 1:
        traffic.time = clock
    meter = TrafficMeter()
    meter.arrival_times = True  # (as the trainer turns it on for its window)
    dist.barrier()
    with meter:
        for _ in range(2):
            if rank == 1:
                time.sleep(0.3)
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(4))
    return meter, clock


def _peer_wait_across_hosts(rank: int, world: int) -> Dict[str, Any]:
    import time

    import torchrec_herald.traffic as traffic

    meter, _ = _two_steps_rank_1_late_on_its_own_clock(rank)
    meter.arrival_times = False
    with meter:
        if rank == 1:
            time.sleep(0.3)  # not recorded: no part of the wait
        dist.all_reduce(torch.ones(4))
    return {"offsets": traffic.clock_offsets(), "peer_wait_ms": traffic.measured_peer_wait(meter, 2),
            "recorded": len(meter.arrivals), "none": traffic.measured_peer_wait(TrafficMeter(), 0)}


def test_the_wait_for_late_peers_is_measured_on_one_clock_across_hosts_from_the_recorded_steps_alone() -> None:
    """Ranks on several hosts share no clock: ``clock_offsets`` reads each rank's from when the ranks leave blocking
    all-reduces, so rank 0's wait for rank 1 (0.3 s a step) is measured, not rank 1's 100 s lead."""
    got = run_multiprocess(_peer_wait_across_hosts, 2)
    assert [g["recorded"] for g in got] == [4, 4] and got[0]["none"] is None
    off = got[0]["offsets"]
    assert off[0] == 0.0 and abs(off[1] - 100.0) < 0.05, off
    late = got[0]["peer_wait_ms"]
    assert got[1]["peer_wait_ms"] == late and 250 <= late[0] < 450 and late[1] < 50, late


def _peer_wait_with_drift(rank: int, world: int) -> Dict[str, Any]:
    import torchrec_herald.traffic as traffic

    meter, clock = _two_steps_rank_1_late_on_its_own_clock(rank)
    at_window = traffic.clock_offsets()  # (as the trainer reads them when its window closes)
    clock.ahead += 5.0  # (the run goes on; rank 1's clock drifts 5 s more)
    return {"window": traffic.measured_peer_wait(meter, 2, offsets=at_window),
            "end": traffic.measured_peer_wait(meter, 2)}


def test_the_wait_for_late_peers_uses_the_clocks_offsets_of_its_own_steps_not_of_the_runs_end() -> None:
    """Clocks of two hosts drift apart over a run: offsets read at the run's end put rank 1's recorded calls 5 s
    early, and its wait for rank 0 5 s a step. Read when the steps were recorded, the wait is rank 0's 0.3 s."""
    got = run_multiprocess(_peer_wait_with_drift, 2)[0]
    assert 250 <= got["window"][0] < 450 and got["window"][1] < 50, got
    assert got["end"][1] > 4000, got  # (the drift, taken for a wait)


def _left_in_flight_past_the_wait(rank: int, world: int) -> Dict[str, Any]:
    import time

    import torchrec_herald.traffic as traffic

    traffic.IN_FLIGHT_WAIT_S = 0.3
    said = messages_of(traffic.logger.name)
    dist.barrier()  # (both ranks start together)
    t0 = time.perf_counter()
    with TrafficMeter(completion_times=True) as meter:
        if rank == 0:
            work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 joins only after its meter's block
    closed_s = time.perf_counter() - t0
    if rank == 1:
        time.sleep(1.0)
        work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    time.sleep(0.1)
    return {"closed_s": closed_s, "said": said, "durations": dict(meter.duration_by_kind)}


def test_a_meter_waits_a_bounded_time_for_calls_in_flight_and_names_those_left() -> None:
    got = run_multiprocess(_left_in_flight_past_the_wait, 2)[0]
    assert 0.3 <= got["closed_s"] < 0.9, got  # the wait's 0.3 s, not the peer's 1 s
    assert got["said"] == ["TrafficMeter: 1 collective(s) still in flight 0.3 s after the meter's block ended; their "
                           "completion times are not counted"], got
    assert got["durations"] == {}, got  # (completed after the meter closed: not counted)


# --------------------------------------------------------------------------- TorchRec's own collectives
B, D, FEATURES, ROWS = 4, 8, ["f0", "f1", "f2", "f3"], [40, 30, 20, 10]


def _table_wise_step(rank: int, world: int) -> Dict[str, Any]:
    from torchrec.datasets.utils import Batch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim import apply_optimizer_in_backward

    from torchrec_herald.data import kjt_from_ids
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner.stock import describe_plan, stock_plan
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder
    from torchrec_herald.traffic import MeteredDataParallelWrapper

    tables = build_tables(FEATURES, ROWS, D)
    model = build_dlrm_train(tables, 3, [8, D], [8, 1], device="cpu")
    apply_optimizer_in_backward(torch.optim.SGD, model.model.sparse_arch.embedding_bag_collection.parameters(),
                                {"lr": 0.1})
    sharders = [CpuEmbeddingBagCollectionSharder()]
    plan = stock_plan(model, tables, sharders, "table_wise", world, B, torch.device("cpu"), dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders,
                                   data_parallel_wrapper=MeteredDataParallelWrapper(D))
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randint(0, n, (B,), generator=g) for n in ROWS])
    batch = Batch(torch.rand(B, 3, generator=g), kjt_from_ids(FEATURES, ids), torch.ones(B))
    owned = sum(1 for t in tables if plan.plan["model.sparse_arch.embedding_bag_collection"][t.name]
                .ranks == [rank])
    with TrafficMeter(embedding_dim=D) as fwd:
        loss, _ = dmp(batch)
    with TrafficMeter(embedding_dim=D) as bwd:
        loss.backward()
    dense_bytes = sum(p.numel() * p.element_size() for n, p in dmp.named_parameters()
                      if "embedding_bag_collection" not in n)
    return {"fwd": fwd.summary(), "bwd": bwd.summary(), "bwd_tags": bwd.tag_summary(), "owned": owned,
            "plan": describe_plan(plan), "dense_bytes": dense_bytes}


def test_meter_sees_torchrec_table_wise_all_to_all_exactly() -> None:
    """TABLE_WISE, 2 ranks: the pooled output all-to-all sends each remote sample's pooled vector of
    every locally owned feature; backward sends the same volume of gradients the other way."""
    world = 2
    res = run_multiprocess(_table_wise_step, world)
    assert set(res[0]["plan"].values()) == {"table_wise"}
    assert sum(r["owned"] for r in res) == len(FEATURES)
    f32 = 4
    fwd_float, bwd_float = [], []
    for rank, r in enumerate(res):
        fwd_a2a = r["fwd"]["all_to_all_single"]
        # per rank: its owned features' pooled vectors for the (W-1)*B remote samples
        expect_fwd_vectors = (world - 1) * B * r["owned"]
        assert fwd_a2a["embedding_vectors"] == expect_fwd_vectors
        fwd_float.append(fwd_a2a["embedding_vectors"] * D * f32)
        bwd_a2a = r["bwd"]["all_to_all_single"]
        # backward: gradients of this rank's B samples for the features owned by the other rank
        assert bwd_a2a["embedding_vectors"] == B * (len(FEATURES) - r["owned"])
        bwd_float.append(bwd_a2a["embedding_vectors"] * D * f32)
        # the dense (DDP) gradient all-reduce is seen too: ring 2(W-1)/W * dense param bytes
        assert r["bwd_tags"]["dense_allreduce"]["bytes"] == (2 * (world - 1) * r["dense_bytes"]) // world
        assert r["bwd"]["all_reduce"]["bytes"] == r["bwd_tags"]["dense_allreduce"]["bytes"]
    # the hand formula, per rank on average: B * features * dim * 4 * (W-1)/W
    assert sum(fwd_float) / world == B * len(FEATURES) * D * f32 * (world - 1) / world
    assert sum(bwd_float) / world == B * len(FEATURES) * D * f32 * (world - 1) / world


def _a_worker_counts_in_its_steps_meter(rank: int, world: int) -> Dict[str, Any]:
    """A worker thread given the step's meter (``counting_in``) after the step ended: its collectives count there,
    tagged there, and not in a second meter active meanwhile on the training thread, which sees only the worker's
    call after the block (as any thread's)."""
    import threading

    from torchrec_herald.pipeline.run_ahead import RunAhead
    from torchrec_herald.traffic import traffic_tag

    step = TrafficMeter()
    with step:
        meters = TrafficMeter.counting()
    other = TrafficMeter()

    def job() -> None:
        with TrafficMeter.counting_in(meters):
            with traffic_tag("ahead"):
                dist.all_reduce(torch.ones(4))  # 16 bytes: 2·(W−1)/W·16 sent
        dist.all_reduce(torch.ones(8))  # (32 bytes, outside the block: the active meter's)

    with other:
        t = threading.Thread(target=job)
        t.start()
        t.join()
    # the run-ahead worker does the same for the meters counting where its job was submitted
    ahead = RunAhead()
    with step:
        ahead.submit(dist.all_reduce, torch.ones(2))
    ahead.collect()
    ahead.shutdown()
    return {"step": step.summary(), "tags": step.tag_summary(), "other": other.summary(),
            "installed": getattr(dist.all_reduce, "_herald_meter", False)}


def test_a_workers_collectives_count_in_the_meter_of_the_step_that_gave_it_work() -> None:
    """herald's run-ahead job outlives the step that submitted it: its exchanges made between two steps (or in another
    run's turn) reached no meter, or the wrong one, and the counts moved from run to run."""
    for r in run_multiprocess(_a_worker_counts_in_its_steps_meter, 2):
        assert r["step"] == {"all_reduce": {"calls": 2, "bytes": 16 + 8, "embedding_vectors": 0.0}}, r
        assert r["tags"] == {"ahead": {"calls": 1, "bytes": 16, "embedding_vectors": 0.0}}, r
        assert r["other"] == {"all_reduce": {"calls": 1, "bytes": 32, "embedding_vectors": 0.0}}, r
        assert not r["installed"], r  # (no meter left counting: collectives are torch's own again)


def _train_with_a_late_rank(rank: int, world: int, run_dir: str, epochs: int = 1) -> Dict[str, Any]:
    import time
    from pathlib import Path

    import torchrec_herald.trainer as trainer
    from torchrec_herald.config import compose_config

    trainer.PEER_WAIT_WINDOW = (1, 8) if epochs == 1 else (7, 8)  # (20 and 200 by default)
    if rank == 1:
        trainer.fault_injection = lambda step, r: time.sleep(0.2)  # between its steps: late to the next one
    cfg = compose_config(["planner=table_wise", "pipeline=sparse_dist", "data.num_train_batches=10", "eval=false",
                          "batch_size=64", f"epochs={epochs}"])
    return trainer.run_training(cfg, Path(run_dir), show_progress=False)


def test_the_trainer_reports_each_ranks_wait_for_a_late_peer_over_its_window_of_steps(tmp_path: Any) -> None:
    """Rank 1 spends 0.2 s between its steps: rank 0 waits for it in each, rank 1 for nobody. Each rank's breakdown
    holds its own wait (part of its comm wait), and metrics.json every rank's. The window counts the waits for the
    collectives its steps made: a pipelined step waits for one the step before it made, so the first recorded step's
    wait falls outside the window (7 of 8 here; 199 of 200 by default)."""
    m0, m1 = run_multiprocess(_train_with_a_late_rank, 2, str(tmp_path))
    by_rank = m0["peer_wait_ms_by_rank"]
    assert m1["peer_wait_ms_by_rank"] == by_rank and 140 <= by_rank[0] < 320 and by_rank[1] < 40, by_rank
    assert m0["step_time_breakdown_ms"]["peer_wait"] == by_rank[0] and m0["peer_wait_steps"] == 8
    assert m1["step_time_breakdown_ms"]["peer_wait"] == by_rank[1]
    # (rank 0's comm wait over its 10 steps holds the 8 recorded steps' waits)
    assert 10 * m0["step_time_breakdown_ms"]["comm_wait"] >= 8 * by_rank[0] * 0.95


def test_a_window_past_an_epochs_end_counts_the_steps_that_ran_once(tmp_path: Any) -> None:
    """The window (steps 7 to 14) spans the first epoch's end: the epoch's end (no step) is not counted, nor the
    next epoch's first step twice."""
    m0, _ = run_multiprocess(_train_with_a_late_rank, 2, str(tmp_path), 2)
    assert m0["steps"] == 20 and m0["peer_wait_steps"] == 8
