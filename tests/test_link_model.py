"""The link model (torchrec_herald/planner/link_model.py): herald's plan is kept only where its predicted
per-rank cost on the given link is below stock TABLE_WISE's, with exact figures; bad keys are one error
naming the key; through the driver a fast link trains TABLE_WISE and says so, a slow one keeps herald."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.planner.link_model import LinkModel, decide

EXPECTED = [{"lookups": 600.0, "stock_table_wise": 6e5, "herald_total": 1e5},
            {"lookups": 400.0, "stock_table_wise": 4e5, "herald_total": 1e5}]


def test_slow_link_keeps_herald_with_the_predicted_costs() -> None:
    d = decide(EXPECTED, 2, LinkModel(link_mbit=200, collective_latency_ms=1.0, cpu_us_per_lookup=0.6))
    # stock: 5e5 B / 25 MB/s = 20 ms + 5 collectives; herald: 1e5 B = 4 ms + 7 collectives + 0.6 us x 500 lookups
    assert d.herald and d.stock_ms == pytest.approx(25.0) and d.herald_ms == pytest.approx(11.3)
    assert d.describe() == ("link 200 Mbit/s: predicted embedding cost per rank and step 11.3 ms with herald vs "
                            "25.0 ms stock TABLE_WISE -> herald's plan")


def test_fast_link_chooses_stock_table_wise_and_says_why() -> None:
    d = decide(EXPECTED, 2, LinkModel(link_mbit=10_000))
    assert not d.herald and d.stock_ms == pytest.approx(5.4) and d.herald_ms == pytest.approx(7.38)
    assert d.describe().endswith("-> stock TABLE_WISE with DDP (herald's replication, scheduling and forward-ordered "
                                 "dense sync cannot pay on this link)")
    assert d.as_dict()["herald"] is False and d.as_dict()["link_mbit"] == 10_000


@pytest.mark.parametrize("kwargs,message", [
    (dict(link_mbit=0), "planner.link_mbit must be > 0 Mbit/s (or null: unknown), got 0"),
    (dict(link_mbit=100, collective_latency_ms=-1), "planner.collective_latency_ms must be >= 0, got -1"),
    (dict(link_mbit=100, cpu_us_per_lookup=-0.5), "planner.cpu_us_per_lookup must be >= 0, got -0.5"),
])
def test_bad_link_keys_are_one_error_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        LinkModel(**kwargs)
    assert str(e.value) == message


def test_preflight_checks_the_link_keys() -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import preflight

    with pytest.raises(ValueError, match="planner.link_mbit must be > 0"):
        preflight(compose_config(["planner=herald", "planner.link_mbit=-5"]))


def _train(rank: int, world: int, overrides: list, run_dir: str) -> dict:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import run_training

    return run_training(compose_config(overrides), Path(run_dir), show_progress=False)


@pytest.mark.parametrize("mbit,herald", [(100_000, False), (20, True)])
def test_driver_trains_the_plan_the_link_model_chooses(tmp_path: Path, mbit: int, herald: bool) -> None:
    m = run_multiprocess(_train, 2, ["planner=herald", "pipeline=herald", f"planner.link_mbit={mbit}",
                                     "data.num_train_batches=8", "data.num_eval_batches=2", "batch_size=64",
                                     "pipeline.window=3"], str(tmp_path))[0]
    d = m["link_decision"]
    assert d["herald"] is herald and d["link_mbit"] == mbit and m["steps"] == 8
    kinds = set(m["plan"].values())
    if herald:
        assert kinds == {"herald_hot_row_wise"} and m["herald_pipeline"]["window"] == 3
        assert m["dense_sync"] == "forward_ordered"
    else:
        assert kinds == {"table_wise"} and m["herald_pipeline"] == {}  # TorchRec's TrainPipelineSparseDist
        assert m["dense_sync"] == "ddp"  # stock TABLE_WISE in full
        assert "cannot pay on this link" in d["text"]


@pytest.mark.parametrize("metrics,label", [
    ({"link_decision": {"herald": False}}, "herald -> table_wise (link model)"),
    ({"link_decision": {"herald": True}, "herald_pipeline": {"scheduling": {"decided": True, "mode": "on"}}},
     "herald + scheduling"),
    ({"herald_pipeline": {"scheduling": {"decided": True, "mode": "off"}}}, "herald (scheduling off: auto)"),
    ({"herald_pipeline": {"scheduling": {"decided": False, "mode": "off"}}}, "herald + scheduling"),
])
def test_the_compared_run_is_named_after_what_it_trained(metrics: dict, label: str) -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.train import run_label

    assert run_label(compose_config(["planner=herald", "pipeline=herald"]), metrics) == label
