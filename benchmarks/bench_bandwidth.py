"""Speed under emulated bandwidth (docs/design.md §6): samples/s of stock TorchRec and herald, side by side,
with every rank's link rate-limited by ``tc tbf``.

    sudo .venv/bin/python benchmarks/bench_bandwidth.py [--world-sizes 2 4] [--rates 0 1000 200 50]
                                                        [--steps 100] [--segments 5] [--repeats 3]
                                                        [--configs tw stock hot herald]
    (or: make bench-bandwidth ARGS="...")

Each rank runs in its own network namespace (``herald_nsR``) whose only link, a veth pair to a bridge,
carries all its gloo traffic; ``tc tbf`` limits both ends of that link to the rate (0 = unlimited). Every
configuration trains the same global batches (default synthetic data, local batch 256). A run warms up,
then times ``steps`` steps in ``segments`` equal segments (its samples/s: the median segment); each
configuration runs ``repeats`` times, interleaved with the others, and the median run is reported. The order
rotates from repeat to repeat (``--configs a b c``: a b c, b c a, c a b, ...), so that a fixed order cannot book
any cost of a run's place against one configuration every time (on this host, 30 repeats of identical plans put
the second run 1.9 % slower than the first, with a standard error of 2.0 %: within the noise,
``results/twentyfourth_1207/order_reanalysis.txt``). Each place is shared evenly where ``repeats`` is a multiple
of the number of configurations (with 5 repeats of two, the first named goes first 3 times).

Per configuration and rate it records the step-time breakdown on rank 0's main thread:

* ``comm_wait``: time blocked in collectives (sync calls and the ``wait()`` of async ones, TrafficMeter);
  DDP's dense all-reduce is waited for inside autograd's C++ and counts as compute;
* ``scheduler_critical``: herald scheduling on the step's critical path (its collectives excluded);
* ``scheduler_overlapped``: herald scheduling done by the run-ahead thread while steps trained;
* ``compute``: the rest of the step;

and, matching the ranks' collective calls on the host's one clock (``traffic.peer_lateness``), ``peer_wait_ms``: the
part of ``comm_wait`` rank 0 spent waiting for its latest peer to arrive (``peer_wait_ms_by_rank``: every rank's).

Stock's communication share (``comm_wait`` / step) says which GPU-cluster regime a rate stands for.
Writes ``benchmarks/results/bandwidth.json``, ``bandwidth.png`` and the BANDWIDTH section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from netns_crosscheck import run_in_namespaces, setup, sh, teardown  # noqa: E402  (one netns plumbing)
sys.path.insert(0, str(HERE.parent))
from torchrec_herald.traffic import peer_lateness  # noqa: E402

PORT = 29571
logger = logging.getLogger("bench_bandwidth")

#: configuration name -> (label, Hydra overrides)
CONFIGS: Dict[str, tuple] = {
    "tw": ("stock all TABLE_WISE", ["planner=table_wise"]),
    "stock": ("stock default plan", ["planner=stock"]),
    "hot": ("herald hot replication", ["planner=herald", "pipeline=sparse_dist"]),
    "herald": ("herald full", ["planner=herald", "pipeline=herald"]),
    # diagnostics, not in the default set: stock TABLE_WISE with the forward-ordered dense sync; hot
    # replication with DDP's dense sync (before forward_ordered); herald's scheduling forced on (no probe,
    # no link model)
    "tw_fo": ("stock all TABLE_WISE, forward-ordered dense sync", ["planner=table_wise",
                                                                  "+planner.dense_sync=forward_ordered"]),
    "hot_ddp": ("herald hot replication, DDP dense sync", ["planner=herald", "pipeline=sparse_dist",
                                                           "planner.dense_sync=ddp"]),
    "sched": ("herald hot replication + scheduling (forced on)", ["planner=herald", "pipeline=herald",
                                                                  "pipeline.scheduling=on"]),
    # herald with its defaults and no link key (the planner does not know the link)
    "herald_defaults": ("herald full, defaults (no link key)", ["planner=herald", "pipeline=herald"]),
    # the same fed by a user's own loader of this rank's batches (OWN_LOADER): scores, samples and reads
    # gathered, scheduled ahead by default, or on the training thread (run_ahead=false)
    "herald_own": ("herald full, defaults, a user's own per-rank loader", ["planner=herald", "pipeline=herald"]),
    "herald_own_serial": ("herald full, own per-rank loader, scheduled on the training thread",
                          ["planner=herald", "pipeline=herald", "pipeline.run_ahead=false"]),
    # the two planning strategies, scheduling forced on, no link key: every rank plans every row of the
    # whole global batches (global), or each rank its own rows from its own batches, ahead (by_home)
    "global_on": ("herald, global planning, scheduling on", ["planner=herald", "pipeline=herald",
                                                            "pipeline.scheduling=on", "pipeline.planning=global"]),
    # one planning strategy forced, every other key at its default (no link key; scheduling=auto probes)
    "global": ("herald, global planning, defaults otherwise", ["planner=herald", "pipeline=herald",
                                                               "pipeline.planning=global"]),
    "by_home": ("herald, planning by home, defaults otherwise", ["planner=herald", "pipeline=herald",
                                                                 "pipeline.planning=by_home"]),
    "by_home_on": ("herald, planning by home, scheduling on", ["planner=herald", "pipeline=herald",
                                                              "pipeline.scheduling=on", "pipeline.planning=by_home",
                                                              "pipeline.allocator=identity"]),
    # what each technique buys (no link key): scheduling forced on, then HET's bounded staleness on top,
    # and Slipstream's input skipping on herald's defaults (each approximate mode without its exact
    # reference run; skipping's counterpart without it is herald_defaults)
    "het": ("herald + scheduling + HET staleness 3", ["planner=herald", "pipeline=herald", "pipeline.scheduling=on",
                                                     "pipeline.staleness=3", "pipeline.reference=false"]),
    "het1": ("herald + scheduling + HET staleness 1", ["planner=herald", "pipeline=herald", "pipeline.scheduling=on",
                                                      "pipeline.staleness=1", "pipeline.reference=false"]),
    "skip": ("herald + Slipstream skip=input", ["planner=herald", "pipeline=herald", "pipeline.skip=input",
                                                "pipeline.reference=false"]),
    # per-table decisions: herald's hot replication kept whatever the link, and a per-table split forced by a
    # declared link where the model of commit 3cde93a split the tables (5 herald, 21 TABLE_WISE on the default
    # data); the current model, which charges a split herald's extra work per step, picks the default plan there
    "hot_kept": ("herald hot replication, kept (planner.link_mbit=null)", ["planner=herald", "planner.link_mbit=null",
                                                                         "pipeline=sparse_dist"]),
    "hot_kept_ddp": ("herald hot replication, kept, DDP dense sync", ["planner=herald", "planner.link_mbit=null",
                                                                     "pipeline=sparse_dist", "planner.dense_sync=ddp"]),
    "sched_kept": ("herald hot replication + scheduling, kept (planner.link_mbit=null, scheduling on)",
                   ["planner=herald", "planner.link_mbit=null", "pipeline=herald", "pipeline.scheduling=on"]),
    "split": ("herald tables beside TABLE_WISE ones (split forced: declared 1200 Mbit/s, 0.001 ms)",
              ["planner=herald", "planner.link_mbit=1200", "planner.collective_latency_ms=0.001", "pipeline=sparse_dist"]),
}
#: configurations fed as a TorchRec user's own data loader feeds them (this rank's batches, not the trainer's
#: TrainStream): herald then gathers every rank's scores and reads and moves samples
OWN_LOADER = {"herald_own", "herald_own_serial"}
#: herald full declares the link it runs on (planner.link_mbit); "unlimited" (veth without tc) as 10 Gbit/s
UNLIMITED_DECLARED_MBIT = 10_000


def trained_plan(row: Dict[str, Any]) -> str:
    """The plan a run with a link decision trained: ``herald`` (herald's tables, all or some) or the stock plan the
    model of time picked (``table_wise``, ``default``)."""
    d = row.get("link_decision") or {}
    return "herald" if d.get("herald", True) else str(d.get("chosen") or "table_wise")


def run_order(configs: List[str], repeat: int) -> List[str]:
    """The configurations' order in repeat ``repeat``: ``configs`` rotated by ``repeat`` places, so that each takes
    each place of a repeat once in every ``len(configs)`` repeats."""
    k = repeat % len(configs)
    return list(configs[k:]) + list(configs[:k])


def limit(world: int, rate_mbit: int) -> None:
    """``tc tbf`` at ``rate_mbit`` on both ends of every rank's link (0: no limit). The bucket holds 1 ms
    of traffic (at least 16 KiB), so a step's messages cannot ride a burst past the rate."""
    for r in range(world):
        for dev, ns in ((f"herald_v{r}", None), (f"eth{r}", f"herald_ns{r}")):
            pre = ["ip", "netns", "exec", ns] if ns else []
            subprocess.run(pre + ["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_mbit:
                burst = max(16 * 1024, rate_mbit * 1_000_000 // 8 // 1000)
                sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                   "burst", str(burst), "latency", "100ms")


class CountedBatches:
    """A plain iterator over this rank's batches (a user's own loader), counting them as ``position`` (as a
    TrainStream's) for the samples-per-second figures."""

    def __init__(self, batches: Any) -> None:
        self._it, self.position = iter(batches), 0

    def __iter__(self) -> "CountedBatches":
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self.position += 1
        return batch


def worker(config: str, steps: int, segments: int, warmup: int, out: str, rate: int) -> None:
    """One rank (inside its namespace): build the configuration, warm up, time ``steps`` steps."""
    import torch
    import torch.distributed as dist

    from torchrec_herald.config import compose_config
    from torchrec_herald.data import build_data_source
    from torchrec_herald.dist_utils import init_distributed
    from torchrec_herald.metrics import step_time_breakdown
    from torchrec_herald.trainer import build_model_and_plan, build_pipeline, train_stream
    from torchrec_herald.traffic import TrafficMeter

    torch.set_num_threads(1)
    rank, world, device = init_distributed()
    window = 5
    link = [f"planner.link_mbit={rate or UNLIMITED_DECLARED_MBIT}"] if config == "herald" else []
    overrides = CONFIGS[config][1]
    # input skipping refills each global batch with live samples: a step reads more than one batch
    batches = (warmup + steps + window) * (2 if "pipeline.skip=input" in overrides else 1)
    cfg = compose_config(overrides + link + [f"data.num_train_batches={batches}", "eval=false"])
    data = build_data_source(cfg.data)
    dmp, optimizer, decision = build_model_and_plan(cfg, data, world, device)
    pipeline = build_pipeline(cfg, dmp, optimizer, device, decision)
    it = (CountedBatches(data.train_batches(rank, world, cfg.batch_size)) if config in OWN_LOADER
          else train_stream(data, rank, world, cfg.batch_size))
    for _ in range(warmup):
        pipeline.progress(it)
    s0 = pipeline.scheduler_seconds()
    dist.barrier()
    seg_s: List[float] = []
    seg_read: List[int] = []  # global batches the loader gave per segment (more than steps with input skipping)
    per = steps // segments
    with TrafficMeter(embedding_dim=cfg.model.embedding_dim, completion_times=True) as meter:
        for _ in range(segments):
            t0, p0 = time.perf_counter(), it.position
            for _ in range(per):
                out_ = pipeline.progress(it)
            out_[0].item()
            seg_s.append(time.perf_counter() - t0)
            seg_read.append(it.position - p0)
        # the run-ahead job the last step chained (it counts in this meter) finishes before the meter is read: its
        # calls are counted whole every time, not as far as it had got
        pipeline.end_turn()
    n = per * segments
    sched = [(after - before) / n for after, before in zip(pipeline.scheduler_seconds(), s0)]
    result = {
        "rank": rank, "config": config, "steps": n,
        # samples of the data consumed per second (trained or, with input skipping, skipped)
        "samples_per_s": statistics.median(world * cfg.batch_size * r / s for r, s in zip(seg_read, seg_s)),
        "segment_samples_per_s": [world * cfg.batch_size * r / s for r, s in zip(seg_read, seg_s)],
        "trained_samples_per_s": statistics.median(world * cfg.batch_size * per / s for s in seg_s),
        "batches_read_per_step": sum(seg_read) / n,
        "bytes_per_step": meter.total()["bytes"] / n,
        "link_decision": decision.link_report(),
        "scheduling": pipeline.report().get("scheduling"),
        "approximate": pipeline.approximate_report() if hasattr(pipeline, "approximate_report") else {},
        "breakdown_ms": step_time_breakdown(sum(seg_s) / n, meter.wait_s / n, *sched),
        # per collective label: calls and bytes per step, the ms per step waited for it, and from its calls to their
        # completions (overlapped or waited for)
        "by_label": {k: {"calls": v["calls"] / n, "bytes": v["bytes"] / n,
                         "wait_ms": 1000 * meter.wait_by_tag.get(k, 0.0) / n,
                         "duration_ms": 1000 * meter.duration_by_tag.get(k, 0.0) / n}
                     for k, v in meter.tag_summary().items()},
        # per collective kind (all_reduce, all_to_all_single, ...): the same, the untagged calls too
        "by_kind": {k: {"calls": v["calls"] / n, "bytes": v["bytes"] / n,
                        "duration_ms": 1000 * meter.duration_by_kind.get(k, 0.0) / n}
                    for k, v in meter.summary().items()},
        "untagged_wait_ms": 1000 * meter.wait_by_tag.get("untagged", 0.0) / n,
        # the training thread's collectives' call times and when it needed each result: run_one matches them over
        # the ranks (peer_wait_ms)
        "arrivals": meter.arrivals, "needed": meter.needed,
    }
    Path(out).write_text(json.dumps(result))
    pipeline.detach()
    dist.barrier()
    dist.destroy_process_group()


def host_speed_ms() -> float:
    """How fast this VM's cores are right now: ms for a fixed single-thread matmul loop (lower is faster).
    Recorded before every run: herald's step is CPU-bound where stock's waits for the link, so a slow
    phase of the host moves the ratios (RESULTS.md, "Noise")."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.ones(256, 256)
    t0 = time.perf_counter()
    for _ in range(150):
        a @ a
    torch.set_num_threads(threads)
    return 1000 * (time.perf_counter() - t0)


def run_one(world: int, config: str, rate: int, a: argparse.Namespace, tmp: Path) -> Dict[str, Any]:
    probe_ms = host_speed_ms()
    run_in_namespaces(world, PORT, lambda r: [
        __file__, "--worker", "--config", config, "--steps", str(a.steps), "--segments", str(a.segments),
        "--warmup", str(a.warmup), "--out", str(tmp / f"{config}_{r}.json"), "--rate", str(rate)],
        f"{config}, W={world}", timeout=1800)
    ranks = [json.loads((tmp / f"{config}_{r}.json").read_text()) for r in range(world)]
    arrivals, needed = [x.pop("arrivals") for x in ranks], [x.pop("needed") for x in ranks]
    try:  # (the ranks share this host's clock)
        late = [1000 * s / ranks[0]["steps"] for s in peer_lateness(arrivals, needed)]
    except ValueError as e:
        logger.warning("%s, W=%d: no peer wait measured (%s)", config, world, e)
        late = []
    row = dict(ranks[0])
    # ms per step each rank waited for its latest peer to arrive at the collectives, from when it needed each result
    # (rank 0's: its breakdown's)
    row["peer_wait_ms"] = late[0] if late else None
    row["peer_wait_ms_by_rank"] = late
    row["bytes_per_step_all_ranks"] = sum(x["bytes_per_step"] for x in ranks)
    row["samples_per_s"] = min(x["samples_per_s"] for x in ranks)  # ranks step together; take the slowest view
    row["host_speed_ms"] = probe_ms
    row.pop("rank")
    return row


def ratios(rows: List[Dict[str, Any]]) -> None:
    """Each row's speedup over stock TABLE_WISE and over the stock default plan at the same W and rate."""
    for r in rows:
        for base in ("tw", "stock"):
            ref = [x for x in rows if x["config"] == base and x["world_size"] == r["world_size"]
                   and x["rate_mbit"] == r["rate_mbit"]]
            r[f"speedup_vs_{base}"] = r["samples_per_s"] / ref[0]["samples_per_s"] if ref else None


def rate_name(rate: int) -> str:
    return "unlimited" if rate == 0 else f"{rate} Mbit/s"


def markdown(rows: List[Dict[str, Any]], command: str) -> str:
    lines = [f"Command: `{command}` (samples/s: the median of the repeats, each the median of its timed "
             "segments; breakdown of that run on rank 0's main thread, ms per step)", "",
             "| ranks | link | configuration | samples/s | vs TABLE_WISE | vs default plan | step | compute | "
             "comm wait | scheduler on path | scheduler overlapped | KiB/step (all ranks) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["breakdown_ms"]
        f = (lambda v: "–" if v is None else f"{v:.2f}×")
        lines.append(f"| {r['world_size']} | {rate_name(r['rate_mbit'])} | {CONFIGS[r['config']][0]} | "
                     f"{r['samples_per_s']:.0f} | {f(r['speedup_vs_tw'])} | {f(r['speedup_vs_stock'])} | "
                     f"{b['step']:.1f} | {b['compute']:.1f} | {b['comm_wait']:.1f} | {b['scheduler_critical']:.1f} | "
                     f"{b['scheduler_overlapped']:.1f} | {r['bytes_per_step_all_ranks'] / 1024:.0f} |")
    chose = []
    for r in rows:
        if r["config"] != "herald":
            continue
        d, sch = r.get("link_decision") or {}, r.get("scheduling") or {}
        what = "stock TABLE_WISE (link model)" if d and not d.get("herald") else \
            ("hot replication + scheduling" if sch.get("mode") == "on" else "hot replication alone (auto)")
        chose.append(f"W={r['world_size']} {rate_name(r['rate_mbit'])}: {what}")
    if chose:
        lines += ["", "What herald full trained (`planner.link_mbit` = the link's rate, unlimited declared as "
                  f"{UNLIMITED_DECLARED_MBIT} Mbit/s; `pipeline.scheduling=auto`): " + "; ".join(chose) + "."]
    shares = [f"W={r['world_size']} {rate_name(r['rate_mbit'])}: {100 * r['breakdown_ms']['comm_wait'] / r['breakdown_ms']['step']:.0f} %"
              for r in rows if r["config"] == "tw"]
    probes = sorted(p for r in rows for p in r.get("repeat_host_speed_ms", []))
    if probes:
        lines += ["", f"Host speed during the runs (ms for a fixed single-thread matmul loop before each run, "
                  f"lower is faster): min {probes[0]:.0f}, median {probes[len(probes) // 2]:.0f}, max {probes[-1]:.0f}."]
    if shares:
        lines += ["", "Stock TABLE_WISE's communication share of its step (comm wait / step): " + ", ".join(shares) + "."]
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], out: Path) -> None:
    """Left: speedup over the baseline (W=2: TABLE_WISE, W=4: default plan) vs link rate, one line per
    configuration and world size; right: herald full's and the baseline's step-time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["rate_mbit"] for r in rows}, key=lambda v: (v == 0, v))
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.6))
    ax = axes[0]
    styles = {"tw": ("#8c8c8c", "s"), "stock": ("#4c4c4c", "^"), "hot": ("#4c72b0", "o"), "herald": ("#dd8452", "D"),
              "sched": ("#55a868", "v"), "het": ("#c44e52", "P"), "het1": ("#8172b3", "X"), "skip": ("#937860", "*")}
    present = {r["config"] for r in rows}
    extra = iter(["#da8bc3", "#ccb974", "#64b5cd", "#2f4b7c", "#a05195"])  # configs without a style of their own
    styles.update({c: (next(extra, "#333333"), "h") for c in CONFIGS if c in present and c not in styles})
    for w, ls in zip(worlds, ("-", "--", ":")):
        base = "tw" if w == 2 else "stock"
        if base not in present:  # (a run of herald's techniques alone: relative to the first of these present)
            base = next((c for c in ("hot", "sched", "herald_defaults") if c in present), base)
        for cfg, (color, marker) in styles.items():
            ys = []
            for rate in rates:
                m = [r for r in rows if r["world_size"] == w and r["rate_mbit"] == rate and r["config"] == cfg]
                b = [r for r in rows if r["world_size"] == w and r["rate_mbit"] == rate and r["config"] == base]
                ys.append(m[0]["samples_per_s"] / b[0]["samples_per_s"] if m and b else float("nan"))
            if cfg != base and cfg in present:
                ax.plot(range(len(rates)), ys, ls, color=color, marker=marker,
                        label=f"W={w}: {CONFIGS[cfg][0]} / {CONFIGS[base][0]}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rates)), [rate_name(v) for v in rates])
    ax.set_xlabel("per-rank link rate (tc tbf)")
    ax.set_ylabel("samples/s relative to the baseline")
    ax.set_title("Speedup vs bandwidth (higher is better)")
    # (one column where the labels are long: two would run past the figure's left edge)
    long_labels = max((len(t) for t in ax.get_legend_handles_labels()[1]), default=0) > 70
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1 if long_labels else 2, frameon=False)
    ax.grid(alpha=0.3)
    ax = axes[1]
    parts = [("compute", "#4c72b0"), ("comm_wait", "#c44e52"), ("scheduler_critical", "#dd8452")]
    labels, bottoms = [], []
    sel = ([r for r in rows if r["config"] in ("herald", "tw" if r["world_size"] == 2 else "stock")]
           if "herald" in present else list(rows))  # (a run without herald full: every row)
    sel.sort(key=lambda r: (r["world_size"], (r["rate_mbit"] == 0, r["rate_mbit"]), r["config"] != "herald"))
    x = range(len(sel))
    bottom = [0.0] * len(sel)
    for part, color in parts:
        vals = [r["breakdown_ms"][part] for r in sel]
        ax.bar(x, vals, bottom=bottom, color=color, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    short = {"herald": "herald", "tw": "TW", "stock": "default"}
    ax.set_xticks(list(x), [f"W={r['world_size']} {rate_name(r['rate_mbit']).replace(' Mbit/s', 'M')}: "
                            f"{short.get(r['config'], r['config'])}"
                            for r in sel], fontsize=7, rotation=60, ha="right")
    ax.set_ylim(0, 1.08 * max(bottom))
    ax.set_ylabel("ms per step (rank 0)")
    ax.set_title("Step time: herald full vs the baseline (W=2: TW, W=4: default plan)" if "herald" in present
                 else "Step time per configuration", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=130, bbox_inches="tight")  # (the legend below the left axes stays in the image)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", type=int, nargs="+", default=[0, 1000, 200, 50], help="Mbit/s per link; 0 = unlimited")
    p.add_argument("--configs", nargs="+", default=["tw", "stock", "hot", "herald"], choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--segments", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (interleaved); the median is reported")
    p.add_argument("--warmup", type=int, default=40, help="untimed steps (herald's scheduling=auto decides within 30)")
    p.add_argument("--out", default=str(HERE / "results" / "bandwidth.json"))
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.config, a.steps, a.segments, a.warmup, a.out, a.rate)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.plot_only:
        plot(json.loads(Path(a.out).read_text())["rows"], Path(a.out).with_suffix(".png"))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_bandwidth needs root (ip netns, veth, tc)")
    if a.steps % a.segments:
        raise SystemExit(f"--steps {a.steps} must be a multiple of --segments {a.segments}")
    if a.repeats % len(a.configs):
        first = sum(run_order(a.configs, rep)[0] == a.configs[0] for rep in range(a.repeats))
        logger.warning("--repeats %d is not a multiple of the %d configurations: %s runs first in %d of the %d "
                       "repeats, so the places of a repeat are not shared evenly",
                       a.repeats, len(a.configs), a.configs[0], first, a.repeats)
    rows: List[Dict[str, Any]] = []
    for world in a.world_sizes:
        setup(world)
        try:
            for rate in a.rates:
                limit(world, rate)
                reps: Dict[str, List[Dict[str, Any]]] = {c: [] for c in a.configs}
                for rep in range(a.repeats):  # configurations interleaved, so drifts of the machine hit all alike,
                    for config in run_order(a.configs, rep):  # and each takes each place as often (the position's cost)
                        with tempfile.TemporaryDirectory() as tmp:
                            row = run_one(world, config, rate, a, Path(tmp))
                        reps[config].append(row)
                        logger.info("W=%d %s %s (repeat %d): %.0f samples/s, %s%s", world, rate_name(rate), config, rep,
                                    row["samples_per_s"], {k: round(v, 1) for k, v in row["breakdown_ms"].items()},
                                    f", trained {trained_plan(row)}" if row.get("link_decision") else "")
                for config, runs in reps.items():
                    # each repeat in run order (repeat r of every configuration ran side by side): its samples/s and step,
                    # and its place in the repeat (0: first)
                    in_order = [{"samples_per_s": r["samples_per_s"], "step_ms": r["breakdown_ms"]["step"],
                                 "place": run_order(a.configs, i).index(config),
                                 **({"trained": trained_plan(r)} if r.get("link_decision") else {})}
                                for i, r in enumerate(runs)]
                    runs.sort(key=lambda r: r["samples_per_s"])
                    row = dict(runs[len(runs) // 2])  # the median repeat (its breakdown with it)
                    row.update(world_size=world, rate_mbit=rate,
                               repeat_samples_per_s=[r["samples_per_s"] for r in runs],
                               repeat_host_speed_ms=[r["host_speed_ms"] for r in runs], repeats_in_order=in_order)
                    if any(r.get("link_decision") for r in runs):  # (the model of time may pick apart from run to run)
                        row["repeat_trained"] = [trained_plan(r) for r in runs]
                    rows.append(row)
        finally:
            teardown(world)
    ratios(rows)
    from machine_info import machine as machine_info

    command = "python benchmarks/bench_bandwidth.py " + " ".join(sys.argv[1:])
    out = Path(a.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "command": command.strip(), "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    section = markdown(rows, command.strip())
    from bench_traffic import write_results_md

    write_results_md({"BANDWIDTH": section})
    sys.stdout.write(section + "\n")


if __name__ == "__main__":
    main()
