"""``benchmarks/time_model.py``'s validation of the model of time on the committed ``bench_bandwidth`` runs: its
calibration puts stock TABLE_WISE at 2 ranks, 200 Mbit/s on its measured step exactly, each point is priced with its
own probe's rates and latency (the all-to-alls at the calibrated share of the probe's all-to-all rate), and a share
given is taken as given, no point marked a calibration; each 2-rank point adds its plan's measured wait for late
peers at the unlimited link."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import time_model as tm  # noqa: E402


def test_the_validation_calibrates_on_stock_table_wise_and_prices_each_point_with_its_own_probe() -> None:
    v = tm.validate()
    assert [(p["world_size"], p["rate_mbit"]) for p in v["points"]] == [(2, 0), (2, 200), (2, 50), (4, 0), (4, 200),
                                                                          (4, 50)]
    cal = next(p for p in v["points"] if (p["world_size"], p["rate_mbit"]) == (2, 200))
    assert cal["calibration_point"] and cal["stock_step_ms"]["error"] == pytest.approx(0.0, abs=1e-9)
    probes = tm.Probes(tm.VALIDATED)
    unlimited = tm.unlimited_runs(tm.UNLIMITED_RUNS)
    for p in v["points"]:
        W, rate = p["world_size"], p["rate_mbit"]
        measured = probes.by_point[(W, rate)]
        assert p["allreduce_mbit_used"] == measured["allreduce_mbit"]  # (this session's probes timed all-reduces)
        assert p["latency_ms_used"] == measured["collective_latency_ms"]
        assert p["link_mbit_used"] == pytest.approx(measured["link_mbit"] * v["a2a_share"], rel=1e-12)
        assert p["allreduce_call_ms"] == (v["shared_core_allreduce_call_ms"] if W > tm.CORES else 0.0)
        # the wait for late peers: the plan's own at the unlimited link where ranks have a core each, else none (the
        # host floor holds it)
        for side in ("stock", "herald"):
            kind = p["baseline"] if side == "stock" else p["herald_trained"]
            unl = tm.unlimited_row(kind, W, unlimited)
            assert p["peer_wait_ms"][side]["used"] == ((unl.get("peer_wait_ms") or 0.0) if W <= tm.CORES else 0.0), \
                (p, side)
        assert p["peer_wait_ms"]["stock"]["used"] > 0 or W > tm.CORES  # (this session's 2-rank runs measured one)
        assert p["peer_wait_ms"]["stock"]["measured"] is not None
    given = tm.validate(share=1.0, call_ms=0.0)
    assert given["a2a_share"] == 1.0 and given["calibrated"] == {}
    assert not any(p["calibration_point"] for p in given["points"])
    # a slower all-to-all share: stock TABLE_WISE's step at 2 ranks, 200 Mbit/s (all-to-all bound) grows
    assert given["points"][1]["stock_step_ms"]["predicted"] > cal["stock_step_ms"]["predicted"]


def test_bench_bandwidth_rotates_which_configuration_runs_first_in_a_repeat() -> None:
    """With one fixed order, any cost of a run's place in a repeat (on this host 1.9 % ± 2.0 % for the second, 30
    repeats of identical plans) is booked against the same configuration every time. Rotated, each
    configuration takes each place once in every len(configs) repeats."""
    import bench_bandwidth as bb

    assert [bb.run_order(["tw", "herald_defaults"], rep) for rep in range(4)] == \
        [["tw", "herald_defaults"], ["herald_defaults", "tw"]] * 2
    three = [bb.run_order(["a", "b", "c"], rep) for rep in range(3)]
    assert three == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(order[place] for order in three) == ["a", "b", "c"] for place in range(3))
    assert bb.run_order(["a"], 1) == ["a"] and bb.run_order(["a", "b", "c"], 3) == ["a", "b", "c"]
