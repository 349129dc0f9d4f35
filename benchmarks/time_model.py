"""The model of time (``torchrec_herald/planner/time_model.py``): validated on this machine's measured runs,
then projected to 8–128 GPUs with measured inputs.

    python benchmarks/time_model.py [--out benchmarks/results/time_model.json]

**Validate.** Every W=2/4 point of ``bench_bandwidth`` with herald's defaults and no link key
(``results/twentyfifth_1207/final/bw_w{2,4}_{unl,lim}.json``: stock and herald, unlimited, 200 and 50 Mbit/s) is predicted
by :class:`StepTimeModel` from:

* compute: each plan's measured compute at the unlimited link and the same W (herald's scheduled step:
  ``sched_kept``'s, scheduling forced on, where ``--unlimited`` has it; else hot replication's). At W=4 the 4 ranks share
  2 cores: a rank's own compute is half its unlimited step, and that step is the host floor;
* rates and latency: each point's start-up probe (recorded by the herald run there): its all-reduce rate for the
  all-reduces' bytes (runs saved before the probe timed all-reduces: 0.93 of the ``tc`` rate, measured apart), and
  its all-to-all rate times one share for the all-to-alls' bytes (the step's all-to-alls of tens to hundreds of KB
  get more of a link than the probe's MiB ones), calibrated on one point, stock TABLE_WISE at W=2 and 200 Mbit/s,
  and marked so; the latency at the point's own W;
* where the ranks share the host's cores (4 ranks on 2), each all-reduce call's cost beyond its bytes and one latency
  (a ring's steps wait for cores), calibrated on a second stock point, the default plan at W=4 and 200 Mbit/s, and
  marked so;
* the wait for late peers: each plan's, per step, at the unlimited link and the same W (``bench_bandwidth`` matches
  the ranks' collective calls on the host's one clock, each rank's wait counted from when it waited for the result:
  ``peer_wait_ms``), on the critical path; where the ranks share the host's cores the host floor holds it; runs
  saved before it was recorded have none;
* bytes, all-reduces and collectives: TrafficMeter's per step; herald's forward-ordered dense sync is overlapped
  (hidden behind compute alone: it shares the link with the critical collectives), DDP's dense all-reduce is on the
  path.

It reports each point's predicted step and herald/stock ratio beside the measured ones, with the error.

**Project.** W = 8…128, 12.5 / 50 / 400 Gbit/s per GPU, dims 16 and 128, from:

* the GPU step at 1 rank, B=2048, stock and herald hot replication measured in one call on one machine
  (``--gpu-stock`` / ``--gpu-herald``; default the latest lent H200's paired run
  ``results/gpu_h200_1127c/pair_hot.json``, stock's steps interleaved with herald's: 6.2 and 7.7 ms; before it
  ``gpu_step3_{stock,hot}.json``, 4.6 and 8.3 ms; the earlier H100 pair ``gpu_step_time{,_herald}.json``, ids on
  the host, was 8.2 and 17.5 ms);
* bytes per rank from the plans at each W (``results/scale.json``, Kaggle rows, dim 16; dim 128 scales
  the embedding vectors by 8 and keeps the ids);
* the scheduler's CPU per rank-step (``results/home_split_maps_reserved.json``), off the critical path;
* a fabric's 0.02 ms per collective;
* no wait for late peers: no GPU run here had several ranks, so their step-to-step spread is not measured (it
  would lengthen every plan's step, most where a plan has more collectives).

The model picks herald, stock TABLE_WISE or TorchRec's default plan per point; the speedup is the pick's
over the default plan. **Per table** (:func:`project_per_table`): the same points with every candidate,
and the per-table one, priced from the planner's per-table bytes at each W and dim. Writes JSON, a plot
and the TIME_MODEL section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from torchrec_herald.planner.pricing import HERALD_COLLECTIVES, STOCK_TW_COLLECTIVES  # noqa: E402
from torchrec_herald.planner.time_model import PlanLoad, StepTimeModel, choose_plan  # noqa: E402
from bench_bandwidth import trained_plan  # noqa: E402  (one reading of a run's link decision)

RESULTS = HERE / "results"
CORES = 2
#: the measured runs validated (herald's defaults, no link key, each rank in its own namespace; the twenty-fourth
#: session's, its 2-rank runs at 515dc51 and 4-rank ones at cb3afd2, each with its wait for late peers)
LATEST_RUNS = "twentyfifth_1207/final/"
#: a session's validated runs and the unlimited-link runs that give each plan's compute, by name in its folder
VALIDATED_NAMES = ("bw_w2_unl", "bw_w2_lim", "bw_w4_unl", "bw_w4_lim")
UNLIMITED_NAMES = ("bw_w2_unl", "bw_w2_unl_herald", "bw_w4_unl", "bw_w4_unl_hot")
VALIDATED = [LATEST_RUNS + n for n in VALIDATED_NAMES]
#: the runs whose unlimited-link rows give each plan's compute by default (``--unlimited``): the same session's
UNLIMITED_RUNS = [LATEST_RUNS + n for n in UNLIMITED_NAMES]
#: each plan's compute at the unlimited link (file, config, W) where no ``--unlimited`` run has it: herald's hot
#: replication trained at W=2 and W=4 with no rate limit in these runs (an earlier session's)
UNLIMITED = {("table_wise", 2): ("bandwidth_w2_probe", "tw"), ("hot", 2): ("bandwidth_w2_confirm5", "hot"),
             ("default", 4): ("bandwidth_w4_probe", "stock"), ("table_wise", 4): ("bandwidth_w4_probe", "herald_defaults"),
             ("hot", 4): ("bandwidth", "hot")}
FABRIC_LATENCY_MS = 0.02


def _rows(name: str) -> List[Dict[str, Any]]:
    return json.loads((RESULTS / f"{name}.json").read_text())["rows"]


def _row(name: str, config: str, world: int, rate: int) -> Dict[str, Any]:
    return next(r for r in _rows(name) if r["config"] == config and r["world_size"] == world and r["rate_mbit"] == rate)


def trained(row: Dict[str, Any]) -> str:
    """What a row trained: ``table_wise``, ``default``, ``hot`` (herald's hot replication) or
    ``scheduling`` (herald's hot replication + scheduling)."""
    if row["config"] in ("tw", "stock"):
        return {"tw": "table_wise", "stock": "default"}[row["config"]]
    picked = trained_plan(row)
    if picked != "herald":  # the stock plan the model of time picked
        return picked
    return "scheduling" if {"herald_pull", "herald_push_pull"} & set(row["by_label"]) else "hot"


Unlimited = Dict[Tuple[str, int], Tuple[str, str]]


def unlimited_runs(names: List[str]) -> Unlimited:
    """Where each plan's compute at the unlimited link is taken from: :data:`UNLIMITED`'s runs, except where
    ``names`` (``bench_bandwidth`` JSONs in ``results/``: their rows at rate 0, by what each trained) have it: a
    later file overrides an earlier one; within a file the first row of a plan counts (a stock baseline before
    herald's defaults where the model of time picked the same plan)."""
    runs = dict(UNLIMITED)
    for name in names:
        found: Unlimited = {}
        for r in _rows(name):
            if r["rate_mbit"] == 0:
                found.setdefault((trained(r), r["world_size"]), (name, r["config"]))
        runs.update(found)
    return runs


#: the share of a shaped link gloo's all-reduce gets (2 ranks, 64 KB-1 MB, 25-400 Mbit/s: 0.88-0.94; RESULTS.md "What
#: a collective gets of a shaped link"): the all-reduce rate of runs saved before the probe timed all-reduces
GLOO_ALLREDUCE_SHARE = 0.93
#: the labels of all-reduces in runs saved before bench_bandwidth recorded collectives by kind (herald's hot-row
#: sync was the dense all-reduce in every such run: 579 rows × 96 B at 4 ranks, one call a step)
ALLREDUCE_LABELS = ("dense_allreduce", "data_parallel_table_allreduce", "herald_hot_sync")


def allreduces(row: Dict[str, Any], herald: bool) -> Tuple[float, float, float, float]:
    """(bytes, calls) per rank and step of the row's all-reduces on the critical path, then of those overlapped
    (herald's forward-ordered dense sums): TrafficMeter's by collective kind where the row has it, else by label."""
    labels = row["by_label"]
    ovl = labels.get("dense_allreduce", {}) if herald else {}
    ovl_bytes, ovl_calls = ovl.get("bytes", 0.0), ovl.get("calls", 0.0)
    if "by_kind" in row:
        ar = row["by_kind"].get("all_reduce", {})
        total_bytes, total_calls = ar.get("bytes", 0.0), ar.get("calls", 0.0)
    else:
        total_bytes = sum(v["bytes"] for k, v in labels.items() if k in ALLREDUCE_LABELS)
        total_calls = sum(v["calls"] for k, v in labels.items() if k in ALLREDUCE_LABELS)
    return total_bytes - ovl_bytes, total_calls - ovl_calls, ovl_bytes, ovl_calls


def unlimited_row(kind: str, W: int, unlimited: Optional[Unlimited] = None) -> Dict[str, Any]:
    """The unlimited-link run whose compute (and all-reduce cost) stands for plan ``kind`` at W ranks: herald's
    scheduled step's own where a run with scheduling forced on (``sched_kept``) measured it, else hot replication's
    (the same lookups, without applying a plan)."""
    runs = unlimited or UNLIMITED
    base = "hot" if kind == "scheduling" and (kind, W) not in runs else kind
    name, config = runs[(base, W)]
    return _row(name, config, W, 0)


def load_of(row: Dict[str, Any], kind: str, unlimited: Optional[Unlimited] = None) -> Tuple[PlanLoad, float]:
    """The row's plan as a PlanLoad (measured bytes and collectives per rank and step, its all-reduces apart,
    measured compute at the unlimited link), and that unlimited step."""
    W = row["world_size"]
    unl_row = unlimited_row(kind, W, unlimited)
    unl = unl_row["breakdown_ms"]
    herald = kind in ("hot", "scheduling")
    ar_bytes, ar_calls, ovl_bytes, ovl_calls = allreduces(row, herald)
    if herald:
        collectives = sum(v["calls"] for k, v in row["by_label"].items() if k != "dense_allreduce")
    else:
        collectives = STOCK_TW_COLLECTIVES + 1 + ("data_parallel_table_allreduce" in row["by_label"])
    critical = row["bytes_per_step"] - ovl_bytes
    if W > CORES:  # ranks share the host's cores: own compute, and the host floor (their waits for each other in it)
        compute, floor, late = unl["step"] * CORES / W, unl["step"], 0.0
    else:  # the unlimited run's peer wait, as its compute: a rate-limited run's own holds the skew its transfers
        # cause, which bytes / rate already prices (runs saved before bench_bandwidth matched arrivals have none: 0)
        compute, floor, late = unl["compute"], 0.0, unl_row.get("peer_wait_ms") or 0.0
    return PlanLoad(kind, critical, ovl_bytes, collectives, compute_ms=compute, host_bound_ms=floor,
                    allreduce_bytes=ar_bytes, allreduce_calls=ar_calls, overlapped_calls=ovl_calls,
                    peer_wait_ms=late), unl["step"]


class Probes:
    """Each (W, rate)'s start-up probe, recorded by the herald run there: the all-to-all rate, the all-reduce rate
    (where the probe timed all-reduces; else :data:`GLOO_ALLREDUCE_SHARE` of a ``tc`` rate, or the all-to-all rate
    at the unlimited link) and the latency."""

    def __init__(self, validated: List[str]) -> None:
        self.by_point = {(r["world_size"], r["rate_mbit"]): r["link_decision"]["measured"]
                         for n in validated for r in _rows(n) if r["config"] == "herald_defaults"}

    def a2a_mbit(self, W: int, rate: int) -> float:
        return self.by_point[(W, rate)]["link_mbit"]

    def allreduce_mbit(self, W: int, rate: int) -> float:
        measured = self.by_point[(W, rate)].get("allreduce_mbit")
        if measured is not None:
            return measured
        return GLOO_ALLREDUCE_SHARE * rate if rate else self.a2a_mbit(W, rate)

    def latency_ms(self, W: int, rate: int) -> float:
        return self.by_point[(W, rate)]["collective_latency_ms"]

    def measured_all_reduces(self) -> bool:
        return all(m.get("allreduce_mbit") is not None for m in self.by_point.values())


def model_for(row: Dict[str, Any], probes: Probes, a2a_share: float, call_ms: float = 0.0) -> StepTimeModel:
    """The model of time at ``row``'s point: the probe's all-to-all rate × ``a2a_share`` (what the step's all-to-alls,
    of tens to hundreds of KB, get beside the probe's MiB ones), its all-reduce rate and latency at this W and link,
    and, where the ranks share the host's cores (W > :data:`CORES`), ``call_ms`` per all-reduce call."""
    W, rate = row["world_size"], row["rate_mbit"]
    return StepTimeModel(link_mbit=probes.a2a_mbit(W, rate) * a2a_share, allreduce_mbit=probes.allreduce_mbit(W, rate),
                         collective_latency_ms=probes.latency_ms(W, rate),
                         allreduce_call_ms=call_ms if W > CORES else 0.0)


def shared_core_call_ms(row: Dict[str, Any], probes: Probes, a2a_share: float,
                        unlimited: Optional[Unlimited] = None) -> float:
    """What each all-reduce call must cost, where ranks share cores, to put ``row`` (a stock run at W > cores) on its
    measured step: its step less its compute, its bytes and its collectives' latency, per all-reduce call (0 where
    those already pass the step). One such figure, stock's at W=4 and 200 Mbit/s,
    is the validation's second calibration. (TrafficMeter's times from each call to its completion do not give it:
    at the unlimited link they hold each peer's lateness and the overlap, 4-14 ms a call at W=4, ~1.4 at W=2.)"""
    load, _ = load_of(row, trained(row), unlimited)
    m = model_for(row, probes, a2a_share)
    path = m.predict(load)
    rest = path.compute_ms + path.extra_ms + path.comm_ms
    return max((row["breakdown_ms"]["step"] - rest) / max(load.allreduce_calls, 1.0), 0.0)


def a2a_share(row: Dict[str, Any], probes: Probes, unlimited: Optional[Unlimited] = None) -> float:
    """The multiple of the probe's all-to-all rate that puts a stock row (TABLE_WISE at W=2) on its measured step:
    its all-to-all bytes over the step less its compute, its all-reduces, its collectives' latency and its plan's
    wait for late peers. One such figure, at 200 Mbit/s, is the validation's calibration."""
    load, _ = load_of(row, trained(row), unlimited)
    m = model_for(row, probes, 1.0)
    # (the model's path for the step without its all-to-all bytes: compute, all-reduces, latencies)
    rest = m.predict(replace(load, critical_bytes=load.allreduce_bytes))
    others = rest.compute_ms + rest.extra_ms + rest.comm_ms
    return m.bytes(load.critical_bytes - load.allreduce_bytes) / (row["breakdown_ms"]["step"] - others)


def share_by_rate(names: List[str], probes: Probes, unlimited: Optional[Unlimited] = None) -> List[Dict[str, Any]]:
    """:func:`a2a_share` at every rate-limited stock TABLE_WISE row at W=2 of ``names`` (``bench_bandwidth`` JSONs in
    ``results/`` whose points the probes cover): how the share moves with the rate."""
    rows = [(n, r) for n in names for r in _rows(n) if r["config"] == "tw" and r["world_size"] == 2
            and r["rate_mbit"] > 0 and (2, r["rate_mbit"]) in probes.by_point]
    return [{"rate_mbit": r["rate_mbit"], "step_ms": r["breakdown_ms"]["step"], "from": n,
             "a2a_share": a2a_share(r, probes, unlimited)} for n, r in sorted(rows, key=lambda x: -x[1]["rate_mbit"])]


def validate(validated: Optional[List[str]] = None, rate_sweep: Optional[List[str]] = None,
             share: Optional[float] = None, unlimited: Optional[Unlimited] = None,
             call_ms: Optional[float] = None) -> Dict[str, Any]:
    """Each measured point of ``validated`` (``bench_bandwidth`` JSONs in ``results/``, default
    :data:`VALIDATED`: herald's defaults beside a stock baseline) against the model's prediction. Two figures are
    calibrated where not given, each on one stock point, marked so: the all-to-all share (``share``, stock
    TABLE_WISE at W=2, 200 Mbit/s) and what an all-reduce call costs where ranks share cores (``call_ms``, stock's
    baseline at W=4, 200 Mbit/s; 0 where no such point)."""
    validated = validated or VALIDATED
    unlimited = unlimited if unlimited is not None else unlimited_runs(UNLIMITED_RUNS)
    probes = Probes(validated)
    calibrated: Dict[str, Tuple[str, str, int, int]] = {}

    def point(config: str, W: int) -> Optional[Tuple[str, Dict[str, Any]]]:
        return next(((n, r) for n in validated for r in _rows(n)
                     if (r["config"], r["world_size"], r["rate_mbit"]) == (config, W, 200)), None)

    if share is None:
        cal = point("tw", 2) or ("bandwidth_w2_probe_limited", _row("bandwidth_w2_probe_limited", "tw", 2, 200))
        share = a2a_share(cal[1], probes, unlimited)
        calibrated["a2a_share"] = (cal[0], "tw", 2, 200)
    if call_ms is None:
        cal4 = next((point(c, W) for c in ("stock", "tw") for W in (4, 8) if point(c, W)), None)
        call_ms = shared_core_call_ms(cal4[1], probes, share, unlimited) if cal4 else 0.0
        if cal4:
            calibrated["call_ms"] = (cal4[0], cal4[1]["config"], cal4[1]["world_size"], 200)
    points = []
    for n in validated:
        rows = _rows(n)
        for r in rows:
            if r["config"] == "herald_defaults":
                continue
            h = next(x for x in rows if x["config"] == "herald_defaults" and x["rate_mbit"] == r["rate_mbit"])
            W, rate = r["world_size"], r["rate_mbit"]
            (sl, _), (hl, _) = load_of(r, trained(r), unlimited), load_of(h, trained(h), unlimited)
            m = model_for(r, probes, share, call_ms)
            ps, ph = m.predict(sl).step_ms, m.predict(hl).step_ms
            ms, mh = r["breakdown_ms"]["step"], h["breakdown_ms"]["step"]
            points.append({
                "world_size": W, "rate_mbit": rate, "baseline": trained(r), "herald_trained": trained(h),
                "link_mbit_used": m.link_mbit, "allreduce_mbit_used": m.allreduce_rate_mbit,
                "latency_ms_used": m.collective_latency_ms, "allreduce_call_ms": m.allreduce_call_ms,
                "calibration_point": (n, r["config"], W, rate) in calibrated.values(),
                "stock_step_ms": {"measured": ms, "predicted": ps, "error": ps / ms - 1},
                "herald_step_ms": {"measured": mh, "predicted": ph, "error": ph / mh - 1},
                # ms per step waited for late peers: the model's (the unlimited run's), and this point's own run's
                "peer_wait_ms": {"stock": {"used": sl.peer_wait_ms, "measured": r.get("peer_wait_ms")},
                                 "herald": {"used": hl.peer_wait_ms, "measured": h.get("peer_wait_ms")}},
                # samples/s ratio herald / stock: the measured one is bench_bandwidth's (median runs)
                "ratio": {"measured": h["samples_per_s"] / r["samples_per_s"], "predicted": ps / ph,
                          "measured_from_steps": ms / mh},
            })
            points[-1]["ratio"]["error"] = points[-1]["ratio"]["predicted"] / points[-1]["ratio"]["measured"] - 1
    return {"a2a_share": share, "shared_core_allreduce_call_ms": call_ms, "calibrated": calibrated,
            "allreduce_measured_by_probe": probes.measured_all_reduces(), "points": points,
            "share_by_rate": share_by_rate(list(validated) + list(rate_sweep or []), probes, unlimited)}


def gpu_steps(gpu: Tuple[str, str], B: int) -> Tuple[float, float, str]:
    """(stock ms, herald ms, where from) at local batch ``B`` from two ``gpu_step_time.py`` JSONs in
    ``results/`` (stock's, herald's; measured in one call on one machine). A paired run (``--baseline``
    stock, its steps interleaved with herald's in one process) may be given as both: its baseline is stock's."""
    runs = [json.loads((RESULTS / name).read_text()) for name in gpu]
    stock, herald = (next(r for r in d["runs"] if r["local_batch"] == B) for d in runs)
    stock_ms = 1e3 * stock.get("baseline_step_s_median", stock["step_s_median"])
    herald_ms = 1e3 * herald["step_s_median"]
    where = f"results/{gpu[0]}, {gpu[1]} ({runs[0]['machine'].get('gpu', '?')}, 1 rank, B={B})"
    return stock_ms, herald_ms, where


def project(worlds: List[int], links_gbit: List[float], dims: List[int], gpu: Tuple[str, str]) -> Dict[str, Any]:
    stock_ms, herald_ms, where = gpu_steps(gpu, 2048)
    scale = {r["world_size"]: r for r in json.loads((RESULTS / "scale.json").read_text())["runs"]
             if r["setting"] == "kaggle" and r["local_batch"] == 2048}
    sched = {r["world_size"]: r["scheduler_cpu_s_per_rank_step"]["mean"] * 1e3 for r in
             json.loads((RESULTS / "home_split_maps_reserved.json").read_text())["runs"] if r["local_batch"] == 2048}
    out = []
    for W in worlds:
        s = scale[W]
        B, lookups = s["local_batch"], s["lookups_per_rank_step"]
        ids_bytes = lookups * 8.0 * (W - 1) / W  # int64 ids to other ranks, per rank (TW/default/herald cold)
        for dim in dims:
            def per_rank(key: str) -> float:
                b = s["embedding_bytes_per_step"][key] / W
                return ids_bytes + (b - ids_bytes) * dim / 16 if b > ids_bytes else b * dim / 16
            for gbit in links_gbit:
                m = StepTimeModel(link_mbit=gbit * 1e3, collective_latency_ms=FABRIC_LATENCY_MS, compute_ms=stock_ms)
                loads = [PlanLoad("herald", per_rank("herald_hot_only"), 0.0, HERALD_COLLECTIVES,
                                  compute_ms=herald_ms),
                         PlanLoad("table_wise", per_rank("stock_table_wise"), 0.0, STOCK_TW_COLLECTIVES),
                         PlanLoad("default", per_rank("stock_default_plan"), 0.0, STOCK_TW_COLLECTIVES + 1)]
                choice = choose_plan(loads, m)
                p = choice.predictions
                # what herald would give with the device-resident step's target (herald ≤ 1.1× stock's step),
                # not measured: the id bookkeeping still runs on the CPU
                target = m.predict(PlanLoad("herald", loads[0].critical_bytes, 0.0, HERALD_COLLECTIVES,
                                            compute_ms=1.1 * stock_ms)).step_ms
                out.append({"world_size": W, "dim": dim, "link_gbit": gbit, "local_batch": B,
                            "bytes_per_rank": {ld.name: ld.critical_bytes for ld in loads},
                            "predicted_step_ms": {n: v.step_ms for n, v in p.items()},
                            "chosen": choice.chosen,
                            "herald_vs_default": p["default"].step_ms / p["herald"].step_ms,
                            "chosen_vs_default": p["default"].step_ms / p[choice.chosen].step_ms,
                            "herald_vs_default_if_gpu_step_1_1x": p["default"].step_ms / target,
                            "scheduler_cpu_ms_off_path": sched.get(W)})
    return {"inputs": {"gpu_stock_step_ms": stock_ms, "gpu_herald_step_ms": herald_ms,
                       "fabric_latency_ms": FABRIC_LATENCY_MS, "bytes": "results/scale.json (kaggle, B=2048, dim 16)",
                       "gpu": where},
            "points": out}


def table_traffic_at(W: int, B: int, dim: int, stats_batches: int = 4, budget: int = 64 << 20
                     ) -> Tuple[Dict[str, Dict[str, float]], Dict[str, str]]:
    """Per table of full Kaggle (synthetic ids, as ``bench_scale``): the planner's expected bytes per step
    (all ranks: ``lookups``, ``stock_table_wise``, ``stock_row_wise``, ``herald_total``) with the hot sets the
    cost model picks at W ranks, B per rank and this dim; and each table's type in TorchRec's default plan."""
    from torchrec_herald.data import SyntheticCriteo, kjt_from_ids
    from torchrec_herald.model import build_dlrm_train, build_tables
    from torchrec_herald.planner import AccessStats, CostModelHotSetSelector
    from torchrec_herald.planner.stock import describe_plan, stock_plan
    from torchrec_herald.sharding import CpuEmbeddingBagCollectionSharder
    import torch

    src = SyntheticCriteo(scale=1.0, seed=0)
    tables = build_tables(src.feature_names, src.num_embeddings, dim, "SUM")
    G = W * B
    stats = AccessStats.from_batches([kjt_from_ids(src.feature_names, src.global_batch("train", -1 - i, G)[1][:, :min(G, 65536)])
                                      for i in range(stats_batches)], tables)
    choice = CostModelHotSetSelector().select(stats, tables, W, B, budget)
    model = build_dlrm_train(tables, 13, [64, dim], [64, 1], device="meta")
    types = describe_plan(stock_plan(model, tables, [CpuEmbeddingBagCollectionSharder()], "default", W, B,
                                     torch.device("cpu")))
    return {n: c.expected.as_dict() for n, c in choice.items()}, types


def project_per_table(worlds: List[int], links_gbit: List[float], dims: List[int], gpu: Tuple[str, str],
                      B: int = 2048) -> Dict[str, Any]:
    """The projection with the per-table candidate: every candidate priced from the same per-table bytes
    (:func:`table_traffic_at`); herald's extra GPU time (the measured herald − stock GPU step) as the model
    prices it, per lookup of the whole EBC, which a split pays in full."""
    from torchrec_herald.planner.pricing import LinkModel
    from torchrec_herald.planner.time_model import decide, default_plan_load, mixed_plan_load, per_table_choice

    stock_ms, herald_ms, where = gpu_steps(gpu, B)
    out = []
    for W in worlds:
        for dim in dims:
            expected, types = table_traffic_at(W, B, dim)
            lookups = sum(e["lookups"] for e in expected.values()) / W
            us_per_lookup = (herald_ms - stock_ms) * 1e3 / lookups
            sizes = dict(zip(*_kaggle_sizes()))
            table_bytes = {n: 4.0 * sizes[n] * dim for n in expected}  # a DATA_PARALLEL table's all-reduce
            for gbit in links_gbit:
                link = LinkModel(link_mbit=gbit * 1e3, collective_latency_ms=FABRIC_LATENCY_MS,
                                 cpu_us_per_lookup=us_per_lookup)
                pick = per_table_choice(expected, types, W, link)
                mixed = (mixed_plan_load(expected, pick, W, 0.0), pick) if len({k == "herald" for k in pick.values()}) == 2 else None
                default = default_plan_load(types, expected, table_bytes, W, 0.0)
                d = decide(expected.values(), W, link, default_plan=default, mixed=mixed)
                p = {n: v.step_ms + stock_ms for n, v in d.predictions.items()}  # + the stock step's compute
                out.append({"world_size": W, "dim": dim, "link_gbit": gbit, "local_batch": B,
                            "herald_us_per_lookup": us_per_lookup, "predicted_step_ms": p, "chosen": d.chosen,
                            "herald_tables": sum(k == "herald" for k in pick.values()),
                            "chosen_vs_default": p["default"] / p[d.chosen],
                            "herald_vs_default": p["default"] / p["herald"],
                            "mixed_vs_default": p["default"] / p["mixed"] if "mixed" in p else None,
                            "per_table": pick})
                print(f"W={W} dim={dim} {gbit:g} Gbit/s: {d.chosen} {out[-1]['chosen_vs_default']:.2f}x "
                      f"(herald {out[-1]['herald_vs_default']:.2f}x, {out[-1]['herald_tables']} herald tables)", flush=True)
    return {"inputs": {"gpu_stock_step_ms": stock_ms, "gpu_herald_step_ms": herald_ms, "local_batch": B, "gpu": where,
                       "bytes": "planner's expected bytes per table, full Kaggle (synthetic ids), hot sets at W and dim"},
            "points": out}


def _kaggle_sizes() -> Tuple[List[str], List[int]]:
    from torchrec_herald.data import SyntheticCriteo
    from torchrec_herald.model import table_name

    src = SyntheticCriteo(scale=1.0, seed=0)
    return [table_name(f) for f in src.feature_names], list(src.num_embeddings)


def _calibrated(point: Optional[List[Any]]) -> str:
    """``calibrated on <config>, W=<W>, <rate> Mbit/s`` for a validation's calibration point (``given``: none)."""
    if not point:
        return "given"
    _, config, W, rate = point
    return f"calibrated on {'stock TABLE_WISE' if config == 'tw' else 'TorchRec' + chr(39) + 's default plan'}, W={W}, {rate} Mbit/s"


def markdown(result: Dict[str, Any], command: str) -> str:
    v = result["validation"]
    lines = [f"Command: `{command}`", "",
             f"Validation: the step's all-to-alls at {v['a2a_share']:.2f}× the probe's all-to-all rate ("
             + _calibrated(v["calibrated"].get("a2a_share")) + "); all-reduces at the probe's all-reduce rate"
             + ("" if v.get("allreduce_measured_by_probe") else " (0.93 of the tc rate where it did not time them)")
             + f"; each point's own latency; where ranks share cores, {v['shared_core_allreduce_call_ms']:.1f} ms "
             f"more per all-reduce call ({_calibrated(v['calibrated'].get('call_ms'))}); where ranks have a core each, "
             "each plan's wait for late peers measured at the unlimited link.", "",
             "| ranks | link | stock trained | herald trained | stock step measured / predicted (err) | "
             "herald step measured / predicted (err) | ratio measured / predicted (err) |", "|---|---|---|---|---|---|---|"]
    for p in v["points"]:
        link = "unlimited" if p["rate_mbit"] == 0 else f"{p['rate_mbit']} Mbit/s"
        s, h, r = p["stock_step_ms"], p["herald_step_ms"], p["ratio"]
        mark = " (calibration)" if p["calibration_point"] else ""
        lines.append(f"| {p['world_size']} | {link} | {p['baseline']} | {p['herald_trained']} | "
                     f"{s['measured']:.1f} / {s['predicted']:.1f} ({100 * s['error']:+.0f} %){mark} | "
                     f"{h['measured']:.1f} / {h['predicted']:.1f} ({100 * h['error']:+.0f} %) | "
                     f"{r['measured']:.2f}× / {r['predicted']:.2f}× ({100 * r['error']:+.0f} %) |")
    by_rate = v.get("share_by_rate") or []
    if len(by_rate) > 1:
        lines += ["", "The share of the probe's all-to-all rate that puts stock TABLE_WISE at W=2 on its measured step, "
                  "by rate: " + ", ".join(f"{e['rate_mbit']} Mbit/s {e['a2a_share']:.2f}" for e in by_rate) + "."]
    lines += ["", "Per point: " + "; ".join(
        f"{p['world_size']} ranks {'unlimited' if not p['rate_mbit'] else str(p['rate_mbit']) + ' Mbit/s'}: all-to-all "
        f"{p['link_mbit_used']:,.0f}, all-reduce {p['allreduce_mbit_used']:,.0f} Mbit/s, {p['latency_ms_used']:.2f} ms, "
        f"all-reduce call {p['allreduce_call_ms']:.1f} ms" + _peer_wait(p.get("peer_wait_ms"))
        for p in v["points"]) + "."]
    pr = result["projection"]
    lines += ["", f"Projection (GPU step {pr['inputs']['gpu_stock_step_ms']:.1f} ms stock, "
              f"{pr['inputs']['gpu_herald_step_ms']:.1f} ms herald, from {pr['inputs']['gpu']}; the model's pick vs TorchRec's "
              "default plan; herald alone in brackets):", ""]
    lines += _grid(pr["points"], lambda p: f"{p['chosen_vs_default']:.2f}× {p['chosen']} ({p['herald_vs_default']:.2f}×)")
    return "\n".join(lines)


def _peer_wait(pw: Optional[Dict[str, Dict[str, Optional[float]]]]) -> str:
    """``, peer wait stock 1.1 / herald 0.9 ms (measured there 1.1 / 0.9)`` where the model used one ('' else)."""
    if not pw or not (pw["stock"]["used"] or pw["herald"]["used"]):
        return ""
    there = [pw[s]["measured"] for s in ("stock", "herald")]
    seen = "" if None in there else f" (measured there {there[0]:.1f} / {there[1]:.1f})"
    return f", peer wait stock {pw['stock']['used']:.1f} / herald {pw['herald']['used']:.1f} ms{seen}"


def _grid(points: List[Dict[str, Any]], cell: Any) -> List[str]:
    """A markdown table of ``points``: a row per (dim, link), a column per W, ``cell(point)`` in each."""
    worlds = sorted({p["world_size"] for p in points})
    lines = ["| dim | link per GPU | " + " | ".join(f"W={w}" for w in worlds) + " |", "|---|---|" + "---|" * len(worlds)]
    for dim in sorted({p["dim"] for p in points}):
        for gbit in sorted({p["link_gbit"] for p in points}):
            cells = [cell(p) for p in sorted(points, key=lambda p: p["world_size"])
                     if p["dim"] == dim and p["link_gbit"] == gbit]
            lines.append(f"| {dim} | {gbit:g} Gbit/s | " + " | ".join(cells) + " |")
    return lines


def markdown_per_table(pt: Dict[str, Any]) -> str:
    """The per-table projection: the pick vs TorchRec's default plan, the herald tables in the per-table
    candidate's best split, herald alone in brackets."""
    lines = [f"Per-table decisions (every candidate from the planner's per-table bytes, full Kaggle, B={pt['inputs']['local_batch']} "
             f"per GPU; herald's extra GPU time {pt['inputs']['gpu_herald_step_ms'] - pt['inputs']['gpu_stock_step_ms']:.1f} ms "
             "per step, paid by a split too; cell: the model's pick vs the default plan, herald tables in the best "
             "per-table split of 26, herald alone in brackets):", ""]
    lines += _grid(pt["points"], lambda p: f"{p['chosen_vs_default']:.2f}× {p['chosen']}, {p['herald_tables']} h "
                                           f"({p['herald_vs_default']:.2f}×)")
    return "\n".join(lines)


def plot(result: Dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["projection"]["points"]
    dims = sorted({p["dim"] for p in pts})
    fig, axes = plt.subplots(1, len(dims) + 1, figsize=(5 * (len(dims) + 1), 4))
    v = result["validation"]["points"]
    ax = axes[0]
    lim = [0.5, max(max(p["ratio"]["measured"], p["ratio"]["predicted"]) for p in v) * 1.1]
    ax.fill_between(lim, [x * 0.85 for x in lim], [x * 1.15 for x in lim], color="0.9", zorder=1)
    ax.plot(lim, lim, "k--", lw=1, zorder=2)
    for p in v:
        ax.scatter(p["ratio"]["measured"], p["ratio"]["predicted"], color=f"C{p['world_size'] // 2 - 1}",
                   label=f"W={p['world_size']}", zorder=3, marker="o" if p["rate_mbit"] else "s")
        ax.annotate("unl." if not p["rate_mbit"] else f"{p['rate_mbit']}", (p["ratio"]["measured"], p["ratio"]["predicted"]),
                    fontsize=7, xytext=(4, -8), textcoords="offset points")
    h, lab = ax.get_legend_handles_labels()
    ax.legend(dict(zip(lab, h)).values(), dict(zip(lab, h)).keys())
    ax.set_xlabel("measured herald / stock (samples/s)")
    ax.set_ylabel("predicted")
    ax.set_title("validation (grey: ±15 %)")
    for ax, dim in zip(axes[1:], dims):
        for i, gbit in enumerate(sorted({p["link_gbit"] for p in pts})):
            sel = sorted((p for p in pts if p["dim"] == dim and p["link_gbit"] == gbit), key=lambda p: p["world_size"])
            ax.plot([p["world_size"] for p in sel], [p["chosen_vs_default"] for p in sel], "o-", color=f"C{i}",
                    label=f"{gbit:g} Gbit/s: model's pick")
            ax.plot([p["world_size"] for p in sel], [p["herald_vs_default"] for p in sel], ":", color=f"C{i}",
                    label=f"{gbit:g} Gbit/s: herald alone")
            if gbit == min(p["link_gbit"] for p in pts):
                ax.plot([p["world_size"] for p in sel], [p["herald_vs_default_if_gpu_step_1_1x"] for p in sel], "-.",
                        color=f"C{i}", label=f"{gbit:g} Gbit/s: herald if its GPU step were 1.1x stock's")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (W)")
        ax.set_ylabel("speedup vs TorchRec's default plan")
        ax.set_title(f"projection, dim {dim}")
        ax.legend(fontsize=6, loc="center right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: Optional[List[str]] = None) -> None:
    from bench_traffic import write_results_md  # RESULTS.md's marked sections, one writer for every benchmark
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--links-gbit", type=float, nargs="+", default=[12.5, 50, 400])
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--out", default=str(RESULTS / "time_model.json"))
    ap.add_argument("--gpu-stock", default="gpu_h200_1127c/pair_hot.json", help="stock's GPU step JSON in results/")
    ap.add_argument("--gpu-herald", default="gpu_h200_1127c/pair_hot.json",
                    help="herald's GPU step JSON in results/, measured beside --gpu-stock")
    ap.add_argument("--validated", nargs="+", default=None,
                    help=f"bench_bandwidth JSONs in results/ (no .json) to validate on (default: {' '.join(VALIDATED)})")
    ap.add_argument("--unlimited", nargs="+", default=UNLIMITED_RUNS,
                    help="bench_bandwidth JSONs in results/ (no .json) whose unlimited-link rows give each plan's "
                         f"compute (default: {' '.join(UNLIMITED_RUNS)}; then the runs UNLIMITED names)")
    ap.add_argument("--rate-sweep", nargs="+", default=[],
                    help="more bench_bandwidth JSONs in results/ (no .json) with stock TABLE_WISE at W=2 at other rates: "
                         "the all-to-all share at each rate is reported beside the validation (not used by it)")
    ap.add_argument("--a2a-share", type=float, default=None,
                    help="the multiple of the probe's all-to-all rate to validate with, instead of calibrating it on "
                         "stock TABLE_WISE at W=2, 200 Mbit/s")
    ap.add_argument("--validate-only", action="store_true", help="the validation alone (no projection, no RESULTS.md)")
    a = ap.parse_args(argv)
    gpu = (a.gpu_stock, a.gpu_herald)
    command = "python benchmarks/time_model.py" + (" " + " ".join(argv) if argv else "")
    validation = validate(a.validated, a.rate_sweep, a.a2a_share, unlimited_runs(a.unlimited))
    if a.validate_only:
        print(json.dumps(validation, indent=1))
        return
    result = {"command": command, "validation": validation, "projection": project(a.world_sizes, a.links_gbit, a.dims, gpu),
              "per_table": project_per_table(a.world_sizes, a.links_gbit, a.dims, gpu)}
    out = Path(a.out)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    md = markdown(result, command) + "\n\n" + markdown_per_table(result["per_table"])
    write_results_md({"TIME_MODEL": md})
    print(md)


if __name__ == "__main__":
    main(sys.argv[1:])
