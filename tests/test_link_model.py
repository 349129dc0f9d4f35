"""The link model (torchrec_herald/planner/pricing.py) and the model of time (planner/time_model.py):
the plan with the shortest predicted per-rank step on the given link is chosen, with exact figures; bad keys are one error
naming the key; through the driver a fast link trains TABLE_WISE and says so, a slow one keeps herald."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
from herald_harness import messages_of

from torchrec_herald.dist_utils import run_multiprocess
from torchrec_herald.planner.pricing import LinkModel
from torchrec_herald.planner.time_model import decide

EXPECTED = [{"lookups": 600.0, "stock_table_wise": 6e5, "herald_total": 1e5},
            {"lookups": 400.0, "stock_table_wise": 4e5, "herald_total": 1e5}]


def test_slow_link_keeps_herald_with_the_predicted_costs() -> None:
    d = decide(EXPECTED, 2, LinkModel(link_mbit=200, collective_latency_ms=1.0, cpu_us_per_lookup=0.6))
    # stock: 5e5 B / 25 MB/s = 20 ms + 5 collectives; herald: 1e5 B = 4 ms + 7 collectives + 0.6 us x 500 lookups
    assert d.herald and d.stock_ms == pytest.approx(25.0) and d.herald_ms == pytest.approx(11.3)
    assert d.describe() == ("link 200 Mbit/s: predicted step cost per rank (link, collectives, herald's extra work) "
                            "herald's plan 11.3 ms, stock TABLE_WISE 25.0 ms -> herald's plan")
    assert d.chosen == "herald" and d.as_dict()["predicted"]["table_wise"]["comm_ms"] == pytest.approx(25.0)


def test_dense_all_reduce_counts_on_tw_path_but_overlaps_herald_forward_ordered_sync() -> None:
    """2e5 dense bytes per rank at 200 Mbit/s = 8 ms: on TABLE_WISE's path (DDP); under herald's forward-ordered sync
    they hide behind compute alone (herald's extra work, and the step's compute where known), not behind the
    critical collectives, which share their link: herald's link part is 4 + 8 ms of bytes and 7 latencies."""
    from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel

    link = LinkModel(link_mbit=200, collective_latency_ms=1.0, cpu_us_per_lookup=0.6)
    d = decide(EXPECTED, 2, link, dense_bytes=2e5)
    assert d.stock_ms == pytest.approx(33.0) and d.herald_ms == pytest.approx(19.0)  # (0.3 ms of extra work hides 0.3)
    assert d.predictions["herald"].link_busy_ms == pytest.approx(19.0)
    ddp = decide(EXPECTED, 2, link, dense_bytes=2e5, dense_sync="ddp")
    assert ddp.herald_ms == pytest.approx(19.3)
    herald = PlanLoad("herald", 1e5, 2e5, 7, 500.0)  # (its load above: 4 ms of bytes, 8 overlapped, 500 lookups)
    assert StepTimeModel.on(link).predict(herald).step_ms == pytest.approx(19.0)
    with_compute = StepTimeModel(**{**vars(link), "compute_ms": 10.0})  # 10 ms of compute hide the 8 ms
    assert with_compute.predict(herald).step_ms == pytest.approx(10.0 + 11.3)


def test_default_plan_is_chosen_where_it_is_predicted_fastest() -> None:
    from torchrec_herald.planner.time_model import default_plan_load

    expected = {"a": EXPECTED[0], "b": {**EXPECTED[1], "stock_row_wise": 2e5}}
    # a: TABLE_WISE 6e5; b: ROW_WISE 2e5; c: DATA_PARALLEL, 1e4 B of table -> 2·(1/2)·1e4·2 = 2e4 all ranks
    load = default_plan_load({"a": "table_wise", "b": "row_wise", "c": "data_parallel"}, expected,
                             {"c": 1e4}, 2, dense_bytes=0.0)
    assert load.critical_bytes == pytest.approx((6e5 + 2e5 + 2e4) / 2) and load.collectives == 5 + 5 + 1
    cheap = default_plan_load({"a": "data_parallel"}, expected, {"a": 1e3}, 2, dense_bytes=0.0)
    d = decide(EXPECTED, 2, LinkModel(link_mbit=10_000), default_plan=cheap)
    assert d.chosen == "default" and not d.herald
    assert d.predictions["default"].step_ms == pytest.approx(1e3 * 8 / 1e7 + 1.0)
    assert "-> TorchRec's default plan with DDP" in d.describe()


def test_the_default_plan_must_beat_table_wise_by_more_than_one_collectives_latency() -> None:
    """TorchRec's default plan predicted faster than TABLE_WISE by less than one collective's latency: TABLE_WISE
    trains (the model cannot tell them apart, and the default plan's extra sharding kinds compute more than it
    prices), and the decision says why; by more: the default plan."""
    from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel, choose_plan

    m = StepTimeModel(link_mbit=0.008, collective_latency_ms=0.5)  # 1 B per ms: bytes read as ms
    herald = PlanLoad("herald", 50.0, collectives=7)  # 53.5 ms
    tw = PlanLoad("table_wise", 40.0, collectives=5)  # 42.5 ms

    def default(ms: float) -> PlanLoad:
        return PlanLoad("default", ms - 3.0, collectives=6)

    close = choose_plan([herald, tw, default(42.0)], m)  # 0.5 ms faster: within the latency
    assert close.chosen == "table_wise" and close.predictions["default"].step_ms == pytest.approx(42.0)
    assert close.describe().endswith(
        "-> stock TABLE_WISE with DDP (herald's replication, scheduling and forward-ordered dense sync cannot pay on "
        "this link); TorchRec's default plan is predicted within one collective's latency (0.50 ms) of stock "
        "TABLE_WISE, closer than the model can tell; its extra sharding kinds compute more beside the link than the "
        "model prices"), close.describe()
    assert close.as_dict()["note"] == close.note != ""
    clear = choose_plan([herald, tw, default(41.9)], m)
    assert clear.chosen == "default" and clear.note == "" and clear.as_dict()["note"] == ""
    # herald predicted between the two, within the margin: the fastest of the others, herald
    between = choose_plan([PlanLoad("herald", 38.7, collectives=7), tw, default(42.0)], m)  # herald 42.2 ms
    assert between.chosen == "herald" and between.note
    # without a TABLE_WISE candidate there is nothing to prefer: the fastest
    assert choose_plan([herald, default(42.0)], m).chosen == "default"


def test_step_time_model_takes_the_longest_of_path_link_and_host() -> None:
    from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel

    m = StepTimeModel(link_mbit=80, collective_latency_ms=0.5, compute_ms=10.0, cpu_us_per_lookup=1.0)
    # 1e5 B at 80 Mbit/s = 10 ms; path = 10 + 2 (2000 lookups) + 1 (scheduler) + 10 + 2·0.5 = 24
    p = m.predict(PlanLoad("x", 1e5, 0.0, 2, lookups=2000, scheduler_ms=1.0))
    assert (p.compute_ms, p.extra_ms, p.comm_ms, p.step_ms) == pytest.approx((10.0, 3.0, 11.0, 24.0))
    # the link: 4e5 B = 40 ms and the 2 critical collectives' latencies (the 3e5 B overlapped hide behind compute alone)
    assert m.predict(PlanLoad("y", 1e5, 3e5, 2)).step_ms == pytest.approx(41.0)
    assert m.predict(PlanLoad("z", 0.0, host_bound_ms=50.0)).step_ms == 50.0
    # a measured wait for late peers holds the path (24 + 3), not the link (still 10 ms + 2 latencies)
    late = m.predict(PlanLoad("x", 1e5, 0.0, 2, lookups=2000, scheduler_ms=1.0, peer_wait_ms=3.0))
    assert (late.comm_ms, late.link_busy_ms, late.step_ms) == pytest.approx((14.0, 11.0, 27.0))
    # where the link is busiest, the peers' lateness hides behind it: 41 ms, not 10 + 11 + 3
    assert m.predict(PlanLoad("y", 1e5, 3e5, 2, peer_wait_ms=3.0)).step_ms == pytest.approx(41.0)


def test_fast_link_chooses_stock_table_wise_and_says_why() -> None:
    d = decide(EXPECTED, 2, LinkModel(link_mbit=10_000))
    assert not d.herald and d.stock_ms == pytest.approx(5.4) and d.herald_ms == pytest.approx(7.38)
    assert d.describe().endswith("-> stock TABLE_WISE with DDP (herald's replication, scheduling and forward-ordered "
                                 "dense sync cannot pay on this link)")
    assert d.as_dict()["herald"] is False and d.as_dict()["link_mbit"] == 10_000


@pytest.mark.parametrize("kwargs,message", [
    (dict(link_mbit=0), "LinkModel.link_mbit (planner.link_mbit) must be > 0 Mbit/s (or null: unknown), got 0"),
    # an infinite rate read as one rank's local "link" (a 2-rank job described itself as one rank)
    (dict(link_mbit=float("inf")), "LinkModel.link_mbit (planner.link_mbit) must be > 0 Mbit/s (or null: unknown), got inf"),
    # an infinite latency priced every candidate at inf, and the per-table pick raised KeyError
    (dict(link_mbit=100, collective_latency_ms=float("inf")), "LinkModel.collective_latency_ms (planner.collective_latency_ms) must be >= 0, got inf"),
    (dict(link_mbit="200"), "LinkModel.link_mbit (planner.link_mbit) must be a number, got '200'"),  # (was: TypeError from '>')
    (dict(link_mbit=True), "LinkModel.link_mbit (planner.link_mbit) must be a number, got True"),  # (was: 1 Mbit/s)
    (dict(link_mbit=100, collective_latency_ms=-1), "LinkModel.collective_latency_ms (planner.collective_latency_ms) must be >= 0, got -1"),
    (dict(link_mbit=100, cpu_us_per_lookup=-0.5), "LinkModel.cpu_us_per_lookup (planner.cpu_us_per_lookup) must be >= 0, got -0.5"),
])
def test_bad_link_keys_are_one_error_naming_the_key(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        LinkModel(**kwargs)
    assert str(e.value) == message


def test_only_the_one_rank_link_is_infinite() -> None:
    from torchrec_herald.planner.time_model import StepTimeModel

    local = LinkModel.local(0.6)
    assert local.is_local and local.link_mbit == float("inf") and not LinkModel(link_mbit=1e9).is_local
    assert StepTimeModel.on(local).is_local and StepTimeModel.on(local) == StepTimeModel.on(LinkModel.local(0.6))
    with pytest.raises(ValueError, match=r"^LinkModel\(one_rank=True\) is one rank's local link"):
        LinkModel(link_mbit=200, one_rank=True)  # (a finite link flagged local: its decisions said one rank)


def _planner_for(link: object = None, topology: object = None) -> object:
    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.planner.topology import make_topology

    data = SyntheticCriteo(scale=0.001)
    sample = [b.sparse_features for _, b in zip(range(2), data.train_batches(0, 1, 64))]
    return HeraldPlanner(topology=topology or make_topology(2, "cpu"), batch_size=64, sample_batches=sample,
                         link=link)


@pytest.mark.parametrize("link", [200, 0, "auto", {"link_mbit": 200}])
def test_a_link_that_is_not_a_link_model_is_refused_at_construction(link: object) -> None:
    """``HeraldPlanner(link=200)`` passed construction and raised AttributeError in ``decide``; ``link=0`` was dropped
    silently (herald's plan trained unpriced)."""
    with pytest.raises(TypeError) as e:
        _planner_for(link)
    assert str(e.value) == f"HeraldPlanner(link=...) takes a LinkModel (e.g. LinkModel(link_mbit=200)) or None, got {link!r}"


@pytest.mark.parametrize("field, value, message", [
    ("intra_host_bw", 0.0, "Topology.intra_host_bw must be a finite number > 0 (bytes per ms), got 0.0"),
    ("intra_host_bw", -1.0, "Topology.intra_host_bw must be a finite number > 0 (bytes per ms), got -1.0"),
    ("intra_host_bw", float("inf"), "Topology.intra_host_bw must be a finite number > 0 (bytes per ms), got inf"),
    ("inter_host_bw", "fast", "Topology.inter_host_bw must be a finite number > 0 (bytes per ms), got 'fast'"),
    ("local_world_size", -1, "Topology.local_world_size must be an int >= 1 (ranks per host), got -1"),
])
def test_a_bad_topology_bandwidth_is_one_error_naming_the_topologys_field(field: str, value: object,
                                                                         message: str) -> None:
    """A bad ``Topology`` bandwidth was reported as ``planner.link_mbit``, a key the user never set, with the value
    after a unit conversion (-1 as -0.008); an infinite one made a 2-rank job one rank's."""
    from torchrec.distributed.planner import Topology

    topology = Topology(world_size=2, compute_device="cpu", **{"local_world_size": 2, field: value})
    with pytest.raises(ValueError) as e:
        _planner_for(topology=topology)
    assert str(e.value) == f"HeraldPlanner: {message}"


def _different_links(rank: int, world: int) -> str:
    import torch.distributed as dist

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    data = SyntheticCriteo(scale=0.001)
    model = build_dlrm_train(build_tables(data.feature_names, data.num_embeddings, 16), data.num_dense, [64, 16],
                             [64, 1], device="meta")
    planner = _planner_for(LinkModel(link_mbit=20 if rank == 0 else 100_000, collective_latency_ms=0.5))
    try:
        planner.decide(model, [HeraldEmbeddingBagCollectionSharder()], dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "decided"


def test_ranks_given_different_links_raise_one_error_on_every_rank() -> None:
    """Rank 0 on a 20 Mbit/s link picked herald's plan, rank 1 on 100,000 TABLE_WISE; each then waited in its own
    collective until the timeout."""
    errors = run_multiprocess(_different_links, 2, timeout_s=120)
    assert errors[0] == errors[1] == (
        "HeraldPlanner.decide: the ranks were given different links (rank 0: LinkModel(link_mbit=20, "
        "collective_latency_ms=0.5, cpu_us_per_lookup=0.6, allreduce_mbit=None); rank 1: LinkModel(link_mbit=100000, "
        "collective_latency_ms=0.5, cpu_us_per_lookup=0.6, allreduce_mbit=None)); give every rank the same link= (or "
        "the same Topology bandwidths)"), errors


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
                                     "planner.collective_latency_ms=1",  # (nothing measured: no tie on a slow host)
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


@pytest.mark.parametrize("link,herald", [("auto", False), ("null", True)])
def test_one_rank_trains_stock_table_wise_by_default_and_herald_where_told(tmp_path: Path, link: str,
                                                                            herald: bool) -> None:
    """At one rank no embedding leaves the rank: herald's plan cannot save a byte and only adds its own work,
    so the default (``planner.link_mbit=auto``, nothing to measure) trains stock TABLE_WISE and says why;
    ``planner.link_mbit=null`` (unknown: herald's plan kept) still trains herald's plan there."""
    m = run_multiprocess(_train, 1, ["planner=herald", "pipeline=herald", f"planner.link_mbit={link}",
                                     "data.num_train_batches=6", "data.num_eval_batches=1", "batch_size=64"],
                         str(tmp_path))[0]
    kinds = set(m["plan"].values())
    if herald:
        assert kinds == {"herald_hot_row_wise"} and m["dense_sync"] == "forward_ordered"
        assert not (m.get("link_decision") or {}).get("predicted")
        return
    d = m["link_decision"]
    assert kinds == {"table_wise"} and m["dense_sync"] == "ddp" and m["herald_pipeline"] == {}
    assert d["chosen"] == "table_wise" and d["one_rank"] is True and d["link_mbit"] is None
    assert d["predicted"]["table_wise"]["step_ms"] == 0.0 and d["predicted"]["herald"]["extra_ms"] > 0.0
    assert d["text"].startswith("one rank, no link (no embedding leaves the rank, so herald's plan saves nothing)")
    assert d["text"].endswith("-> stock TABLE_WISE")


@pytest.mark.parametrize("metrics,label", [
    ({"link_decision": {"herald": False}}, "herald -> table_wise (link model)"),
    ({"link_decision": {"herald": False, "chosen": "table_wise"}}, "herald -> table_wise (link model)"),
    ({"link_decision": {"herald": False, "chosen": "default"}}, "herald -> default plan (link model)"),
    ({"link_decision": {"herald": True, "chosen": "mixed"}}, "herald per table + scheduling"),
    ({"link_decision": {"herald": True}, "herald_pipeline": {"scheduling": {"decided": True, "mode": "on"}}},
     "herald + scheduling"),
    ({"herald_pipeline": {"scheduling": {"decided": True, "mode": "off"}}}, "herald (scheduling off: auto)"),
    ({"herald_pipeline": {"scheduling": {"setting": "off", "mode": "off"}}}, "herald (scheduling off: set)"),
    ({"herald_pipeline": {"scheduling": {"decided": False, "mode": "off", "why": "the run ended before its probe"}}},
     "herald (scheduling off: the probe did not finish)"),
    ({"herald_pipeline": {"scheduling": {"decided": False, "mode": "on", "why": "the run ended before its probe"}}},
     "herald + scheduling"),
])
def test_the_compared_run_is_named_after_what_it_trained(metrics: dict, label: str) -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.train import run_label

    assert run_label(compose_config(["planner=herald", "pipeline=herald"]), metrics) == label


@pytest.mark.parametrize("overrides,metrics,label", [
    (["pipeline.staleness=1"], {"link_decision": {"herald": True}}, "herald + scheduling + staleness=1"),
    (["pipeline.skip=input"], {"link_decision": {"herald": False, "chosen": "table_wise"}},
     "herald -> table_wise (link model; skip=input not applied)"),
])
def test_an_approximate_run_is_named_with_its_mode(overrides: list, metrics: dict, label: str) -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.train import run_label

    assert run_label(compose_config(["planner=herald", "pipeline=herald", *overrides]), metrics) == label


def _train_logged(rank: int, world: int, overrides: list, run_dir: str) -> tuple:
    seen = messages_of("torchrec_herald.pipeline.build")
    return _train(rank, world, overrides, run_dir), seen


def test_an_approximate_mode_on_a_link_where_a_stock_plan_wins_says_it_is_not_applied(tmp_path: Path) -> None:
    """The model of time may pick a stock plan, which has no cache or hot row for HET or Slipstream to relax:
    the run says so in one warning and in metrics.json, where it trained the stock plan silently."""
    (m, seen), _ = run_multiprocess(_train_logged, 2, DEFAULTS + ["planner.link_mbit=100000", "pipeline.staleness=1",
                                                                  "pipeline.reference=false", "eval=false"],
                                    str(tmp_path))
    reason = ("pipeline.staleness=1 not applied: the model of time chose a stock plan on this link (see the planner's "
              "line), which has no herald cache or hot row to relax; planner.link_mbit=null keeps herald's plan")
    assert m["approximate"] == {"applied": False, "reason": reason}
    assert [s for s in seen if "not applied" in s] == [f"pipeline=herald: {reason}"]
    assert m["summary"]["eval_auc"] is None
    json.loads((tmp_path / "metrics.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in metrics.json"))


def test_the_planner_decides_the_fallback_itself_with_a_typed_decision() -> None:
    """``HeraldPlanner.decide``: herald's plan, sharders and forward-ordered dense sync on a slow link;
    stock TABLE_WISE, TorchRec's sharder and DDP on a fast one; both with the predicted times."""
    import torch

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.planner.topology import make_topology
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder, HeraldEmbeddingBagCollectionSharder

    data = SyntheticCriteo(scale=0.001)
    tables = build_tables(data.feature_names, data.num_embeddings, 16)
    model = build_dlrm_train(tables, data.num_dense, [64, 16], [64, 1], device="meta")
    sample = [b.sparse_features for _, b in zip(range(5), data.train_batches(0, 1, 128))]
    for mbit, herald in ((20, True), (100_000, False)):
        planner = HeraldPlanner(topology=make_topology(2, "cpu"), batch_size=64, sample_batches=sample,
                                link=LinkModel(link_mbit=mbit))
        d = planner.decide(model, [HeraldEmbeddingBagCollectionSharder()])
        assert d.herald is herald and d.link is not None and d.link.herald is herald
        assert d.dense_sync == ("forward_ordered" if herald else "ddp")
        assert isinstance(d.sharders[0], HeraldEmbeddingBagCollectionSharder if herald
                          else CpuEmbeddingBagCollectionSharder)
        kinds = {ps.sharding_type for plan in d.plan.plan.values() for ps in plan.values()}
        assert kinds == ({"herald_hot_row_wise"} if herald else {"table_wise"})
        assert d.link_report()["predicted_herald_ms"] == pytest.approx(d.link.herald_ms)
        assert {"herald", "table_wise", "default"} <= set(d.link.predictions) <= {"herald", "table_wise", "default",
                                                                                   "mixed"}
        fastest = min(d.link.predictions, key=lambda n: d.link.predictions[n].step_ms)
        assert d.link.chosen == fastest or (fastest, d.link.chosen, bool(d.link.note)) == ("default", "table_wise", True)
        assert torch.is_tensor(next(iter(planner.last_choices.values())).hot_ids)


def test_the_stock_candidates_keep_the_users_constraints() -> None:
    """A user's ``ParameterConstraints`` given to ``HeraldPlanner`` hold in the stock plan the model of time
    may train instead (TorchRec's default or TABLE_WISE), as stock TorchRec would plan with them; they were
    dropped there."""
    from torchrec.distributed.planner import ParameterConstraints

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.planner.topology import make_topology
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    data = SyntheticCriteo(scale=0.001)
    tables = build_tables(data.feature_names, data.num_embeddings, 16)
    model = build_dlrm_train(tables, data.num_dense, [64, 16], [64, 1], device="meta")
    sample = [b.sparse_features for _, b in zip(range(5), data.train_batches(0, 1, 128))]
    pinned, herald_type = tables[3].name, tables[4].name
    planner = HeraldPlanner(topology=make_topology(2, "cpu"), batch_size=64, sample_batches=sample,
                            link=LinkModel(link_mbit=100_000, collective_latency_ms=0.02),
                            constraints={pinned: ParameterConstraints(sharding_types=["row_wise"]),
                                         herald_type: ParameterConstraints(sharding_types=["herald_hot_row_wise"])})
    d = planner.decide(model, [HeraldEmbeddingBagCollectionSharder()])
    types = {t: ps.sharding_type for plan in d.plan.plan.values() for t, ps in plan.items()}
    assert d.link is not None and d.link.chosen in ("table_wise", "default")  # (a fast link: a stock plan)
    assert types[pinned] == "row_wise" and set(types.values()) - {"row_wise"}, (d.link.chosen, types)
    assert types[herald_type] == "row_wise"  # (herald's type allowed: its row-wise layout, for TorchRec's planner)


def test_each_table_goes_where_it_costs_less_time_and_the_mix_pays_its_collectives() -> None:
    """Per table: herald where it saves bytes for its extra work per lookup (a: 1e5 + 600 lookups vs 6e5),
    the cheaper stock type otherwise (b: ROW_WISE's 3e5 < TABLE_WISE's 4e5 < herald's 4e5 + 4000 lookups;
    c, DATA_PARALLEL in the default plan, offered as TABLE_WISE: herald's 5e4 bytes vs 1e3). The per-table
    candidate pays both parts' collectives: chosen at a fabric's latency, not at gloo's 1 ms on this
    machine."""
    from torchrec_herald.planner.time_model import mixed_plan_load, per_table_choice

    expected = {"a": {"lookups": 600.0, "stock_table_wise": 6e5, "herald_total": 1e5},
                "b": {"lookups": 4000.0, "stock_table_wise": 4e5, "stock_row_wise": 3e5, "herald_total": 4e5},
                "c": {"lookups": 10.0, "stock_table_wise": 1e3, "herald_total": 5e4}}
    fast = LinkModel(link_mbit=100, collective_latency_ms=0.02, cpu_us_per_lookup=0.6)
    pick = per_table_choice(expected, {"a": "table_wise", "b": "row_wise", "c": "data_parallel"}, 2, fast)
    assert pick == {"a": "herald", "b": "row_wise", "c": "table_wise"}
    load = mixed_plan_load(expected, pick, 2, dense_bytes=0.0)
    # herald's a, stock b (row-wise bytes) and c (table-wise); herald's 7 + two stock types' 5 collectives each
    assert (load.critical_bytes, load.collectives, load.lookups) == ((1e5 + 3e5 + 1e3) / 2, 7 + 5 + 5, 2305.0)
    whole = [expected["a"], expected["b"], expected["c"]]
    d = decide(whole, 2, fast, mixed=(load, pick))
    assert d.chosen == "mixed" and d.herald and d.per_table == pick
    assert d.predictions["mixed"].step_ms < min(p.step_ms for n, p in d.predictions.items() if n != "mixed")
    assert "(1 herald tables, stock row_wise: b; table_wise: c)" in d.describe()
    gloo = LinkModel(link_mbit=100, collective_latency_ms=1.0, cpu_us_per_lookup=0.6)
    assert decide(whole, 2, gloo, mixed=(load, pick)).chosen == "herald"


def test_the_planner_trains_a_per_table_pick_in_one_ebc() -> None:
    """``HeraldPlanner.decide`` with a fixed top-5 % hot set synced densely (what it costs is not weighed
    against what it saves), 200 Mbit/s and a fabric's 0.02 ms per collective: the tables whose hot sync
    costs herald more bytes than TABLE_WISE sends for them go stock, the others stay herald, in one plan
    with herald's sharder and dense sync, predicted faster than herald's, TABLE_WISE and the default plan.
    Herald's extra work is charged on every lookup either way (it is per step)."""
    import torch

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.planner.hot_set import TopFractionHotSetSelector
    from torchrec_herald.planner.topology import make_topology
    from torchrec_herald.sharding import HeraldEmbeddingBagCollectionSharder

    data = SyntheticCriteo(scale=0.001)
    tables = build_tables(data.feature_names, data.num_embeddings, 16)
    model = build_dlrm_train(tables, data.num_dense, [64, 16], [64, 1], device="meta")
    sample = [b.sparse_features for _, b in zip(range(5), data.train_batches(0, 1, 128))]
    planner = HeraldPlanner(topology=make_topology(2, "cpu"), batch_size=64, sample_batches=sample,
                            hot_set_selector=TopFractionHotSetSelector(0.05),
                            link=LinkModel(link_mbit=200, collective_latency_ms=0.02, cpu_us_per_lookup=0.6))
    d = planner.decide(model, [HeraldEmbeddingBagCollectionSharder()])
    assert d.link is not None and d.link.chosen == "mixed", d.link.describe()
    p = d.link.predictions
    assert p["mixed"].step_ms < min(p["herald"].step_ms, p["table_wise"].step_ms, p["default"].step_ms)
    kinds = {name: ps.sharding_type for plan in d.plan.plan.values() for name, ps in plan.items()}
    assert kinds == {t: ("herald_hot_row_wise" if k == "herald" else k) for t, k in d.link.per_table.items()}
    assert set(kinds.values()) - {"herald_hot_row_wise"} and "herald_hot_row_wise" in kinds.values()
    for name, kind in d.link.per_table.items():  # stock exactly where herald would send more bytes
        e = planner.last_choices[name].expected.as_dict()
        assert (kind != "herald") == (e["herald_total"] > e["stock_table_wise"]), (name, kind, e)
    assert d.herald and d.dense_sync == "forward_ordered"
    assert isinstance(d.sharders[0], HeraldEmbeddingBagCollectionSharder)
    assert d.link_report()["per_table"] == d.link.per_table
    assert torch.is_tensor(next(iter(planner.last_choices.values())).hot_ids)


def test_the_bandwidth_stated_in_torchrecs_topology_is_the_link() -> None:
    """``Topology(inter_host_bw=...)`` (TorchRec's unit, bytes per ms) across hosts, ``intra_host_bw``
    within one; TorchRec's defaults state nothing."""
    import warnings

    from torchrec.distributed.planner.types import Topology

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.planner import HeraldPlanner
    from torchrec_herald.planner.topology import make_topology

    def topology(world: int, local: int, **bw: float) -> Topology:
        with warnings.catch_warnings():  # TorchRec 1.9 prefers TopologyFactory; users still state bandwidths here
            warnings.simplefilter("ignore")
            return Topology(world_size=world, compute_device="cpu", local_world_size=local, **bw)

    data = SyntheticCriteo(scale=0.001)
    sample = [b.sparse_features for _, b in zip(range(2), data.train_batches(0, 1, 64))]
    across = HeraldPlanner(topology=topology(4, 2, inter_host_bw=25_000.0, intra_host_bw=1e6), batch_size=64,
                           sample_batches=sample)
    assert across.link is not None and across.link.link_mbit == pytest.approx(200.0)  # 25 MB/s
    within = HeraldPlanner(topology=topology(2, 2, inter_host_bw=25_000.0, intra_host_bw=1e6), batch_size=64,
                           sample_batches=sample)
    assert within.link.link_mbit == pytest.approx(8000.0)
    assert HeraldPlanner(topology=make_topology(2, "cpu"), batch_size=64, sample_batches=sample).link is None
    given = HeraldPlanner(topology=topology(4, 2, inter_host_bw=25_000.0), batch_size=64, sample_batches=sample,
                          link=LinkModel(link_mbit=50))
    assert given.link.link_mbit == 50  # an explicit link wins


def test_a_topology_stating_the_other_hosts_bandwidth_only_gives_no_link(caplog: pytest.LogCaptureFixture) -> None:
    """Ranks across hosts with only ``intra_host_bw`` stated (or one host with only ``inter_host_bw``): the ranks'
    own link is TorchRec's default, not the user's; no link is taken, with one warning naming the key to state
    (TorchRec's default inter-host rate was taken as the link)."""
    import logging
    import warnings

    from torchrec.distributed.planner.types import Topology

    from torchrec_herald.planner.planner import link_from_topology

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        across = Topology(world_size=4, compute_device="cpu", local_world_size=2, intra_host_bw=25_000.0)
        within = Topology(world_size=2, compute_device="cpu", local_world_size=2, inter_host_bw=25_000.0)
    with caplog.at_level(logging.WARNING, logger="torchrec_herald.planner.planner"):
        assert link_from_topology(across) is None and link_from_topology(within) is None
    assert [r.getMessage() for r in caplog.records if r.name == "torchrec_herald.planner.planner"] == [
        "HeraldPlanner: the Topology states intra_host_bw, but its 4 ranks span hosts of 2 (local_world_size=2): their "
        "link is inter_host_bw, which it leaves at TorchRec's default; no link is taken from it (state inter_host_bw, "
        "set local_world_size to the ranks per host, or give link=)",
        "HeraldPlanner: the Topology states inter_host_bw, but its 2 ranks share one host (local_world_size=2): their "
        "link is intra_host_bw, which it leaves at TorchRec's default; no link is taken from it (state intra_host_bw, "
        "set local_world_size to the ranks per host, or give link=)"]


def test_the_cost_model_prices_in_time_on_a_known_link_and_picks_the_rows_bytes_pick() -> None:
    """The hot-set cost model prices rows through the planner's pricing (bytes, or ms on a link). Time
    here is linear in bytes, so the hot sets are the same; the nets are in the pricing's unit."""
    import torch

    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import build_tables
    from torchrec_herald.planner import AccessStats, CostModelHotSetSelector
    from torchrec_herald.planner.pricing import ByteCount

    data = SyntheticCriteo(scale=0.001)
    tables = build_tables(data.feature_names, data.num_embeddings, 16)
    stats = AccessStats.from_batches([b.sparse_features for _, b in zip(range(5), data.train_batches(0, 1, 128))],
                                     tables)
    in_bytes = CostModelHotSetSelector().select(stats, tables, 2, 64, 20_000)
    in_time = CostModelHotSetSelector(pricing=LinkModel(link_mbit=20)).select(stats, tables, 2, 64, 20_000)
    assert sum(c.num_hot for c in in_bytes.values()) > 0
    for name, c in in_bytes.items():
        assert torch.equal(c.hot_ids, in_time[name].hot_ids) and c.sync == in_time[name].sync
    assert ByteCount().bytes(1000.0) == 1000.0 and LinkModel(link_mbit=8).bytes(1000.0) == pytest.approx(1.0)
    assert LinkModel(link_mbit=8).collectives(3) == pytest.approx(3.0) and ByteCount().lookups(5) == 0.0


# ------------------------------------------------------------------------------------------ link probe

@pytest.mark.parametrize("override, message", [
    ("planner.link_mbit=0", "planner.link_mbit must be > 0 Mbit/s, auto (measured at start) or null (unknown), got 0"),
    ("planner.link_mbit=fast", "planner.link_mbit must be > 0 Mbit/s, auto (measured at start) or null (unknown), "
                               "got 'fast'"),
    ("planner.collective_latency_ms=0", "planner.collective_latency_ms must be > 0 ms or auto (measured at start), "
                                        "got 0"),
    ("planner.collective_latency_ms=-2", "planner.collective_latency_ms must be > 0 ms or auto (measured at start), "
                                         "got -2"),
    ("planner.link_mbit=inf", "planner.link_mbit must be > 0 Mbit/s, auto (measured at start) or null (unknown), "
                              "got inf"),
    ("planner.collective_latency_ms=inf", "planner.collective_latency_ms must be > 0 ms or auto (measured at start), "
                                          "got inf"),
    ("planner.allreduce_mbit=0", "planner.allreduce_mbit must be > 0 Mbit/s, auto (measured at start with "
                                 "planner.link_mbit) or null (planner.link_mbit's), got 0"),
    ("planner.allreduce_mbit=-5", "planner.allreduce_mbit must be > 0 Mbit/s, auto (measured at start with "
                                  "planner.link_mbit) or null (planner.link_mbit's), got -5"),
    ("planner.allreduce_mbit=fast", "planner.allreduce_mbit must be > 0 Mbit/s, auto (measured at start with "
                                    "planner.link_mbit) or null (planner.link_mbit's), got 'fast'"),
])
def test_a_zero_or_negative_link_value_fails_in_preflight_naming_the_key(override: str, message: str) -> None:
    from torchrec_herald.config import compose_config
    from torchrec_herald.trainer import preflight

    with pytest.raises(ValueError) as e:
        preflight(compose_config(["planner=herald", override]))
    assert str(e.value) == message


def test_measured_values_replace_only_the_auto_keys() -> None:
    from torchrec_herald.planner.config import HeraldPlannerConfig
    from torchrec_herald.planner.link_probe import LinkProbe

    probe = LinkProbe(link_mbit=180.0, latency_ms=0.4, bytes_per_rank=1 << 20, seconds=0.3)
    assert HeraldPlannerConfig().wants_probe and not HeraldPlannerConfig(link_mbit=50, collective_latency_ms=2).wants_probe
    c = HeraldPlannerConfig().with_measured(probe)
    assert (c.link_mbit, c.collective_latency_ms) == (180.0, 0.4)
    c = HeraldPlannerConfig(link_mbit=50).with_measured(probe)
    assert (c.link_mbit, c.collective_latency_ms) == (50, 0.4)
    c = HeraldPlannerConfig().with_measured(None)  # no probe: rate unknown, the latency's default
    assert (c.link_mbit, c.collective_latency_ms, c.link_model()) == (None, 1.0, None)
    # link_mbit=null keeps herald's plan whatever the link: nothing is priced, so nothing is probed
    assert not HeraldPlannerConfig(link_mbit=None).wants_probe and HeraldPlannerConfig(link_mbit=50).wants_probe


def test_the_all_reduce_rate_is_measured_with_the_link_rate_given_or_the_link_rates() -> None:
    """``planner.allreduce_mbit=auto``: the probe's all-reduce rate where the link rate is measured too; where the link
    rate is given, that rate prices every collective; a number given is kept; null is the link rate's."""
    from torchrec_herald.planner.config import HeraldPlannerConfig
    from torchrec_herald.planner.link_probe import LinkProbe

    probe = LinkProbe(link_mbit=100.0, latency_ms=0.4, bytes_per_rank=1 << 20, seconds=0.3, allreduce_mbit=180.0)
    assert HeraldPlannerConfig().with_measured(probe).link_model().allreduce_mbit == 180.0
    assert HeraldPlannerConfig(link_mbit=50).with_measured(probe).link_model().allreduce_mbit is None
    assert HeraldPlannerConfig(allreduce_mbit=90).with_measured(probe).link_model().allreduce_mbit == 90.0
    assert HeraldPlannerConfig(allreduce_mbit=None).with_measured(probe).link_model().allreduce_mbit is None
    assert HeraldPlannerConfig(link_mbit=50, allreduce_mbit=70).link_model().allreduce_mbit == 70.0
    assert "100 Mbit/s per rank (180 for all-reduces)" in probe.describe() and probe.as_dict()["allreduce_mbit"] == 180.0
    with pytest.raises(ValueError, match=r"LinkModel\(one_rank=True\) is one rank's local link"):
        LinkModel(link_mbit=float("inf"), collective_latency_ms=0.0, allreduce_mbit=5.0, one_rank=True)


def test_all_reduce_bytes_cross_at_the_all_reduce_rate() -> None:
    """An all-reduce's bytes (on the path, or overlapped) at ``allreduce_mbit``, the others' at ``link_mbit``; where
    ranks share cores each all-reduce call costs ``allreduce_call_ms`` more (on the path, and in the link's time)."""
    from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel

    m = StepTimeModel(link_mbit=80, allreduce_mbit=160, collective_latency_ms=0.5, compute_ms=10.0)
    # 1e5 B: 4e4 all-to-all at 80 Mbit/s = 4 ms, 6e4 all-reduce at 160 = 3 ms; 2e5 overlapped at 160 = 10 ms
    p = m.predict(PlanLoad("x", 1e5, 2e5, 2, allreduce_bytes=6e4))
    assert (p.comm_ms, p.link_busy_ms, p.step_ms) == pytest.approx((8.0, 18.0, 18.0))  # (link: bytes + 2 latencies)
    shared = StepTimeModel(link_mbit=80, allreduce_mbit=160, collective_latency_ms=0.5, compute_ms=10.0,
                           allreduce_call_ms=4.0)
    q = shared.predict(PlanLoad("x", 1e5, 2e5, 2, allreduce_bytes=6e4, allreduce_calls=1, overlapped_calls=3))
    assert (q.comm_ms, q.link_busy_ms, q.step_ms) == pytest.approx((12.0, 34.0, 34.0))
    same = StepTimeModel(link_mbit=80, collective_latency_ms=0.5)  # no all-reduce rate: the link's
    assert same.predict(PlanLoad("x", 1e5, 0.0, 0, allreduce_bytes=6e4)).comm_ms == pytest.approx(10.0)


def test_the_per_table_split_ranks_tables_by_the_time_they_save_at_each_collectives_rate() -> None:
    """Table x saves the most bytes a lookup, but through a dense hot-row sync whose all-reduce gets a quarter of the
    all-to-alls' rate; y saves fewer, by all-to-alls: on that link herald takes y and not x (ranked by bytes, the
    splits tried were x first, and the best one, y alone, was never priced)."""
    from torchrec_herald.planner.time_model import per_table_choice

    expected = {"x": {"lookups": 100.0, "stock_table_wise": 1e5, "herald_total": 6e4, "herald_hot_sync_allreduce": 6e4},
                "y": {"lookups": 100.0, "stock_table_wise": 5e4, "herald_total": 2e4}}
    link = LinkModel(link_mbit=200, allreduce_mbit=50, collective_latency_ms=0.0, cpu_us_per_lookup=0.0)
    assert per_table_choice(expected, {"x": "table_wise", "y": "table_wise"}, 2, link) == {"x": "table_wise",
                                                                                            "y": "herald"}
    same = LinkModel(link_mbit=200, collective_latency_ms=0.0, cpu_us_per_lookup=0.0)  # one rate: both pay
    assert per_table_choice(expected, {"x": "table_wise", "y": "table_wise"}, 2, same) == {"x": "herald", "y": "herald"}


def test_the_decision_prices_the_dense_sums_and_the_dense_hot_sync_at_the_all_reduce_rate() -> None:
    """Herald's dense hot-row sync and forward-ordered dense sums, and DDP's dense sum on TABLE_WISE's path, at the
    all-reduce rate: on a link whose all-reduces get twice the all-to-alls' rate herald's busy link is shorter."""
    expected = [{**EXPECTED[0], "herald_hot_sync_allreduce": 4e4}, EXPECTED[1]]
    link = LinkModel(link_mbit=200, collective_latency_ms=1.0, cpu_us_per_lookup=0.6)
    one = decide(expected, 2, link, dense_bytes=2e5)
    two = decide(expected, 2, LinkModel(link_mbit=200, collective_latency_ms=1.0, cpu_us_per_lookup=0.6,
                                        allreduce_mbit=400), dense_bytes=2e5)
    # TABLE_WISE: 5e5 B all-to-all = 20 ms, 2e5 dense = 8 ms -> 4 at 400 Mbit/s; + 5 latencies
    assert (one.stock_ms, two.stock_ms) == pytest.approx((33.0, 29.0))
    # herald's link: 1e5 B of which 2e4 (per rank) hot sync: 3.2 + 0.8 -> 0.4, and 2e5 dense 8 -> 4 ms
    assert one.predictions["herald"].link_busy_ms == pytest.approx(12.0 + 7.0)  # (and 7 latencies)
    assert two.predictions["herald"].link_busy_ms == pytest.approx(3.2 + 0.4 + 4.0 + 7.0)
    assert two.herald_ms == pytest.approx(3.2 + 0.4 + 4.0 + 7.0)  # its link: no compute to hide the dense sums
    assert two.describe().startswith("link 200 Mbit/s (400 for all-reduces): predicted step cost per rank")
    assert two.as_dict()["allreduce_mbit"] == 400 and one.as_dict()["allreduce_mbit"] is None
    assert one.describe().startswith("link 200 Mbit/s: predicted step cost per rank")


def _probe(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from torchrec_herald.planner.link_probe import probe_link

    p = probe_link(dist.group.WORLD, max_bytes=1 << 20)
    return p.link_mbit, p.latency_ms, p.bytes_per_rank


def test_the_probe_gives_every_rank_the_same_positive_figures() -> None:
    a, b = run_multiprocess(_probe, 2)
    assert a == b  # every rank decides alike
    rate, latency, sent = a
    assert rate > 0 and latency > 0
    # the last size's all-to-alls (1 to 3 of them) over one rank's link: n / (4 W) floats to each of the
    # W - 1 peers
    assert sent in {k * (n // 8) * 4 for n in (256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)
                    for k in (1, 2, 3)}


def _probe_timed(rank: int, world: int, fast_repeat: bool = False) -> tuple:
    """The probe with each rank's collective times fixed (the collectives still run): rank 0 times a one-element
    all-reduce at 1 ms and an all-to-all at 50 ms, rank 1 at 1.5 and 75 ms; with ``fast_repeat`` the all-to-all
    repeated first at the last size takes half that on every rank (a shaped link's fast transfer)."""
    import torch.distributed as dist

    import torchrec_herald.planner.link_probe as link_probe

    real, calls = link_probe._timed, []

    def timed(op: object, *args: object) -> float:
        real(op, *args)  # type: ignore[arg-type]
        calls.append(1)
        fast = 0.5 if fast_repeat and len(calls) == 22 + 7 + 1 else 1.0
        return (0.001 if len(calls) <= 22 else 0.050 * fast) * (1 + rank / 2)  # 22 latency all-reduces, then all-to-alls

    link_probe._timed = timed
    p = link_probe.probe_link(dist.group.WORLD)
    return p.link_mbit, p.latency_ms, p.bytes_per_rank, len(calls), p.total_bytes_per_rank, p.allreduce_mbit


def test_the_probe_prices_the_slowest_ranks_times() -> None:
    """Latency: the slowest rank's median all-reduce (1.5 ms). Rate: all-to-alls doubling from 256 KiB while each
    takes under 0.1 s (rank 1's 75 ms) and the budget of 1 s allows, up to 16 MiB; then two repeats at 16 MiB:
    8 MiB over this rank's link each, in a median 75 ms less one latency. The all-reduce rate: all-reduces doubling
    from 256 KiB within their 0.5 s (five sizes: a sixth would pass it), then one repeat at 4 MiB (a second would
    pass it), a ring's 2·(W−1)/W of it over each rank's link."""
    got = run_multiprocess(_probe_timed, 2)
    assert got[0] == got[1]
    rate, latency, sent, calls, total, allreduce = got[0]
    assert latency == pytest.approx(1.5, rel=1e-12)
    assert sent == 3 * (8 << 20) and calls == 22 + 7 + 2 + 5 + 1  # 256 KiB … 16 MiB, two repeats; 256 KiB … 4 MiB, one
    assert total == (sum((256 << 10 << k) // 2 for k in range(7)) + 2 * (8 << 20)  # half of each size crosses at W=2
                     + sum(256 << 10 << k for k in range(5)) + (4 << 20))  # all of it, in a ring all-reduce at W=2
    assert rate == pytest.approx((8 << 20) * 8 / (0.075 - 0.0015) / 1e6, rel=1e-12)
    assert allreduce == pytest.approx((4 << 20) * 8 / (0.075 - 0.0015) / 1e6, rel=1e-12)


def test_one_fast_transfer_of_a_shaped_link_does_not_move_the_probes_rate() -> None:
    """A shaped link's transfers of one size alternate between fast and slow: the rate is the median of the last
    size's three, so one transfer at twice the speed leaves it where the slow ones put it (the mean of two would
    read 4/3 of it; RESULTS, the twenty-second session: 18 % of probes averaging two moved by over 10 %)."""
    even = run_multiprocess(_probe_timed, 2)[0]
    fast = run_multiprocess(_probe_timed, 2, True)
    assert fast[0] == fast[1] and fast[0][0] == even[0] and fast[0][2] == even[2]


def _measured(rank: int, world: int, fail_on: int = -1) -> object:
    import torchrec_herald.planner.link_probe as link_probe

    real = link_probe.probe_link

    def probe(*args: object, **kwargs: object) -> object:
        out = real(*args, **kwargs)
        if rank == fail_on:  # (its collectives ran with the others': its own last wait timed out)
            raise RuntimeError("Timed out waiting 30000ms for send operation to complete")
        return out

    link_probe.probe_link = probe
    link = link_probe.measured_link(None)
    return None if link is None else (link.link_mbit, link.collective_latency_ms, link.cpu_us_per_lookup)


def test_measured_link_gives_every_rank_the_same_link_model_or_none_where_a_probe_failed() -> None:
    """The API's one call for the link (``HeraldPlanner(link=measured_link(pg))``): the probe's rate and latency as
    a LinkModel, alike on every rank; where one rank's probe fails, None on every rank (planning with the
    Topology's stated bandwidth), never one rank pricing apart."""
    a, b = run_multiprocess(_measured, 2)
    assert a == b and a[0] > 0 and a[1] > 0 and a[2] == LinkModel.cpu_us_per_lookup
    assert run_multiprocess(_measured, 2, 1) == [None, None]
    from torchrec_herald.planner.link_probe import measured_link  # (one rank, no process group: nothing to measure)

    assert measured_link(None) == LinkModel.local(LinkModel.cpu_us_per_lookup)


def _probe_failing_before_a_collective(rank: int, world: int, poll: bool = False) -> tuple:
    """Rank 1's probe fails before its first all-to-all (an allocation, say), which rank 0 enters. ``poll``: the probe
    waits as it does for CUDA tensors (NCCL's), by polling its collectives against a host deadline."""
    import functools

    import torch
    import torch.distributed as dist

    import torchrec_herald.planner.link_probe as link_probe

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of memory on rank 1 alone")

    aborted: list = []

    def abort(group: object) -> None:
        aborted.append(group is not None and group is not dist.group.WORLD)
        real_abort(group)

    real, real_probe, real_abort = dist.all_to_all_single, link_probe.probe_link, link_probe.abort_failed_group
    if rank == 1:
        dist.all_to_all_single = broken
    link_probe.probe_link = functools.partial(real_probe, poll=poll)
    link_probe.abort_failed_group = abort
    seen = messages_of("torchrec_herald.planner")
    try:
        probe = link_probe.probe_on_every_rank(dist.group.WORLD, timeout_s=2.0)
    finally:
        dist.all_to_all_single, link_probe.probe_link, link_probe.abort_failed_group = real, real_probe, real_abort
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)  # the job's group carries its next collective as it should
    return probe, seen, after.item(), aborted


def test_a_probe_failing_on_one_rank_before_a_collective_leaves_the_jobs_group_in_step() -> None:
    """The probe runs on a group of its own: the all-to-all rank 0 entered and rank 1 never did times out there
    (after the probe's timeout), instead of pairing with rank 1's next collective on the job's group, which failed
    the job ("the process group failed right after the start-up link probe"). Each rank warns once, both plan on
    the configured values, and the job's group sums right after."""
    (p0, seen0, after0, ab0), (p1, seen1, after1, ab1) = run_multiprocess(_probe_failing_before_a_collective, 2)
    assert p0 is None and p1 is None and after0 == after1 == 3.0
    tail = "; planning with the configured link values (planner.link_mbit / planner.collective_latency_ms)"
    assert seen1 == ["planner: the link probe failed (out of memory on rank 1 alone)" + tail]
    assert seen0 == ["planner: the link probe failed (Operation timed out!)" + tail]
    assert ab0 == ab1 == [True]  # each rank aborted the probe's own group, once (over gloo a no-op: the call alone)


def test_a_probe_waiting_as_on_a_gpu_gives_up_at_its_host_deadline_and_the_job_goes_on() -> None:
    """NCCL's wait never times out on the host (the host then blocks in ``cuda.synchronize`` until the watchdog ends
    the process), so the probe polls CUDA collectives against its own deadline and the failed rank aborts the probe's
    group, watchdog and all. The same path on gloo: rank 0 gives up on the all-to-all rank 1 never entered, by its
    deadline (the message is the probe's, not gloo's timeout), warns once, and the job's group sums right after."""
    (p0, seen0, after0, ab0), (p1, seen1, after1, ab1) = run_multiprocess(_probe_failing_before_a_collective, 2,
                                                                          True)
    assert p0 is None and p1 is None and after0 == after1 == 3.0
    tail = "; planning with the configured link values (planner.link_mbit / planner.collective_latency_ms)"
    assert seen1 == ["planner: the link probe failed (out of memory on rank 1 alone)" + tail]
    assert seen0 == ["planner: the link probe failed (a probe collective took over 2 s)" + tail]
    assert ab0 == ab1 == [True]


def _probe_blocked_in_a_call(rank: int, world: int) -> tuple:
    """Rank 1's probe blocks inside its first all-to-all's call, before any work to wait for exists (NCCL connecting
    to a peer, say)."""
    import time

    import torch
    import torch.distributed as dist

    import torchrec_herald.planner.link_probe as link_probe

    def blocked(*args: object, **kwargs: object) -> None:
        time.sleep(60)

    real = dist.all_to_all_single
    if rank == 1:
        dist.all_to_all_single = blocked
    seen = messages_of("torchrec_herald.planner")
    t0 = time.monotonic()
    try:
        probe = link_probe.probe_on_every_rank(dist.group.WORLD, timeout_s=2.0, own_thread=True)  # (as for NCCL's)
    finally:
        dist.all_to_all_single = real
    took = time.monotonic() - t0
    after = torch.tensor([rank + 1.0])
    dist.all_reduce(after)
    return probe, seen, after.item(), took


def test_a_probe_blocked_inside_a_call_gives_up_at_its_deadline_and_the_job_goes_on() -> None:
    """No wait bounds a call that never returns: where the collectives are NCCL's (whose first use of a communicator
    or a pair's channels connects inside the call), the probe runs on a thread of its own, joined for the probe's
    timeout and twice its budget (2 + 3 s here), and the rank whose probe is still blocked then warns once and plans
    with the configured values, as the others do, instead of hanging the job. Over gloo here, the thread asked for."""
    (p0, seen0, after0, took0), (p1, seen1, after1, took1) = run_multiprocess(_probe_blocked_in_a_call, 2)
    assert p0 is None and p1 is None and after0 == after1 == 3.0
    tail = "; planning with the configured link values (planner.link_mbit / planner.collective_latency_ms)"
    assert seen1 == ["planner: the link probe failed (the link probe did not finish in 5 s)" + tail]
    assert seen0 == ["planner: the link probe failed (Operation timed out!)" + tail]
    assert took1 < 30 and took0 < 30, (took0, took1)  # (not the 60 s the blocked call sleeps)


class _NeverDone:
    """A collective's work whose peer never came."""

    def is_completed(self) -> bool:
        return False

    def wait(self, *args: object) -> bool:
        raise AssertionError("a polled wait must not block in the backend's wait")


class _Failed:
    def is_completed(self) -> bool:
        return True

    def wait(self, *args: object) -> bool:
        raise RuntimeError("Connection closed by peer")


def test_a_polled_wait_raises_at_its_deadline_or_with_the_collectives_own_error() -> None:
    from datetime import timedelta

    from torchrec_herald.planner.link_probe import ProbeTimeout, await_within

    with pytest.raises(ProbeTimeout, match=r"^a probe collective took over 0\.05 s$"):
        await_within(_NeverDone(), timedelta(seconds=0.05), poll=True)
    with pytest.raises(RuntimeError, match="^Connection closed by peer$"):
        await_within(_Failed(), timedelta(seconds=5), poll=True)


def _train_probe_failing(rank: int, world: int, overrides: list, run_dir: str, failing_ranks: tuple = (0, 1)) -> tuple:
    import torchrec_herald.planner.link_probe as link_probe

    real = link_probe.probe_link

    def broken(*args: object, **kwargs: object) -> object:
        if rank not in failing_ranks:
            return real(*args, **kwargs)
        real(*args, **kwargs)  # (its collectives ran with the others': its own last wait timed out)
        raise RuntimeError("Timed out waiting 30000ms for send operation to complete")

    link_probe.probe_link = broken
    seen = messages_of("torchrec_herald.planner")  # (decision.py and link_probe.py)
    return _train(rank, world, overrides, run_dir), seen


DEFAULTS = ["planner=herald", "pipeline=herald", "data.num_train_batches=6", "data.num_eval_batches=2",
            "batch_size=64", "pipeline.window=3"]


def test_with_no_link_key_the_driver_measures_the_link_and_decides_on_it(tmp_path: Path) -> None:
    m = run_multiprocess(_train, 2, DEFAULTS, str(tmp_path))[0]
    d = m["link_decision"]
    measured = d["measured"]
    assert measured["link_mbit"] > 0 and measured["collective_latency_ms"] > 0
    assert d["link_mbit"] == measured["link_mbit"] and measured["text"].startswith("measured link: ")
    # (every input measured: which plan wins depends on the host, so the model's rule is asserted, not the outcome)
    steps, margin = {name: p["step_ms"] for name, p in d["predicted"].items()}, measured["collective_latency_ms"]
    fastest = min(steps, key=steps.get)
    if d["note"]:  # TorchRec's default plan fastest, but within one collective's latency of TABLE_WISE
        assert fastest == "default" and steps["table_wise"] - steps["default"] <= margin
        assert steps[d["chosen"]] == min(ms for name, ms in steps.items() if name != "default")
    else:
        assert steps[d["chosen"]] == steps[fastest]
    if d["chosen"] == "default":
        assert steps["table_wise"] - steps["default"] > margin
    # what trained follows the choice: herald's tables (all, or the per-table pick's), or a stock plan with DDP
    if d["chosen"] == "herald":
        assert set(m["plan"].values()) == {"herald_hot_row_wise"} and m["dense_sync"] == "forward_ordered"
    elif d["chosen"] == "mixed":
        assert m["plan"] == {t: "herald_hot_row_wise" if k == "herald" else k for t, k in d["per_table"].items()}
    else:
        assert m["dense_sync"] == "ddp" and m["herald_pipeline"] == {}
        if d["chosen"] == "table_wise":
            assert set(m["plan"].values()) == {"table_wise"}


def test_a_failed_probe_warns_once_and_keeps_the_configured_values(tmp_path: Path) -> None:
    (m, seen), _ = run_multiprocess(_train_probe_failing, 2, DEFAULTS, str(tmp_path))
    warnings = [s for s in seen if "link probe failed" in s]
    assert warnings == ["planner: the link probe failed (Timed out waiting 30000ms for send operation to complete); "
                        "planning with the configured link values (planner.link_mbit / "
                        "planner.collective_latency_ms)"]
    assert m["link_decision"] is None and set(m["plan"].values()) == {"herald_hot_row_wise"}  # rate unknown


def test_a_probe_failing_on_one_rank_only_leaves_every_rank_on_the_configured_values(tmp_path: Path) -> None:
    """Ranks planning apart (one on measured figures, one on the configured ones) could pick different plans and
    wait in different collectives: a probe counts only where it succeeded on every rank."""
    (m0, seen0), (m1, seen1) = run_multiprocess(_train_probe_failing, 2, DEFAULTS, str(tmp_path), (1,))
    assert [s for s in seen0 if "probe failed" in s] == [
        "planner: another rank's link probe failed; every rank plans with the configured link values "
        "(planner.link_mbit / planner.collective_latency_ms)"]
    assert [s for s in seen1 if "probe failed" in s] == [
        "planner: the link probe failed (Timed out waiting 30000ms for send operation to complete); planning with "
        "the configured link values (planner.link_mbit / planner.collective_latency_ms)"]
    assert m0["link_decision"] is None and m1["link_decision"] is None and m0["plan"] == m1["plan"]


def _train_counting_probes(rank: int, world: int, overrides: list, run_dir: str) -> tuple:
    import torchrec_herald.planner.link_probe as link_probe
    from torchrec_herald.planner.link_probe import LinkProbe

    calls: list = []

    def probe(*args: object, **kwargs: object) -> LinkProbe:  # a slow link: herald's plan is chosen
        calls.append(1)
        return LinkProbe(link_mbit=20.0 + len(calls), latency_ms=0.2, bytes_per_rank=1 << 20, seconds=0.4)

    link_probe.probe_link = probe
    seen = messages_of("torchrec_herald.planner")
    m = _train(rank, world, overrides, run_dir)
    ref = json.loads((Path(run_dir) / "exact_reference" / "metrics.json").read_text())
    return len(calls), seen, m["link_decision"], ref["link_decision"]


def test_an_approximate_run_probes_the_link_once_and_logs_its_plan_table_once(tmp_path: Path) -> None:
    """An approximate run plans three times (a first build whose refusals stop the job before its exact reference
    trains, the reference, the run): the link is measured once and the three plan on that one measure (a second
    probe could measure another rate and train the reference on another plan), and the plan's table is logged once."""
    res = run_multiprocess(_train_counting_probes, 2, DEFAULTS + ["pipeline.staleness=1", "data.num_train_batches=4",
                                                                   "eval=false"], str(tmp_path))
    for rank, (calls, seen, decision, ref_decision) in enumerate(res):
        assert calls == 1
        assert decision["measured"]["link_mbit"] == ref_decision["measured"]["link_mbit"] == 21.0
        assert decision["herald"] and decision == ref_decision
        tables = [s.split("\n")[0] for s in seen if s.startswith("HeraldPlanner: 26 tables")]
        assert tables == (["HeraldPlanner: 26 tables"] + ["HeraldPlanner: 26 tables, the plan this job logged first (in the approximate run's log)"] * 2
                          if rank == 0 else [])  # (rank 0 plans, every rank gets its plan)
        assert [s for s in seen if s.startswith("planner: measured link")] == [
            "planner: measured link: 21 Mbit/s per rank, 0.20 ms per collective (1.0 MiB per rank in 0.40 s)"]


def _measured_with_bad_cpu(rank: int, world: int, cpu: object) -> tuple:
    import torch.distributed as dist

    import torchrec_herald.planner.link_probe as link_probe

    real, calls = link_probe.probe_link, []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    link_probe.probe_link = counted
    try:
        link_probe.measured_link(dist.group.WORLD, cpu_us_per_lookup=cpu)  # type: ignore[arg-type]
        return "no error", len(calls)
    except ValueError as e:
        return str(e), len(calls)


@pytest.mark.parametrize("cpu, message", [("0.6x", "LinkModel.cpu_us_per_lookup (planner.cpu_us_per_lookup) must be a number, got '0.6x'"),
                                          (-1, "LinkModel.cpu_us_per_lookup (planner.cpu_us_per_lookup) must be >= 0, got -1")])
def test_measured_link_checks_its_cpu_price_before_probing(cpu: object, message: str) -> None:
    """``measured_link(pg, cpu_us_per_lookup=-1)`` at 2 ranks ran the probe's collectives first, and '0.6x' raised
    float()'s error: refused on every rank before any probe."""
    assert run_multiprocess(_measured_with_bad_cpu, 2, cpu) == [(message, 0), (message, 0)]


def _device_of_probe(rank: int, world: int) -> str:
    import torch.distributed as dist

    from torchrec_herald.dist_utils import collective_device

    return str(collective_device(dist.group.WORLD))


def test_the_probe_times_the_link_where_the_training_sends_its_tensors() -> None:
    """On a gloo group the probe's tensors are the CPU's (on a GPU host the trainer's ``cpu:gloo,cuda:nccl`` group
    gives CUDA ones, over NCCL: CPU tensors there timed gloo's TCP, not the embeddings' link)."""
    import torch

    from torchrec_herald.dist_utils import default_backend

    assert run_multiprocess(_device_of_probe, 2) == ["cpu", "cpu"]
    assert default_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.parametrize("backend, cuda, device", [("cpu:gloo,cuda:nccl", True, "cuda:0"), ("nccl", True, "cuda:0"),
                                                  ("gloo", True, "cpu"), ("cpu:gloo,cuda:nccl", False, "cpu")])
def test_the_probe_device_follows_the_groups_cuda_backend(monkeypatch: pytest.MonkeyPatch, backend: str, cuda: bool,
                                                          device: str) -> None:
    import torch
    import torch.distributed as dist

    from torchrec_herald.dist_utils import collective_device

    monkeypatch.setattr(dist, "get_backend", lambda pg=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert str(collective_device(None)) == device


def test_a_job_within_a_deadline_gives_its_result_its_own_error_or_a_timeout() -> None:
    import threading
    import time

    from torchrec_herald.planner.link_probe import ProbeTimeout, within_deadline

    assert within_deadline(lambda: threading.current_thread().name, 5.0) == "herald-link-probe"

    def fails() -> None:
        raise RuntimeError("NCCL error: remote process exited")

    with pytest.raises(RuntimeError, match="^NCCL error: remote process exited$"):
        within_deadline(fails, 5.0)
    with pytest.raises(ProbeTimeout, match=r"^the link probe did not finish in 0\.1 s$"):
        within_deadline(lambda: time.sleep(3), 0.1)


def _thread_of_probe(rank: int, world: int) -> list:
    import threading

    import torch.distributed as dist

    import torchrec_herald.planner.link_probe as link_probe

    names: list = []
    real = link_probe.probe_link

    def probe(*args: object, **kwargs: object) -> object:
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    link_probe.probe_link = probe
    link_probe.probe_on_every_rank(dist.group.WORLD)
    link_probe.probe_on_every_rank(dist.group.WORLD, own_thread=True)
    return names


def test_over_gloo_the_probe_times_the_link_from_the_callers_thread_as_the_training_does() -> None:
    """A probe on a thread of its own read a shaped link's gloo all-to-all at the full rate in 3 of 24 probes, where
    the training's, made on the caller's thread, get about half (0 of 24 on the caller's thread): gloo's calls never
    block before returning, so only NCCL's probe needs a thread of its own."""
    assert run_multiprocess(_thread_of_probe, 2) == [["MainThread", "herald-link-probe"]] * 2
